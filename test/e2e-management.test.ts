/**
 * End to end on the embedded default (PGlite, local VMs with embedded SSH, Docker): an operator steers the
 * instances through the management API with the `dispatch-cloud instance` and `queue` commands. Drain lets the
 * running bundle finish, then the VM goes; hold keeps an idle VM past timeoutIdle and gives it no bundle (the
 * dispatcher creates another instead); run puts it back to work.
 *
 * With one bundle per instance and two instances at most, a bundle can be made to wait at quota for the held one.
 * Bundles here wait until the test lets them go (`docker exec ... touch /tmp/go`), so every step is observed
 * in a known state instead of after a sleep.
 */
import { execFileSync } from "node:child_process";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import type { ManagementBundle, ManagementInstance } from "../cli/management-client.ts";
import { E2eSystem, until } from "./e2e-harness.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";

const IMAGE = requireDockerImage();
const TIMEOUT_IDLE_S = 3;

describe("end to end: steering instances with the operator CLI", () => {
  let sys: E2eSystem;

  beforeAll(async () => {
    sys = await E2eSystem.start({
      database: "pglite",
      sshServer: "embedded",
      runtimeEngine: "docker",
      management: true,
      timeoutIdle: `${TIMEOUT_IDLE_S}s`,
      maxInstances: 2,
      cloudYaml: "  maxRunningBundlesPerInstance: 1",
    });
  }, 180_000);

  afterAll(async () => {
    await sys?.stop();
  }, 120_000);

  /** Runs the CLI in-process against the system's management API. */
  async function cli(argv: string[]): Promise<{ code: number; out: string[]; err: string[] }> {
    const out: string[] = [];
    const err: string[] = [];
    const io: CliIo = {
      argv,
      env: {
        DISPATCH_CLOUD_MANAGEMENT_URL: sys.management?.url,
        DISPATCH_CLOUD_MANAGEMENT_TOKEN: sys.management?.token,
      },
      cwd: sys.dir,
      out: (l) => out.push(l),
      err: (l) => err.push(l),
      progress: (l) => err.push(l),
    };
    return { code: await runCli(io), out, err };
  }

  const instances = async () =>
    (await sys.manage<{ items: ManagementInstance[] }>("GET", "/instances")).items;
  const instance = async (id: string) => (await instances()).find((i) => i.instanceId === id);

  /** A bundle that runs until the test creates /tmp/go in its container. */
  const gated = (name: string) =>
    sys.submit({
      name,
      image: IMAGE,
      command: ["sh", "-c", `while [ ! -e /tmp/go ]; do sleep 0.1; done; echo ${name} > /out/done`],
    });

  /** The instance a running bundle runs on, as the management API lists it. */
  const runningOn = (uuid: string) =>
    until(`bundle ${uuid} listed on an instance`, async () =>
      (await instances()).find((i) => i.runningBundles.includes(uuid)),
    );

  /** Lets a gated bundle finish; its container starts a moment after the bundle is `running`. */
  async function release(uuid: string): Promise<void> {
    const id = await until(`the container of ${uuid} running`, () => {
      const ids = execFileSync("docker", ["ps", "-q", "--filter", `label=dispatch-cloud.bundle=${uuid}`], {
        encoding: "utf8",
      })
        .split("\n")
        .filter(Boolean);
      expect(ids.length, `containers of ${uuid}`).toBeLessThanOrEqual(1);
      return ids[0];
    });
    execFileSync("docker", ["exec", id, "touch", "/tmp/go"]);
  }

  it("drain: the running bundle finishes ready, then the VM is destroyed", async () => {
    const uuid = await gated("drained");
    await sys.waitState(uuid, ["running"]);
    const vm = await runningOn(uuid);

    const listed = await cli(["instance", "list", "--header"]);
    expect(listed.code, listed.err.join("\n")).toBe(0);
    expect(listed.out[0]).toMatch(
      /^INSTANCE\s+ADDRESS\s+STATE\s+IDLE BEHAVIOR\s+TYPE\s+PROVIDER TYPE\s+PRICE/,
    );
    const row = listed.out.find((l) => l.startsWith(vm.instanceId));
    expect(row).toMatch(/\brunning\s+run\s+e2e\.medium\b/);
    expect(row).toContain(uuid);

    const drained = await cli(["instance", "drain", vm.instanceId]);
    expect(drained).toMatchObject({ code: 0, out: [`${vm.instanceId}: idle behavior drain`] });
    expect(await instance(vm.instanceId)).toMatchObject({ idleBehavior: "drain", runningBundles: [uuid] });

    await release(uuid);
    expect(await sys.waitState(uuid)).toMatchObject({
      state: "ready",
      exitCode: 0,
      instanceId: vm.instanceId,
    });
    await until(`drained instance ${vm.instanceId} destroyed`, async () =>
      (await instance(vm.instanceId)) === undefined ? true : undefined,
    );
  }, 240_000);

  it("hold: an idle held instance outlives timeoutIdle and gets no bundle; run: it is used again", async () => {
    // Hold the instance while its bundle still runs, so timeoutIdle cannot win a race against the hold.
    const first = await gated("before-hold");
    await sys.waitState(first, ["running"]);
    const held = await runningOn(first);
    const hold = await cli(["instance", "hold", held.instanceId]);
    expect(hold).toMatchObject({ code: 0, out: [`${held.instanceId}: idle behavior hold`] });
    await release(first);
    expect(await sys.waitState(first)).toMatchObject({ state: "ready", instanceId: held.instanceId });

    // Idle for twice timeoutIdle, still there and still held.
    const idle = await until(`held instance idle for ${2 * TIMEOUT_IDLE_S}s`, async () => {
      const i = await instance(held.instanceId);
      if (i === undefined) throw new Error(`held instance ${held.instanceId} was destroyed`);
      return i.state === "idle" && i.secondsInState >= 2 * TIMEOUT_IDLE_S ? i : undefined;
    });
    expect(idle).toMatchObject({ idleBehavior: "hold", runningBundles: [] });

    // A new bundle goes to a new instance, not to the held one.
    const second = await gated("while-held");
    await sys.waitState(second, ["running"]);
    const other = await runningOn(second);
    expect(other.instanceId).not.toBe(held.instanceId);
    expect(await instance(held.instanceId)).toMatchObject({ idleBehavior: "hold", runningBundles: [] });

    // At quota (2 of 2, one bundle per instance, the other one busy): the next bundle waits; the queue says why.
    const third = await gated("after-run");
    const waiting = await until(`${third} waiting at quota`, async () => {
      const q = await cli(["queue", "--header"]);
      expect(q.code, q.err.join("\n")).toBe(0);
      const row = q.out.find((l) => l.startsWith(third));
      return row?.includes("at quota") === true ? q.out : undefined;
    });
    expect(waiting[0]).toMatch(/^UUID\s+STATE\s+PRIORITY\s+TYPE\s+WAITING SINCE\s+STATUS$/);
    expect(waiting.find((l) => l.startsWith(third))).toMatch(
      /\bstaged\s+\d+\s+e2e\.medium\s+\d{4}-\S+\s+waiting in queue at position 1: at quota: 2 of 2 instances; waiting for an idle instance of type e2e\.medium$/,
    );
    expect(waiting.find((l) => l.startsWith(second))).toMatch(/\brunning\b/);

    // run: the held instance takes the waiting bundle.
    const run = await cli(["instance", "run", held.instanceId]);
    expect(run).toMatchObject({ code: 0, out: [`${held.instanceId}: idle behavior run`] });
    await sys.waitState(third, ["running"]);
    expect((await runningOn(third)).instanceId).toBe(held.instanceId);
    const view = await sys.manage<ManagementBundle>("GET", `/bundles/${third}`);
    expect(view).toMatchObject({ uuid: third, state: "running", instanceId: held.instanceId });

    await release(second);
    await release(third);
    expect(await sys.waitState(second)).toMatchObject({ state: "ready", instanceId: other.instanceId });
    expect(await sys.waitState(third)).toMatchObject({ state: "ready", instanceId: held.instanceId });
    // Both now behave `run`: idle past timeoutIdle, they go.
    for (const id of [other.instanceId, held.instanceId]) {
      await until(`idle instance ${id} shut down`, async () =>
        (await instance(id)) === undefined ? true : undefined,
      );
    }
  }, 300_000);

  it("reports unknown ids one line each and exits 1; kill destroys an instance at once", async () => {
    const mixed = await cli(["instance", "hold", "no-such-instance"]);
    expect(mixed.code).toBe(1);
    expect(mixed.out).toEqual([
      expect.stringMatching(/^no-such-instance: error: .*\[management\.unknown_instance\]$/),
    ]);

    // An instance held idle, so timeoutIdle does not take it first.
    const uuid = await gated("before-kill");
    await sys.waitState(uuid, ["running"]);
    const id = (await runningOn(uuid)).instanceId;
    expect((await cli(["instance", "hold", id])).code).toBe(0);
    await release(uuid);
    await sys.waitState(uuid);
    const killed = await cli(["instance", "kill", id, "--reason", "e2e test"]);
    expect(killed).toMatchObject({ code: 0, out: [`${id}: shutdown`] });
    await until(`killed instance ${id} gone`, async () =>
      (await instance(id)) === undefined ? true : undefined,
    );
  }, 240_000);
});
