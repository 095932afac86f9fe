/**
 * `dispatch-cloud cloudtest` with the ec2 driver against the fake EC2 endpoint, whose instances are local VMs
 * with their own sshd (OpenSSH) on 127.0.9.x: every step passes, and the fake saw the instance created with the
 * dispatcher's tags and then terminated.
 */
import { chmod, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { FakeEc2 } from "./fake-ec2.ts";
import { requireOpenSsh } from "./local-driver-helpers.ts";
import { runBin } from "./serve-process.ts";

describe("cloudtest on the ec2 driver against the fake EC2", () => {
  let fake: FakeEc2;
  let dir: string;
  let user: string;

  beforeAll(async () => {
    user = requireOpenSsh();
    dir = await mkdtemp(join(tmpdir(), "dc-cloudtest-ec2-"));
    await chmod(dir, 0o755); // the VMs' login user must reach their directories
    fake = await new FakeEc2({
      localVms: { stateDir: join(dir, "vms"), user, addressPrefix: "127.0.9." },
      terminatedLingerMs: 200,
    }).start();
  }, 60_000);

  afterAll(async () => {
    await fake?.stop();
    if (dir !== undefined) await rm(dir, { recursive: true, force: true });
  }, 60_000);

  function run(): Promise<{ code: number; stdout: string; stderr: string }> {
    return runBin(["cloudtest", "--config", join(dir, "config.yml"), "--command", "cat /proc/version"], {
      ...process.env,
      DC_CT_AWS_SECRET: "cloudtest-secret-not-real",
    });
  }

  it("passes every step; the instance was created tagged, with IMDSv2 required, and terminated", async () => {
    await writeFile(
      join(dir, "config.yml"),
      `clusterId: ct002
dataDir: ${dir}/data
logging: {level: warn}
cloud:
  driver: ec2
  imageId: ami-0cloudtest000000
  driverParameters:
    region: us-east-1
    endpoint: "${fake.url}"
    accessKeyId: AKIACLOUDTEST
    secretAccessKey: env:DC_CT_AWS_SECRET
    subnetId: subnet-0a
    securityGroupIds: [sg-0cloudtest]
    adminUsername: ${user}
  timeoutBooting: 30s
  timeoutShutdown: 10s
  resourceTags: {Team: research}
instanceTypes:
  ct.small: {providerType: t3.small, vcpus: 2, ram: 2GiB, price: 0.02}
`,
    );
    const r = await run();
    expect(r.stdout, r.stderr).toContain("cloudtest passed");
    expect(r.code).toBe(0);
    expect(r.stdout).toMatch(/create an instance of type ct\.small \(t3\.small\): ok/);
    expect(r.stdout).toMatch(/connect over SSH and verify the instance secret: ok/);
    expect(r.stdout).toMatch(/\| Linux version/);
    expect(r.stdout).toMatch(/see it gone from the list: ok/);
    // The secret key never shows.
    expect(r.stdout + r.stderr).not.toContain("cloudtest-secret-not-real");

    const created = [...fake.instances.values()];
    expect(created).toHaveLength(1);
    const inst = created[0]!;
    expect(inst.type).toBe("t3.small");
    expect(inst.imageId).toBe("ami-0cloudtest000000");
    expect(inst.tags["DispatchCloudInstanceSetID"]).toBe("ct002");
    expect(inst.tags["DispatchCloudInstanceType"]).toBe("ct.small");
    expect(inst.tags["Team"]).toBe("research");
    expect(inst.state === "terminated" || inst.state === "shutting-down").toBe(true);
    expect(inst.userData).toContain("dispatch-cloud-instance-secret");
    const terminated = fake.calls.filter((c) => c.action === "TerminateInstances" && c.code === null);
    expect(terminated.length).toBeGreaterThan(0);
  }, 150_000);
});
