import { once } from "node:events";
import { Registry } from "prom-client";
import { describe, expect, it } from "vitest";
import { initScript, newInstanceSecret } from "../../dispatcher/pool/bootstrap.ts";
import { IDENTITY_COMMAND } from "../../dispatcher/sshexec/executor.ts";
import { createLogger } from "../../lib/logger.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "../errors.ts";
import { DriverRegistry, openInstanceSet } from "../registry.ts";
import type { InstanceSet, InstanceType } from "../types.ts";
import { StubCloud, type StubCloudOptions, stubDriver, stubQuotaGroup } from "./driver.ts";

function itype(name: string, providerType = name, preemptible = false): InstanceType {
  return {
    name,
    providerType,
    vcpus: 2,
    ram: 4 << 30,
    includedScratch: 0,
    addedScratch: 0,
    scratch: 0,
    price: 0.1,
    preemptible,
    gpu: null,
  };
}

const SMALL = itype("small", "m5.large");

function setup(opts: Omit<StubCloudOptions, "clock"> = {}) {
  const clock = new FakeClock();
  const cloud = new StubCloud({ clock, ...opts });
  const set = cloud.instanceSet("zzzzz");
  return { clock, cloud, set };
}

function create(set: InstanceSet, type = SMALL, secret = newInstanceSecret()) {
  return set.create(type, "img", { Secret: secret }, initScript(secret, ""), "ssh-ed25519 AAAA test");
}

/** Runs `n` creates one after another; returns the outcome of each ("ok" or the error's code). */
async function creates(set: InstanceSet, n: number, type = SMALL): Promise<string[]> {
  const out: string[] = [];
  for (let i = 0; i < n; i++) {
    try {
      await create(set, type);
      out.push("ok");
    } catch (err) {
      out.push((err as CloudError).code);
    }
  }
  return out;
}

const count = (xs: string[], x: string) => xs.filter((y) => y === x).length;

describe("stub cloud basics", () => {
  it("creates, lists by tag, retags and destroys; instance sets over one cloud share its VMs", async () => {
    const { cloud, set } = setup();
    const a = await set.create(SMALL, "img", { Set: "x", Type: "small" }, "", "key");
    const b = await set.create(itype("big", "c5.xlarge"), "img", { Set: "y" }, "", "key");
    expect(a.address).toBe("stub-1");
    expect(a.remoteUser).toBe("root");
    expect(b.providerType).toBe("c5.xlarge");
    expect((await set.instances({ Set: "x" })).map((i) => i.id)).toEqual([a.id]);
    await a.setTags({ Set: "x", Type: "other" });
    expect((await set.instances({ Set: "x" }))[0]?.tags).toEqual({ Set: "x", Type: "other" });

    const restarted = cloud.instanceSet("zzzzz");
    await set.stop();
    await expect(set.instances({})).rejects.toBeInstanceOf(CloudError);
    expect((await restarted.instances({})).map((i) => i.id).sort()).toEqual([a.id, b.id].sort());
    await b.destroy();
    await b.destroy(); // destroying a gone instance is not an error
    expect((await restarted.instances({})).map((i) => i.id)).toEqual([a.id]);
    await expect(b.setTags({})).rejects.toMatchObject({ code: "cloud.instance_gone" });
    expect(cloud.counts.create).toEqual({ ok: 2 });
    expect(cloud.calls.map((c) => `${c.op}:${c.outcome}`)).toContain("setTags:cloud.instance_gone");
  });

  it("reads the secret from the init script the pool writes", async () => {
    const { cloud, set } = setup();
    const secret = newInstanceSecret();
    const inst = await create(set, SMALL, secret);
    expect(cloud.vm(inst.id)?.secret).toBe(secret);
  });

  it("names quota groups by the EC2 rule: alphabetic prefix, -spot when preemptible", () => {
    const { set } = setup();
    expect(set.quotaGroup(itype("a", "m5.large"))).toBe("m");
    expect(set.quotaGroup(itype("b", "m5.large", true))).toBe("m-spot");
    expect(stubQuotaGroup({ providerType: "inf2.xlarge", preemptible: false })).toBe("inf");
    expect(stubQuotaGroup({ providerType: "Standard_D2s_v3", preemptible: false })).toBe("standard");
  });

  it("works through the driver registry and the wrappers", async () => {
    const clock = new FakeClock();
    const cloud = new StubCloud({ clock });
    const registry = new Registry();
    const config = {
      clusterId: "zzzzz",
      cloud: {
        driver: "stub" as const,
        driverParameters: { cloud },
        tagKeyPrefix: "DispatchCloud",
        resourceTags: { Owner: "ops" },
        instanceSetId: "",
        maxCloudOpsPerSecond: 0,
      },
    };
    const deps = {
      clock,
      registry,
      logger: createLogger({ level: "silent", format: "json" }),
      drivers: new DriverRegistry().register("stub", stubDriver),
    };
    const set = await openInstanceSet(config, deps);
    const inst = await set.create(SMALL, "img", {}, "", "key");
    expect(inst.tags).toMatchObject({ Owner: "ops", DispatchCloudInstanceSetID: "zzzzz" });
    const foreign = cloud.instanceSet("other");
    await foreign.create(SMALL, "img", { DispatchCloudInstanceSetID: "other" }, "", "key");
    expect((await set.instances({})).map((i) => i.id)).toEqual([inst.id]);
    expect(inst.priceHistory?.(SMALL)).toEqual([{ startTime: clock.now(), price: 0.1 }]);
    const again = await openInstanceSet(config, deps);
    expect((await again.instances({})).map((i) => i.id)).toEqual([inst.id]);
  });

  it("builds a cloud from config-file parameters and rejects bad ones with a path", async () => {
    const clock = new FakeClock();
    const deps = {
      clock,
      registry: new Registry(),
      logger: createLogger({ level: "silent", format: "json" }),
    };
    const set = await stubDriver.instanceSet(
      {
        seed: 7,
        quotaMaxInstances: 1,
        bootDelay: "30s",
        broken: { everyNth: 2 },
        capacityErrors: { all: false },
      },
      "zzzzz",
      {},
      deps,
    );
    await create(set);
    await expect(create(set)).rejects.toBeInstanceOf(CloudQuotaError);
    const bad = [
      [{ errorRateCreate: 2 }, "cloud.driverParameters.errorRateCreate"],
      [{ bootDelay: 30 }, "cloud.driverParameters.bootDelay"],
      [{ broken: { everyNth: 0 } }, "cloud.driverParameters.broken.everyNth"],
      [{ capacityErrors: { types: [] } }, "cloud.driverParameters.capacityErrors.types"],
      [{ bogus: 1 }, "cloud.driverParameters.bogus"],
      [{ cloud: {} }, "cloud.driverParameters.cloud"],
      [{ cloud: new StubCloud({ clock }), seed: 1 }, "cloud.driverParameters.seed"],
      [[], "cloud.driverParameters"],
    ] as const;
    for (const [params, path] of bad) {
      await expect(stubDriver.instanceSet(params, "zzzzz", {}, deps)).rejects.toMatchObject({
        code: "cloud.invalid_parameters",
        path,
      });
    }
  });
});

describe("stub cloud fault knobs", () => {
  it("errorRateCreate: fails about that share of creates, the same ones under the same seed", async () => {
    const runs = [];
    for (const seed of [1, 1, 2]) {
      const { set, cloud } = setup({ seed, errorRateCreate: 0.1 });
      const outcomes = await creates(set, 1000);
      runs.push(outcomes);
      const failures = count(outcomes, "cloud.error");
      console.log(`errorRateCreate 0.1, seed ${seed}: ${failures} of 1000 creates failed`);
      expect(failures).toBeGreaterThanOrEqual(70);
      expect(failures).toBeLessThanOrEqual(130);
      expect(cloud.liveCount).toBe(1000 - failures);
      expect(cloud.counts.create["cloud.error"]).toBe(failures);
    }
    expect(runs[1]).toEqual(runs[0]);
    expect(runs[2]).not.toEqual(runs[0]);
  });

  it("errorRateDestroy: fails about that share of destroys; those VMs stay listed", async () => {
    const { set, cloud } = setup({ errorRateDestroy: 0.2 });
    await creates(set, 1000);
    let failures = 0;
    for (const inst of await set.instances({})) {
      await inst.destroy().catch((err: unknown) => {
        expect(err).toBeInstanceOf(CloudError);
        failures++;
      });
    }
    console.log(`errorRateDestroy 0.2: ${failures} of 1000 destroys failed`);
    expect(failures).toBeGreaterThanOrEqual(150);
    expect(failures).toBeLessThanOrEqual(250);
    expect((await set.instances({})).length).toBe(failures);
    expect(cloud.liveCount).toBe(failures);
  });

  it("quotaMaxInstances: creates past the quota fail with CloudQuotaError until a VM goes", async () => {
    const { set } = setup({ quotaMaxInstances: 10 });
    const outcomes = await creates(set, 15);
    expect(count(outcomes, "ok")).toBe(10);
    expect(outcomes.slice(10)).toEqual(Array(5).fill("cloud.quota"));
    await expect(create(set)).rejects.toBeInstanceOf(CloudQuotaError);
    await (await set.instances({}))[0]?.destroy();
    await expect(create(set)).resolves.toBeDefined();
  });

  it("minTimeBetweenCreateCalls / ListCalls: early calls fail with CloudRateLimitError and earliestRetry", async () => {
    const { set, clock } = setup({ minTimeBetweenCreateCalls: 1000, minTimeBetweenListCalls: 5000 });
    const t0 = clock.now();
    await create(set);
    await clock.advance(300);
    const err = await create(set).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(CloudRateLimitError);
    expect((err as CloudRateLimitError).earliestRetry).toBe(t0 + 1000);
    await clock.advance(700);
    await expect(create(set)).resolves.toBeDefined();

    await set.instances({});
    await clock.advance(4999);
    await expect(set.instances({})).rejects.toMatchObject({
      code: "cloud.rate_limit",
      earliestRetry: t0 + 6000,
    });
    await clock.advance(1);
    expect(await set.instances({})).toHaveLength(2);

    // Over 10 s of calls every 100 ms, exactly one create per second gets through.
    let ok = 0;
    for (let i = 0; i < 100; i++) {
      if ((await creates(set, 1))[0] === "ok") ok++;
      await clock.advance(100);
    }
    expect(ok).toBe(10);
  });

  it("capacityErrors: by instance type, by quota group, or for all", async () => {
    const spot = itype("small-spot", "m5.large", true);
    const other = itype("c", "c5.large");
    const { set, cloud } = setup({ capacityErrors: { instanceTypes: new Set(["small"]) } });
    const byType = await create(set).catch((e: unknown) => e);
    expect(byType).toBeInstanceOf(CapacityError);
    expect(byType).toMatchObject({ scope: "instanceType", instanceType: "small", code: "cloud.capacity" });
    await expect(create(set, spot)).resolves.toBeDefined();
    expect(count(await creates(set, 20), "cloud.capacity")).toBe(20);

    cloud.knobs.capacityErrors.instanceTypes.clear();
    cloud.knobs.capacityErrors.quotaGroups.add("m-spot");
    await expect(create(set)).resolves.toBeDefined();
    await expect(create(set, spot)).rejects.toMatchObject({ scope: "quotaGroup", quotaGroup: "m-spot" });

    cloud.knobs.capacityErrors.all = true;
    await expect(create(set, other)).rejects.toMatchObject({ scope: "all" });
  });

  it("holdCloudOps/releaseCloudOps: held calls wait until released, lists are not held by default", async () => {
    const { set, cloud } = setup();
    cloud.holdCloudOps();
    const held = once(cloud, "op:held");
    const done: string[] = [];
    const pending = [1, 2, 3].map((n) => create(set).then((i) => done.push(`${n}:${i.id}`)));
    await held;
    expect(cloud.pendingOps).toBe(3);
    expect(await set.instances({})).toEqual([]);
    cloud.releaseCloudOps(1);
    await pending[0];
    expect(done).toEqual(["1:stub-vm-1"]);
    expect(cloud.pendingOps).toBe(2);
    cloud.releaseCloudOps();
    await Promise.all(pending);
    expect(done).toHaveLength(3);
    expect(cloud.pendingOps).toBe(0);
    await expect(create(set)).resolves.toBeDefined();

    cloud.holdCloudOps(["list"]);
    const listHeld = once(cloud, "op:held");
    const listing = set.instances({});
    await listHeld;
    expect(cloud.pendingOps).toBe(1);
    cloud.releaseCloudOps();
    expect(await listing).toHaveLength(4);
  });

  it("bootDelay: commands are refused until the delay has passed (fixed or per VM)", async () => {
    const { set, cloud, clock } = setup({ bootDelay: 60_000 });
    const inst = await create(set);
    const exec = cloud.executorFor(inst);
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.connect_failed" });
    await clock.advance(59_999);
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.connect_failed" });
    await clock.advance(1);
    expect((await exec.execute("true")).exitCode).toBe(0);

    cloud.knobs.bootDelay = (vm) => vm.serial * 1000;
    const second = await create(set);
    expect(cloud.vm(second.id)?.bootAt).toBe(clock.now() + 2000);
  });

  it("broken: every Nth VM, or a seeded share, reports broken in crunch-run --list", async () => {
    const { set, cloud } = setup({ broken: { everyNth: 7 } });
    await creates(set, 70);
    const broken = cloud.liveVms().filter((vm) => vm.broken);
    expect(broken.map((vm) => vm.serial)).toEqual([7, 14, 21, 28, 35, 42, 49, 56, 63, 70]);
    const runner = "/tmp/dispatch-cloud/crunch-run~abc";
    for (const vm of cloud.liveVms()) vm.files.set(runner, Buffer.from("bin"));
    const seventh = await cloud.executorFor("stub-vm-7").execute(`${runner} --list`);
    expect(seventh.stdout.toString()).toBe("broken\n");
    const sixth = await cloud.executorFor("stub-vm-6").execute(`${runner} --list`);
    expect(sixth.stdout.toString()).toBe("");

    cloud.knobs.broken = { rate: 0.2 };
    await creates(set, 1000);
    const share = cloud.liveVms().filter((vm) => vm.serial > 70 && vm.broken).length;
    console.log(`broken rate 0.2: ${share} of 1000 VMs broken`);
    expect(share).toBeGreaterThanOrEqual(150);
    expect(share).toBeLessThanOrEqual(250);
  });

  it("commandsFail: every command on those VMs fails", async () => {
    const { set, cloud } = setup({ commandsFail: (vm) => vm.serial === 2 });
    await creates(set, 3);
    expect((await cloud.executorFor("stub-vm-1").execute("true")).exitCode).toBe(0);
    const res = await cloud.executorFor("stub-vm-2").execute("true");
    expect(res.exitCode).toBe(2);
    expect(res.stderr.toString()).toMatch(/cannot fork/);
  });

  it("neverBoot: SSH answers, the boot probe never passes", async () => {
    const { set, cloud, clock } = setup({
      neverBoot: { everyNth: 2 },
      bootProbeCommand: "systemctl is-system-running",
    });
    await creates(set, 4);
    await clock.advance(3_600_000);
    const probe = async (id: string) =>
      (await cloud.executorFor(id).execute("systemctl is-system-running")).exitCode;
    expect(await Promise.all(["stub-vm-1", "stub-vm-2", "stub-vm-3", "stub-vm-4"].map(probe))).toEqual([
      0, 1, 0, 1,
    ]);
    const viaSudo = await cloud.executorFor("stub-vm-2").execute("sudo systemctl is-system-running");
    expect(viaSudo.exitCode).toBe(1);
    const secret = await cloud.executorFor("stub-vm-2").execute(IDENTITY_COMMAND);
    expect(secret.stdout.toString()).toBe(cloud.vm("stub-vm-2")?.secret);
  });

  it("runnerMissing: the runner cannot be installed and is never found", async () => {
    const { set, cloud } = setup({ runnerMissing: { rate: 0.5 } });
    await creates(set, 200);
    const missing = cloud.liveVms().filter((vm) => vm.runnerMissing);
    expect(missing.length).toBeGreaterThanOrEqual(70);
    expect(missing.length).toBeLessThanOrEqual(130);
    const path = "/tmp/dispatch-cloud/crunch-run~00ff";
    const install = `mkdir -p /tmp/dispatch-cloud && cat >${path}.tmp && chmod 0755 ${path}.tmp && mv ${path}.tmp ${path}`;
    for (const vm of cloud.liveVms()) {
      const exec = cloud.executorFor(vm.id);
      const res = await exec.execute(install, { stdin: Buffer.from("binary") });
      expect(res.exitCode).toBe(vm.runnerMissing ? 2 : 0);
      expect((await exec.execute(`${path} --list`)).exitCode).toBe(vm.runnerMissing ? 127 : 0);
    }
  });

  it("runnerCrashRate: that share of detached runners die at once and are not listed", async () => {
    const { set, cloud } = setup({ runnerCrashRate: 0.25 });
    await create(set);
    const vm = cloud.liveVms()[0];
    if (vm === undefined) throw new Error("no VM");
    vm.files.set("/opt/crunch-run~1", Buffer.from("bin"));
    const exec = cloud.executorFor(vm.id);
    for (let i = 0; i < 1000; i++) {
      const res = await exec.execute(`/opt/crunch-run~1 --detach zzzzz-bndl-${i}`, { stdin: "{}" });
      expect(res.exitCode).toBe(0);
    }
    const crashed = cloud.runners("exited").length;
    console.log(`runnerCrashRate 0.25: ${crashed} of 1000 runners crashed`);
    expect(crashed).toBeGreaterThanOrEqual(200);
    expect(crashed).toBeLessThanOrEqual(300);
    const listed = (await exec.execute("/opt/crunch-run~1 --list")).stdout.toString().trim().split("\n");
    expect(listed).toHaveLength(1000 - crashed);
  });

  it("runnerDetachDelay: --detach takes that long on the clock; a shorter timeout is ssh.timeout", async () => {
    const { set, cloud, clock } = setup({ runnerDetachDelay: 5000 });
    const inst = await create(set);
    cloud.vm(inst.id)?.files.set("/opt/crunch-run", Buffer.from("bin"));
    const exec = cloud.executorFor(inst);
    let done = false;
    const detach = exec.execute("/opt/crunch-run --detach u1", { stdin: "{}" }).then((r) => {
      done = true;
      return r;
    });
    await clock.advance(4999);
    expect(done).toBe(false);
    expect((await exec.execute("/opt/crunch-run --list")).stdout.toString()).toBe("u1\n");
    await clock.advance(1);
    expect((await detach).stdout.toString()).toBe('{"uuid":"u1","pid":1000}\n');

    const timedOut = exec.execute("/opt/crunch-run --detach u2", { stdin: "{}", timeoutMs: 1000 });
    const check = expect(timedOut).rejects.toMatchObject({ code: "ssh.timeout" });
    await clock.advance(1000);
    await check;
    expect((await exec.execute("/opt/crunch-run --list")).stdout.toString()).toBe("u1\nu2\n");
  });

  it("runnersIgnoreTerm: --kill 15 leaves them running, --kill 9 ends them", async () => {
    const { set, cloud } = setup({ runnersIgnoreTerm: true });
    const inst = await create(set);
    const vm = cloud.vm(inst.id);
    vm?.files.set("/opt/crunch-run", Buffer.from("bin"));
    const exec = cloud.executorFor(inst);
    await exec.execute("/opt/crunch-run --detach u1", { stdin: "{}" });
    const kills: string[] = [];
    vm?.on("runner:kill", (r, sig) => kills.push(`${r.uuid}:${sig}`));
    expect((await exec.execute("/opt/crunch-run --kill 15 u1")).exitCode).toBe(1);
    expect((await exec.execute("/opt/crunch-run --list")).stdout.toString()).toBe("u1\n");
    expect((await exec.execute("/opt/crunch-run --kill 9 u1")).exitCode).toBe(0);
    expect((await exec.execute("/opt/crunch-run --list")).stdout.toString()).toBe("");
    expect(kills).toEqual(["u1:TERM", "u1:KILL"]);
    expect(vm?.runners.get("u1")).toMatchObject({ state: "exited", signal: "KILL" });
  });

  it("staleTagsFor: lists show the tags from before the last setTags for a while", async () => {
    const { set, clock } = setup({ staleTagsFor: 10_000 });
    const inst = await set.create(SMALL, "img", { IdleBehavior: "run" }, "", "key");
    await inst.setTags({ IdleBehavior: "hold" });
    expect((await set.instances({}))[0]?.tags).toEqual({ IdleBehavior: "run" });
    expect(await set.instances({ IdleBehavior: "hold" })).toEqual([]);
    await clock.advance(9999);
    expect((await set.instances({}))[0]?.tags).toEqual({ IdleBehavior: "run" });
    await clock.advance(1);
    expect((await set.instances({}))[0]?.tags).toEqual({ IdleBehavior: "hold" });
  });

  it("destroyedVmsLinger: a destroyed VM stays listed for a while, answers nothing, its runners die", async () => {
    const { set, cloud, clock } = setup({ destroyedVmsLinger: 30_000 });
    const inst = await create(set);
    const vm = cloud.vm(inst.id);
    vm?.files.set("/opt/crunch-run", Buffer.from("bin"));
    const exec = cloud.executorFor(inst);
    await exec.execute("/opt/crunch-run --detach u1", { stdin: "{}" });
    await inst.destroy();
    expect(cloud.liveCount).toBe(0);
    expect(vm?.runners.get("u1")).toMatchObject({ state: "exited", signal: "KILL" });
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.connect_failed" });
    await clock.advance(29_999);
    expect((await set.instances({})).map((i) => i.id)).toEqual([inst.id]);
    await clock.advance(1);
    expect(await set.instances({})).toEqual([]);
    expect(cloud.vm(inst.id)).toBeUndefined();
  });
});

describe("stub runners", () => {
  it("calls onRunnerStart with the stdin document; finishRunner ends the runner", async () => {
    const starts: unknown[] = [];
    const { set, cloud } = setup({
      onRunnerStart: (vm, uuid, doc) => {
        starts.push({ vm: vm.id, uuid, doc });
      },
    });
    const inst = await create(set);
    const vm = cloud.vm(inst.id);
    if (vm === undefined) throw new Error("no VM");
    vm.files.set("/opt/crunch-run", Buffer.from("bin"));
    const exec = cloud.executorFor(inst);
    const res = await exec.execute("/opt/crunch-run --detach --stdin-config --runtime-engine=docker u1", {
      stdin: JSON.stringify({ token: "dcr_x" }),
    });
    expect(JSON.parse(res.stdout.toString())).toEqual({ uuid: "u1", pid: 1000 });
    expect(starts).toEqual([{ vm: inst.id, uuid: "u1", doc: { token: "dcr_x" } }]);
    const exits: string[] = [];
    cloud.on("runner:exit", (v, r) => exits.push(`${v.id}:${r.uuid}:${r.exitCode}`));
    vm.finishRunner("u1", 3);
    expect(exits).toEqual([`${inst.id}:u1:3`]);
    expect(cloud.runners().map(({ runner }) => runner.state)).toEqual(["exited"]);

    cloud.knobs.onRunnerStart = async () => {
      throw new Error("harness failed");
    };
    const hookError = once(cloud, "hook:error");
    await exec.execute("/opt/crunch-run --detach u2", { stdin: "{}" });
    expect(((await hookError)[0] as Error).message).toBe("harness failed");
  });
});
