/**
 * End to end "on EC2": the dispatcher runs with the ec2 driver, whose real SDK talks to the fake EC2 endpoint
 * (test/fake-ec2.ts); each EC2 instance is a local VM with its own sshd on its own 127.0.8.x address (its private
 * IP), booted with the UserData the driver sent; bundles run in real Docker containers.
 *
 * With faults on (20 % of all EC2 requests throttled, the cheapest type always at capacity, a quota of 5
 * instances that recently terminated ones still count toward, 10 % of the answers to RunInstances, CreateTags and
 * TerminateInstances lost after the work was done, new instances missing from lists and unknown to CreateTags and
 * TerminateInstances for a few seconds) 50 bundles all reach ready, each run once, the driver-operation metrics
 * count each class of error, and no instance is left behind. A RunInstances whose answer is lost once is sent
 * again with the same ClientToken: one instance, which the bundle runs on; lost twice, the instance (tagged at
 * launch) is adopted from the list and ends used or terminated, never invisible. A spot interruption notice (the
 * fake IMDS) during a running bundle requeues it, and it completes on another instance.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type BundleView, E2eSystem, until } from "./e2e-harness.ts";
import { type Ec2Faults, FakeEc2 } from "./fake-ec2.ts";
import { FakeImds } from "./fake-imds.ts";
import { requireDockerImage, requireOpenSsh } from "./local-driver-helpers.ts";

const IMAGE = requireDockerImage();
const ADDRESS_PREFIX = "127.0.8.";

/** The ec2 driver's lines of the config, pointing at the fake. */
function ec2DriverYaml(fake: FakeEc2, user: string): string {
  return [
    "  driver: ec2",
    "  imageId: ami-0123456789abcdef0",
    "  driverParameters:",
    "    region: us-east-1",
    `    endpoint: "${fake.url}"`,
    "    accessKeyId: AKIAE2ETESTKEY",
    "    secretAccessKey: env:DC_E2E_AWS_SECRET",
    "    subnetId: [subnet-0a, subnet-0b, subnet-0c]",
    "    securityGroupIds: [sg-0e2e]",
    `    adminUsername: ${user}`,
    // Short enough that an answer held until the client gives up costs little time.
    "    requestTimeout: 10s",
  ].join("\n");
}

/** EC2's eventual consistency and lost answers, at a realistic rate. */
const REALISTIC: Partial<Ec2Faults> = {
  lostAnswerRate: 0.1,
  lostAnswerActions: new Set(["RunInstances", "CreateTags", "TerminateInstances"]),
  lostAnswerMode: "drop",
  listDelayMs: 3000,
  tagNotFoundMs: 3000,
  terminateNotFoundMs: 2000,
  terminatedCountMs: 3000,
};

const LIVE = new Set(["pending", "running"]);

describe("end to end on the fake EC2 with faults switched on", () => {
  let fake: FakeEc2;
  let imds: FakeImds;
  let sys: E2eSystem;
  let vmDir: string;

  beforeAll(async () => {
    const user = requireOpenSsh();
    process.env["DC_E2E_AWS_SECRET"] = "e2e-secret-access-key-not-real";
    vmDir = await mkdtemp(join(tmpdir(), "dc-e2e-ec2-vms-"));
    imds = await new FakeImds().start();
    fake = await new FakeEc2({
      localVms: { stateDir: vmDir, user, addressPrefix: ADDRESS_PREFIX },
      imds,
      terminatedLingerMs: 500,
    }).start();
    sys = await E2eSystem.start({
      database: "pg",
      sshServer: "openssh",
      runtimeEngine: "docker",
      management: true,
      maxInstances: 10,
      timeoutIdle: "3s",
      driverYaml: ec2DriverYaml(fake, user),
      cloudYaml: ["  maxRunningBundlesPerInstance: 4", "  spotInterruptionCheckInterval: 500ms"].join("\n"),
      instanceTypesYaml: [
        // The cheapest: always at capacity on the fake. medium is within maximumPriceFactor (1.5) of it.
        "  small:",
        "    providerType: m5.large",
        "    vcpus: 4",
        "    ram: 4GiB",
        "    price: 0.05",
        "  medium:",
        "    providerType: c5.xlarge",
        "    vcpus: 4",
        "    ram: 8GiB",
        "    price: 0.07",
        "  spotty:",
        "    providerType: c5.2xlarge",
        "    vcpus: 8",
        "    ram: 16GiB",
        "    price: 0.12",
        "    preemptible: true",
      ].join("\n"),
    });
  }, 180_000);

  async function eventsOf(uuid: string) {
    type Event = { fromState: string | null; toState: string; reason: string | null };
    return (await sys.json<{ items: Event[] }>("GET", `/bundles/${uuid}/events`)).items;
  }

  /**
   * Asserts the bundle ran once: the one requeue allowed is its runner's when the container runtime could not even
   * start the container (this machine's Docker under load), when its command did not run. Returns the instances it
   * went to running on, in order.
   */
  async function ranOnce(done: BundleView): Promise<string[]> {
    const events = await eventsOf(done.uuid);
    const requeues = events.filter((e) => e.fromState === "running" && e.toState === "staged");
    for (const r of requeues) expect(r.reason).toMatch(/the container runtime failed: .*runc create failed/);
    expect(events.filter((e) => e.toState === "running")).toHaveLength(requeues.length + 1);
    const on = requeues.map((r) => /on instance (\S+):/.exec(r.reason ?? "")?.[1] ?? "");
    return [...on, String(done["instanceId"])];
  }

  /** Waits until the fake has no pending or running instance; returns how many it has launched in all. */
  async function noInstanceLeft(ms = 180_000): Promise<number> {
    await until(
      "every instance terminated",
      () => ([...fake.instances.values()].some((i) => LIVE.has(i.state)) ? undefined : true),
      ms,
    );
    return fake.instances.size;
  }

  afterAll(async () => {
    await sys?.stop();
    await fake?.stop();
    await imds?.stop();
    if (vmDir !== undefined) await rm(vmDir, { recursive: true, force: true });
  }, 180_000);

  it("runs 50 bundles to ready, each once, through throttling, capacity, a quota, lost answers and EC2's eventual consistency", async () => {
    Object.assign(fake.faults, REALISTIC);
    // Few mutating calls are made (instances are reused): at least one lost answer of each kind, whatever the draws.
    fake.faults.loseNext.push({ action: "RunInstances" }, { action: "TerminateInstances" });
    fake.faults.throttleRate = 0.2;
    // At least one throttled create whatever the random draws (a fast run makes few calls).
    fake.faults.next.push({ action: "RunInstances", code: "RequestLimitExceeded", status: 503 });
    fake.faults.typesAtCapacity = new Set(["m5.large"]);
    // Well under what 50 bundles of 4 per instance ask for, so the quota is reached even when they run fast.
    fake.faults.maxInstances = 3;
    const uuids: string[] = [];
    for (let i = 0; i < 50; i++) {
      uuids.push(
        await sys.submit({
          name: `ec2-${i}`,
          image: IMAGE,
          command: ["sh", "-c", `sleep 1; echo ${i} > /out/n`],
          resources: { vcpus: 1, ram: "256MiB" },
        }),
      );
    }
    const done: BundleView[] = [];
    for (const uuid of uuids) done.push(await sys.waitState(uuid, ["ready"], 600_000));
    expect(done.map((b) => b.state)).toEqual(uuids.map(() => "ready"));
    for (const [i, uuid] of uuids.entries()) {
      const out = await sys.text(`/bundles/${uuid}/outputs/n`);
      expect(out.body.trim()).toBe(String(i));
    }
    // No bundle ran twice.
    for (const b of done) await ranOnce(b);

    // The fake refused what it was told to refuse, and the dispatcher counted each class of error.
    const codes = new Set(fake.calls.map((c) => c.code));
    expect(codes).toContain("RequestLimitExceeded");
    expect(codes).toContain("InsufficientInstanceCapacity");
    expect(codes).toContain("InstanceLimitExceeded");
    const errors = (code: string) =>
      sys.metricSum("dispatchcloud_driver_errors_total", { driver: "ec2", code });
    expect(await errors("cloud.rate_limit")).toBeGreaterThan(0);
    expect(await errors("cloud.capacity")).toBeGreaterThan(0);
    expect(await errors("cloud.quota")).toBeGreaterThan(0);
    // No instance of the type at capacity ever ran; the quota held (at most 3 at once, by the fake's history)
    // and was reached.
    expect([...fake.instances.values()].some((i) => i.type === "m5.large")).toBe(false);
    let live = 0;
    let peak = 0;
    for (const h of fake.history) {
      live += h.event === "launched" ? 1 : -1;
      peak = Math.max(peak, live);
    }
    expect(peak).toBe(3);
    // One instance per create: every instance has a secret of its own (a RunInstances sent again after a lost
    // answer, with its ClientToken, launched nothing more).
    const secrets = [...fake.instances.values()].map((i) => i.tags["DispatchCloudInstanceSecret"]);
    expect(new Set(secrets).size).toBe(secrets.length);

    // Nothing leaks: once idle, every instance is terminated, those whose create answers were lost included.
    await noInstanceLeft();
    // Answers were lost (at least the one-shots), and the work behind them done.
    const lostActions = new Set(fake.calls.filter((c) => c.lost !== null).map((c) => c.action));
    expect(lostActions).toContain("RunInstances");
    expect(lostActions).toContain("TerminateInstances");
  }, 900_000);

  it("a RunInstances answer lost once: sent again with the same ClientToken, one instance, and the bundle runs on it", async () => {
    await noInstanceLeft();
    fake.resetFaults();
    Object.assign(fake.faults, REALISTIC, { lostAnswerRate: 0 });
    const before = fake.instances.size;
    const from = fake.calls.length;
    fake.faults.loseNext.push({ action: "RunInstances", mode: "drop" });
    const uuid = await sys.submit({
      name: "lost-once",
      image: IMAGE,
      command: ["sh", "-c", "echo once > /out/x"],
      resources: { vcpus: 1, ram: "256MiB" },
    });
    const done = await sys.waitState(uuid, ["ready"], 300_000);
    // The create's two sends (the lost one, then the one with the same token) came first.
    const run = fake.calls.slice(from).filter((c) => c.action === "RunInstances" && c.code === null);
    expect(run.slice(0, 2).map((c) => c.lost)).toEqual(["drop", null]);
    const token = run[0]!.params["ClientToken"];
    expect(run[1]!.params["ClientToken"]).toBe(token);
    // One instance for that create, the first launched, and the bundle (first) ran on it: the create succeeded.
    const launched = [...fake.instances.values()].slice(before);
    expect(launched.filter((i) => i.params["ClientToken"] === token)).toHaveLength(1);
    expect(launched[0]!.params["ClientToken"]).toBe(token);
    const ranOn = await ranOnce(done);
    expect(ranOn[0]).toBe(launched[0]!.id);
    // Nothing more was launched for it (unless the container runtime failed and it had to move).
    if (ranOn.length === 1) expect(launched).toHaveLength(1);
    await noInstanceLeft();
  }, 600_000);

  it("a RunInstances answer lost twice: the create fails, and the instance is adopted from the list, then used or terminated", async () => {
    await noInstanceLeft();
    fake.resetFaults();
    Object.assign(fake.faults, REALISTIC, { lostAnswerRate: 0 });
    const from = fake.calls.length;
    fake.faults.loseNext.push(
      { action: "RunInstances", mode: "drop" },
      { action: "RunInstances", mode: "late" },
    );
    const uuid = await sys.submit({
      name: "lost-twice",
      image: IMAGE,
      command: ["sh", "-c", "echo twice > /out/x"],
      resources: { vcpus: 1, ram: "256MiB" },
    });
    const lostCall = await until("the RunInstances answers lost", () =>
      fake.calls.slice(from).find((c) => c.action === "RunInstances" && c.lost === "late"),
    );
    const token = lostCall.params["ClientToken"];
    expect(
      fake.calls
        .slice(from)
        .filter((c) => c.action === "RunInstances" && c.lost !== null)
        .map((c) => c.lost),
    ).toEqual(["drop", "late"]);
    const mine = [...fake.instances.values()].filter((i) => i.params["ClientToken"] === token);
    expect(mine).toHaveLength(1);
    const id = mine[0]!.id;
    // Never invisible: the dispatcher finds it in the cloud's list (tagged at launch) and manages it.
    await until(
      "the instance adopted by the dispatcher",
      async () => {
        const items = (await sys.manage<{ items: { instanceId: string }[] }>("GET", "/instances")).items;
        return items.some((w) => w.instanceId === id) ? true : undefined;
      },
      120_000,
    );
    await ranOnce(await sys.waitState(uuid, ["ready"], 300_000));
    // Used (the bundle ran on it) or not, it ends terminated; still exactly one instance for that create.
    await until(
      "the adopted instance terminated",
      () => (LIVE.has(fake.instances.get(id)?.state ?? "") ? undefined : true),
      180_000,
    );
    expect([...fake.instances.values()].filter((i) => i.params["ClientToken"] === token)).toHaveLength(1);
    await noInstanceLeft();
  }, 600_000);

  it("requeues a bundle whose spot instance gets an interruption notice; it completes on another", async () => {
    fake.resetFaults();
    Object.assign(fake.faults, REALISTIC);
    const uuid = await sys.submit({
      name: "spot",
      image: IMAGE,
      command: ["sh", "-c", "sleep 8; echo survived > /out/x"],
      resources: { vcpus: 1, ram: "256MiB" },
      preemptible: true,
    });
    const first = await sys.waitState(uuid, ["running"], 300_000);
    const instanceId = String(first["instanceId"]);
    expect(fake.instances.get(instanceId)?.spot).not.toBeNull();
    await until("crunch-run polling the instance's IMDS", () => (imds.polled(instanceId) ? true : undefined));
    fake.interrupt(instanceId);
    const final = await sys.waitState(uuid, ["ready"], 300_000);
    expect(final.attempt).toBe(2);
    expect(final["instanceId"]).not.toBe(instanceId);
    expect(await sys.requeueReason(uuid)).toMatch(/preempted/);
    expect((await sys.text(`/bundles/${uuid}/outputs/x`)).body.trim()).toBe("survived");
    // The interrupted instance is shut down (the cloud would terminate it anyway).
    await until("the interrupted instance terminated", () => {
      const state = fake.instances.get(instanceId)?.state;
      return state === undefined || state === "terminated" || state === "shutting-down" ? true : undefined;
    });
    await noInstanceLeft();
  }, 600_000);
});
