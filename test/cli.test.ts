import { execFile } from "node:child_process";
import { mkdtemp, readFile, stat, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import { BIN, type ServeProcess, startServe } from "./serve-process.ts";

const run = promisify(execFile);

interface Captured {
  code: number;
  out: string[];
  err: string[];
}

/** Runs one CLI command in-process against the served API. */
async function cli(
  serve: ServeProcess,
  argv: string[],
  env: Record<string, string> = {},
  onOut: (line: string) => void = () => {},
): Promise<Captured> {
  const out: string[] = [];
  const err: string[] = [];
  const io: CliIo = {
    argv,
    env: { DISPATCH_CLOUD_API_URL: serve.apiUrl, ...env },
    cwd: serve.dir,
    out: (l) => {
      out.push(l);
      onOut(l);
    },
    err: (l) => err.push(l),
    progress: (l) => err.push(l),
  };
  const code = await runCli(io);
  return { code, out, err };
}

describe("dispatch-cloud serve and the CLI, as real processes", () => {
  let serve: ServeProcess;
  beforeAll(async () => {
    serve = await startServe();
  }, 90_000);
  afterAll(async () => {
    const code = await serve?.stop();
    expect(code).toBe(0);
  });

  it("answers /_health/ping and wrote the admin token with mode 0600", async () => {
    const res = await fetch(`${serve.apiUrl}/_health/ping`);
    expect(res.status).toBe(200);
    expect(await res.json()).toEqual({ health: "OK" });
    const st = await stat(join(serve.dir, "data", "admin-token"));
    expect(st.mode & 0o777).toBe(0o600);
    const token = (await readFile(join(serve.dir, "data", "admin-token"), "utf8")).trim();
    expect(token).toMatch(/^dcu_[A-Za-z0-9_-]{43}$/);
    expect(serve.stderr()).not.toContain(token);
  });

  it("runs serve's node with the heap flags bin/dispatch-cloud gives it (docs/operations.md)", async () => {
    const argv = (await readFile(`/proc/${serve.child.pid}/cmdline`, "utf8")).split("\0");
    expect(argv[0]).toMatch(/node$/);
    expect(argv).toEqual(
      expect.arrayContaining(["--initial-old-space-size=128", "--max-semi-space-size=64"]),
    );
  });

  it("submits with flags, then lists, shows, shows events and kills the bundle", async () => {
    const sub = await cli(serve, [
      "submit",
      "--data-dir",
      "data",
      "--image",
      "busybox",
      "--name",
      "first",
      "--ram",
      "64MiB",
      "--env",
      "A=1",
      "--",
      "echo",
      "hello",
    ]);
    expect(sub.err).toEqual([]);
    expect(sub.code).toBe(0);
    const uuid = sub.out[0]!;
    expect(uuid).toMatch(/^tst01-bndl-[a-z0-9]{15}$/);

    const list = await cli(serve, ["bundles", "list", "--data-dir", "data", "--json"]);
    expect(list.code).toBe(0);
    const items = JSON.parse(list.out.join("\n")) as { uuid: string; resources: { ram: number } }[];
    expect(items.map((b) => b.uuid)).toContain(uuid);
    expect(items.find((b) => b.uuid === uuid)?.resources.ram).toBe(64 * 1024 * 1024);

    const show = await cli(serve, ["bundles", "show", uuid, "--data-dir", "data"]);
    expect(show.code).toBe(0);
    expect(show.out.join("\n")).toMatch(/command:\s+\["echo","hello"\]/);

    const kill = await cli(serve, ["bundles", "kill", uuid, "--data-dir", "data", "--reason", "test"]);
    expect(kill.out).toEqual([`${uuid}: killed`]);
    expect(kill.code).toBe(0);

    const events = await cli(serve, ["bundles", "events", uuid, "--data-dir", "data", "--json"]);
    const states = (JSON.parse(events.out.join("\n")) as { toState: string }[]).map((e) => e.toState);
    expect(states[0]).toBe("created");
    expect(states.at(-1)).toBe("killed");
  });

  it("submits from a YAML file and reports API errors with code and path", async () => {
    await writeFile(
      join(serve.dir, "spec.yml"),
      "image: busybox\ncommand: ['true']\nresources: {ram: 4XB}\n",
    );
    const bad = await cli(serve, ["submit", "spec.yml", "--data-dir", "data"]);
    expect(bad.code).toBe(1);
    expect(bad.err.join("\n")).toMatch(/resources\.ram/);
    expect(bad.err.join("\n")).toContain("[request.invalid_body]");
  });

  it("--wait follows a bundle until it is final and exits 1 when it did not succeed", async () => {
    let printed: (uuid: string) => void = () => {};
    const uuidPrinted = new Promise<string>((ok) => (printed = ok));
    const waiting = cli(
      serve,
      ["submit", "--data-dir", "data", "--wait", "--image", "x", "--", "true"],
      {},
      printed,
    );
    const uuid = await uuidPrinted;
    expect((await cli(serve, ["bundles", "kill", uuid, "--data-dir", "data"])).code).toBe(0);
    const waited = await waiting;
    expect(waited.code).toBe(1);
    expect(waited.err.join("\n")).toMatch(new RegExp(`${uuid} killed`));
  });

  it("creates a user (admin only); the new user sees only their own bundles", async () => {
    const created = await cli(serve, ["users", "create", "alice", "--data-dir", "data"]);
    expect(created.code).toBe(0);
    const token = created.out[0]!;
    expect(token).toMatch(/^dcu_/);
    const asAlice = { DISPATCH_CLOUD_TOKEN: token };
    const list = await cli(serve, ["bundles", "list", "--json"], asAlice);
    expect(JSON.parse(list.out.join("\n"))).toEqual([]);
    const denied = await cli(serve, ["users", "create", "bob"], asAlice);
    expect(denied.code).toBe(1);
    expect(denied.err.join("\n")).toContain("[auth.forbidden]");
  });

  it("says how to get a token when none is found, and how to reach the server when it is down", async () => {
    const none = await cli(serve, ["bundles", "list", "--data-dir", "/nonexistent"]);
    expect(none.code).toBe(1);
    expect(none.err.join("\n")).toContain("[cli.no_token]");
    const down = await cli(serve, [
      "bundles",
      "list",
      "--api-url",
      "http://127.0.0.1:9",
      "--data-dir",
      "data",
    ]);
    expect(down.err.join("\n")).toContain("[cli.unreachable]");
  });

  it("rejects unknown commands and flags with exit code 2", async () => {
    expect((await cli(serve, ["frobnicate"])).code).toBe(2);
    expect((await cli(serve, ["bundles", "list", "--bogus"])).code).toBe(2);
  });
});

describe("bin/dispatch-cloud config", () => {
  it("config defaults prints a file that config check accepts", async () => {
    const { stdout } = await run(BIN, ["config", "defaults"]);
    expect(stdout).toContain("maxInstances");
    const file = join(await mkdtemp(join(tmpdir(), "dc-config-")), "defaults.yml");
    await writeFile(file, stdout);
    const checked = await run(BIN, ["config", "check", file]);
    expect(checked.stdout + checked.stderr).not.toMatch(/error/i);
  });

  it("config check names cloud.timeoutIdle and suggests maxInstances, exiting non-zero", async () => {
    const file = join(await mkdtemp(join(tmpdir(), "dc-config-")), "bad.yml");
    await writeFile(file, 'cloud: {timeoutIdle: "abc", maxInstnces: 3}\n');
    const failed = await run(BIN, ["config", "check", file]).then(
      () => null,
      (e: { code: number; stdout: string; stderr: string }) => e,
    );
    expect(failed).not.toBeNull();
    expect(failed!.code).not.toBe(0);
    const text = failed!.stdout + failed!.stderr;
    expect(text).toContain("cloud.timeoutIdle");
    expect(text).toContain("did you mean maxInstances?");
  });
});
