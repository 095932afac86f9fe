/**
 * The users' API: bundles (create, list, get, kill, events, logs, outputs) and users (admins create them).
 */
import { Type } from "@sinclair/typebox";
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import { formatDigest, parseDigest } from "../lib/cas/digest.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { NO_CONTROL_PATTERN } from "../lib/text-limits.ts";
import { BUNDLE_UUID_PATTERN, hashToken, newBundleUuid, newUserToken, newUserUuid } from "../lib/tokens.ts";
import {
  createUser,
  getBundleForOwner,
  insertBundle,
  insertBundles,
  insertUploadedBundle,
  listBundles,
  listEvents,
} from "../store/queries.ts";
import { killBundle } from "../store/transitions.ts";
import { BUNDLE_STATES, type Bundle, type BundleState, isFinalState, type User } from "../store/types.ts";
import { callerOf, requireAdmin, userAuthHook } from "./auth.ts";
import { parseBatchRequest, parseBundleRequest } from "./bundle-request.ts";
import { readManifestStats } from "./cas/routes.ts";
import type { RouteContext } from "./context.ts";
import { pinImages } from "./image-resolve.ts";
import { logReadable, parseLogQuery } from "./logs.ts";
import { parseOutputPath } from "./outputs.ts";
import { encodeOutputCursor, parseOutputListQuery } from "./outputs-listing.ts";
import { insertWithinLimits, limitsApply, sendRefusal } from "./quotas.ts";
import { validate } from "./validate.ts";
import { bundleView, decodeCursor, encodeCursor, eventView, type ListCursor } from "./views.ts";

export const DEFAULT_LIST_LIMIT = 50;
export const MAX_LIST_LIMIT = 500;

export const KillRequest = Type.Object(
  {
    reason: Type.Optional(
      Type.String({
        minLength: 1,
        maxLength: 1000,
        pattern: NO_CONTROL_PATTERN,
        errorMessage: "must be a string of 1-1000 characters without control characters or line breaks",
      }),
    ),
  },
  { additionalProperties: false },
);

export const UserRequest = Type.Object(
  {
    name: Type.String({
      pattern: "^[A-Za-z0-9][A-Za-z0-9._@-]{0,99}$",
      errorMessage: "must be 1-100 characters from A-Z a-z 0-9 . _ @ -, starting with a letter or digit",
    }),
    isAdmin: Type.Optional(Type.Boolean({ default: false })),
  },
  { additionalProperties: false },
);

/** `POST /bundles/uploads`: a tree in the content-addressed store, kept as a ready bundle. */
export const UploadRequest = Type.Object(
  {
    manifest: Type.String({
      maxLength: 100,
      description: "The digest (<sha256 hex>/<size>) of the tree's manifest, uploaded by the caller.",
    }),
    name: Type.Optional(Type.String({ maxLength: 200, pattern: NO_CONTROL_PATTERN })),
  },
  { additionalProperties: false },
);

const BUNDLE_UUID = new RegExp(BUNDLE_UUID_PATTERN);

function uuidParam(request: FastifyRequest): string {
  const uuid = (request.params as Record<string, string | undefined>)["uuid"] ?? "";
  if (!BUNDLE_UUID.test(uuid)) {
    throw new DispatchCloudError(
      "request.invalid_param",
      `uuid: not a bundle uuid: ${JSON.stringify(uuid)}`,
      {
        path: "uuid",
      },
    );
  }
  return uuid;
}

const notFound = (uuid: string) => new DispatchCloudError("bundle.not_found", `no bundle ${uuid}`);

export interface ListQuery {
  states: BundleState[] | undefined;
  limit: number;
  after: ListCursor | null;
}

/** `?state=a,b&limit=N&cursor=...`; repeated parameters are joined; anything else is refused. */
export function parseListQuery(query: unknown): ListQuery {
  const out: ListQuery = { states: undefined, limit: DEFAULT_LIST_LIMIT, after: null };
  const bad = (path: string, message: string) =>
    new DispatchCloudError("request.invalid_query", `${path}: ${message}`, { path });
  for (const [key, raw] of Object.entries((query ?? {}) as Record<string, unknown>)) {
    const value = Array.isArray(raw) ? raw.map(String).join(",") : String(raw);
    if (key === "state") {
      const states = value
        .split(",")
        .map((s) => s.trim())
        .filter((s) => s !== "");
      for (const s of states) {
        if (!(BUNDLE_STATES as readonly string[]).includes(s)) {
          throw bad(
            "state",
            `unknown state ${JSON.stringify(s.slice(0, 40))}; one of ${BUNDLE_STATES.join(", ")}`,
          );
        }
      }
      out.states = [...new Set(states as BundleState[])];
    } else if (key === "limit") {
      if (!/^[0-9]{1,4}$/.test(value) || Number(value) < 1 || Number(value) > MAX_LIST_LIMIT) {
        throw bad("limit", `must be a whole number from 1 to ${MAX_LIST_LIMIT}`);
      }
      out.limit = Number(value);
    } else if (key === "cursor") {
      out.after = value === "" ? null : decodeCursor(value);
    } else {
      throw bad(key, "unknown query parameter; known: state, limit, cursor");
    }
  }
  return out;
}

const userView = (u: User) => ({
  uuid: u.uuid,
  name: u.name,
  isAdmin: u.isAdmin,
  createdAt: u.createdAt.toISOString(),
});

export function registerUserRoutes(app: FastifyInstance, ctx: RouteContext): void {
  const { db } = ctx;
  const onRequest = userAuthHook(db, ctx.nowMs, ctx.tokenCache);
  const view = (b: Bundle) => bundleView(b, ctx.nowMs());
  const ownBundle = async (request: FastifyRequest): Promise<Bundle> => {
    const uuid = uuidParam(request);
    const bundle = await getBundleForOwner(db, uuid, callerOf(request).uuid);
    if (bundle === null) throw notFound(uuid);
    return bundle;
  };

  app.post("/api/v1/bundles", { onRequest }, async (request, reply) => {
    const caller = callerOf(request);
    // The image pinned now (our store, then registries: image-resolve.ts), so every attempt runs the same one.
    const [newBundle] = await pinImages(ctx.imageResolvers, [
      parseBundleRequest(request.body, caller.uuid, ctx.defaultMaxAttempts, ctx.bundleMinimums),
    ]);
    if (newBundle === undefined) throw new Error("pinImages lost the bundle");
    const uuid = newBundleUuid(ctx.clusterId);
    // Without dependencies or limits to check, the insert joins the submissions around it in one statement.
    const grouped = newBundle.dependencies.length === 0 && !limitsApply(caller, ctx.submitLimits);
    const result = grouped
      ? { ok: true as const, value: await ctx.submitCoalescer.insert(uuid, newBundle) }
      : await insertWithinLimits(db, {
          owner: caller,
          count: 1,
          limits: ctx.submitLimits,
          nowMs: ctx.nowMs(),
          insert: (tx) => insertBundle(tx, uuid, newBundle, "submitted"),
        });
    if (!result.ok) return sendRefusal(reply, result.refusal);
    ctx.bundlesWritten?.([result.value]);
    request.log.info(
      { bundleUuid: result.value.uuid, owner: caller.uuid, image: result.value.image },
      "bundle created",
    );
    return reply.code(201).send(view(result.value));
  });

  // A tree uploaded to the content-addressed store, as a ready bundle that others may depend on.
  app.post("/api/v1/bundles/uploads", { onRequest }, async (request, reply) => {
    const caller = callerOf(request);
    const body = validate(UploadRequest, request.body);
    const d = parseDigest(body.manifest, "manifest");
    const backend = ctx.casBackend;
    const stats =
      backend === null
        ? null
        : await readManifestStats(db, backend, { userUuid: caller.uuid, manifests: [] }, d);
    if (stats === null) {
      throw new DispatchCloudError(
        "cas.unknown_manifest",
        `manifest: ${formatDigest(d)} is not a manifest in the store that you may read; upload the tree first`,
        { path: "manifest" },
      );
    }
    const bundle = await insertUploadedBundle(db, newBundleUuid(ctx.clusterId), {
      ownerUuid: caller.uuid,
      name: body.name ?? "",
      manifest: formatDigest(d),
      bytes: stats.bytes,
    });
    request.log.info({ bundleUuid: bundle.uuid, owner: caller.uuid, files: stats.files }, "tree uploaded");
    return reply.code(201).send(view(bundle));
  });

  // Many bundles in one request, all or nothing (docs/api.md "Batch submission"). With `Prefer:
  // return=minimal` each item of the answer is only the bundle's uuid and state.
  app.post(
    "/api/v1/bundles/batch",
    { onRequest, bodyLimit: ctx.maxBatchBodySize },
    async (request, reply) => {
      const caller = callerOf(request);
      const bundles = await pinImages(
        ctx.imageResolvers,
        parseBatchRequest(request.body, caller.uuid, ctx.defaultMaxAttempts, ctx.bundleMinimums),
      );
      const items = bundles.map((bundle) => ({ uuid: newBundleUuid(ctx.clusterId), bundle }));
      const minimal = prefersMinimal(request.headers.prefer);
      // Whole rows when someone in this process wants them (`serve`'s queue, which would otherwise read them
      // back after the insert's NOTIFY), however briefly the caller is answered.
      const whole = !minimal || ctx.bundlesWritten !== null;
      const result = await insertWithinLimits(db, {
        owner: caller,
        count: items.length,
        limits: ctx.submitLimits,
        nowMs: ctx.nowMs(),
        insert: (tx) =>
          whole
            ? insertBundles(tx, caller.uuid, items, "submitted")
            : insertBundles(tx, caller.uuid, items, "submitted", "brief"),
      });
      if (!result.ok) return sendRefusal(reply, result.refusal);
      request.log.info({ owner: caller.uuid, count: items.length }, "bundles created (batch)");
      if (whole) ctx.bundlesWritten?.(result.value as Bundle[]);
      if (minimal) {
        return reply
          .code(201)
          .header("preference-applied", "return=minimal")
          .send({ items: result.value.map((b) => ({ uuid: b.uuid, state: b.state })) });
      }
      return reply.code(201).send({ items: (result.value as Bundle[]).map(view) });
    },
  );

  app.get("/api/v1/bundles", { onRequest }, async (request) => {
    const q = parseListQuery(request.query);
    const rows = await listBundles(db, {
      ownerUuid: callerOf(request).uuid,
      ...(q.states === undefined ? {} : { states: q.states }),
      after: q.after,
      limit: q.limit + 1,
    });
    const items = rows.slice(0, q.limit);
    const last = items[items.length - 1];
    const nextCursor = rows.length > q.limit && last !== undefined ? encodeCursor(last) : null;
    return { items: items.map(view), nextCursor };
  });

  app.get("/api/v1/bundles/:uuid", { onRequest }, async (request) => view(await ownBundle(request)));

  app.post("/api/v1/bundles/:uuid/kill", { onRequest }, async (request) => {
    const bundle = await ownBundle(request);
    const body =
      request.body === undefined || request.body === null ? {} : validate(KillRequest, request.body);
    const conflict = (b: Bundle) =>
      new DispatchCloudError(
        "bundle.conflict",
        `bundle ${b.uuid} is already ${b.state}; it cannot be killed`,
      );
    if (isFinalState(bundle.state)) throw conflict(bundle);
    const caller = callerOf(request);
    const result = await killBundle(db, bundle.uuid, {
      actor: `user:${caller.uuid}`,
      reason: body.reason ?? `killed by ${caller.name}`,
    });
    if (!result.ok) {
      if (result.current === null) throw notFound(bundle.uuid);
      throw conflict(result.current);
    }
    request.log.info({ bundleUuid: bundle.uuid, from: bundle.state, by: caller.uuid }, "bundle killed");
    return view(result.bundle);
  });

  app.get("/api/v1/bundles/:uuid/events", { onRequest }, async (request) => {
    const bundle = await ownBundle(request);
    const events = await listEvents(db, bundle.uuid);
    return { items: events.map(eventView) };
  });

  app.get("/api/v1/bundles/:uuid/logs", { onRequest }, async (request, reply) => {
    const bundle = await ownBundle(request);
    const q = parseLogQuery(request.query);
    const attempt = q.attempt ?? bundle.attempt;
    const body = logReadable({
      db,
      notifier: ctx.logNotifier,
      uuid: bundle.uuid,
      stream: q.stream,
      attempt,
      attemptDefaulted: q.attempt === null,
      follow: q.follow,
      pollIntervalMs: ctx.logPollInterval,
      logger: request.log,
    });
    if (q.follow) {
      // fastify sends the headers with the first bytes; a follower of a quiet log must get them at once. The
      // connection closes with the response, so a server shutting down does not wait on it afterwards.
      reply.raw.once("pipe", () => reply.raw.flushHeaders());
      reply.header("connection", "close");
    }
    return reply
      .type("text/plain; charset=utf-8")
      .header("x-dispatch-cloud-attempt", String(attempt))
      .header("cache-control", "no-store")
      .send(body);
  });

  const outputs = async (request: FastifyRequest, reply: FastifyReply) => {
    const bundle = await ownBundle(request);
    const raw = (request.params as Record<string, string | undefined>)["*"] ?? "";
    const rel = parseOutputPath(raw);
    const page = parseOutputListQuery(request.query);
    // One file more than the page tells whether another page follows.
    const want = { after: page.after, limit: page.limit + 1 };
    const entry =
      bundle.outputManifest === undefined
        ? await ctx.outputs.get(bundle.uuid, rel, want)
        : (await ctx.storedOutputs.of(bundle.uuid, bundle.outputManifest)).get(rel, want);
    if (entry.kind === "dir") {
      const files = entry.files.slice(0, page.limit);
      const last = files[files.length - 1];
      const more = entry.files.length > page.limit && last !== undefined;
      return { files, nextCursor: more ? encodeOutputCursor(last.path) : null };
    }
    return reply
      .type("application/octet-stream")
      .header("content-length", String(entry.size))
      .send(entry.open());
  };
  app.get("/api/v1/bundles/:uuid/outputs", { onRequest }, outputs);
  app.get("/api/v1/bundles/:uuid/outputs/*", { onRequest }, outputs);

  app.get("/api/v1/users/current", { onRequest }, async (request) => userView(callerOf(request)));

  app.post("/api/v1/users", { onRequest }, async (request, reply) => {
    requireAdmin(callerOf(request));
    const body = validate(UserRequest, request.body);
    const token = newUserToken();
    const user = await createUser(db, {
      uuid: newUserUuid(ctx.clusterId),
      name: body.name,
      isAdmin: body.isAdmin ?? false,
      tokenHash: hashToken(token),
    });
    // The only time the token is ever shown; the database keeps its hash.
    return reply.code(201).send({ ...userView(user), token });
  });
}

/**
 * Whether a request's Prefer header (RFC 7240: comma-separated preferences, names case-insensitive, a value
 * maybe quoted; the header maybe repeated) asks for `return=minimal`.
 */
export function prefersMinimal(header: string | string[] | undefined): boolean {
  const values = header === undefined ? [] : Array.isArray(header) ? header : [header];
  return values.some((v) =>
    v.split(",").some((pref) => {
      const [name, value] = (pref.split(";")[0] ?? "").split("=", 2).map((x) => x.trim());
      return name?.toLowerCase() === "return" && value?.replace(/^"(.*)"$/, "$1").toLowerCase() === "minimal";
    }),
  );
}
