import { describe, expect, it } from "vitest";
import { initScript, newInstanceSecret } from "../../dispatcher/pool/bootstrap.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import type { InstanceType } from "../types.ts";
import { StubCloud } from "./driver.ts";

const TYPE: InstanceType = {
  name: "small",
  providerType: "m5.large",
  vcpus: 2,
  ram: 4 << 30,
  includedScratch: 0,
  addedScratch: 0,
  scratch: 0,
  price: 0.1,
  preemptible: false,
  gpu: null,
};

async function newVm() {
  const cloud = new StubCloud({ clock: new FakeClock() });
  const secret = newInstanceSecret();
  const inst = await cloud.instanceSet("zzzzz").create(TYPE, "img", {}, initScript(secret, ""), "key");
  const vm = cloud.vm(inst.id);
  if (vm === undefined) throw new Error("no VM");
  return { cloud, vm, secret, inst };
}

describe("stub executor identity check (expectedSecret)", () => {
  it("runs commands once the VM's secret file matches", async () => {
    const { cloud, inst, secret } = await newVm();
    const exec = cloud.executorFor(inst, { expectedSecret: secret });
    expect((await exec.execute("echo ok")).stdout.toString()).toBe("ok\n");
  });

  it("says not ready while there is no secret file, then connects once there is", async () => {
    const { cloud, vm, inst, secret } = await newVm();
    vm.secret = undefined;
    const exec = cloud.executorFor(inst, { expectedSecret: secret });
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.not_ready" });
    vm.secret = secret;
    expect((await exec.execute("true")).exitCode).toBe(0);
  });

  it("refuses a VM with another secret, and every command after that, without running anything", async () => {
    const { cloud, vm, inst } = await newVm();
    const commands: string[] = [];
    cloud.on("command", (_vm, command) => commands.push(command));
    const exec = cloud.executorFor(inst, { expectedSecret: newInstanceSecret() });
    await expect(exec.execute("echo hi")).rejects.toMatchObject({ code: "ssh.host_mismatch" });
    await expect(exec.execute("echo again")).rejects.toMatchObject({ code: "ssh.host_mismatch" });
    // Even a later fix of the file does not make a refused host acceptable to this executor.
    vm.secret = "whatever";
    await expect(exec.execute("echo third")).rejects.toMatchObject({ code: "ssh.host_mismatch" });
    expect(commands).toEqual([]);
  });

  it("without expectedSecret, checks nothing (as before)", async () => {
    const { cloud, vm, inst } = await newVm();
    vm.secret = undefined;
    expect((await cloud.executorFor(inst).execute("true")).exitCode).toBe(0);
  });
});
