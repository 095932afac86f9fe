/**
 * End to end "on EC2": the dispatcher runs with the ec2 driver, whose real SDK talks to the fake EC2 endpoint
 * (test/fake-ec2.ts); each EC2 instance is a local VM with its own sshd on its own 127.0.8.x address (its private
 * IP), booted with the UserData the driver sent; bundles run in real Docker containers.
 *
 * With faults on (20 % of all EC2 requests throttled, the cheapest type always at capacity, a quota of 5
 * instances) 50 bundles all reach ready, and the driver-operation metrics count each class of error. A spot
 * interruption notice (the fake IMDS) during a running bundle requeues it, and it completes on another instance.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type BundleView, E2eSystem, until } from "./e2e-harness.ts";
import { FakeEc2 } from "./fake-ec2.ts";
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
  ].join("\n");
}

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

  afterAll(async () => {
    await sys?.stop();
    await fake?.stop();
    await imds?.stop();
    if (vmDir !== undefined) await rm(vmDir, { recursive: true, force: true });
  }, 180_000);

  it("runs 50 bundles to ready through throttling, a type at capacity and a quota of 5", async () => {
    fake.faults.throttleRate = 0.2;
    // At least one throttled create whatever the random draws (a fast run makes few calls).
    fake.faults.next.push({ action: "RunInstances", code: "RequestLimitExceeded", status: 503 });
    fake.faults.typesAtCapacity = new Set(["m5.large"]);
    fake.faults.maxInstances = 5;
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
    // No instance of the type at capacity ever ran; the quota held (at most 5 at once, by the fake's call log)
    // and was reached.
    expect([...fake.instances.values()].some((i) => i.type === "m5.large")).toBe(false);
    let live = 0;
    let peak = 0;
    const terminated = new Set<string>();
    for (const c of fake.calls) {
      if (c.code !== null) continue;
      if (c.action === "RunInstances") peak = Math.max(peak, ++live);
      if (c.action !== "TerminateInstances") continue;
      for (const [k, id] of Object.entries(c.params)) {
        if (k.startsWith("InstanceId.") && !terminated.has(id)) {
          terminated.add(id);
          live--;
        }
      }
    }
    expect(peak).toBe(5);
  }, 900_000);

  it("requeues a bundle whose spot instance gets an interruption notice; it completes on another", async () => {
    fake.faults.throttleRate = 0;
    fake.faults.maxInstances = 0;
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
  }, 600_000);
});
