/**
 * The users' API tokens: create one (shown once), list, revoke. A user manages their own tokens; an admin may
 * list, revoke and create any user's. Another user's token answers 404 to a non-admin, exactly like one that
 * does not exist. A revoked or expired token authenticates nothing (auth.ts).
 */
import { Type } from "@sinclair/typebox";
import type { FastifyInstance, FastifyRequest } from "fastify";
import { DispatchCloudError } from "../lib/errors.ts";
import { hashToken, newUserToken, TOKEN_ID_PATTERN, USER_UUID_PATTERN } from "../lib/tokens.ts";
import { parseDuration } from "../lib/units.ts";
import { countTokens, createToken, getUser, listTokens, lockUser, revokeToken } from "../store/queries.ts";
import type { ApiToken, User } from "../store/types.ts";
import { callerOf, callerTokenOf, requireAdmin, userAuthHook } from "./auth.ts";
import type { RouteContext } from "./context.ts";
import { invalidBody, validate } from "./validate.ts";

/** An instant with a time zone, as JSON dates are written: `2026-05-01T12:00:00Z`, `...T12:00:00.000+02:00`. */
const ISO_INSTANT = "^\\d{4}-\\d{2}-\\d{2}T\\d{2}:\\d{2}:\\d{2}(\\.\\d{1,3})?(Z|[+-]\\d{2}:\\d{2})$";
/** The last instant an expiry may be (JSON dates have four-digit years). */
const LATEST_EXPIRY_MS = Date.UTC(9999, 11, 31, 23, 59, 59, 999);

export const TokenRequest = Type.Object(
  {
    label: Type.Optional(
      Type.String({
        maxLength: 100,
        pattern: "^[^\\u0000-\\u001f\\u007f]*$",
        errorMessage: "must be at most 100 characters without control characters",
      }),
    ),
    expiresAt: Type.Optional(
      Type.String({
        pattern: ISO_INSTANT,
        errorMessage: "must be an ISO 8601 instant with a time zone, such as 2026-05-01T12:00:00Z",
      }),
    ),
    ttl: Type.Optional(
      Type.String({
        minLength: 1,
        maxLength: 50,
        errorMessage: "must be a duration such as 30d, 12h or 90m",
      }),
    ),
    userUuid: Type.Optional(
      Type.String({ pattern: USER_UUID_PATTERN, errorMessage: "must be a user uuid (admins only)" }),
    ),
  },
  { additionalProperties: false },
);

/** A token as the API shows it: never the secret, nor its hash. */
export function tokenView(t: ApiToken, opts: { nowMs: number; currentId: string | null }) {
  const iso = (d: Date | null) => (d === null ? null : d.toISOString());
  return {
    id: t.id,
    userUuid: t.userUuid,
    label: t.label,
    createdAt: t.createdAt.toISOString(),
    expiresAt: iso(t.expiresAt),
    lastUsedAt: iso(t.lastUsedAt),
    revokedAt: iso(t.revokedAt),
    expired: t.expiresAt !== null && t.expiresAt.getTime() <= opts.nowMs,
    /** The token this request was made with. */
    current: t.id === opts.currentId,
  };
}

/** When a new token expires (ms since the epoch), from `expiresAt` or `ttl` (null: never). */
export function expiryOf(body: { expiresAt?: string; ttl?: string }, nowMs: number): number | null {
  if (body.expiresAt !== undefined && body.ttl !== undefined) {
    throw invalidBody("ttl", "give expiresAt or ttl, not both");
  }
  let at: number;
  let field: "expiresAt" | "ttl";
  if (body.expiresAt !== undefined) {
    field = "expiresAt";
    at = Date.parse(body.expiresAt);
    if (Number.isNaN(at)) throw invalidBody(field, "is not a valid date and time");
    if (at <= nowMs) throw invalidBody(field, "must be in the future");
  } else if (body.ttl !== undefined) {
    field = "ttl";
    let ms: number;
    try {
      ms = parseDuration(body.ttl);
    } catch (err) {
      throw invalidBody(field, err instanceof Error ? err.message : String(err));
    }
    if (ms <= 0) throw invalidBody(field, "must be longer than 0");
    at = nowMs + ms;
  } else {
    return null;
  }
  if (at > LATEST_EXPIRY_MS) throw invalidBody(field, "must end before the year 10000");
  return at;
}

const USER_UUID = new RegExp(USER_UUID_PATTERN);
const TOKEN_ID = new RegExp(TOKEN_ID_PATTERN);

const userNotFound = (uuid: string, path: string) =>
  new DispatchCloudError("user.not_found", `no user ${uuid}`, { path });

/** `?user=UUID` (whose tokens to list: default the caller's); anything else is refused. */
function parseTokenListQuery(query: unknown): { user: string | null } {
  let user: string | null = null;
  for (const [key, raw] of Object.entries((query ?? {}) as Record<string, unknown>)) {
    if (key !== "user") {
      throw new DispatchCloudError("request.invalid_query", `${key}: unknown query parameter; known: user`, {
        path: key,
      });
    }
    if (typeof raw !== "string" || !USER_UUID.test(raw)) {
      throw new DispatchCloudError("request.invalid_query", "user: must be one user uuid", { path: "user" });
    }
    user = raw;
  }
  return { user };
}

function tokenIdParam(request: FastifyRequest): string {
  const id = (request.params as Record<string, string | undefined>)["id"] ?? "";
  if (!TOKEN_ID.test(id)) {
    throw new DispatchCloudError(
      "request.invalid_param",
      `id: not a token id: ${JSON.stringify(id.slice(0, 60))}`,
      {
        path: "id",
      },
    );
  }
  return id;
}

/** The user whose tokens a request is about: the caller, or (admins only) the given one. */
async function subjectUser(
  ctx: RouteContext,
  caller: User,
  uuid: string | undefined | null,
  path: string,
): Promise<User> {
  if (uuid === undefined || uuid === null || uuid === caller.uuid) return caller;
  requireAdmin(caller);
  const user = await getUser(ctx.db, uuid);
  if (user === null) throw userNotFound(uuid, path);
  return user;
}

export function registerTokenRoutes(app: FastifyInstance, ctx: RouteContext): void {
  const { db } = ctx;
  const onRequest = userAuthHook(db, ctx.nowMs, ctx.tokenCache);
  const view = (request: FastifyRequest, t: ApiToken) =>
    tokenView(t, { nowMs: ctx.nowMs(), currentId: callerTokenOf(request).id });

  app.post("/api/v1/tokens", { onRequest }, async (request, reply) => {
    const caller = callerOf(request);
    const body = validate(
      TokenRequest,
      request.body === undefined || request.body === null ? {} : request.body,
    );
    const nowMs = ctx.nowMs();
    const expiresAt = expiryOf(body, nowMs);
    const owner = await subjectUser(ctx, caller, body.userUuid, "userUuid");
    const secret = newUserToken();
    const token = await db.transaction(async (tx) => {
      // The user's row lock makes the count and the insert one step for parallel requests.
      if ((await lockUser(tx, owner.uuid)) === null) throw userNotFound(owner.uuid, "userUuid");
      if ((await countTokens(tx, owner.uuid)) >= ctx.maxTokensPerUser) {
        throw new DispatchCloudError(
          "quota.tokens",
          `${owner.uuid} already holds ${ctx.maxTokensPerUser} tokens, the most one user may (quotas.maxTokensPerUser); revoke one first`,
        );
      }
      return createToken(tx, {
        userUuid: owner.uuid,
        tokenHash: hashToken(secret),
        label: body.label ?? "",
        expiresAt: expiresAt === null ? null : new Date(expiresAt),
        now: new Date(nowMs),
      });
    });
    // The only time the token is ever shown; the database keeps its hash.
    return reply.code(201).send({ ...view(request, token), token: secret });
  });

  app.get("/api/v1/tokens", { onRequest }, async (request) => {
    const q = parseTokenListQuery(request.query);
    const user = await subjectUser(ctx, callerOf(request), q.user, "user");
    const tokens = await listTokens(db, user.uuid);
    return { items: tokens.map((t) => view(request, t)) };
  });

  app.delete("/api/v1/tokens/:id", { onRequest }, async (request) => {
    const id = tokenIdParam(request);
    const caller = callerOf(request);
    const revoked = await revokeToken(db, {
      id,
      ownerUuid: caller.isAdmin ? null : caller.uuid,
      now: new Date(ctx.nowMs()),
    });
    if (revoked === null) throw new DispatchCloudError("token.not_found", `no token ${id}`, { path: "id" });
    ctx.tokenCache.clear();
    request.log.info({ tokenId: id, owner: revoked.userUuid, by: caller.uuid }, "token revoked");
    return view(request, revoked);
  });
}
