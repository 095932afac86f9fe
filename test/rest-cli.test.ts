/**
 * The CLI's log and output commands (`bundles logs`, `bundles outputs` and its pages, `submit --wait`) against a real REST
 * server on a port, with a runner's calls made through the runner API.
 */
import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { pino } from "pino";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { ByteIo } from "../cli/client.ts";
import { packTar } from "../lib/tar.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { type BundleManager, createBundleManager } from "../rest-server/bundle-manager.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser, getBundle } from "../store/queries.ts";
import { openTestDb, startWithRunnerToken, type TestDb } from "./db.ts";

interface Captured {
  code: number;
  out: string[];
  err: string[];
  bytes: Buffer;
}

describe("CLI: bundles logs, bundles outputs, submit --wait", () => {
  let db: TestDb;
  let app: FastifyInstance;
  let manager: BundleManager;
  let apiUrl: string;
  let dir: string;
  const token = newUserToken();

  const cli = async (argv: string[], withBytes = false): Promise<Captured> => {
    const out: string[] = [];
    const err: string[] = [];
    const bytes: Buffer[] = [];
    const io: ByteIo = {
      argv,
      env: { DISPATCH_CLOUD_API_URL: apiUrl, DISPATCH_CLOUD_TOKEN: token },
      cwd: dir,
      out: (l) => out.push(l),
      err: (l) => err.push(l),
      progress: (l) => err.push(l),
      ...(withBytes ? { write: (b: Uint8Array) => void bytes.push(Buffer.from(b)) } : {}),
    };
    const code = await runCli(io);
    return { code, out, err, bytes: Buffer.concat(bytes) };
  };
  const inject = async (
    method: "GET" | "POST" | "PUT",
    url: string,
    auth: string,
    payload?: object | Buffer,
  ) => {
    const headers: Record<string, string> = { authorization: `Bearer ${auth}` };
    if (Buffer.isBuffer(payload))
      headers["content-type"] = url.includes("outputs") ? "application/x-tar" : "application/octet-stream";
    const res = await app.inject({ method, url, headers, ...(payload === undefined ? {} : { payload }) });
    expect(res.statusCode, res.body).toBeLessThan(300);
    return res.json();
  };
  /** Plays a runner for the bundle: start, stdout and stderr, outputs, finish. */
  const runAs = async (
    uuid: string,
    opts: { stdout: string; stderr: string; exitCode: number; files?: Record<string, string> },
  ) => {
    await manager.runOnce();
    const { token: runner } = await startWithRunnerToken(db, uuid);
    await inject("POST", "/api/v1/runner/start", runner, {});
    await inject("POST", "/api/v1/runner/logs?stream=stdout&offset=0", runner, Buffer.from(opts.stdout));
    await inject("POST", "/api/v1/runner/logs?stream=stderr&offset=0", runner, Buffer.from(opts.stderr));
    if (opts.files !== undefined) {
      const src = await mkdtemp(join(dir, "out-"));
      for (const [p, content] of Object.entries(opts.files)) {
        await mkdir(join(src, p, ".."), { recursive: true });
        await writeFile(join(src, p), content);
      }
      const parts: Buffer[] = [];
      for await (const c of packTar(src)) parts.push(c as Buffer);
      await inject("PUT", "/api/v1/runner/outputs", runner, Buffer.concat(parts));
    }
    await inject("POST", "/api/v1/runner/finish", runner, { exitCode: opts.exitCode });
  };

  beforeAll(async () => {
    db = await openTestDb("pglite");
    dir = await mkdtemp(join(tmpdir(), "dc-rest-cli-"));
    await createUser(db, {
      uuid: newUserUuid("zzzzz"),
      name: "cli",
      isAdmin: false,
      tokenHash: hashToken(token),
    });
    app = await createRestServer({
      db,
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 2 ** 20,
      defaultMaxAttempts: 3,
      dataDir: join(dir, "data"),
    });
    apiUrl = await app.listen({ host: "127.0.0.1", port: 0 });
    manager = createBundleManager({ db, logger: pino({ level: "silent" }) });
  });
  afterAll(async () => {
    await app?.close();
    await db?.close();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  it("prints logs and outputs, as lines or as bytes", async () => {
    const b = await inject("POST", "/api/v1/bundles", token, {
      command: ["echo", "hello"],
      image: "busybox",
    });
    await runAs(b.uuid, {
      stdout: "hello\nworld\n",
      stderr: "warning\n",
      exitCode: 0,
      files: { "result.txt": "42\n", "data/x.bin": "\u0000\u0001" },
    });
    expect(await cli(["bundles", "logs", b.uuid])).toMatchObject({ code: 0, out: ["hello", "world"] });
    expect(await cli(["bundles", "logs", b.uuid, "--stream", "stderr"])).toMatchObject({
      code: 0,
      out: ["warning"],
    });
    expect((await cli(["bundles", "logs", b.uuid, "--follow"], true)).bytes.toString()).toBe(
      "hello\nworld\n",
    );
    const bad = await cli(["bundles", "logs", b.uuid, "--stream", "stdin"]);
    expect(bad.code).toBe(1);
    expect(bad.err.join("\n")).toContain("[request.invalid_query]");

    const list = await cli(["bundles", "outputs", b.uuid]);
    expect(list.code).toBe(0);
    expect(list.out).toEqual(["SIZE  PATH", "2     data/x.bin", "3     result.txt"]);
    const json = await cli(["bundles", "outputs", b.uuid, "data", "--json"]);
    expect(JSON.parse(json.out.join("\n"))).toEqual([{ path: "data/x.bin", size: 2 }]);
    expect(await cli(["bundles", "outputs", b.uuid, "result.txt"])).toMatchObject({ code: 0, out: ["42"] });
    expect((await cli(["bundles", "outputs", b.uuid, "data/x.bin"], true)).bytes).toEqual(
      Buffer.from("\u0000\u0001"),
    );
    const missing = await cli(["bundles", "outputs", b.uuid, "nope"]);
    expect(missing.code).toBe(1);
    expect(missing.err.join("\n")).toContain("[output.not_found]");
  });

  it("bundles outputs follows the listing's pages", async () => {
    const b = await inject("POST", "/api/v1/bundles", token, { command: ["true"], image: "busybox" });
    const files = Object.fromEntries(Array.from({ length: 7 }, (_, i) => [`f/${i}.txt`, "x".repeat(i)]));
    await runAs(b.uuid, { stdout: "x\n", stderr: "x\n", exitCode: 0, files });
    const json = await cli(["bundles", "outputs", b.uuid, "--page-size", "2", "--json"]);
    expect(json.code, json.err.join("\n")).toBe(0);
    expect(JSON.parse(json.out.join("\n"))).toEqual(
      Array.from({ length: 7 }, (_, i) => ({ path: `f/${i}.txt`, size: i })),
    );
    const table = await cli(["bundles", "outputs", b.uuid, "f", "--page-size", "3"]);
    expect(table.out).toEqual(["SIZE  PATH", ...Array.from({ length: 7 }, (_, i) => `${i}     f/${i}.txt`)]);
    const bad = await cli(["bundles", "outputs", b.uuid, "--page-size", "0"]);
    expect(bad.code).toBe(2);
  });

  it("submit --wait prints the stdout log and the output listing of a ready bundle", async () => {
    const waiting = cli(["submit", "--wait", "--image", "busybox", "--", "echo", "hello"]);
    // Play the runner once the bundle exists.
    let uuid = "";
    await vi.waitFor(async () => {
      const { rows } = await db.query<{ uuid: string }>(
        "SELECT uuid FROM bundles WHERE state = 'staged' AND command = '[\"echo\", \"hello\"]'::jsonb",
      );
      expect(rows).toHaveLength(1);
      uuid = rows[0]!.uuid;
    });
    await runAs(uuid, { stdout: "hello\n", stderr: "", exitCode: 0, files: { "o.txt": "o" } });
    const res = await waiting;
    expect(res.code).toBe(0);
    expect(res.out).toEqual([uuid, "hello"]);
    expect(res.err.join("\n")).toContain(`outputs of ${uuid}:`);
    expect(res.err.join("\n")).toMatch(/1\s+o\.txt/);
  });

  it("submit --wait prints the tail of the stderr log of a failed bundle", async () => {
    const waiting = cli(["submit", "--wait", "--image", "busybox", "--", "false"]);
    let uuid = "";
    await vi.waitFor(async () => {
      const { rows } = await db.query<{ uuid: string }>(
        "SELECT uuid FROM bundles WHERE state = 'staged' AND command = '[\"false\"]'::jsonb",
      );
      expect(rows).toHaveLength(1);
      uuid = rows[0]!.uuid;
    });
    const stderr = Array.from({ length: 30 }, (_, i) => `line ${i + 1}`).join("\n") + "\n";
    await runAs(uuid, { stdout: "not shown\n", stderr, exitCode: 1 });
    const res = await waiting;
    expect(res.code).toBe(1);
    expect(res.out).toEqual([uuid]);
    expect(res.err).toContain(`stderr of ${uuid} (last 20 of 30 lines):`);
    expect(res.err).toContain("line 30");
    expect(res.err).toContain("line 11");
    expect(res.err).not.toContain("line 10");
    expect((await getBundle(db, uuid))?.state).toBe("failed");
  });
});
