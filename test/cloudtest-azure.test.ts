/**
 * `dispatch-cloud cloudtest` with the azure driver against the fake Resource Manager endpoint, whose VMs are
 * local VMs with their own sshd (OpenSSH) on 127.0.16.x: every step passes, the NIC was created before the VM,
 * and nothing (VM, NIC, disk) is left.
 */
import { chmod, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { azureDriverYaml } from "./azure-config.ts";
import { FakeArm } from "./fake-arm.ts";
import { requireOpenSsh } from "./local-driver-helpers.ts";
import { runBin } from "./serve-process.ts";

describe("cloudtest on the azure driver against the fake Resource Manager", () => {
  let fake: FakeArm;
  let dir: string;
  let user: string;

  beforeAll(async () => {
    user = requireOpenSsh();
    dir = await mkdtemp(join(tmpdir(), "dc-cloudtest-azure-"));
    await chmod(dir, 0o755); // the VMs' login user must reach their directories
    fake = await new FakeArm({
      localVms: { stateDir: join(dir, "vms"), user, addressPrefix: "127.0.16." },
    }).start();
  }, 60_000);

  afterAll(async () => {
    await fake?.stop();
    if (dir !== undefined) await rm(dir, { recursive: true, force: true });
  }, 60_000);

  it("passes every step; NIC before VM; the VM, its NIC and its disk are gone after", async () => {
    await writeFile(
      join(dir, "config.yml"),
      `clusterId: ct003
dataDir: ${dir}/data
logging: {level: warn}
cloud:
${azureDriverYaml(fake, user, "DC_CT_AZURE_SECRET")}
  timeoutBooting: 30s
  timeoutShutdown: 10s
  resourceTags: {Team: research}
instanceTypes:
  ct.small: {providerType: Standard_B2s, vcpus: 2, ram: 4GiB, price: 0.04}
`,
    );
    const r = await runBin(
      ["cloudtest", "--config", join(dir, "config.yml"), "--command", "cat /proc/version"],
      {
        ...process.env,
        DC_CT_AZURE_SECRET: "dc-secret",
      },
    );
    expect(r.stdout, r.stderr).toContain("cloudtest passed");
    expect(r.code).toBe(0);
    expect(r.stdout).toMatch(/create an instance of type ct\.small \(Standard_B2s\): ok/);
    expect(r.stdout).toMatch(/\| Linux version/);
    expect(r.stdout).toMatch(/see it gone from the list: ok/);
    expect(r.stdout + r.stderr).not.toContain("dc-secret");

    const puts = fake.calls.filter((c) => c.method === "PUT" && c.code === null);
    const nicAt = puts.findIndex((c) => c.path.includes("/networkInterfaces/"));
    const vmAt = puts.findIndex((c) => c.path.includes("/virtualMachines/"));
    expect(nicAt).toBeGreaterThanOrEqual(0);
    expect(vmAt).toBeGreaterThan(nicAt);
    expect(fake.vms.size).toBe(0);
    expect(fake.nics.size).toBe(0);
    expect(fake.disks.size).toBe(0);
  }, 150_000);
});
