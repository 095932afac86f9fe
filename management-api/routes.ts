/**
 * The management API's routes (docs/operations.md): instances and their idle behaviour, the queue as the
 * scheduler sees it, kills, /metrics, the health check and the OpenAPI document. Authentication is the
 * server's onRequest hook (server.ts); a standby dispatcher answers 503 management.not_active here.
 */
import type { FastifyInstance } from "fastify";
import type { Registry } from "prom-client";
import type { IdleBehavior } from "../dispatcher/types.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { hasControlCharacter, hasLoneSurrogate } from "../lib/text-limits.ts";
import { BUNDLE_UUID_PATTERN } from "../lib/tokens.ts";
import type { Db } from "../store/db.ts";
import { killBundle } from "../store/transitions.ts";
import { isFinalState } from "../store/types.ts";
import { managementApiDocument } from "./openapi.ts";
import {
  bundleItem,
  bundleItems,
  instanceItems,
  type ManagementParts,
  type ManagementSource,
  userWorkerItems,
} from "./views.ts";

export interface ManagementContext {
  dispatcher: ManagementSource;
  db: Db;
  registry: Registry;
  nowMs(): number;
}

const MAX_REASON = 1000;
const MAX_INSTANCE_ID = 200;
const BUNDLE_UUID = new RegExp(BUNDLE_UUID_PATTERN);

/** The query string as single values; only `allowed` keys, each at most once. */
function queryOf(query: unknown, allowed: readonly string[]): Record<string, string> {
  const out: Record<string, string> = {};
  for (const [key, raw] of Object.entries((query ?? {}) as Record<string, unknown>)) {
    if (!allowed.includes(key)) {
      throw new DispatchCloudError(
        "request.invalid_query",
        `${key}: unknown query parameter; known: ${allowed.join(", ")}`,
        { path: key },
      );
    }
    if (typeof raw !== "string") {
      throw new DispatchCloudError("request.invalid_query", `${key}: given more than once`, { path: key });
    }
    out[key] = raw;
  }
  return out;
}

const badQuery = (key: string, why: string) =>
  new DispatchCloudError("request.invalid_query", `${key}: ${why}`, { path: key });

/**
 * Text the query gives for a log line, a tag or a state reason: no control characters or line breaks (NUL,
 * which PostgreSQL refuses, among them) and no lone surrogates (which UTF-8 cannot hold).
 */
function checkText(key: string, value: string, max: number): string {
  if (value.length > max) throw badQuery(key, `at most ${max} characters`);
  if (hasControlCharacter(value)) throw badQuery(key, "must not contain control characters or line breaks");
  if (hasLoneSurrogate(value)) throw badQuery(key, "must not contain a lone UTF-16 surrogate");
  return value;
}

function required(q: Record<string, string>, key: string): string {
  const v = q[key];
  if (v === undefined || v.trim() === "") throw badQuery(key, "required");
  return v;
}

/** An instance id as the pool knows them: printable, at most MAX_INSTANCE_ID characters. */
function instanceIdOf(q: Record<string, string>): string {
  return checkText("instance_id", required(q, "instance_id"), MAX_INSTANCE_ID);
}

/** A bundle uuid (the kill query's or the path's): xxxxx-bndl-xxxxxxxxxxxxxxx. */
function bundleUuid(value: string, key: string, where: "query" | "param"): string {
  if (BUNDLE_UUID.test(value)) return value;
  const code = where === "query" ? "request.invalid_query" : "request.invalid_param";
  throw new DispatchCloudError(code, `${key}: not a bundle uuid: ${show(value)}`, { path: key });
}

function reasonOf(q: Record<string, string>, fallback: string): string {
  const r = q["reason"];
  if (r === undefined || r.trim() === "") return fallback;
  return checkText("reason", r, MAX_REASON);
}

const show = (s: string): string => JSON.stringify(s.length > 80 ? `${s.slice(0, 80)}...` : s);

export function registerManagementRoutes(app: FastifyInstance, ctx: ManagementContext): void {
  const partsOf = (): ManagementParts => {
    const parts = ctx.dispatcher.parts;
    if (!ctx.dispatcher.active || parts === null) {
      throw new DispatchCloudError(
        "management.not_active",
        "this dispatcher is a standby (another one is active); ask the active one",
      );
    }
    return parts;
  };
  const workerOf = (parts: ManagementParts, id: string) => {
    const w = parts.pool.worker(id);
    if (w === undefined) {
      throw new DispatchCloudError("management.unknown_instance", `no instance ${show(id)}`, {
        path: "instance_id",
      });
    }
    return w;
  };

  app.get("/_health/ping", async () => ({ health: "OK" }));

  app.get("/metrics", async (_request, reply) => {
    const text = await ctx.registry.metrics();
    return reply.type(ctx.registry.contentType).send(text);
  });

  app.get("/management/v1/openapi.json", async () => managementApiDocument());

  app.get("/management/v1/instances", async (request) => {
    queryOf(request.query, []);
    return { items: instanceItems(partsOf(), ctx.nowMs()) };
  });

  app.get("/management/v1/workers", async (request) => {
    queryOf(request.query, []);
    return { items: userWorkerItems(partsOf()) };
  });

  for (const behavior of ["hold", "drain", "run"] as const satisfies readonly IdleBehavior[]) {
    app.post(`/management/v1/instances/${behavior}`, async (request) => {
      const q = queryOf(request.query, ["instance_id"]);
      const id = instanceIdOf(q);
      const parts = partsOf();
      const w = workerOf(parts, id);
      request.log.info({ instanceId: w.id, idleBehavior: behavior }, "operator set the idle behaviour");
      await parts.pool.setIdleBehavior(w.id, behavior);
      return { instanceId: w.id, idleBehavior: parts.pool.worker(w.id)?.idleBehavior ?? behavior };
    });
  }

  app.post("/management/v1/instances/kill", async (request) => {
    const q = queryOf(request.query, ["instance_id", "reason"]);
    const id = instanceIdOf(q);
    const reason = reasonOf(q, "killed by an operator");
    const parts = partsOf();
    const w = workerOf(parts, id);
    request.log.info({ instanceId: w.id, reason }, "operator killed an instance");
    parts.pool.shutdown(w.id, reason);
    return { instanceId: w.id, state: "shutdown" as const };
  });

  app.get("/management/v1/bundles", async (request) => {
    queryOf(request.query, []);
    return { items: bundleItems(partsOf()) };
  });

  app.get("/management/v1/bundles/:uuid", async (request) => {
    queryOf(request.query, []);
    const uuid = bundleUuid(
      (request.params as Record<string, string | undefined>)["uuid"] ?? "",
      "uuid",
      "param",
    );
    const parts = partsOf();
    const b = parts.queue.get(uuid);
    if (b === undefined) {
      throw new DispatchCloudError("management.unknown_bundle", `no bundle ${show(uuid)} in the queue`, {
        path: "uuid",
      });
    }
    return bundleItem(b, parts);
  });

  app.post("/management/v1/bundles/kill", async (request) => {
    const q = queryOf(request.query, ["uuid", "reason"]);
    const uuid = bundleUuid(required(q, "uuid"), "uuid", "query");
    const reason = reasonOf(q, "killed by an operator");
    const parts = partsOf();
    const result = await killBundle(ctx.db, uuid, { actor: "operator", reason });
    if (!result.ok) {
      const cur = result.current;
      if (cur === null) {
        throw new DispatchCloudError("management.unknown_bundle", `no bundle ${show(uuid)}`, {
          path: "uuid",
        });
      }
      if (isFinalState(cur.state)) {
        throw new DispatchCloudError(
          "bundle.conflict",
          `bundle ${cur.uuid} is already ${cur.state}; it cannot be killed`,
        );
      }
      throw new DispatchCloudError("bundle.conflict", `bundle ${cur.uuid} changed meanwhile; try again`);
    }
    // The queue drops it at once (sync then stops its runner); NOTIFY would tell it too.
    parts.queue.apply(result.bundle);
    request.log.info({ bundleUuid: uuid, reason }, "operator killed a bundle");
    return { uuid, state: "killed" as const };
  });
}
