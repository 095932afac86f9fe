/**
 * The management API's OpenAPI 3.1 document (`GET /management/v1/openapi.json`), built from the TypeBox schemas
 * its routes use (schemas.ts), with lib/openapi.ts's building blocks. JSON round trips drop TypeBox's symbol
 * keys, so what is served is plain JSON Schema.
 */
import { ErrorResponse, errors, type Json, json, plain, query, ref } from "../lib/openapi.ts";
import { VERSION } from "../lib/version.ts";
import {
  BundleItem,
  BundleKillResult,
  BundleList,
  Health,
  IdleBehaviorResult,
  InstanceKillResult,
  InstanceList,
  UserWorkerList,
} from "./schemas.ts";

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
      "/management/v1/workers": {
        get: {
          operationId: "listUserWorkers",
          summary:
            "Users' own workers the dispatcher reads (active and draining; docs/workers.md): their slots, bundles and check-in age.",
          responses: { "200": json(ref("UserWorkerList"), "The workers."), ...errors(ACTIVE_ERRORS) },
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
        UserWorkerList: plain(UserWorkerList),
        Health: plain(Health),
        Error: plain(ErrorResponse),
      },
    },
  };
}
