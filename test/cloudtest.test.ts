import { chmod, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { runBin } from "./serve-process.ts";

const dirs: string[] = [];
afterAll(async () => {
  await Promise.all(dirs.map((d) => rm(d, { recursive: true, force: true })));
});

/** Runs `bin/dispatch-cloud cloudtest` against the local driver with the given cloud settings. */
async function cloudtest(
  sshServer: "embedded" | "openssh",
  cloudYaml = "",
  args: string[] = [],
): Promise<{ code: number; stdout: string; stderr: string }> {
  const dir = await mkdtemp(join(tmpdir(), "dc-cloudtest-"));
  await chmod(dir, 0o755); // the openssh VMs' login user must reach the state dir
  dirs.push(dir);
  const user = process.env["DISPATCH_CLOUD_TEST_VM_USER"] ?? "dcvm";
  const config = join(dir, "config.yml");
  await writeFile(
    config,
    `clusterId: ct001
dataDir: ${dir}/data
logging: {level: warn}
cloud:
  driver: local
  driverParameters: {stateDir: ${dir}/vms, sshServer: ${sshServer}, user: ${user}, bootDelay: 200ms}
  timeoutShutdown: 10s
${cloudYaml.includes("timeoutBooting") ? "" : "  timeoutBooting: 8s\n"}${cloudYaml}`,
  );
  return runBin(["cloudtest", "--config", config, ...args]);
}

describe.each(["embedded", "openssh"] as const)("cloudtest on the local driver with %s SSH", (mode) => {
  it("passes every step and prints each with its duration", async () => {
    if (mode === "openssh" && process.getuid?.() !== 0) {
      throw new Error(
        'openssh mode needs root and sshd: run as root after eval "$(bash scripts/test-services.sh)"',
      );
    }
    const r = await cloudtest(mode, "", ["--command", 'echo "root=$DISPATCH_VM_ROOT"']);
    expect(r.stdout, r.stderr).toContain("cloudtest passed");
    expect(r.code).toBe(0);
    expect(r.stdout).toMatch(/\[1\] create an instance of type local\.small \(local\.small\): ok \(\d/);
    expect(r.stdout).toMatch(/see it listed with its tags: ok/);
    expect(r.stdout).toMatch(/connect over SSH and verify the instance secret: ok/);
    expect(r.stdout).toMatch(/wait for the boot probe \(true\): ok/);
    expect(r.stdout).toMatch(/\| root=\/.+/);
    expect(r.stdout).toMatch(/see it gone from the list: ok/);
  });

  it("fails at the secret step when the VM's secret file is wrong", async () => {
    const r = await cloudtest(
      mode,
      `  instanceInitCommand: 'echo -n 0000000000000000000000000000000000000000 >"\${DISPATCH_VM_ROOT:-}/var/run/dispatch-cloud-instance-secret"'\n`,
    );
    expect(r.code).not.toBe(0);
    expect(r.stdout).toMatch(
      /cloudtest failed: step 3 \(connect over SSH and verify the instance secret\) failed/,
    );
    expect(r.stdout).not.toContain("0000000000000000000000000000000000000000");
    expect(r.stdout).toMatch(/cleaning up: destroying local-/);
  });

  it("fails at the boot probe step when the probe never passes", async () => {
    const r = await cloudtest(mode, "  bootProbeCommand: 'false'\n  timeoutBooting: 3s\n");
    expect(r.code).not.toBe(0);
    expect(r.stdout).toMatch(
      /cloudtest failed: step 4 \(wait for the boot probe \(false\)\) failed: gave up/,
    );
  });
});
