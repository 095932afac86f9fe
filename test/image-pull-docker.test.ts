/**
 * crunch-run's pull (crunch-run/image-pull.ts) against the real Docker daemon and the open registry of
 * scripts/test-services.sh: the per-image lock that makes supervisors on one instance (separate processes) pull an
 * image once. A live holder's lock makes a supervisor wait, saying the holder's progress, and pull itself once the
 * lock is gone; a dead holder's lock is removed; a wait ends when the bundle is stopped.
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createDockerClient } from "../crunch-run/docker-api.ts";
import { pullImage } from "../crunch-run/image-pull.ts";
import { procStartTime } from "../crunch-run/lock.ts";
import { waitFor } from "./local-driver-helpers.ts";

const REGISTRY = process.env["DISPATCH_CLOUD_TEST_REGISTRY"];
if (REGISTRY === undefined || REGISTRY === "") {
  throw new Error(
    "DISPATCH_CLOUD_TEST_REGISTRY is not set: run `bash scripts/test-services.sh` as root (starts the registries) and load its export lines",
  );
}
const IMAGE = `${REGISTRY}/dctest/busybox:1`;
const UUID = "zzzzz-bndl-aaaaaaaaaaaaaaa";

const removeImage = () => execFileSync("docker", ["rmi", "-f", IMAGE], { stdio: "ignore" });
const lockName = (image: string) => `${createHash("sha256").update(image).digest("hex").slice(0, 32)}.lock`;

describe("pullImage: one pull per image per instance", () => {
  let dir: string;
  let holder: ChildProcess;
  const docker = createDockerClient(process.env);

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-pull-"));
    holder = spawn("sleep", ["300"], { stdio: "ignore" });
  });
  afterAll(async () => {
    holder.kill("SIGKILL");
    removeImage();
    await rm(dir, { recursive: true, force: true });
  });

  const pull = (lockDir: string, said: string[], signal = new AbortController().signal) =>
    pullImage({
      docker,
      image: IMAGE,
      auth: [],
      say: (l) => said.push(l),
      signal,
      retryBudgetMs: 2000,
      lockDir,
      uuid: UUID,
      progressIntervalMs: 60_000,
    });

  it("waits while another live supervisor holds the image's lock, saying its progress; pulls once it is gone", async () => {
    removeImage();
    const lockDir = join(dir, "live");
    const lock = join(lockDir, lockName(IMAGE));
    await mkdir(lockDir, { recursive: true });
    const pid = holder.pid ?? 0;
    await writeFile(
      lock,
      JSON.stringify({
        uuid: "zzzzz-bndl-bbbbbbbbbbbbbbb",
        pid,
        startTime: procStartTime(pid),
        progress: "1.0 of 2.0 MB",
      }),
    );
    const said: string[] = [];
    const done = pull(lockDir, said);
    await waitFor("the waiting line", () => said.length > 0);
    expect(said[0]).toBe(
      `pulling ${IMAGE}: another bundle on this instance is pulling it (1.0 of 2.0 MB); waiting for it`,
    );
    await rm(lock);
    await done;
    expect(said).toContain(`pulling ${IMAGE} from ${REGISTRY}`);
    expect(said.at(-1)).toMatch(new RegExp(`^pulled ${IMAGE.replace(/\./g, "\\.")} in [0-9.]+ s$`));
  });

  it("removes a dead holder's lock and pulls", async () => {
    removeImage();
    const lockDir = join(dir, "dead");
    await mkdir(lockDir, { recursive: true });
    // A pid that is not running: a child that has exited.
    const gone = spawn("true");
    await new Promise((r) => gone.once("exit", r));
    await writeFile(
      join(lockDir, lockName(IMAGE)),
      JSON.stringify({ uuid: "zzzzz-bndl-bbbbbbbbbbbbbbb", pid: gone.pid, startTime: "1" }),
    );
    const said: string[] = [];
    await pull(lockDir, said);
    expect(said[0]).toBe(`pulling ${IMAGE} from ${REGISTRY}`);
  });

  it("stops waiting when the bundle is stopped", async () => {
    removeImage();
    const lockDir = join(dir, "abort");
    await mkdir(lockDir, { recursive: true });
    const pid = holder.pid ?? 0;
    await writeFile(
      join(lockDir, lockName(IMAGE)),
      JSON.stringify({ uuid: "zzzzz-bndl-bbbbbbbbbbbbbbb", pid, startTime: procStartTime(pid) }),
    );
    const abort = new AbortController();
    const said: string[] = [];
    const done = pull(lockDir, said, abort.signal);
    await waitFor("the waiting line", () => said.length > 0);
    abort.abort(new Error("stopped by SIGTERM"));
    await expect(done).rejects.toThrow("stopped by SIGTERM");
  });
});
