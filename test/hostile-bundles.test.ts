/**
 * Hostile bundles against the real thing: the Docker daemon (image dctest/busybox:1), an in-process REST server
 * on PGlite, crunch-run as a real process from sources. Each bundle tries one way to get bytes of the host or of
 * another bundle into its output, or to exhaust the server, and the test checks the outcome the docs promise:
 * links that leave /out, FIFOs and an /out replaced by a link fail the bundle at once with a reason that names
 * the path as the container saw it; links that stay inside are kept as links; too many files fail the bundle;
 * a log flood is truncated with a notice. A secret written on the host for the purpose never reaches an output,
 * a log or a reason. A missing daemon or image fails the suite with how to get them.
 */
import { randomBytes } from "node:crypto";
import { chmodSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { readdir, stat } from "node:fs/promises";
import { tmpdir } from "node:os";
import { basename, dirname, join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createDockerClient, listBundleContainers } from "../crunch-run/docker-api.ts";
import { runnerPaths, workDir } from "../crunch-run/paths.ts";
import type { Bundle } from "../store/types.ts";
import { type RunnerHarness, startRunnerHarness, supervisorLog } from "./crunch-run-harness.ts";
import { useTestDb } from "./db.ts";
import { requireDockerImage } from "./docker-check.ts";

const IMAGE = "dctest/busybox:1";
const MAX_FILES = 20_000;
const MAX_LOG = 256 * 1024;

// Each test runs Docker containers (and one waits out a victim bundle's 20 s): the bound is generous so that a
// machine loaded by the rest of the suite is not taken for a failure.
describe("hostile bundles (docker runtime)", { timeout: 120_000 }, () => {
  const getDb = useTestDb("pglite");
  const docker = createDockerClient(process.env);
  let h: RunnerHarness;
  /** A host file no bundle may read: its content must never show up anywhere a user can see. */
  const secret = `host-secret-${randomBytes(12).toString("hex")}`;
  const hostDir = mkdtempSync(join(tmpdir(), "dc-hostile-"));
  const hostFile = join(hostDir, "secret.txt");

  beforeAll(async () => {
    await requireDockerImage(docker, IMAGE);
    writeFileSync(hostFile, `${secret}\n`);
    chmodSync(hostDir, 0o755);
    h = await startRunnerHarness(getDb(), { maxOutputFiles: MAX_FILES, maxLogBytesPerStream: MAX_LOG });
  });
  afterAll(async () => {
    if (h !== undefined) {
      for (const c of await listBundleContainers(docker, h.root, { all: true }).catch(() => [])) {
        await docker.call("DELETE", `/containers/${c.Id}?force=true`).catch(() => {});
      }
      await h.close();
    }
    rmSync(hostDir, { recursive: true, force: true });
  });

  const bundle = (script: string, extra: Record<string, unknown> = {}) =>
    h.newStartingBundle({ image: IMAGE, command: ["sh", "-c", script], ...extra });
  const run = async (
    b: { uuid: string; token: string; attempt: number },
    runtimeEngine = "docker",
  ): Promise<Bundle> => {
    const res = await h.detach(b, { runtimeEngine });
    expect(res.code, res.stderr).toBe(0);
    return h.waitFinal(b.uuid, 120_000);
  };
  /** The output listing (every file of the bundle's output). */
  const listing = async (uuid: string) => {
    const res = await h.output(uuid, "");
    expect(res.status, res.body).toBe(200);
    return (JSON.parse(res.body) as { files: { path: string; size: number; link?: string }[] }).files;
  };
  /** Everything a user can see of the bundle: reason, both logs, the listing and every file in it. */
  const visible = async (b: Bundle) => {
    const files = await listing(b.uuid);
    const bodies = await Promise.all(
      files.filter((f) => f.link === undefined).map(async (f) => (await h.output(b.uuid, f.path)).body),
    );
    return [
      b.stateReason ?? "",
      await h.log(b.uuid, "stdout"),
      await h.log(b.uuid, "stderr"),
      JSON.stringify(files),
      ...bodies,
    ].join("\n");
  };
  const expectFailedFor = async (b: Bundle, reason: RegExp) => {
    expect(b.state, await supervisorLog(h.root, b.uuid)).toBe("failed");
    expect(b.stateReason).toMatch(reason);
    // The reason names the path inside the container, never where the bundle's output is on the host.
    expect(b.stateReason).not.toContain(
      workDir(runnerPaths({ DISPATCH_VM_ROOT: h.root }), b.uuid, b.attempt),
    );
    expect(await listing(b.uuid)).toEqual([]);
    expect(await visible(b)).not.toContain(secret);
  };

  it("refuses a link to a host file; the host's bytes never reach the output", async () => {
    const b = await bundle(`echo fine > /out/ok; ln -s ${hostFile} /out/h`);
    await expectFailedFor(await run(b), /\/out\/h is a symbolic link to ".*", outside \/out/);
  });

  it("refuses a link to another bundle's work directory while that bundle runs", async () => {
    const victim = await bundle("echo other-users-data > /out/secret.txt; sleep 20");
    const started = await h.detach(victim, { runtimeEngine: "docker" });
    expect(started.code, started.stderr).toBe(0);
    await h.waitState(victim.uuid, ["running"]);
    const victimDir = workDir(runnerPaths({ DISPATCH_VM_ROOT: h.root }), victim.uuid, victim.attempt);
    const thief = await bundle(`ln -s ${victimDir} /out/x; ln -s ${victimDir}/out/secret.txt /out/y`);
    const final = await run(thief);
    await expectFailedFor(final, /\/out\/x is a symbolic link to ".*", outside \/out/);
    expect(await visible(final)).not.toContain("other-users-data");
    const victimFinal = await h.waitFinal(victim.uuid, 60_000);
    expect(victimFinal.state).toBe("ready");
    expect(await h.output(victim.uuid, "secret.txt")).toEqual({ status: 200, body: "other-users-data\n" });
  });

  it("refuses a link to the instance's lock directory (where running bundles' uuids are)", async () => {
    const b = await bundle(`ln -s ${h.root}/var/lock /out/locks`);
    const final = await run(b);
    await expectFailedFor(final, /\/out\/locks is a symbolic link to ".*", outside \/out/);
    expect(await visible(final)).not.toMatch(/crunch-run-[a-z0-9]{5}-bndl-[a-z0-9]{15}\.lock/);
  });

  it("keeps a link loop and inner links as links: the bundle succeeds, nothing is followed", async () => {
    const b = await bundle(
      "mkdir /out/d && echo inner > /out/d/f && ln -s . /out/loop && ln -s d/f /out/alias && ln -s /out/d /out/abs",
    );
    const final = await run(b);
    expect(final.state, await supervisorLog(h.root, b.uuid)).toBe("ready");
    expect(await listing(b.uuid)).toEqual([
      { path: "abs", size: 0, link: "d" },
      { path: "alias", size: 0, link: "d/f" },
      { path: "d/f", size: 6 },
      { path: "loop", size: 0, link: "." },
    ]);
    // Reading through an inner link gives the inner file; the loop leads back to the root, not outside.
    expect(await h.output(b.uuid, "alias")).toEqual({ status: 200, body: "inner\n" });
    expect(await h.output(b.uuid, "loop/loop/d/f")).toEqual({ status: 200, body: "inner\n" });
  });

  it("cannot make /out itself a link: Docker's mount stays, and with the process runtime it is refused", async () => {
    const inDocker = await bundle(
      "rm -rf /out 2>/dev/null; mv /out /gone 2>/dev/null; test -d /out && ! test -L /out && echo still-here > /out/f",
    );
    const final = await run(inDocker);
    expect(final.state, await supervisorLog(h.root, inDocker.uuid)).toBe("ready");
    expect(await h.output(inDocker.uuid, "f")).toEqual({ status: 200, body: "still-here\n" });

    // The process runtime's command runs as a uid of its own: it may not remove its output directory, so the
    // link lands inside it, and is refused all the same.
    const proc = await bundle(
      `cd /; rm -rf "$DISPATCH_OUTPUT_DIR"; ln -s ${hostDir} "$DISPATCH_OUTPUT_DIR"; true`,
    );
    await expectFailedFor(
      await run(proc, "process"),
      /^uploading the outputs failed: \$DISPATCH_OUTPUT_DIR(\/dc-hostile-\w+)? is a symbolic link/,
    );
  });

  it("refuses a FIFO, naming it", async () => {
    const b = await bundle("echo fine > /out/ok; mkfifo /out/pipe");
    await expectFailedFor(await run(b), /\/out\/pipe is a FIFO/);
  });

  it(`fails a bundle that leaves more than maxOutputFiles (${MAX_FILES}) files`, async () => {
    const b = await bundle("cd /out && seq 1 100000 | xargs touch && echo made");
    const final = await run(b);
    await expectFailedFor(final, /runner\.output_too_many_files/);
    expect(await h.log(b.uuid, "stdout")).toBe("made\n");
  }, 300_000);

  it("keeps the first maxLogBytesPerStream bytes of a log flood, then a notice", async () => {
    const b = await bundle("yes flood | head -c 3000000; echo done >&2");
    const final = await run(b);
    expect(final.state, await supervisorLog(h.root, b.uuid)).toBe("ready");
    const stdout = await h.log(b.uuid, "stdout");
    expect(stdout.length).toBeLessThan(MAX_LOG + 300);
    expect(stdout.slice(0, MAX_LOG)).toBe("flood\n".repeat(MAX_LOG / 6 + 1).slice(0, MAX_LOG));
    expect(stdout.slice(MAX_LOG)).toMatch(
      /\[dispatch-cloud\] the stdout log reached its limit of 262144 bytes/,
    );
    expect(await h.log(b.uuid, "stderr")).toContain("done\n");
  });

  it("keeps docker's own copy of a flooding bundle's log within containerLogMaxBytes (two files)", async () => {
    const cap = 2 ** 20;
    const b = await bundle("head -c 20000000 /dev/zero | tr '\\0' a | fold -w 1000; sleep 2; echo done >&2");
    const res = await h.detach(b, { runtimeEngine: "docker", containerLogMaxBytes: cap });
    expect(res.code, res.stderr).toBe(0);
    // docker's json-file log of the container (the file and its rotated copy), watched until the bundle ends.
    let largest = 0;
    let ended = false;
    const finalRow = h.waitFinal(b.uuid, 120_000).finally(() => {
      ended = true;
    });
    while (!ended) {
      const [c] = await listBundleContainers(docker, h.root, { uuid: b.uuid, all: true });
      const logPath =
        c === undefined
          ? undefined
          : (
              await docker
                .json<{ LogPath?: string }>("GET", `/containers/${c.Id}/json`)
                .catch(() => ({ LogPath: undefined }))
            ).LogPath;
      if (logPath) {
        const dir = dirname(logPath);
        const names = (await readdir(dir).catch(() => [])).filter((n) => n.startsWith(basename(logPath)));
        const sizes = await Promise.all(
          names.map((n) =>
            stat(join(dir, n)).then(
              (st) => st.size,
              () => 0,
            ),
          ),
        );
        largest = Math.max(
          largest,
          sizes.reduce((a, n) => a + n, 0),
        );
      }
      await new Promise((r) => setTimeout(r, 100));
    }
    const final = await finalRow;
    expect(final.state, await supervisorLog(h.root, b.uuid)).toBe("ready");
    // The bundle wrote 20 MB; docker kept at most two files of the cap (each may pass it by one entry).
    expect(largest).toBeGreaterThan(cap / 2);
    expect(largest).toBeLessThanOrEqual(2 * cap + 64 * 1024);
    // The end still arrives through the rotations.
    expect(await h.log(b.uuid, "stderr")).toContain("done\n");
  }, 120_000);
});
