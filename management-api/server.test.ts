/**
 * The management API's authentication, its standby answers, /metrics, the health check and the OpenAPI
 * documents, through fastify.inject. Instances and the queue: instances.test.ts and queue.test.ts.
 */
import { mkdtemp, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import type { FastifyInstance } from "fastify";
import { Counter, Registry } from "prom-client";
import { afterAll, describe, expect, it } from "vitest";
import type { Config } from "../config/schema.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { createRestServer } from "../rest-server/server.ts";
import { stubConfig, useTestDb } from "../test/dispatcher-harness.ts";
import { createManagementServer } from "./server.ts";

const TOKEN = "dcm-test-0123456789abcdef0123456789abcdef";
const STANDBY = { active: false, parts: null };

const withToken = (token: string): Config => {
  const c = stubConfig();
  return { ...c, management: { ...c.management, token } } as Config;
};

/** Every route of the management API, with a valid query where it takes one. */
const ROUTES: Array<{ method: "GET" | "POST"; url: string }> = [
  { method: "GET", url: "/_health/ping" },
  { method: "GET", url: "/metrics" },
  { method: "GET", url: "/management/v1/openapi.json" },
  { method: "GET", url: "/management/v1/instances" },
  { method: "POST", url: "/management/v1/instances/hold?instance_id=i-1" },
  { method: "POST", url: "/management/v1/instances/drain?instance_id=i-1" },
  { method: "POST", url: "/management/v1/instances/run?instance_id=i-1" },
  { method: "POST", url: "/management/v1/instances/kill?instance_id=i-1&reason=test" },
  { method: "GET", url: "/management/v1/bundles" },
  { method: "GET", url: "/management/v1/bundles/zzzzz-bndl-000000000000000" },
  { method: "POST", url: "/management/v1/bundles/kill?uuid=zzzzz-bndl-000000000000000" },
  { method: "GET", url: "/no/such/route" },
];

describe("management API: authentication, standby, metrics, OpenAPI", () => {
  const getDb = useTestDb("pg");
  const apps: FastifyInstance[] = [];
  afterAll(async () => {
    for (const app of apps) await app.close();
  });

  const server = async (
    config: Config,
    over: { registry?: Registry; env?: Record<string, string> } = {},
  ): Promise<FastifyInstance> => {
    const app = await createManagementServer({
      config,
      dispatcher: STANDBY,
      db: getDb(),
      registry: over.registry ?? new Registry(),
      logger: false,
      env: over.env ?? {},
    });
    apps.push(app);
    return app;
  };

  it("answers 403 auth.forbidden to everything when no token is configured, with or without a header", async () => {
    const app = await server(withToken(""));
    for (const r of ROUTES) {
      for (const headers of [{}, { authorization: `Bearer ${TOKEN}` }, { authorization: "Bearer " }]) {
        const res = await app.inject({ ...r, headers });
        expect([r.url, res.statusCode]).toEqual([r.url, 403]);
        expect(res.json().error.code).toBe("auth.forbidden");
        expect(res.json().error.message).toContain("management.token is not configured");
      }
    }
  });

  it("answers 401 without a token, 403 with a wrong one, and never echoes the token", async () => {
    const app = await server(withToken(TOKEN));
    for (const r of ROUTES) {
      const missing = await app.inject(r);
      expect([r.url, missing.statusCode, missing.json().error.code]).toEqual([
        r.url,
        401,
        "auth.missing_token",
      ]);
      const malformed = await app.inject({ ...r, headers: { authorization: TOKEN } });
      expect([r.url, malformed.statusCode]).toEqual([r.url, 401]);
      for (const wrong of [`${TOKEN}x`, TOKEN.slice(0, -1), "dcu_other", TOKEN.toUpperCase()]) {
        const res = await app.inject({ ...r, headers: { authorization: `Bearer ${wrong}` } });
        expect([r.url, res.statusCode, res.json().error.code]).toEqual([r.url, 403, "auth.forbidden"]);
        expect(res.body).not.toContain(wrong);
      }
    }
  });

  it("serves the health check, metrics and its OpenAPI document with the right token", async () => {
    const registry = new Registry();
    const counter = new Counter({
      name: "dispatchcloud_test_total",
      help: "A test counter.",
      registers: [registry],
    });
    counter.inc(3);
    const app = await server(withToken(TOKEN), { registry });
    const auth = { authorization: `Bearer ${TOKEN}` };
    const ping = await app.inject({ url: "/_health/ping", headers: auth });
    expect(ping.statusCode).toBe(200);
    expect(ping.json()).toEqual({ health: "OK" });
    const metrics = await app.inject({ url: "/metrics", headers: auth });
    expect(metrics.statusCode).toBe(200);
    expect(metrics.headers["content-type"]).toContain("text/plain");
    expect(metrics.body).toContain("# HELP dispatchcloud_test_total A test counter.");
    expect(metrics.body).toContain("dispatchcloud_test_total 3");
    const doc = await app.inject({ url: "/management/v1/openapi.json", headers: auth });
    expect(doc.statusCode).toBe(200);
    const body = doc.json();
    expect(body.openapi).toBe("3.1.0");
    expect(Object.keys(body.paths).sort()).toEqual([
      "/_health/ping",
      "/management/v1/bundles",
      "/management/v1/bundles/kill",
      "/management/v1/bundles/{uuid}",
      "/management/v1/instances",
      "/management/v1/instances/drain",
      "/management/v1/instances/hold",
      "/management/v1/instances/kill",
      "/management/v1/instances/run",
      "/management/v1/openapi.json",
      "/management/v1/workers",
      "/metrics",
    ]);
    expect(Object.keys(body.components.schemas.InstanceList.properties.items.items.properties)).toEqual([
      "instanceId",
      "address",
      "instanceType",
      "providerType",
      "price",
      "state",
      "idleBehavior",
      "preempted",
      "problem",
      "runningBundles",
      "lastBusyAt",
      "stateSince",
      "secondsInState",
    ]);
    expect(body.paths["/management/v1/instances/kill"].post.responses["404"].description).toBe(
      "management.unknown_instance",
    );
    // Plain JSON: no TypeBox symbols or functions survive.
    expect(JSON.parse(JSON.stringify(body))).toEqual(body);
  });

  it("takes the token from a file:// reference", async () => {
    const dir = await mkdtemp(join(tmpdir(), "dc-mgmt-token-"));
    const file = join(dir, "token");
    await writeFile(file, `${TOKEN}\n`, { mode: 0o600 });
    const app = await server(withToken(pathToFileURL(file).href));
    expect(
      (await app.inject({ url: "/_health/ping", headers: { authorization: `Bearer ${TOKEN}` } })).statusCode,
    ).toBe(200);
    // The file's trailing newline is not part of the token.
    expect(
      (await app.inject({ url: "/_health/ping", headers: { authorization: `Bearer ${TOKEN}\n` } }))
        .statusCode,
    ).not.toBe(200);
    const empty = join(dir, "empty");
    await writeFile(empty, "");
    await expect(server(withToken(pathToFileURL(empty).href))).rejects.toMatchObject({
      code: "config.missing_secret",
      path: "management.token",
    });
    await expect(server(withToken(pathToFileURL(join(dir, "absent")).href))).rejects.toMatchObject({
      code: "config.unreadable_file",
    });
  });

  it("takes the token from an env: reference, and refuses to start when the variable is unset", async () => {
    const app = await server(withToken("env:DC_MGMT_TOKEN"), { env: { DC_MGMT_TOKEN: TOKEN } });
    const ok = await app.inject({ url: "/_health/ping", headers: { authorization: `Bearer ${TOKEN}` } });
    expect(ok.statusCode).toBe(200);
    const wrong = await app.inject({
      url: "/_health/ping",
      headers: { authorization: "Bearer DC_MGMT_TOKEN" },
    });
    expect(wrong.statusCode).toBe(403);
    const err = await server(withToken("env:DC_MGMT_TOKEN"), { env: {} }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(DispatchCloudError);
    expect(err).toMatchObject({ code: "config.missing_secret", path: "management.token" });
    expect((err as Error).message).toContain("DC_MGMT_TOKEN");
  });

  it("answers 503 management.not_active for instance and queue routes on a standby, but serves metrics and ping", async () => {
    const app = await server(withToken(TOKEN));
    const auth = { authorization: `Bearer ${TOKEN}` };
    for (const r of ROUTES) {
      const res = await app.inject({ ...r, headers: auth });
      if (r.url.startsWith("/management/v1/instances") || r.url.startsWith("/management/v1/bundles")) {
        expect([r.url, res.statusCode, res.json().error.code]).toEqual([r.url, 503, "management.not_active"]);
      } else if (r.url === "/no/such/route") {
        expect([res.statusCode, res.json().error.code]).toEqual([404, "request.not_found"]);
      } else {
        expect([r.url, res.statusCode]).toEqual([r.url, 200]);
      }
    }
  });

  it("refuses malformed queries with request.invalid_query and the parameter's path before anything else", async () => {
    const app = await server(withToken(TOKEN));
    const auth = { authorization: `Bearer ${TOKEN}` };
    const cases: Array<[string, string]> = [
      ["/management/v1/instances/hold", "instance_id"],
      ["/management/v1/instances/drain?instance_id=", "instance_id"],
      ["/management/v1/instances/run?instance_id=i-1&instance_id=i-2", "instance_id"],
      ["/management/v1/instances/kill?reason=x", "instance_id"],
      ["/management/v1/instances/hold?instance_id=i-1&force=1", "force"],
      ["/management/v1/bundles/kill", "uuid"],
      ["/management/v1/bundles/kill?uuid=zzzzz-bndl-000000000000000&reason=" + "x".repeat(1001), "reason"],
      // NUL (PostgreSQL refuses it: this was a 500), other control characters and line breaks, malformed uuids.
      ["/management/v1/bundles/kill?uuid=zzzzz-bndl-000000000000000%00", "uuid"],
      ["/management/v1/bundles/kill?uuid=%00", "uuid"],
      ["/management/v1/bundles/kill?uuid=not-a-uuid", "uuid"],
      ["/management/v1/bundles/kill?uuid=zzzzz-bndl-000000000000000&reason=a%00b", "reason"],
      ["/management/v1/bundles/kill?uuid=zzzzz-bndl-000000000000000&reason=a%0AINFO%20forged", "reason"],
      ["/management/v1/bundles/kill?uuid=zzzzz-bndl-000000000000000&reason=a%E2%80%A8b", "reason"],
      ["/management/v1/instances/kill?instance_id=i-1&reason=%1b%5b31m", "reason"],
      ["/management/v1/instances/hold?instance_id=i-1%00", "instance_id"],
      ["/management/v1/instances/drain?instance_id=" + "i".repeat(201), "instance_id"],
    ];
    for (const [url, path] of cases) {
      const res = await app.inject({ method: "POST", url, headers: auth });
      expect([url, res.statusCode, res.json().error]).toEqual([
        url,
        400,
        expect.objectContaining({ code: "request.invalid_query", path }),
      ]);
    }
    const list = await app.inject({ url: "/management/v1/instances?x=1", headers: auth });
    expect([list.statusCode, list.json().error.path]).toEqual([400, "x"]);
    const one = await app.inject({ url: "/management/v1/bundles/not-a-uuid%00", headers: auth });
    expect([one.statusCode, one.json().error]).toEqual([
      400,
      expect.objectContaining({ code: "request.invalid_param", path: "uuid" }),
    ]);
  });

  it("serves the users' API OpenAPI document on the REST server, built from the schemas its routes use", async () => {
    const rest = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 2 ** 20,
      defaultMaxAttempts: 3,
      dataDir: await mkdtemp(join(tmpdir(), "dc-rest-openapi-")),
    });
    apps.push(rest);
    const res = await rest.inject({ url: "/api/v1/openapi.json" });
    expect(res.statusCode).toBe(200);
    const doc = res.json();
    expect(doc.openapi).toBe("3.1.0");
    expect(doc.paths["/api/v1/bundles"].post.requestBody.content["application/json"].schema).toEqual({
      $ref: "#/components/schemas/BundleRequest",
    });
    expect(doc.components.schemas.BundleRequest.type).toBe("object");
    expect(doc.components.schemas.BundleRequest.properties.command).toBeDefined();
    expect(doc.components.schemas.KillRequest.properties.reason.maxLength).toBe(1000);
    expect(doc.components.schemas.UserRequest.required).toEqual(["name"]);
    expect(Object.keys(doc.paths)).toContain("/api/v1/bundles/{uuid}/logs");
  });
});
