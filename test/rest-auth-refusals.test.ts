/**
 * Requests the REST server and the management API refuse for their token (lib/auth-refusals.ts): counted by
 * the token's kind and the error's code, summed in one warning per interval with the addresses that sent them,
 * never a token.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyRequest } from "fastify";
import { Registry } from "prom-client";
import { afterAll, beforeAll, expect, it } from "vitest";
import type { Config } from "../config/schema.ts";
import { createAuthRefusals, tokenKind } from "../lib/auth-refusals.ts";
import type { Logger } from "../lib/logger.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createManagementServer } from "../management-api/server.ts";
import { createRestServer, type RestServerOptions } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import { describeEachDb } from "./db.ts";
import { stubConfig } from "./dispatcher-harness.ts";
import { capturingLogger } from "./fixtures.ts";
import { promtool } from "./promtool.ts";
import { injectClient } from "./rest-client.ts";

it("names a token's kind by its prefix alone", () => {
  expect(tokenKind(undefined)).toBe("none");
  expect(tokenKind("Basic abc")).toBe("none");
  expect(tokenKind("Bearer dcu_x")).toBe("user");
  expect(tokenKind("bearer dcr_x")).toBe("runner");
  expect(tokenKind("Bearer dcw_x")).toBe("worker");
  expect(tokenKind("Bearer nonsense")).toBe("other");
});

it("keeps at most 10,000 addresses an interval however many send refused requests, and counts them all", () => {
  const { logger, lines } = capturingLogger("info");
  const refusals = createAuthRefusals({ logger, interval: 600_000 });
  const from = (ip: string) =>
    ({ ip, headers: { authorization: "Bearer dcu_x" } }) as unknown as FastifyRequest;
  for (let i = 0; i < 10_050; i++)
    refusals.record(from(`10.${i >> 16}.${(i >> 8) & 255}.${i & 255}`), "auth.invalid_token");
  for (let i = 0; i < 5; i++) refusals.record(from("192.0.2.7"), "auth.invalid_token");
  refusals.close();
  const [warning, ...more] = lines.filter((l) => l["msg"] === "requests refused for their token");
  expect(more).toEqual([]);
  expect(warning).toMatchObject({ refusals: 10_055, byToken: { user: 10_055 }, addresses: 10_000 });
  // An address first seen once 10,000 are kept counts in the total only.
  expect(warning?.["topAddresses"]).toHaveLength(10);
  expect(JSON.stringify(warning)).not.toContain("192.0.2.7");
  // A new interval starts empty: nothing more to say.
  refusals.flush();
  expect(lines.filter((l) => l["msg"] === "requests refused for their token")).toHaveLength(1);
});

describeEachDb("requests refused for their token", (getDb) => {
  let dataDir: string;
  beforeAll(async () => {
    dataDir = await mkdtemp(join(tmpdir(), "dc-refusals-"));
  });
  afterAll(async () => {
    if (dataDir !== undefined) await rm(dataDir, { recursive: true, force: true });
  });
  /** A REST server whose refusal warning comes when it closes (the interval is longer than the test). */
  const restServer = (logger: Logger, more: Partial<RestServerOptions> = {}) =>
    createRestServer({
      db: getDb(),
      logger,
      clusterId: "zzzzz",
      maxRequestBodySize: 64 * 1024,
      defaultMaxAttempts: 3,
      dataDir,
      authRefusalLogInterval: 600_000,
      ...more,
    });

  it("counts them by token kind and code, and sums them in one warning with the addresses, no token in it", async () => {
    const { logger, lines } = capturingLogger("info");
    const registry = new Registry();
    const app = await restServer(logger, { metricsRegistry: registry });
    const api = injectClient(app);
    const alice = newUserToken();
    await createUser(getDb(), {
      uuid: newUserUuid("zzzzz"),
      name: `alice-${Math.random()}`,
      isAdmin: false,
      tokenHash: hashToken(alice),
    });
    const unknownUser = newUserToken();
    const unknownRunner = `dcr_${"q".repeat(43)}`;
    const unknownWorker = `dcw_${"w".repeat(43)}`;
    const refused = [
      await api("GET", "/api/v1/bundles"),
      await api("GET", "/api/v1/bundles", unknownUser),
      await api("GET", "/api/v1/users/current", unknownUser),
      await api("POST", "/api/v1/runner/heartbeat", unknownRunner, { resourceUsage: {} }),
      await api("POST", "/api/v1/runner/logs?stream=stdout&offset=0", "nonsense", Buffer.from("x"), {
        "content-type": "application/octet-stream",
      }),
      await api("POST", "/api/v1/workers/checkin", unknownWorker, {}),
    ];
    expect(refused.map((r) => r.status)).toEqual([401, 401, 401, 401, 401, 401]);
    // Allowed, or refused for what the token may do (403): not counted.
    expect((await api("GET", "/api/v1/users/current", alice)).status).toBe(200);
    expect((await api("POST", "/api/v1/users", alice, { name: "bob" })).status).toBe(403);

    const counted = (await registry.getSingleMetric("dispatchcloud_rest_auth_refusals_total")?.get())?.values;
    expect(
      Object.fromEntries((counted ?? []).map((v) => [`${v.labels["token"]} ${v.labels["code"]}`, v.value])),
    ).toEqual({
      "none auth.missing_token": 1,
      "user auth.invalid_token": 2,
      "runner auth.invalid_token": 1,
      "other auth.invalid_token": 1,
      "worker auth.invalid_token": 1,
    });
    const text = await registry.metrics();
    expect(promtool(text)).toEqual({ status: 0, output: "" });

    expect(lines.filter((l) => l["msg"] === "requests refused for their token")).toEqual([]);
    await app.close();
    const warnings = lines.filter((l) => l["msg"] === "requests refused for their token");
    expect(warnings).toEqual([
      expect.objectContaining({
        level: 40,
        refusals: 6,
        byToken: { none: 1, user: 2, runner: 1, other: 1, worker: 1 },
        addresses: 1,
        topAddresses: [{ address: "127.0.0.1", count: 6 }],
      }),
    ]);
    const logged = JSON.stringify(lines);
    for (const secret of [alice, unknownUser, unknownRunner, unknownWorker, "nonsense"]) {
      expect(logged).not.toContain(secret);
    }
  });

  it("names the client behind a trusted proxy (restServer.trustedProxies), and only behind one", async () => {
    const summed = async (trustedProxies: string[] | undefined) => {
      const { logger, lines } = capturingLogger("info");
      const app = await restServer(logger, trustedProxies === undefined ? {} : { trustedProxies });
      // fastify.inject's connection is from 127.0.0.1.
      for (const forwarded of ["203.0.113.9", "198.51.100.1, 203.0.113.9", "203.0.113.9"]) {
        const res = await app.inject({
          method: "GET",
          url: "/api/v1/bundles",
          headers: { "x-forwarded-for": forwarded },
        });
        expect(res.statusCode).toBe(401);
      }
      await app.close();
      return lines.find((l) => l["msg"] === "requests refused for their token")?.["topAddresses"];
    };
    expect(await summed(["127.0.0.1"])).toEqual([{ address: "203.0.113.9", count: 3 }]);
    // The proxy trusted but not the address before it: that address is the client.
    expect(await summed(["127.0.0.0/8", "203.0.113.9"])).toEqual([
      { address: "203.0.113.9", count: 2 },
      { address: "198.51.100.1", count: 1 },
    ]);
    // Nobody trusted: anybody can write the header, so it is not believed.
    expect(await summed(undefined)).toEqual([{ address: "127.0.0.1", count: 3 }]);
    expect(await summed([])).toEqual([{ address: "127.0.0.1", count: 3 }]);
    expect(await summed(["10.0.0.0/8"])).toEqual([{ address: "127.0.0.1", count: 3 }]);
  });

  it("counts the management API's refusals on their own metric and warning, never the token", async () => {
    const token = `dcm-${"m".repeat(40)}`;
    const management = async (configured: string) => {
      const { logger, lines } = capturingLogger("info");
      const registry = new Registry();
      const c = stubConfig();
      const app = await createManagementServer({
        config: { ...c, management: { ...c.management, token: configured } } as Config,
        dispatcher: { active: false, parts: null },
        db: getDb(),
        registry,
        logger,
        env: {},
        authRefusalLogInterval: 600_000,
      });
      return { app, lines, registry };
    };
    const { app, lines, registry } = await management(token);
    const call = (authorization?: string) =>
      app.inject({
        method: "GET",
        url: "/management/v1/instances",
        headers: authorization === undefined ? {} : { authorization },
      });
    const wrongUser = newUserToken();
    const statuses = [
      (await call()).statusCode,
      (await call(`Bearer ${wrongUser}`)).statusCode,
      (await call("Bearer nonsense")).statusCode,
      (await call(`Bearer ${token}x`)).statusCode,
    ];
    expect(statuses).toEqual([401, 403, 403, 403]);
    // The right token: not counted.
    expect((await call(`Bearer ${token}`)).statusCode).not.toBe(403);
    const counted = (await registry.getSingleMetric("dispatchcloud_management_auth_refusals_total")?.get())
      ?.values;
    expect(
      Object.fromEntries((counted ?? []).map((v) => [`${v.labels["token"]} ${v.labels["code"]}`, v.value])),
    ).toEqual({ "none auth.missing_token": 1, "user auth.forbidden": 1, "other auth.forbidden": 2 });
    expect(registry.getSingleMetric("dispatchcloud_rest_auth_refusals_total")).toBeUndefined();
    expect(promtool(await registry.metrics())).toEqual({ status: 0, output: "" });
    await app.close();
    const message = "management API requests refused for their token";
    expect(lines.filter((l) => l["msg"] === message)).toEqual([
      expect.objectContaining({
        level: 40,
        refusals: 4,
        byToken: { none: 1, user: 1, other: 2 },
        topAddresses: [{ address: "127.0.0.1", count: 4 }],
      }),
    ]);
    const logged = JSON.stringify(lines);
    for (const secret of [token, wrongUser, "nonsense"]) expect(logged).not.toContain(secret);

    // With no management token configured every request is refused the same way: nothing to count.
    const off = await management("");
    expect((await off.app.inject({ method: "GET", url: "/management/v1/instances" })).statusCode).toBe(403);
    await off.app.close();
    expect(off.registry.getSingleMetric("dispatchcloud_management_auth_refusals_total")).toBeUndefined();
    expect(off.lines.filter((l) => l["msg"] === message)).toEqual([]);
  });
});
