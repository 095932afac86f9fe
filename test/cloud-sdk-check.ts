/**
 * Whether a built program (the .cjs or the SEA) can load the ec2 and azure drivers' SDKs, which the build carries
 * apart from its code (scripts/build.ts LAZY_GROUPS): `cloudtest` against the fake EC2 and the fake Resource
 * Manager, whose instances are records without a VM, gets past create and list (and then cannot connect).
 */
import { execFile } from "node:child_process";
import { writeFile } from "node:fs/promises";
import path from "node:path";
import { promisify } from "node:util";
import { expect } from "vitest";
import { azureDriverYaml } from "./azure-config.ts";
import { FakeArm } from "./fake-arm.ts";
import { FakeEc2 } from "./fake-ec2.ts";

const run = promisify(execFile);

/** `command` runs the program (e.g. [node, file] or [exe]); config and data files go under `dir`. */
export async function cloudtestCreatesAndLists(command: string[], dir: string): Promise<void> {
  const ec2 = await new FakeEc2().start();
  const arm = await new FakeArm().start();
  try {
    const common = (driver: string) =>
      `clusterId: bt001\ndataDir: ${dir}/data-${driver}\nlogging: {level: warn}\ncloud:\n`;
    const tail = "  timeoutBooting: 1s\n  timeoutShutdown: 1s\ninstanceTypes:\n";
    const configs = {
      ec2: `${common("ec2")}  driver: ec2\n  imageId: ami-0123456789abcdef0\n  driverParameters:\n    region: us-east-1\n    endpoint: "${ec2.url}"\n    accessKeyId: AKIABUILDTEST\n    secretAccessKey: env:DC_BT_SECRET\n    subnetId: subnet-0a\n${tail}  bt.small: {providerType: t3.small, vcpus: 2, ram: 2GiB, price: 0.02}\n`,
      azure: `${common("azure")}${azureDriverYaml(arm, "dcvm", "DC_BT_SECRET")}\n${tail}  bt.small: {providerType: Standard_B2s, vcpus: 2, ram: 4GiB, price: 0.04}\n`,
    };
    for (const [driver, yaml] of Object.entries(configs)) {
      const config = path.join(dir, `cloudtest-${driver}.yml`);
      await writeFile(config, yaml);
      const secret = driver === "ec2" ? "not-a-real-aws-secret" : "dc-secret";
      // The instances are records without a VM: cloudtest gets past create and list, then cannot connect.
      const r = await run(command[0]!, [...command.slice(1), "cloudtest", "--config", config], {
        env: { ...process.env, DC_BT_SECRET: secret },
      }).catch((err: { stdout: string; stderr: string }) => err);
      expect(r.stdout, `${driver}: ${r.stderr}`).toMatch(
        /\[1\] create an instance of type bt\.small \([^)]+\): ok/,
      );
      expect(r.stdout, driver).toMatch(/see it listed with its tags: ok/);
    }
  } finally {
    await ec2.stop();
    await arm.stop();
  }
}
