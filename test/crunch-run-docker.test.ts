/**
 * crunch-run end to end with the docker runtime: the real Docker daemon (image dctest/busybox:1), a real REST
 * server in process, crunch-run as a real process from sources. A missing daemon or image fails the suite
 * with how to get them.
 *
 * Container starts that fail for real: a command that does not exist or cannot be executed (the bundle's
 * fault), and two the runtime's: a dependency mount onto a path that cannot be created (an image whose /in is a
 * file, made here with docker commit: runc refuses with the same 400 "OCI runtime create failed" as a missing
 * command) and ROCm devices that this machine lacks (a 500 saying "no such file or directory").
 */
import { existsSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createDockerClient, listBundleContainers } from "../crunch-run/docker-api.ts";
import { RUNTIME_FAILURES_BEFORE_BROKEN } from "../crunch-run/runtime-failures.ts";
import { listEvents } from "../store/queries.ts";
import { type RunnerHarness, startRunnerHarness, supervisorLog } from "./crunch-run-harness.ts";
import { useTestDb } from "./db.ts";
import { requireDockerImage } from "./docker-check.ts";

const IMAGE = "dctest/busybox:1";
/** dctest/busybox:1 with /in a regular file: no dependency can be mounted at /in/<name>. Made per run. */
const IN_FILE_IMAGE = `dctest/in-is-a-file:${process.pid}-${Date.now().toString(36)}`;
const MiB = 1024 * 1024;

describe("crunch-run (docker runtime)", () => {
  const getDb = useTestDb("pglite");
  const docker = createDockerClient(process.env);
  let h: RunnerHarness;

  beforeAll(async () => {
    await requireDockerImage(docker, IMAGE);
    h = await startRunnerHarness(getDb());
  });
  afterAll(async () => {
    if (h !== undefined) {
      for (const c of await listBundleContainers(docker, h.root, { all: true }).catch(() => [])) {
        await docker.call("DELETE", `/containers/${c.Id}?force=true`).catch(() => {});
      }
      await h.close();
    }
    await docker.call("DELETE", `/images/${encodeURIComponent(IN_FILE_IMAGE)}?force=true`).catch(() => {});
  });

  const bundle = (command: string[], extra: Record<string, unknown> = {}) =>
    h.newStartingBundle({ image: IMAGE, command, ...extra });
  const run = async (b: { uuid: string; token: string; attempt: number }) => {
    const res = await h.detach(b, { runtimeEngine: "docker" });
    expect(res.code, res.stderr).toBe(0);
    return h.waitFinal(b.uuid);
  };
  const containersOf = (uuid: string) => listBundleContainers(docker, h.root, { uuid, all: true });
  const lockPath = (name: string) => join(h.root, "var", "lock", name);
  const failuresFile = () => lockPath("crunch-run-runtime-failures");
  const failureLines = () =>
    existsSync(failuresFile())
      ? readFileSync(failuresFile(), "utf8")
          .split("\n")
          .filter((l) => l !== "")
      : [];

  /** Makes IN_FILE_IMAGE from IMAGE: a container that replaces /in by a file, committed. */
  const makeInFileImage = async () => {
    const { Id } = await docker.json<{ Id: string }>("POST", "/containers/create", {
      Image: IMAGE,
      Cmd: ["sh", "-c", "rm -rf /in && echo not-a-directory > /in"],
    });
    try {
      await docker.json("POST", `/containers/${Id}/start`);
      const { StatusCode } = await docker.json<{ StatusCode: number }>("POST", `/containers/${Id}/wait`);
      expect(StatusCode).toBe(0);
      const [repo, tag] = IN_FILE_IMAGE.split(":");
      await docker.json("POST", `/commit?container=${Id}&repo=${repo}&tag=${tag}`);
    } finally {
      await docker.call("DELETE", `/containers/${Id}?force=true`);
    }
  };

  it("runs a container to ready with its output, logs and env; the container is removed", async () => {
    const b = await bundle([
      "sh",
      "-c",
      'echo "hi $GREETING" > /out/greeting.txt; echo "out=$DISPATCH_OUTPUT_DIR"; id -u',
    ]);
    const final = await run(b);
    expect(final.state, await supervisorLog(h.root, b.uuid)).toBe("ready");
    expect(await h.output(b.uuid, "greeting.txt")).toEqual({ status: 200, body: "hi hello\n" });
    expect(await h.log(b.uuid, "stdout")).toBe(`out=/out\n${process.getuid?.()}\n`);
    expect(await h.log(b.uuid, "stderr")).toContain("[crunch-run] runtime: docker");
    expect(await containersOf(b.uuid)).toEqual([]);
    expect(await supervisorLog(h.root, b.uuid)).not.toContain(b.token);

    // A bundle depending on it sees its output read-only at /in/<name>.
    const dep = await bundle(
      [
        "sh",
        "-c",
        "cat /in/first/greeting.txt > /out/copy.txt; if touch /in/first/x 2>/dev/null; then echo writable; fi",
      ],
      { dependencies: [{ bundle: b.uuid, subpath: "", name: "first" }] },
    );
    const depFinal = await run(dep);
    expect(depFinal.state, await supervisorLog(h.root, dep.uuid)).toBe("ready");
    expect(await h.output(dep.uuid, "copy.txt")).toEqual({ status: 200, body: "hi hello\n" });
    expect(await h.log(dep.uuid, "stdout")).not.toContain("writable");
  });

  it("fails with the container's exit code", async () => {
    const final = await run(await bundle(["sh", "-c", "exit 3"]));
    expect(final.state).toBe("failed");
    expect(final.exitCode).toBe(3);
  });

  it("fails a bundle over its memory limit with the reason", async () => {
    const b = await bundle(["sh", "-c", 'x=$(head -c 200000000 /dev/zero | tr "\\0" a); echo survived'], {
      resources: { vcpus: 1, ram: 64 * MiB, scratch: 0, gpu: null },
    });
    const final = await run(b);
    expect(final.state).toBe("failed");
    expect(final.stateReason).toContain("memory limit of 64MiB exceeded");
    expect(await h.log(b.uuid, "stdout")).not.toContain("survived");
  });

  it("stops a container at its time limit", async () => {
    const b = await bundle(["sleep", "60"], { limits: { time: 1000, disk: null, network: false } });
    const final = await run(b);
    expect(final.state).toBe("failed");
    expect(final.stateReason).toContain("time limit of 1s exceeded");
    expect(await containersOf(b.uuid)).toEqual([]);
  });

  it("--kill TERM stops and removes the container, without finishing", async () => {
    const b = await bundle(["sleep", "60"]);
    const res = await h.detach(b, { runtimeEngine: "docker" });
    expect(res.code, res.stderr).toBe(0);
    await h.waitState(b.uuid, ["running"]);
    const deadline = Date.now() + 30_000;
    while ((await listBundleContainers(docker, h.root, { uuid: b.uuid })).length === 0) {
      if (Date.now() > deadline) throw new Error(`no container: ${await supervisorLog(h.root, b.uuid)}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    let killed = await h.crunchRun(["--kill", "TERM", b.uuid]);
    for (let i = 0; i < 5 && killed.code !== 0; i++) killed = await h.crunchRun(["--kill", "TERM", b.uuid]);
    expect(killed.code, killed.stderr).toBe(0);
    expect(await containersOf(b.uuid)).toEqual([]);
    expect(await h.listBundles()).toBe("");
    expect((await h.waitState(b.uuid, ["running"])).state).toBe("running");
  });

  it("--list says stale while a dead supervisor's container runs; --kill then removes the container", async () => {
    const b = await bundle(["sleep", "60"]);
    expect((await h.detach(b, { runtimeEngine: "docker" })).code).toBe(0);
    const deadline = Date.now() + 30_000;
    while ((await listBundleContainers(docker, h.root, { uuid: b.uuid })).length === 0) {
      if (Date.now() > deadline) throw new Error(`no container: ${await supervisorLog(h.root, b.uuid)}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    expect((await h.crunchRun(["--kill", "KILL", b.uuid])).code).toBe(0);
    expect(await h.listBundles()).toBe(`${b.uuid} stale\n`);
    expect((await h.detach(b, { runtimeEngine: "docker" })).stderr).toContain("stale");
    expect((await h.crunchRun(["--kill", "TERM", b.uuid])).code).toBe(0);
    expect(await listBundleContainers(docker, h.root, { uuid: b.uuid })).toEqual([]);
    expect(await h.listBundles()).toBe("");
  });

  it("marks the instance broken, without finishing, when the Docker daemon is unreachable", async () => {
    const b = await bundle(["true"]);
    const gone = { DOCKER_HOST: `unix://${join(h.root, "no-such-docker.sock")}` };
    h.dropSpares();
    expect((await h.detach(b, { runtimeEngine: "docker" }, gone)).code).toBe(0);
    const deadline = Date.now() + 30_000;
    while (!(await h.listBundles(gone)).includes("broken")) {
      if (Date.now() > deadline) throw new Error(`not broken: ${await supervisorLog(h.root, b.uuid)}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    expect(await h.listBundles(gone)).toBe("broken\n");
    expect((await h.waitState(b.uuid, ["running"])).state).toBe("running");
    rmSync(join(h.root, "var", "lock", "crunch-run-broken"));
    h.dropSpares(); // the spare that --detach left has the unreachable daemon too
  });

  it("fails at once, naming the image, when the image is missing; the instance is not broken", async () => {
    const b = await h.newStartingBundle({ image: "dctest/no-such-image:7", command: ["true"] });
    const final = await run(b);
    expect(final.state).toBe("failed");
    expect(final.exitCode).toBeNull();
    expect(final.stateReason).toContain("dctest/no-such-image:7");
    expect(existsSync(join(h.root, "var", "lock", "crunch-run-broken"))).toBe(false);
    expect(await h.listBundles()).not.toContain("broken");
  });

  it("fails a bundle whose command does not exist, naming the command; the instance is not broken", async () => {
    const b = await bundle(["no-such-command", "--flag"]);
    const final = await run(b);
    expect(final.state, await supervisorLog(h.root, b.uuid)).toBe("failed");
    expect(final.exitCode).toBeNull();
    expect(final.stateReason).toBe(
      'the command "no-such-command" cannot be run: executable file not found in $PATH',
    );
    expect(await h.log(b.uuid, "stderr")).toContain(
      '[crunch-run] the command "no-such-command" cannot be run',
    );
    expect(await containersOf(b.uuid)).toEqual([]);
    expect(failureLines()).toEqual([]);
    expect(await h.listBundles()).not.toContain("broken");
  });

  it("fails a bundle whose command is not executable, naming it", async () => {
    const final = await run(await bundle(["/etc"]));
    expect(final.state).toBe("failed");
    expect(final.stateReason).toBe('the command "/etc" cannot be run: permission denied');
    const missing = await run(await bundle(["/no/such/program"]));
    expect(missing.stateReason).toBe(
      'the command "/no/such/program" cannot be run: no such file or directory',
    );
    expect(failureLines()).toEqual([]);
  });

  it("requeues a bundle the runtime cannot start, counts it against the instance, and marks the instance broken after a run of them", async () => {
    expect(RUNTIME_FAILURES_BEFORE_BROKEN).toBe(2);
    await makeInFileImage();
    rmSync(failuresFile(), { force: true });
    // A ready bundle to depend on, so that the next one has a mount at /in/<name>.
    const dep = await bundle(["sh", "-c", "echo data > /out/x"]);
    expect((await run(dep)).state).toBe("ready");
    const mountFails = () =>
      h.newStartingBundle({
        image: IN_FILE_IMAGE,
        command: ["true"],
        dependencies: [{ bundle: dep.uuid, subpath: "", name: "first" }],
      });

    // 1. runc refuses the mount with a 400 "OCI runtime create failed", as it does a missing command: requeued.
    const first = await mountFails();
    expect((await h.detach(first, { runtimeEngine: "docker" })).code).toBe(0);
    const requeued = await h.waitState(first.uuid, ["staged", "failed", "ready"]);
    expect(requeued.state, await supervisorLog(h.root, first.uuid)).toBe("staged");
    expect(requeued.attempt).toBe(1);
    expect(requeued.instanceId).toBeNull();
    expect(requeued.stateReason).toMatch(
      /^requeued by its runner on instance i-test: the container runtime failed: .*OCI runtime create failed.*error mounting .* \(this instance's fault, not the bundle's\)$/,
    );
    expect((await listEvents(getDb(), first.uuid)).at(-1)).toMatchObject({
      fromState: "running",
      toState: "staged",
      actor: "runner",
    });
    expect(await h.log(first.uuid, "stderr")).toContain(
      "(this instance's fault, not the bundle's): the bundle is requeued",
    );
    expect(await containersOf(first.uuid)).toEqual([]);
    expect(failureLines()).toHaveLength(1);
    expect(failureLines()[0]).toContain(first.uuid);
    await waitFor(async () => (await h.listBundles()) === "");

    // 2. A container that starts ends the run of failures.
    expect((await run(await bundle(["true"]))).state).toBe("ready");
    expect(failureLines()).toEqual([]);

    // 3. Two in a row: the second (ROCm devices this machine lacks: a 500 that says "no such file or
    // directory", about a device, not the command) requeues its bundle and marks the instance broken.
    expect(existsSync("/dev/kfd")).toBe(false);
    const again = await mountFails();
    expect((await h.detach(again, { runtimeEngine: "docker" })).code).toBe(0);
    expect((await h.waitState(again.uuid, ["staged", "failed"])).state).toBe("staged");
    expect(await h.listBundles()).not.toContain("broken");
    const rocm = await h.newStartingBundle({
      image: IMAGE,
      command: ["true"],
      resources: {
        vcpus: 1,
        ram: 256 * MiB,
        scratch: 0,
        gpu: { stack: "rocm", deviceCount: 1, vram: 0, driverVersion: null, hardwareTarget: [] },
      },
    });
    expect((await h.detach(rocm, { runtimeEngine: "docker", gpuDevices: [0] })).code).toBe(0);
    const rocmFinal = await h.waitState(rocm.uuid, ["staged", "failed"]);
    expect(rocmFinal.state, await supervisorLog(h.root, rocm.uuid)).toBe("staged");
    expect(rocmFinal.stateReason).toContain('adding custom device "/dev/kfd": no such file or directory');
    await waitFor(async () => (await h.listBundles()) === "broken\n");
    expect(readFileSync(lockPath("crunch-run-broken"), "utf8")).toContain(
      "2 container starts in a row failed",
    );
    rmSync(lockPath("crunch-run-broken"));
    rmSync(failuresFile(), { force: true });
  });
});

async function waitFor(cond: () => Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error("condition not met in time");
    await new Promise((r) => setTimeout(r, 100));
  }
}
