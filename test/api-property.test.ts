/**
 * Careless and hostile clients of both HTTP APIs, as a property: over every route the servers themselves
 * registered (lib/http-routes.ts, so a new route is covered without editing this file), requests with
 * generated path parameters, queries, headers, tokens and bodies never get a 5xx, and every 4xx is the error
 * shape `{ error: { code, message, path? } }` with a code of lib/errors.ts and the status that code maps to.
 * The users' and runner API on a REST server with real bundles (final ones with outputs, running ones with
 * runner tokens), the management API on an active dispatcher on the stub cloud; through fastify.inject, on
 * PostgreSQL and PGlite. fast-check prints the seed and the smallest failing request when the property fails.
 */
import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import fc from "fast-check";
import type { FastifyInstance, InjectOptions } from "fastify";
import { Registry } from "prom-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { Config } from "../config/schema.ts";
import { ERROR_CODES } from "../lib/errors.ts";
import { routesOf } from "../lib/http-routes.ts";
import { packTar } from "../lib/tar.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createManagementServer } from "../management-api/server.ts";
import { createRestServer } from "../rest-server/server.ts";
import { encodeCursor } from "../rest-server/views.ts";
import { createUser, getBundle } from "../store/queries.ts";
import { finishBundle, killBundle, markRunning, stageBundle } from "../store/transitions.ts";
import { createTestBundle, createTestUser, describeEachDb, startWithRunnerToken } from "./db.ts";
import { createHarness, type Harness } from "./dispatcher-harness.ts";
import { silentLogger as silent } from "./fixtures.ts";

/** Requests per route and server; every route gets this many, so none is left out by chance. */
const RUNS_PER_ROUTE = 100;
const MGMT_TOKEN = "dcm-property-test-token-0123456789";

// ---- generated pieces ------------------------------------------------------------------------------------

/** Characters that have hurt servers: controls, line breaks, lone surrogates, path and escape characters. */
const nasty = fc.constantFrom(
  "\u0000",
  "\n",
  "\r",
  "\t",
  "\u001b",
  "\u007f",
  "\u0085",
  "\u2028",
  "\ud800",
  "\udfff",
  "\ufeff",
  "\ufffd",
  "é",
  "🚀",
  "/",
  "\\",
  "..",
  ".",
  "%",
  "%00",
  " ",
  '"',
  "'",
  "$(",
  "`",
  ";",
  "&",
  "=",
  "?",
  "#",
  "__proto__",
  "constructor",
);
const unit = fc.oneof({ weight: 3, arbitrary: fc.string({ unit: "grapheme-ascii", maxLength: 1 }) }, nasty);
const text = fc.oneof(
  { weight: 4, arbitrary: fc.string({ unit, maxLength: 12 }) },
  fc.string({ unit: "binary", maxLength: 8 }),
  fc.integer({ min: 250, max: 5000 }).map((n) => "x".repeat(n)),
  fc.constantFrom("", "busybox", "dctest/busybox:1", "4GiB", "1e300GiB", "0", "-1", "1h", "0s", "cuda"),
);
const number = fc.oneof(
  fc.integer(),
  fc.double(),
  fc.constantFrom(0, -0, 1e-300, 5e-324, 1e300, 2 ** 31, 2 ** 31 - 1, 2 ** 53, 2 ** 63, -(2 ** 31) - 1, 0.5),
);
const leaf = fc.oneof(text, number, fc.boolean(), fc.constant(null));
const anyJson = fc.letrec<{ value: unknown }>((tie) => ({
  value: fc.oneof(
    { depthSize: "small", withCrossShrink: true },
    leaf,
    fc.array(tie("value"), { maxLength: 4 }),
    fc.dictionary(text, tie("value"), { maxKeys: 4 }),
  ),
})).value;
const maybe = <T>(a: fc.Arbitrary<T>) => fc.oneof({ weight: 3, arbitrary: a }, anyJson);

/** Paths as requests send them: names with dots, slashes, long names, nasty characters. */
const relPath = fc
  .array(fc.oneof(text, fc.constantFrom("a", "..", ".", "", "x".repeat(256), "é".repeat(128))), {
    maxLength: 5,
  })
  .map((names) => names.join("/"));

/** Real uuids (of bundles, instances) among generated and malformed ones. */
function uuidFrom(known: readonly string[]) {
  return fc.oneof(
    { weight: 3, arbitrary: fc.constantFrom(...known) },
    fc.stringMatching(/^[a-z0-9]{5}-bndl-[a-z0-9]{15}$/),
    text,
  );
}

/** A valid bundle request with one field (at any depth) replaced by a generated value, or left as it is. */
function nearlyValidBundle(uuid: fc.Arbitrary<string>) {
  const valid = {
    name: "nightly",
    command: ["sh", "-c", "echo hi"],
    image: "busybox",
    env: { A: "1" },
    resources: { vcpus: 1, ram: "256MiB", scratch: 0, gpu: { stack: "cuda", deviceCount: 1, vram: "16GiB" } },
    limits: { time: "1h", disk: "1GiB", network: false },
    dependencies: [] as unknown[],
    priority: 500,
    preemptible: false,
    allowFailedDependencies: false,
    maxAttempts: 2,
  };
  const paths = [
    ["name"],
    ["command", 0],
    ["command", 2],
    ["image"],
    ["env", "A"],
    ["env"],
    ["resources", "vcpus"],
    ["resources", "ram"],
    ["resources", "scratch"],
    ["resources", "gpu", "vram"],
    ["resources", "gpu", "hardwareTarget"],
    ["resources", "gpu", "driverVersion"],
    ["limits", "time"],
    ["limits", "disk"],
    ["dependencies", 0, "subpath"],
    ["priority"],
    ["maxAttempts"],
  ] as const;
  return fc
    .tuple(
      fc.option(fc.constantFrom(...paths), { freq: 2 }),
      fc.oneof(leaf, anyJson),
      fc.option(uuid, { freq: 2 }),
      fc.oneof(fc.constantFrom("", "dir", "dir/sub/file.txt"), relPath),
    )
    .map(([path, value, dep, subpath]) => {
      const body = structuredClone(valid);
      if (dep !== null || path?.[0] === "dependencies") {
        body.dependencies = [{ bundle: dep ?? "zzzzz-bndl-000000000000000", subpath }];
      }
      if (path === null) return body;
      let at: Record<string | number, unknown> = body;
      for (const key of path.slice(0, -1)) at = at[key] as Record<string | number, unknown>;
      at[path[path.length - 1]!] = value;
      return body;
    });
}

/** Bodies shaped like this API's requests, with generated values where they matter. */
function shapedBody(uuid: fc.Arbitrary<string>) {
  const size = fc.oneof(number, text, fc.constantFrom("16MiB", "256MiB", "1B", "0B", "64TiB", "65TiB"));
  return fc.oneof(
    { weight: 3, arbitrary: nearlyValidBundle(uuid) },
    fc.record(
      {
        command: maybe(fc.array(text, { maxLength: 3 })),
        image: maybe(text),
        name: maybe(text),
        env: maybe(fc.dictionary(text, text, { maxKeys: 3 })),
        resources: maybe(
          fc.record(
            {
              vcpus: maybe(number),
              ram: maybe(size),
              scratch: maybe(size),
              gpu: maybe(
                fc.record(
                  {
                    stack: maybe(fc.constantFrom("cuda", "rocm", "opencl")),
                    deviceCount: maybe(number),
                    vram: maybe(size),
                    driverVersion: maybe(text),
                    hardwareTarget: maybe(fc.oneof(text, fc.array(text, { maxLength: 3 }))),
                  },
                  { requiredKeys: [] },
                ),
              ),
            },
            { requiredKeys: [] },
          ),
        ),
        limits: maybe(
          fc.record(
            { time: maybe(text), disk: maybe(size), network: maybe(fc.boolean()) },
            { requiredKeys: [] },
          ),
        ),
        dependencies: maybe(
          fc.array(
            fc.record(
              { bundle: maybe(uuid), subpath: maybe(relPath), name: maybe(text) },
              { requiredKeys: [] },
            ),
            { maxLength: 3 },
          ),
        ),
        priority: maybe(number),
        preemptible: maybe(fc.boolean()),
        allowFailedDependencies: maybe(fc.boolean()),
        maxAttempts: maybe(number),
      },
      { requiredKeys: [] },
    ),
    fc.record({ reason: maybe(text) }, { requiredKeys: [] }),
    fc.record({ name: maybe(text), isAdmin: maybe(fc.boolean()) }, { requiredKeys: [] }),
    fc.record(
      {
        exitCode: maybe(fc.oneof(number, fc.constant(null))),
        reason: maybe(text),
        failed: maybe(fc.boolean()),
        resourceUsage: maybe(fc.dictionary(text, number, { maxKeys: 3 })),
      },
      { requiredKeys: [] },
    ),
    fc.record({ action: maybe(text), time: maybe(text) }, { requiredKeys: [] }),
  );
}

/** UTF-8 bytes, percent-encoded (lone surrogates become U+FFFD, as a client library would send them). */
const pct = (s: string): string =>
  [...Buffer.from(s, "utf8")]
    .map((b) =>
      /[A-Za-z0-9._~-]/.test(String.fromCharCode(b))
        ? String.fromCharCode(b)
        : `%${b.toString(16).padStart(2, "0")}`,
    )
    .join("");

/** URL text: well encoded, or raw escapes that do not decode, or too long. */
const urlText = (a: fc.Arbitrary<string>) =>
  fc.oneof(
    { weight: 4, arbitrary: a.map(pct) },
    fc
      .array(
        fc.constantFrom("%ff", "%", "%2", "%00", "%2e%2e", "%2F", "%ED%A0%80", "%C0%AF", "a", "..", "~"),
        {
          minLength: 1,
          maxLength: 4,
        },
      )
      .map((p) => p.join("")),
    fc.integer({ min: 101, max: 3000 }).map((n) => "p".repeat(n)),
  );

const bodyBytes = (uuid: fc.Arbitrary<string>) =>
  fc.oneof(
    { weight: 2, arbitrary: fc.constant(undefined) },
    { weight: 8, arbitrary: shapedBody(uuid).map((v) => Buffer.from(JSON.stringify(v))) },
    { weight: 2, arbitrary: anyJson.map((v) => Buffer.from(JSON.stringify(v) ?? "null")) },
    fc.string({ unit, maxLength: 40 }).map((s) => Buffer.from(s)),
    fc.uint8Array({ maxLength: 1200 }).map((b) => Buffer.from(b)),
    // JSON with a byte that is not UTF-8, and JSON cut short.
    shapedBody(uuid).map((v) =>
      Buffer.concat([Buffer.from(JSON.stringify(v).slice(0, -1)), Buffer.from([0xff, 0x7d])]),
    ),
    shapedBody(uuid).map((v) => Buffer.from(JSON.stringify(v).slice(0, -1))),
  );

const contentType = fc.oneof(
  fc.constantFrom(
    undefined,
    "application/json",
    "application/json; charset=utf-8",
    "APPLICATION/JSON",
    "application/octet-stream",
    "application/x-tar",
    "text/plain",
    "multipart/form-data; boundary=x",
    "application/jsonx",
    "",
  ),
  fc.string({ unit: "grapheme-ascii", maxLength: 20 }),
);

/** Header names and values a client can put on the wire (printable ASCII). */
const headerValue = fc.string({ unit: "grapheme-ascii", maxLength: 30 });
const extraHeaders = fc.dictionary(
  fc.constantFrom(
    "accept",
    "accept-version",
    "content-length",
    "x-forwarded-for",
    "range",
    "if-none-match",
    "expect",
  ),
  headerValue,
  { maxKeys: 2 },
);

interface Generated {
  method: string;
  url: string;
  /** The tokens to send it with, one request each ("valid": every valid token in turn). */
  tokenKind: string;
  headers: Record<string, string>;
  payload: Buffer | undefined;
}

interface RequestOptions {
  /** Bundle uuids (and instance ids) that exist. */
  known: readonly string[];
  queryKeys: readonly string[];
  queryValues: fc.Arbitrary<string>;
  /** Token kinds that are not valid. */
  badTokens: readonly string[];
  /** Paths that exist where the route has a `*` (output files and directories). */
  knownPaths: readonly string[];
}

/**
 * Requests for `route`, in two kinds. Careless ones may get anything wrong anywhere (method, URL encoding,
 * parameters, query, token, content type, body). Careful ones get the envelope right (the route's method,
 * existing uuids, every valid token in turn, the usual content type) so that what they get wrong (a query
 * value, a field of the body) reaches the route's own code.
 */
function requestFor(route: { method: string; url: string }, opts: RequestOptions): fc.Arbitrary<Generated> {
  const uuid = uuidFrom(opts.known);
  const segments = route.url.split("/");
  const pathArb = (careful: boolean) =>
    fc
      .tuple(
        ...segments.map((seg): fc.Arbitrary<string> => {
          if (seg === "*") {
            return careful
              ? fc.oneof(
                  fc.constantFrom(...opts.knownPaths),
                  relPath.map((p) => p.split("/").map(pct).join("/")),
                )
              : fc.oneof(
                  relPath.map((p) => p.split("/").map(pct).join("/")),
                  urlText(text),
                );
          }
          if (seg === ":uuid") return careful ? fc.constantFrom(...opts.known) : urlText(uuid);
          if (seg.startsWith(":")) {
            const value = fc.oneof(
              fc.nat({ max: 5 }).map(String),
              text,
              fc.constantFrom("999999999999", "-1"),
            );
            return careful ? value.map(pct) : urlText(value);
          }
          return fc.constant(seg);
        }),
      )
      .map((parts) => parts.join("/"));
  const query = (careful: boolean) =>
    fc
      .array(
        fc.tuple(
          careful ? fc.constantFrom(...opts.queryKeys) : fc.oneof(fc.constantFrom(...opts.queryKeys), text),
          careful ? opts.queryValues : fc.oneof(opts.queryValues, text),
          fc.boolean(),
        ),
        { maxLength: careful ? 2 : 3 },
      )
      // Values sent as generated (escapes that may not decode) or percent-encoded.
      .map((pairs) => pairs.map(([k, v, raw]) => `${pct(k)}=${raw ? v.replace(/[#&\s]/g, "") : pct(v)}`))
      .map((pairs) => (pairs.length === 0 ? "" : `?${pairs.join("&")}`));
  const url = (careful: boolean) => fc.tuple(pathArb(careful), query(careful)).map(([p, q]) => p + q);
  const bodyless = route.method === "GET" || route.method === "HEAD";
  // What the routes take: JSON, and the runner's raw uploads.
  const usualTypes = fc.oneof(
    { weight: 4, arbitrary: fc.constant("application/json") },
    fc.constantFrom("application/octet-stream", "application/x-tar"),
  );
  const careless = fc.record({
    method: fc.oneof(
      { weight: 9, arbitrary: fc.constant(route.method) },
      fc.constantFrom("GET", "POST", "PUT", "DELETE", "PATCH"),
    ),
    url: url(false),
    tokenKind: fc.constantFrom("valid", ...opts.badTokens),
    headers: fc
      .tuple(contentType, extraHeaders)
      .map(([ct, extra]) => ({ ...extra, ...(ct === undefined ? {} : { "content-type": ct }) })),
    payload: bodyBytes(uuid),
  });
  const careful = fc.record({
    method: fc.constant(route.method),
    url: url(true),
    tokenKind: fc.constant("valid"),
    headers: bodyless
      ? fc.constant({})
      : usualTypes.map((type): Record<string, string> => ({ "content-type": type })),
    payload: bodyless
      ? fc.constant(undefined)
      : fc.oneof(
          { weight: 3, arbitrary: shapedBody(uuid).map((v) => Buffer.from(JSON.stringify(v))) },
          bodyBytes(uuid),
        ),
  });
  return fc.oneof(careless, careful);
}

/** The checks every answer must pass. */
function expectErrorShape(
  res: { statusCode: number; headers: Record<string, unknown>; body: string },
  method: string,
) {
  expect(res.statusCode).toBeLessThan(500);
  if (res.statusCode < 400 || method === "HEAD") return;
  expect(String(res.headers["content-type"])).toMatch(/^application\/json/);
  const body = JSON.parse(res.body) as { error?: { code?: unknown; message?: unknown; path?: unknown } };
  expect(Object.keys(body)).toEqual(["error"]);
  const { code, message, path } = body.error ?? {};
  expect(Object.keys(ERROR_CODES)).toContain(code);
  expect(ERROR_CODES[code as keyof typeof ERROR_CODES].status).toBe(res.statusCode);
  expect(typeof message).toBe("string");
  if (path !== undefined) expect(typeof path).toBe("string");
}

async function injectGenerated(
  app: FastifyInstance,
  g: Generated,
  token: string | undefined,
): Promise<{ statusCode: number; headers: Record<string, unknown>; body: string }> {
  const opts: InjectOptions = {
    method: g.method as NonNullable<InjectOptions["method"]>,
    url: g.url,
    headers: { ...g.headers, ...(token === undefined ? {} : { authorization: token }) },
  };
  if (g.payload !== undefined) opts.payload = g.payload;
  const res = await app.inject(opts);
  return { statusCode: res.statusCode, headers: res.headers, body: res.body };
}

/** Runs the property over every recorded route of `app`; returns the routes, for the caller's checks. */
async function everyRoute(
  app: FastifyInstance,
  build: (route: { method: string; url: string }) => fc.Arbitrary<Generated>,
  validTokens: readonly string[],
  tokenOf: (kind: string) => Promise<string | undefined>,
): Promise<readonly { method: string; url: string }[]> {
  const routes = routesOf(app);
  for (const route of routes) {
    await fc.assert(
      fc.asyncProperty(build(route), async (g) => {
        for (const kind of g.tokenKind === "valid" ? validTokens : [g.tokenKind]) {
          const res = await injectGenerated(app, g, await tokenOf(kind));
          expectErrorShape(res, g.method);
        }
      }),
      { numRuns: RUNS_PER_ROUTE },
    );
  }
  return routes;
}

/** A header for a token kind: none, malformed, or one of the given tokens. */
function authHeader(kind: string, tokens: Record<string, string>): string | undefined {
  if (kind === "none") return undefined;
  if (kind === "malformed") return "Bearer";
  if (kind === "basic") return "Basic dXNlcjpwYXNz";
  if (kind === "unknown-user") return "Bearer dcu_0000000000000000000000000000000000000000000";
  if (kind === "unknown-runner") return "Bearer dcr_0000000000000000000000000000000000000000000";
  const token = tokens[kind];
  return token === undefined ? `Bearer ${kind}` : `Bearer ${token}`;
}

describeEachDb("both HTTP APIs under generated requests", (getDb) => {
  describe("the users' and runner API (REST server)", () => {
    let app: FastifyInstance;
    let dataDir: string;
    const tokens: Record<string, string> = {};
    const uuids: string[] = [];
    let carol = "";
    let runner: { uuid: string; token: string } | null = null;
    let readyUuid = "";

    /** A running bundle of carol's (whose uuid no caller here owns), with a dependency on a ready bundle. */
    const runnerToken = async (): Promise<string> => {
      const db = getDb();
      if (runner !== null && (await getBundle(db, runner.uuid))?.state === "running") return runner.token;
      const b = await createTestBundle(db, carol, {
        dependencies: [{ bundle: readyUuid, subpath: "", name: "dep" }],
      });
      await stageBundle(db, b.uuid, { actor: "test" });
      const { token, bundle } = await startWithRunnerToken(db, b.uuid);
      await markRunning(db, b.uuid, bundle.attempt, { actor: "test" });
      runner = { uuid: b.uuid, token };
      return token;
    };

    /** A ready bundle of `owner` with a few output files (so outputs and dependency routes find some). */
    const readyWithOutputs = async (owner: string): Promise<string> => {
      const db = getDb();
      const b = await createTestBundle(db, owner);
      await stageBundle(db, b.uuid, { actor: "test" });
      const started = await startWithRunnerToken(db, b.uuid);
      await markRunning(db, b.uuid, started.bundle.attempt, { actor: "test" });
      const src = await mkdtemp(join(dataDir, "src-"));
      await mkdir(join(src, "dir", "sub"), { recursive: true });
      await writeFile(join(src, "dir", "sub", "file.txt"), "hello");
      await writeFile(join(src, "top"), "x");
      const chunks: Buffer[] = [];
      for await (const c of packTar(src)) chunks.push(c as Buffer);
      const put = await app.inject({
        method: "PUT",
        url: "/api/v1/runner/outputs",
        headers: { authorization: `Bearer ${started.token}`, "content-type": "application/x-tar" },
        payload: Buffer.concat(chunks),
      });
      expect(put.statusCode).toBe(200);
      const fin = await finishBundle(db, b.uuid, started.bundle.attempt, {
        exitCode: 0,
        actor: "test",
      });
      expect(fin.ok).toBe(true);
      return b.uuid;
    };

    beforeAll(async () => {
      const db = getDb();
      dataDir = await mkdtemp(join(tmpdir(), "dc-property-"));
      app = await createRestServer({
        db,
        logger: false,
        clusterId: "zzzzz",
        maxRequestBodySize: 64 * 1024,
        defaultMaxAttempts: 3,
        dataDir,
        maxOutputSize: 64 * 1024,
      });
      const alice = newUserUuid("zzzzz");
      for (const [name, uuid, isAdmin] of [
        ["admin", newUserUuid("zzzzz"), true],
        ["alice", alice, false],
      ] as const) {
        const token = newUserToken();
        await createUser(db, {
          uuid,
          name: `${name}-${Math.random()}`,
          isAdmin,
          tokenHash: hashToken(token),
        });
        tokens[name] = token;
      }
      carol = (await createTestUser(db)).uuid;
      // Alice's: a killed bundle and a ready one with outputs; every bundle she owns is final, so a followed log
      // ends at once. Carol's ready bundle is the dependency of her running bundles.
      const killed = await createTestBundle(db, alice);
      await killBundle(db, killed.uuid, { actor: "test", reason: "test" });
      uuids.push(killed.uuid, await readyWithOutputs(alice));
      readyUuid = await readyWithOutputs(carol);
      uuids.push(readyUuid);
    });
    afterAll(async () => {
      await app?.close();
      if (dataDir !== undefined) await rm(dataDir, { recursive: true, force: true });
    });

    it("never answers 5xx, and every 4xx is the error shape with its code's status, on every route", async () => {
      const uuid = uuidFrom(uuids);
      const cursorValues = fc.oneof(
        fc.constantFrom(...uuids).map((u) => encodeCursor({ createdAt: new Date(), uuid: u })),
        fc
          .tuple(
            fc.oneof(text, fc.constantFrom("+275760-09-13T00:00:00.000Z", "-004713-01-01T00:00:00.000Z")),
            uuid,
          )
          .map(([createdAt, u]) => Buffer.from(JSON.stringify({ createdAt, uuid: u })).toString("base64url")),
      );
      const queryValues = fc.oneof(
        // Numbers at the edges of what the database columns hold.
        fc.constantFrom(
          "1",
          "0",
          "2147483647",
          "2147483648",
          "9007199254740991",
          "99999999999999999999",
          "-1",
        ),
        fc.constantFrom(
          "true",
          "stdout",
          "stderr",
          "stdin",
          "1e3",
          "01",
          "ready,failed",
          "running",
          "%00",
          "%ED%A0%80",
        ),
        cursorValues,
      );
      const routes = await everyRoute(
        app,
        (route) =>
          requestFor(route, {
            known: uuids,
            queryKeys: ["state", "limit", "cursor", "stream", "follow", "attempt", "offset"],
            queryValues,
            badTokens: ["none", "malformed", "basic", "unknown-user", "unknown-runner"],
            knownPaths: ["", "dir", "dir/", "dir/sub/file.txt", "top", "top/", "nothing-here"],
          })
            // A follower of a bundle that is not final would wait for it (every bundle the tokens here own is
            // final, but a generated query must not rely on that): never follow.
            .map((g) => ({ ...g, url: g.url.replace(/follow=(1|true)/gi, "follow=0") })),
        ["alice", "admin", "runner"],
        async (kind) => authHeader(kind, kind === "runner" ? { runner: await runnerToken() } : tokens),
      );
      expect(routes).toEqual(
        expect.arrayContaining([
          { method: "POST", url: "/api/v1/bundles" },
          { method: "GET", url: "/api/v1/bundles/:uuid/outputs/*" },
          { method: "PUT", url: "/api/v1/runner/outputs" },
          { method: "HEAD", url: "/api/v1/bundles/:uuid/logs" },
          { method: "PUT", url: "/api/v1/cas/blobs/:hash/:size" },
          { method: "PUT", url: "/api/v1/cas/manifests/:hash/:size" },
        ]),
      );
    }, 120_000); // every route gets RUNS_PER_ROUTE requests, and the content-addressed store added 13 routes
  });

  describe("the management API on an active dispatcher", () => {
    let h: Harness;
    let app: FastifyInstance;
    const ids: string[] = [];

    beforeAll(async () => {
      h = await createHarness({ db: getDb(), logger: silent });
      const d = await h.startDispatcher();
      const bundles = await h.submit(3, () => ({ command: ["sleep", "600"] }));
      await h.drive(async () => [...(await h.states(bundles)).values()].every((s) => s === "running"));
      ids.push(...bundles, ...(d.parts?.pool.workers() ?? []).map((w) => w.id));
      const config = { ...h.config, management: { ...h.config.management, token: MGMT_TOKEN } } as Config;
      app = await createManagementServer({
        config,
        dispatcher: d,
        db: h.db,
        registry: new Registry(),
        logger: false,
        clock: h.clock,
      });
    });
    afterAll(async () => {
      await app?.close();
      await h?.close();
    });

    it("never answers 5xx, and every 4xx is the error shape with its code's status, on every route", async () => {
      const routes = await everyRoute(
        app,
        (route) =>
          requestFor(route, {
            known: ids,
            queryKeys: ["instance_id", "uuid", "reason"],
            queryValues: fc.oneof(
              fc.constantFrom(...ids),
              fc.constantFrom("%00", "a%0Ab", "%ED%A0%80", "x".repeat(1001), "because", ""),
            ),
            badTokens: ["none", "malformed", "basic", "wrong"],
            knownPaths: [""],
          }),
        ["management"],
        async (kind) =>
          kind === "management"
            ? `Bearer ${MGMT_TOKEN}`
            : kind === "wrong"
              ? `Bearer ${MGMT_TOKEN}x`
              : authHeader(kind, {}),
      );
      expect(routes).toEqual(
        expect.arrayContaining([
          { method: "POST", url: "/management/v1/bundles/kill" },
          { method: "GET", url: "/management/v1/bundles/:uuid" },
          { method: "GET", url: "/metrics" },
        ]),
      );
    });
  });
});
