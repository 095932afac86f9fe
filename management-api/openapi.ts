/**
 * OpenAPI 3.1 documents, built from the TypeBox schemas the routes use: the management API's
 * (`GET /management/v1/openapi.json`) and the users' API's (`GET /api/v1/openapi.json` on the REST server).
 * JSON round trips drop TypeBox's symbol keys, so what is served is plain JSON Schema; 3.1 because its schemas
 * are JSON Schema 2020-12 (`const`, `patternProperties`, type arrays), which the TypeBox schemas use and 3.0's
 * subset lacks. management-api/openapi.test.ts checks both with a standard validator (swagger-parser).
 */
import type { TSchema } from "@sinclair/typebox";
import { VERSION } from "../crunch-run/version.ts";
import { ERROR_CODES } from "../lib/errors.ts";
import { BundleRequest } from "../rest-server/bundle-request.ts";
import { TokenRequest } from "../rest-server/routes-tokens.ts";
import { KillRequest, UserRequest } from "../rest-server/routes-users.ts";
import {
  BundleItem,
  BundleKillResult,
  BundleList,
  ErrorResponse,
  Health,
  IdleBehaviorResult,
  InstanceKillResult,
  InstanceList,
} from "./schemas.ts";

type Json = Record<string, unknown>;

const nullable = (type: string, extra: Json = {}): Json => ({ type: [type, "null"], ...extra });
/** An API token as the users' API shows it (rest-server/routes-tokens.ts; never the token itself). */
const TOKEN_VIEW: Json = {
  type: "object",
  properties: {
    id: { type: "string" },
    userUuid: { type: "string" },
    label: { type: "string" },
    createdAt: { type: "string", format: "date-time" },
    expiresAt: nullable("string", { format: "date-time" }),
    lastUsedAt: nullable("string", { format: "date-time" }),
    revokedAt: nullable("string", { format: "date-time" }),
    expired: { type: "boolean" },
    current: { type: "boolean", description: "The token this request was made with." },
  },
  required: [
    "id",
    "userUuid",
    "label",
    "createdAt",
    "expiresAt",
    "lastUsedAt",
    "revokedAt",
    "expired",
    "current",
  ],
};

const plain = (schema: TSchema): Json => JSON.parse(JSON.stringify(schema)) as Json;
const ref = (name: string): Json => ({ $ref: `#/components/schemas/${name}` });
const json = (schema: Json, description: string): Json => ({
  description,
  content: { "application/json": { schema } },
});
/** The error responses of a route: each status with the codes that answer with it. */
function errors(codes: readonly (keyof typeof ERROR_CODES)[]): Json {
  const byStatus = new Map<number, string[]>();
  for (const c of codes) {
    const s = ERROR_CODES[c].status;
    byStatus.set(s, [...(byStatus.get(s) ?? []), c]);
  }
  const out: Json = {};
  for (const [status, list] of byStatus) out[String(status)] = json(ref("Error"), list.join(", "));
  return out;
}
const query = (name: string, description: string, required: boolean): Json => ({
  name,
  in: "query",
  required,
  description,
  schema: { type: "string" },
});

const AUTH_ERRORS = ["auth.missing_token", "auth.forbidden"] as const;
const ACTIVE_ERRORS = [...AUTH_ERRORS, "management.not_active"] as const;

/** The management API (management-api/routes.ts). */
export function managementApiDocument(): Json {
  const instanceId = query("instance_id", "The instance's id (as listed).", true);
  const behavior = (b: string, what: string): Json => ({
    post: {
      operationId: `instance${b[0]!.toUpperCase()}${b.slice(1)}`,
      summary: what,
      parameters: [instanceId],
      responses: {
        "200": json(ref("IdleBehaviorResult"), "The instance's idle behaviour now (its tag is rewritten)."),
        ...errors([...ACTIVE_ERRORS, "request.invalid_query", "management.unknown_instance"]),
      },
    },
  });
  return {
    openapi: "3.1.0",
    info: {
      title: "dispatch-cloud management API",
      version: VERSION,
      description:
        "For operators: instances, the queue as the dispatcher sees it, kills, metrics. Every route needs " +
        "Authorization: Bearer <management.token>; with no token configured every request is refused (403).",
    },
    security: [{ bearer: [] }],
    paths: {
      "/management/v1/instances": {
        get: {
          operationId: "listInstances",
          summary: "Every instance of the pool; creates in flight appear as booting under a placeholder id.",
          responses: { "200": json(ref("InstanceList"), "The instances."), ...errors(ACTIVE_ERRORS) },
        },
      },
      "/management/v1/instances/hold": behavior(
        "hold",
        "Hold: never shut down automatically, no new bundles.",
      ),
      "/management/v1/instances/drain": behavior(
        "drain",
        "Drain: no new bundles, shut down once nothing runs.",
      ),
      "/management/v1/instances/run": behavior("run", "Run: the normal behaviour."),
      "/management/v1/instances/kill": {
        post: {
          operationId: "instanceKill",
          summary: "Shuts the instance down at once (its bundles are lost and requeued).",
          parameters: [instanceId, query("reason", "Why (logged); default 'killed by an operator'.", false)],
          responses: {
            "200": json(ref("InstanceKillResult"), "The instance is shutting down."),
            ...errors([...ACTIVE_ERRORS, "request.invalid_query", "management.unknown_instance"]),
          },
        },
      },
      "/management/v1/bundles": {
        get: {
          operationId: "listQueue",
          summary: "The queue: staged bundles in the scheduler's order, then starting and running ones.",
          responses: { "200": json(ref("BundleList"), "The queue."), ...errors(ACTIVE_ERRORS) },
        },
      },
      "/management/v1/bundles/{uuid}": {
        get: {
          operationId: "getQueuedBundle",
          summary: "One bundle of the queue.",
          parameters: [{ name: "uuid", in: "path", required: true, schema: { type: "string" } }],
          responses: {
            "200": json(ref("BundleItem"), "The bundle."),
            ...errors([...ACTIVE_ERRORS, "management.unknown_bundle"]),
          },
        },
      },
      "/management/v1/bundles/kill": {
        post: {
          operationId: "bundleKill",
          summary: "Kills a bundle that is not final (its runner is stopped).",
          parameters: [
            query("uuid", "The bundle's uuid.", true),
            query("reason", "Why (kept in the bundle's events); default 'killed by an operator'.", false),
          ],
          responses: {
            "200": json(ref("BundleKillResult"), "The bundle is killed."),
            ...errors([
              ...ACTIVE_ERRORS,
              "request.invalid_query",
              "management.unknown_bundle",
              "bundle.conflict",
            ]),
          },
        },
      },
      "/metrics": {
        get: {
          operationId: "metrics",
          summary: "Prometheus metrics of the dispatcher (text exposition format).",
          responses: {
            "200": { description: "Metrics.", content: { "text/plain": { schema: { type: "string" } } } },
            ...errors(AUTH_ERRORS),
          },
        },
      },
      "/_health/ping": {
        get: {
          operationId: "ping",
          summary: "Health check.",
          responses: { "200": json(ref("Health"), "Alive."), ...errors(AUTH_ERRORS) },
        },
      },
      "/management/v1/openapi.json": {
        get: {
          operationId: "openapi",
          summary: "This document.",
          responses: { "200": json({ type: "object" }, "OpenAPI 3 document."), ...errors(AUTH_ERRORS) },
        },
      },
    },
    components: {
      securitySchemes: { bearer: { type: "http", scheme: "bearer" } },
      schemas: {
        InstanceList: plain(InstanceList),
        IdleBehaviorResult: plain(IdleBehaviorResult),
        InstanceKillResult: plain(InstanceKillResult),
        BundleList: plain(BundleList),
        BundleItem: plain(BundleItem),
        BundleKillResult: plain(BundleKillResult),
        Health: plain(Health),
        Error: plain(ErrorResponse),
      },
    },
  };
}

/** The users' API (rest-server/routes-users.ts); request bodies are the schemas the routes validate with. */
export function usersApiDocument(): Json {
  const uuid: Json = { name: "uuid", in: "path", required: true, schema: { type: "string" } };
  const bundle = json({ type: "object", description: "A bundle (docs/api.md)." }, "The bundle.");
  const body = (name: string): Json => ({
    required: true,
    content: { "application/json": { schema: ref(name) } },
  });
  const common = ["auth.missing_token", "auth.invalid_token"] as const;
  const ownBundle = [...common, "request.invalid_param", "bundle.not_found"] as const;
  return {
    openapi: "3.1.0",
    info: {
      title: "dispatch-cloud users' API",
      version: VERSION,
      description: "Submit and follow bundles (docs/api.md). Authorization: Bearer <user token>.",
    },
    security: [{ bearer: [] }],
    paths: {
      "/api/v1/bundles": {
        post: {
          operationId: "createBundle",
          requestBody: body("BundleRequest"),
          responses: {
            "201": bundle,
            ...errors([
              ...common,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "quota.queued_bundles",
              "quota.rate_limited",
            ]),
          },
        },
        get: {
          operationId: "listBundles",
          parameters: [
            query("state", "Comma-separated states.", false),
            query("limit", "1-500, default 50.", false),
            query("cursor", "nextCursor of the previous page.", false),
          ],
          responses: {
            "200": json(
              {
                type: "object",
                properties: {
                  items: { type: "array", items: { type: "object" } },
                  nextCursor: { type: ["string", "null"] },
                },
              },
              "A page of the caller's bundles.",
            ),
            ...errors([...common, "request.invalid_query"]),
          },
        },
      },
      "/api/v1/bundles/{uuid}": {
        get: {
          operationId: "getBundle",
          parameters: [uuid],
          responses: { "200": bundle, ...errors(ownBundle) },
        },
      },
      "/api/v1/bundles/{uuid}/kill": {
        post: {
          operationId: "killBundle",
          parameters: [uuid],
          requestBody: { required: false, content: { "application/json": { schema: ref("KillRequest") } } },
          responses: { "200": bundle, ...errors([...ownBundle, "request.invalid_body", "bundle.conflict"]) },
        },
      },
      "/api/v1/bundles/{uuid}/events": {
        get: {
          operationId: "listBundleEvents",
          parameters: [uuid],
          responses: { "200": json({ type: "object" }, "The bundle's state changes."), ...errors(ownBundle) },
        },
      },
      "/api/v1/bundles/{uuid}/logs": {
        get: {
          operationId: "getBundleLogs",
          parameters: [
            uuid,
            query("stream", "stdout or stderr.", false),
            query("follow", "true: keep the response open until the attempt ends.", false),
            query("attempt", "Attempt number; default the current one.", false),
          ],
          responses: {
            "200": {
              description: "The log text.",
              content: { "text/plain": { schema: { type: "string" } } },
            },
            ...errors([...ownBundle, "request.invalid_query"]),
          },
        },
      },
      "/api/v1/bundles/{uuid}/outputs/{path}": {
        get: {
          operationId: "getBundleOutput",
          parameters: [
            uuid,
            { name: "path", in: "path", required: true, schema: { type: "string" } },
            query("limit", "A directory listing: files per page, 1-10000 (default 1000).", false),
            query("cursor", "A directory listing: nextCursor of the previous page.", false),
          ],
          responses: {
            "200": {
              description: "A directory listing (JSON) or a file's bytes.",
              content: {
                "application/json": { schema: { type: "object" } },
                "application/octet-stream": { schema: { type: "string", format: "binary" } },
              },
            },
            ...errors(ownBundle),
          },
        },
      },
      "/api/v1/tokens": {
        post: {
          operationId: "createToken",
          requestBody: body("TokenRequest"),
          responses: {
            "201": json(ref("TokenWithSecret"), "The token's view and the token, shown only this once."),
            ...errors([
              ...common,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "auth.forbidden",
              "user.not_found",
              "quota.tokens",
            ]),
          },
        },
        get: {
          operationId: "listTokens",
          parameters: [query("user", "A user uuid (admins); default the caller.", false)],
          responses: {
            "200": json(
              { type: "object", properties: { items: { type: "array", items: ref("Token") } } },
              "The user's tokens that are not revoked.",
            ),
            ...errors([...common, "request.invalid_query", "auth.forbidden", "user.not_found"]),
          },
        },
      },
      "/api/v1/tokens/{id}": {
        delete: {
          operationId: "revokeToken",
          parameters: [{ name: "id", in: "path", required: true, schema: { type: "string" } }],
          responses: {
            "200": json(ref("Token"), "The revoked token's view."),
            ...errors([...common, "request.invalid_param", "token.not_found"]),
          },
        },
      },
      "/api/v1/users/current": {
        get: {
          operationId: "currentUser",
          responses: { "200": json({ type: "object" }, "The caller."), ...errors(common) },
        },
      },
      "/api/v1/users": {
        post: {
          operationId: "createUser",
          requestBody: body("UserRequest"),
          responses: {
            "201": json({ type: "object" }, "The new user and its token (shown only this once)."),
            ...errors([...common, "auth.forbidden", "request.invalid_body"]),
          },
        },
      },
    },
    components: {
      securitySchemes: { bearer: { type: "http", scheme: "bearer" } },
      schemas: {
        BundleRequest: plain(BundleRequest),
        KillRequest: plain(KillRequest),
        UserRequest: plain(UserRequest),
        TokenRequest: plain(TokenRequest),
        Token: TOKEN_VIEW,
        TokenWithSecret: {
          allOf: [
            ref("Token"),
            { type: "object", properties: { token: { type: "string" } }, required: ["token"] },
          ],
        },
        Error: plain(ErrorResponse),
      },
    },
  };
}
