/**
 * End to end on PostgreSQL: `rest-server` and `dispatcher` as separate processes, local VMs behind OpenSSH
 * sshd (each in its own mount namespace, logged into as a non-root user), crunch-run deployed by the
 * dispatcher from its own sources, and bundles run by the real dockerd from an image made with `docker
 * import`. Every bundle goes the whole way: submit, stage, schedule, start over SSH, container, outputs, finish.
 */
import { execFileSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { E2eSystem, until } from "./e2e-harness.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";

const IMAGE = requireDockerImage();

function containersOf(uuid: string): string[] {
  return execFileSync("docker", ["ps", "-aq", "--filter", `label=dispatch-cloud.bundle=${uuid}`], {
    encoding: "utf8",
  })
    .split("\n")
    .filter(Boolean);
}

/** Pids whose command line or environment contains `text`. */
function processesWith(text: string): number[] {
  const found: number[] = [];
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    for (const what of ["cmdline", "environ"]) {
      try {
        if (readFileSync(`/proc/${name}/${what}`, "latin1").includes(text)) found.push(Number(name));
      } catch {
        // Gone, or not ours to read.
      }
    }
  }
  return found;
}

describe("end to end: PostgreSQL, OpenSSH VMs, Docker", () => {
  let sys: E2eSystem;

  beforeAll(async () => {
    sys = await E2eSystem.start({
      database: "pg",
      sshServer: "openssh",
      runtimeEngine: "docker",
      split: true,
      addressPrefix: "127.0.6.",
    });
  }, 180_000);

  afterAll(async () => {
    await sys?.stop();
  }, 120_000);

  const sh = (script: string, extra: Record<string, unknown> = {}) =>
    sys.submit({ image: IMAGE, command: ["sh", "-c", script], ...extra });

  it("runs `echo hello > /out/greeting` to ready; the output can be listed and downloaded", async () => {
    const uuid = await sh("echo hello > /out/greeting");
    const b = await sys.waitState(uuid);
    expect(b, sys.output().slice(-4000)).toMatchObject({ state: "ready", exitCode: 0, attempt: 1 });
    const list = await sys.json<{ files: { path: string; size: number }[] }>(
      "GET",
      `/bundles/${uuid}/outputs`,
    );
    expect(list.files).toEqual([{ path: "greeting", size: 6 }]);
    expect(await sys.text(`/bundles/${uuid}/outputs/greeting`)).toEqual({ status: 200, body: "hello\n" });
    expect(containersOf(uuid)).toEqual([]);
  }, 180_000);

  it("fails a bundle that exits 3 with exit code 3", async () => {
    const b = await sys.waitState(await sh("exit 3"));
    expect(b).toMatchObject({ state: "failed", exitCode: 3, attempt: 1 });
  }, 120_000);

  it("fails a bundle over its memory limit, and one over its time limit, saying which", async () => {
    // biome-ignore lint/suspicious/noTemplateCurlyInString: the shell's ${#x}, run in the container.
    const hog = await sh('x=$(head -c 400000000 /dev/zero | tr "\\0" a); echo ${#x}', {
      resources: { vcpus: 1, ram: "64MiB" },
    });
    const slow = await sh("sleep 60", { limits: { time: "2s" } });
    const [m, t] = await Promise.all([sys.waitState(hog), sys.waitState(slow)]);
    expect(m.state).toBe("failed");
    expect(m.stateReason).toMatch(/memory limit/);
    expect(t.state).toBe("failed");
    expect(t.stateReason).toMatch(/time limit/);
  }, 120_000);

  it("kills a running bundle: the bundle is killed and its container is gone", async () => {
    const uuid = await sh("sleep 300");
    await sys.waitState(uuid, ["running"]);
    await until("the container", () => (containersOf(uuid).length > 0 ? true : undefined));
    // While it runs, no process on this machine carries a runner token in its command line or environment.
    expect(processesWith("dcr_")).toEqual([]);
    await sys.json("POST", `/bundles/${uuid}/kill`, { reason: "test" });
    expect((await sys.get(uuid)).state).toBe("killed");
    await until("container removal", () => (containersOf(uuid).length === 0 ? true : undefined), 60_000);
  }, 120_000);

  it("mounts a dependency's output read-only; a bundle depending on a failed one fails naming it", async () => {
    const a = await sh("mkdir /out/sub && echo from-a > /out/sub/data.txt");
    const b = await sh(
      "cat /in/input/data.txt > /out/copy; if touch /in/input/x 2>/dev/null; then echo writable; else echo read-only; fi > /out/mode",
      { dependencies: [{ bundle: a, subpath: "sub", name: "input" }] },
    );
    const bad = await sh("exit 1");
    const c = await sh("true", { dependencies: [{ bundle: bad }] });
    expect((await sys.waitState(b)).state).toBe("ready");
    expect((await sys.text(`/bundles/${b}/outputs/copy`)).body).toBe("from-a\n");
    expect((await sys.text(`/bundles/${b}/outputs/mode`)).body).toBe("read-only\n");
    const cb = await sys.waitState(c);
    expect(cb.state).toBe("failed");
    expect(cb.stateReason).toContain(bad);
  }, 180_000);

  it("streams the logs of a running bundle before it ends", async () => {
    const uuid = await sh("echo first; sleep 4; echo second");
    await sys.waitState(uuid, ["running"]);
    const res = await sys.request("GET", `/bundles/${uuid}/logs?stream=stdout&follow=1`);
    expect(res.status).toBe(200);
    const reader = res.body!.getReader();
    let seen = "";
    while (!seen.includes("first")) {
      const { value, done } = await reader.read();
      if (done) break;
      seen += Buffer.from(value).toString();
    }
    expect(seen).toContain("first");
    // The bundle has not ended when its first line arrives.
    expect((await sys.get(uuid)).state).toBe("running");
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      seen += Buffer.from(value).toString();
    }
    expect(seen).toBe("first\nsecond\n");
    expect((await sys.get(uuid)).state).toBe("ready");
  }, 120_000);

  it("fails a bundle whose image is missing at once, naming the image, without marking the VM broken", async () => {
    const uuid = await sys.submit({ image: "dctest/no-such-image:7", command: ["true"] });
    const b = await sys.waitState(uuid);
    expect(b.state).toBe("failed");
    expect(b.attempt).toBe(1);
    expect(b.stateReason).toContain("dctest/no-such-image:7");
    const vms = path.join(sys.dir, "vms");
    const roots = readdirSync(vms)
      .map((d) => path.join(vms, d, "root"))
      .filter((r) => existsSync(r));
    expect(roots.length).toBeGreaterThan(0);
    for (const root of roots) expect(existsSync(path.join(root, "var/lock/crunch-run-broken"))).toBe(false);
  }, 120_000);

  it("loses no bundle and runs none twice when the dispatcher is SIGKILLed while 5 run", async () => {
    const uuids = await Promise.all(Array.from({ length: 5 }, (_, i) => sh(`sleep 6; echo ${i} > /out/n`)));
    for (const u of uuids) await sys.waitState(u, ["running"]);
    await sys.killDispatcher();
    await new Promise((r) => setTimeout(r, 1500));
    await sys.startDispatcher();
    for (const [i, u] of uuids.entries()) {
      const b = await sys.waitState(u);
      expect(b).toMatchObject({ state: "ready", attempt: 1 });
      expect((await sys.text(`/bundles/${u}/outputs/n`)).body).toBe(`${i}\n`);
      const events = await sys.json<{ items: { toState: string }[] }>("GET", `/bundles/${u}/events`);
      expect(events.items.filter((e) => e.toState === "running")).toHaveLength(1);
      expect(events.items.filter((e) => e.toState === "starting")).toHaveLength(1);
    }
  }, 180_000);

  it("starts bundles through the instance's warm spare supervisor, without a --detach process", async () => {
    for (let i = 0; i < 3; i++) {
      expect((await sys.waitState(await sh("true"))).state).toBe("ready");
    }
    // A dispatcher in a process of its own hands the document over once the claim is back.
    expect(sys.output()).toMatch(/"via":"spare","withClaim":false,"msg":"runner started"/);
  }, 120_000);
});
