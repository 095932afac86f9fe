/**
 * The paged outputs listing (`GET /bundles/:uuid/outputs[/path]?limit=&cursor=`): pages of the root and of a
 * directory in path order, the cursor's round trip, and bad parameters, through fastify.inject on PostgreSQL and
 * PGlite.
 */
import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, expect, it } from "vitest";
import { packTar } from "../lib/tar.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createOutputStore } from "../rest-server/outputs.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import { describeEachDb } from "./db.ts";
import { injectClient, type Json, type Res } from "./rest-client.ts";

const CLUSTER = "zzzzz";
const minimal = { command: ["echo", "hi"], image: "busybox" };

const expectError = (res: Res, status: number, code: string, path?: string) => {
  expect(res.status, JSON.stringify(res.body)).toBe(status);
  expect(res.body.error.code).toBe(code);
  if (path !== undefined) expect(res.body.error.path).toBe(path);
};

describeEachDb("REST outputs listing pages", (getDb) => {
  let app: FastifyInstance;
  let api: ReturnType<typeof injectClient>;
  let dir: string;
  const alice = { uuid: newUserUuid(CLUSTER), token: newUserToken() };
  let uuid: string;
  /** Every file, in path order (code units, as JS sorts): directories interleave with names around "/". */
  const FILES = ["a b", "a-z", "a.txt", "a/b", "a/c/d", "a/c0", "a0", "b.txt", "b/x", "b/y/z", "c", "Z"];
  const sorted = [...FILES].sort();

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-rest-outputs-"));
    app = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: CLUSTER,
      maxRequestBodySize: 2 ** 20,
      defaultMaxAttempts: 3,
      dataDir: join(dir, "data"),
    });
    api = injectClient(app);
    await createUser(getDb(), {
      uuid: alice.uuid,
      name: "alice",
      isAdmin: false,
      tokenHash: hashToken(alice.token),
    });
    const res = await api("POST", "/api/v1/bundles", alice.token, minimal);
    uuid = res.body.uuid;
    // The outputs as a runner's upload leaves them (the server reads the same directory).
    const src = await mkdtemp(join(dir, "src-"));
    for (const p of FILES) {
      await mkdir(join(src, p, ".."), { recursive: true });
      await writeFile(join(src, p), p);
    }
    await createOutputStore(join(dir, "data", "outputs")).replace(uuid, packTar(src), {
      maxBytes: 2 ** 20,
    });
  });
  afterAll(async () => {
    await app?.close();
    if (dir) await rm(dir, { recursive: true, force: true });
  });
  const listing = (query = "", path = "") =>
    api("GET", `/api/v1/bundles/${uuid}/outputs${path === "" ? "" : `/${path}`}${query}`, alice.token);

  it("answers the whole listing in one page by default, with nextCursor null", async () => {
    const res = await listing();
    expect(res.status).toBe(200);
    expect(res.body).toEqual({
      files: sorted.map((p) => ({ path: p, size: Buffer.byteLength(p) })),
      nextCursor: null,
    });
  });

  it("pages with limit and the cursor, for every page size, the root or a directory", async () => {
    for (const [path, expected] of [
      ["", sorted],
      ["a", sorted.filter((p) => p.startsWith("a/"))],
      ["b/", sorted.filter((p) => p.startsWith("b/"))],
    ] as const) {
      for (let limit = 1; limit <= expected.length; limit++) {
        const seen: string[] = [];
        let pages = 0;
        let cursor: string | null = null;
        do {
          const q: string = `?limit=${limit}${cursor === null ? "" : `&cursor=${cursor}`}`;
          const res = await listing(q, path);
          expect(res.status, JSON.stringify(res.body)).toBe(200);
          expect(res.body.files.length).toBeLessThanOrEqual(limit);
          seen.push(...res.body.files.map((f: Json) => f.path));
          cursor = res.body.nextCursor;
          pages++;
        } while (cursor !== null);
        expect(seen).toEqual(expected);
        expect(pages).toBe(Math.ceil(expected.length / limit));
      }
    }
  });

  it("refuses a bad cursor, a bad limit and unknown parameters with 400 and the parameter", async () => {
    for (const [query, path] of [
      ["?cursor=not*base64", "cursor"],
      [`?cursor=${Buffer.from("{}").toString("base64url")}`, "cursor"],
      [`?cursor=${Buffer.from('{"after":""}').toString("base64url")}`, "cursor"],
      [`?cursor=${Buffer.from("not json").toString("base64url")}`, "cursor"],
      ["?limit=0", "limit"],
      ["?limit=10001", "limit"],
      ["?limit=2.5", "limit"],
      ["?limit=1&limit=2", "limit"],
      ["?page=2", "page"],
    ] as const) {
      expectError(await listing(query), 400, "request.invalid_query", path);
    }
    expectError(await listing("", "nope"), 404, "output.not_found");
    // A file's bytes, as before.
    const file = await listing("", "a/c/d");
    expect([file.status, file.raw.toString()]).toEqual([200, "a/c/d"]);
  });
});
