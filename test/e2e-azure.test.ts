/**
 * End to end "on Azure": the dispatcher (its own process, apart from the REST server, so that it can be killed)
 * runs with the azure driver, whose real SDK clients talk to the fake Resource Manager endpoint (test/fake-arm.ts,
 * HTTPS with its own CA); each VM is a local VM with its own sshd on 127.0.15.x (its NIC's private IP), booted with
 * the customData the driver sent; bundles run in real Docker.
 *
 * With faults on (5 % of ARM requests throttled with Retry-After, plus one throttled VM create and one throttled
 * status poll of a VM create; 3 % of the answers to PUTs, PATCHes and DELETEs lost after the work was done, plus one
 * lost VM create answer; 5 % of NIC PUTs and DELETEs refused because another operation holds the NIC, plus one;
 * the cheapest size failing its allocation after being accepted; a quota of 3 VMs; one VM create failing after
 * acceptance; a type with an added scratch data disk) 50 bundles all reach ready, each run once, the
 * driver-operation metrics count the error classes, and once the instances are gone no VM, NIC or disk is left. A
 * spot eviction (a Preempt event in the VM's Scheduled Events, from the fake metadata service) during a running
 * bundle requeues it, and it completes on another VM. A dispatcher killed while the answer to its VM create is
 * held is replaced; the new one adopts that VM and runs the bundle on it, once.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { azureDriverYaml } from "./azure-config.ts";
import { type BundleView, E2eSystem, until } from "./e2e-harness.ts";
import { FakeArm } from "./fake-arm.ts";
import { FakeImds } from "./fake-imds.ts";
import { requireDockerImage, requireOpenSsh } from "./local-driver-helpers.ts";

const IMAGE = requireDockerImage();
const COMPUTE_OPERATION = /\/Microsoft\.Compute\/locations\/[^/]+\/operations\//;
const VM_PATH = /\/virtualMachines\/[^/]+$/;
const NIC_PATH = /\/networkInterfaces\/[^/]+$/;

describe("end to end on the fake Azure Resource Manager with faults switched on", () => {
  let fake: FakeArm;
  let imds: FakeImds;
  let sys: E2eSystem;
  let vmDir: string;

  beforeAll(async () => {
    const user = requireOpenSsh();
    process.env["DC_E2E_AZURE_SECRET"] = "dc-secret";
    vmDir = await mkdtemp(join(tmpdir(), "dc-e2e-azure-vms-"));
    imds = await new FakeImds({ cloud: "azure" }).start();
    fake = await new FakeArm({
      localVms: { stateDir: vmDir, user, addressPrefix: "127.0.15." },
      imds,
    }).start();
    sys = await E2eSystem.start({
      database: "pg",
      split: true,
      sshServer: "openssh",
      runtimeEngine: "docker",
      management: true,
      maxInstances: 10,
      timeoutIdle: "3s",
      driverYaml: azureDriverYaml(fake, user, "DC_E2E_AZURE_SECRET"),
      cloudYaml: ["  maxRunningBundlesPerInstance: 4", "  spotInterruptionCheckInterval: 500ms"].join("\n"),
      instanceTypesYaml: [
        // The cheapest: its allocations always fail. medium is within maximumPriceFactor (1.5) of it.
        "  small:",
        "    providerType: Standard_D2s_v3",
        "    vcpus: 4",
        "    ram: 4GiB",
        "    price: 0.05",
        "  medium:",
        "    providerType: Standard_F4s_v2",
        "    vcpus: 4",
        "    ram: 8GiB",
        "    addedScratch: 1GiB",
        "    price: 0.07",
        "  spotty:",
        "    providerType: Standard_F8s_v2",
        "    vcpus: 8",
        "    ram: 16GiB",
        "    price: 0.12",
        "    preemptible: true",
      ].join("\n"),
    });
  }, 180_000);

  afterAll(async () => {
    await sys?.stop();
    await fake?.stop();
    await imds?.stop();
    if (vmDir !== undefined) await rm(vmDir, { recursive: true, force: true });
  }, 180_000);

  /**
   * Bundles whose command ran more than once, or that ended at another attempt than the first for another reason
   * than a container the runtime could not create: each with its events
   * and the dispatcher's log lines about it (for the failure message).
   */
  async function ranTwice(uuids: readonly string[]): Promise<string[]> {
    const twice: string[] = [];
    for (const uuid of uuids) {
      const events = await sys.json<{
        items: { fromState: string; toState: string; reason: string | null }[];
      }>("GET", `/bundles/${uuid}/events`);
      const b = await sys.get(uuid);
      // The one requeue that does not count as a run: the container runtime could not even create the
      // container (seen under heavy load: "runc create failed"), so the command never ran.
      const runs = events.items.filter((e) => e.toState === "running").length;
      const neverRan = events.items.filter(
        (e) =>
          e.fromState === "running" &&
          e.toState === "staged" &&
          /the container runtime failed: .*runc create failed/.test(e.reason ?? ""),
      ).length;
      if (runs - neverRan === 1 && (b.attempt === 1 || neverRan > 0)) continue;
      const log = sys
        .output()
        .split("\n")
        .filter((l) => l.includes(uuid))
        .slice(-40);
      twice.push(
        `${uuid} (attempt ${b.attempt}): ${events.items.map((e) => `${e.fromState}->${e.toState} ${e.reason ?? ""}`).join("; ")}\n${log.join("\n")}`,
      );
    }
    return twice;
  }

  /** Waits until the fake has no VM, NIC or disk; names what is left if it does not happen. */
  async function nothingLeft(ms: number): Promise<void> {
    await until(
      "every VM, NIC and disk gone",
      () => (fake.vms.size === 0 && fake.nics.size === 0 && fake.disks.size === 0 ? true : undefined),
      ms,
    ).catch((err: unknown) => {
      const left = {
        vms: [...fake.vms.keys()],
        nics: [...fake.nics.keys()],
        disks: [...fake.disks.keys()],
      };
      throw new Error(`${(err as Error).message}: left ${JSON.stringify(left)}`);
    });
  }

  it("runs 50 bundles to ready, each once; every VM, NIC and disk is gone once the instances are", async () => {
    fake.faults.throttleRate = 0.05;
    fake.faults.retryAfterSeconds = 1;
    fake.faults.lostAnswerRate = 0.03;
    fake.faults.anotherOperationRate = 0.05;
    // Whatever the rates hit: one VM create whose answer is lost after the VM was made, and one NIC delete refused
    // because another operation holds the NIC.
    fake.faults.lostAnswers.push({ method: "PUT", path: VM_PATH, mode: "drop" });
    fake.faults.next.push({
      method: "DELETE",
      path: NIC_PATH,
      status: 429,
      code: "RetryableErrorDueToAnotherOperation",
      message:
        "Operation DeleteNetworkInterfaceOperation (e2e) is updating the NIC. The call can be retried in 1 seconds.",
      retryAfter: 1,
    });
    fake.faults.sizeErrors = new Map([["Standard_D2s_v3", "AllocationFailed"]]);
    // Well under what 50 bundles of 4 per VM ask for, so the quota is reached even when they run fast (as on EC2).
    // The creates are one at a time (maxConcurrentInstanceCreateOps 1): the one past the quota comes once the
    // second VM's create is done, while most of the 50 still wait. With 3, under CI's load, the first three VMs
    // once ran the queue down before a fourth was asked for, and the quota was never reached.
    fake.faults.maxVms = 2;
    fake.faults.failAfterAccept = { code: "InternalServerError", count: 1 };
    // Whatever the 5 % hit: one VM create is refused with 429 (the pool waits Retry-After), and one status poll
    // of a VM create is throttled (that create polls again, not failing).
    fake.faults.next.push({
      method: "PUT",
      path: /\/virtualMachines\/[^/]+$/,
      status: 429,
      code: "TooManyRequests",
      retryAfter: 1,
    });
    fake.faults.next.push({
      method: "GET",
      path: COMPUTE_OPERATION,
      status: 429,
      code: "TooManyRequests",
      retryAfter: 1,
    });
    const uuids: string[] = [];
    for (let i = 0; i < 50; i++) {
      uuids.push(
        await sys.submit({
          name: `azure-${i}`,
          image: IMAGE,
          command: ["sh", "-c", `sleep 1; echo ${i} > /out/n`],
          resources: { vcpus: 1, ram: "256MiB" },
        }),
      );
    }
    const done: BundleView[] = [];
    for (const uuid of uuids) {
      done.push(await sys.waitState(uuid, ["ready"], 600_000));
      // While the first bundles run, the medium VMs have their added scratch disk (an attached data disk).
      if (done.length === 1) {
        const scratch = [...fake.disks.values()].filter((d) => d.name.endsWith("-scratch"));
        expect(scratch.length).toBeGreaterThan(0);
        expect(scratch.every((d) => d.createOption === "Empty" && d.sizeGb === 1)).toBe(true);
      }
    }
    expect(done.map((b) => b.state)).toEqual(uuids.map(() => "ready"));
    for (const [i, uuid] of uuids.entries()) {
      expect((await sys.text(`/bundles/${uuid}/outputs/n`)).body.trim()).toBe(String(i));
    }

    expect(fake.calls.some((c) => c.status === 429 && COMPUTE_OPERATION.test(c.path))).toBe(true);
    const codes = new Set(fake.calls.map((c) => c.code));
    expect(codes).toContain("TooManyRequests");
    expect(codes).toContain("OperationNotAllowed");
    const errors = (code: string) =>
      sys.metricSum("dispatchcloud_driver_errors_total", { driver: "azure", code });
    expect(await errors("cloud.rate_limit")).toBeGreaterThan(0);
    expect(await errors("cloud.capacity")).toBeGreaterThan(0);
    expect(await errors("cloud.quota")).toBeGreaterThan(0);
    expect(
      [...fake.vms.values()].some((v) => v.size === "Standard_D2s_v3" && v.provisioningState === "Succeeded"),
    ).toBe(false);
    expect(await ranTwice(uuids)).toEqual([]);
    // The faults were met: lost answers (the driver found that VM and used it, or deleted it), busy NICs.
    expect(fake.calls.some((c) => c.lost !== undefined && c.method === "PUT" && VM_PATH.test(c.path))).toBe(
      true,
    );
    expect(codes).toContain("RetryableErrorDueToAnotherOperation");
    // A busy NIC is no rate limit: that call was sent again (the one-shot's NIC delete went through after it).
    const nicDeletes = fake.calls.filter((c) => c.method === "DELETE" && NIC_PATH.test(c.path));
    expect(nicDeletes[0]?.code).toBe("RetryableErrorDueToAnotherOperation");
    expect(nicDeletes.slice(1).some((c) => c.path === nicDeletes[0]?.path && c.status < 400)).toBe(true);

    // No more faults: the idle instances go (timeoutIdle 3s), and with them every NIC and disk, including those
    // of the creates that failed after the NIC existed.
    fake.faults.throttleRate = 0;
    fake.faults.lostAnswerRate = 0;
    fake.faults.anotherOperationRate = 0;
    fake.releaseLostAnswers();
    await nothingLeft(120_000);
  }, 900_000);

  it("requeues a bundle whose spot VM is being evicted; it completes on another", async () => {
    fake.faults.throttleRate = 0;
    fake.faults.maxVms = 0;
    const uuid = await sys.submit({
      name: "spot",
      image: IMAGE,
      command: ["sh", "-c", "sleep 8; echo survived > /out/x"],
      resources: { vcpus: 1, ram: "256MiB" },
      preemptible: true,
    });
    const first = await sys.waitState(uuid, ["running"], 300_000);
    const vmName = String(first["instanceId"]);
    expect(fake.vms.get(vmName)?.priority).toBe("Spot");
    await until("crunch-run reading the VM's Scheduled Events", () =>
      imds.polled(vmName) ? true : undefined,
    );
    fake.interrupt(vmName);
    const final = await sys.waitState(uuid, ["ready"], 300_000);
    expect(final.attempt).toBe(2);
    expect(final["instanceId"]).not.toBe(vmName);
    expect(await sys.requeueReason(uuid)).toMatch(
      /^preempted: spot interruption notice \(preempt at .* GMT\)$/,
    );
    expect((await sys.text(`/bundles/${uuid}/outputs/x`)).body.trim()).toBe("survived");
    // The evicted VM is deleted by the dispatcher (Azure would delete it anyway: evictionPolicy Delete).
    await until("the evicted VM deleted", () => (fake.vms.has(vmName) ? undefined : true), 120_000);
  }, 600_000);

  it("a dispatcher killed while its VM create's answer is held: the next one adopts that VM; the bundle runs on it once", async () => {
    Object.assign(fake.faults, { throttleRate: 0, lostAnswerRate: 0, anotherOperationRate: 0, maxVms: 0 });
    fake.faults.sizeErrors = new Map();
    await nothingLeft(120_000);
    const callsBefore = fake.calls.length;
    const putsBefore = fake.calls.filter((c) => c.method === "PUT" && VM_PATH.test(c.path)).length;
    fake.faults.lostAnswers.push({ method: "PUT", path: VM_PATH, mode: "hold" });
    const uuid = await sys.submit({
      name: "adopted",
      image: IMAGE,
      command: ["sh", "-c", "echo once >> /out/n"],
      resources: { vcpus: 1, ram: "256MiB" },
    });
    const held = await until("the VM create done, its answer held", () =>
      fake.calls
        .slice(callsBefore)
        .find((c) => c.lost === "hold" && c.method === "PUT" && VM_PATH.test(c.path)),
    );
    const vmName = held.path.split("/").at(-1)!;
    expect(fake.vms.has(vmName)).toBe(true);
    // The dispatcher never learns that its create was done; the VM is in no dispatcher's memory.
    await sys.killDispatcher();
    await sys.startDispatcher();
    const done = await sys.waitState(uuid, ["ready"], 300_000);
    expect(done.attempt).toBe(1);
    expect(done["instanceId"]).toBe(vmName);
    expect(await ranTwice([uuid])).toEqual([]);
    expect((await sys.text(`/bundles/${uuid}/outputs/n`)).body).toBe("once\n");
    // Exactly one VM was made for it: the adopted one.
    expect(fake.calls.filter((c) => c.method === "PUT" && VM_PATH.test(c.path)).length - putsBefore).toBe(1);
    await nothingLeft(120_000);
  }, 600_000);
});
