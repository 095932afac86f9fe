import { randomBytes } from "node:crypto";
import { describe, expect, it } from "vitest";
import { IDENTITY_COMMAND } from "../../dispatcher/sshexec/executor.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import type { InstanceType } from "../types.ts";
import { StubCloud } from "./driver.ts";

const TYPES: InstanceType[] = ["m5.large", "c5.xlarge", "r5.2xlarge"].map((providerType, i) => ({
  name: `t${i}`,
  providerType,
  vcpus: 2 << i,
  ram: 4 << (30 + i),
  includedScratch: 0,
  addedScratch: 0,
  scratch: 0,
  price: 0.1 * (i + 1),
  preemptible: false,
  gpu: null,
}));

const VMS = 10_000;
const RUNNERS_PER_VM = 10;

describe("stub cloud at scale", () => {
  it(`holds ${VMS} VMs and ${VMS * RUNNERS_PER_VM} runners in seconds and modest memory`, async () => {
    const clock = new FakeClock();
    const cloud = new StubCloud({ clock, seed: 42, bootDelay: 60_000 });
    const set = cloud.instanceSet("zzzzz");
    const binary = randomBytes(1 << 20);
    const heapBefore = process.memoryUsage().heapUsed;
    const t0 = performance.now();

    for (let i = 0; i < VMS; i++) {
      const type = TYPES[i % TYPES.length] as InstanceType;
      const secret = i.toString(16).padStart(40, "0");
      await set.create(
        type,
        "img",
        {
          DispatchCloudInstanceSetID: "zzzzz",
          DispatchCloudInstanceType: type.name,
          DispatchCloudIdleBehavior: "run",
        },
        `(umask 0177 && echo -n '${secret}' >"\${DISPATCH_VM_ROOT:-}/var/run/dispatch-cloud-instance-secret")`,
        "ssh-ed25519 AAAA test",
      );
    }
    const tCreate = performance.now();

    const listed = await set.instances({ DispatchCloudInstanceSetID: "zzzzz" });
    expect(listed).toHaveLength(VMS);
    expect(await set.instances({ DispatchCloudInstanceType: "t1" })).toHaveLength(Math.floor(VMS / 3));
    const tList = performance.now();

    await clock.advance(60_000);
    const path = `/tmp/dispatch-cloud/crunch-run~0123abcd`;
    let runners = 0;
    let verified = 0;
    for (const inst of listed) {
      const exec = cloud.executorFor(inst);
      const id = await exec.execute(IDENTITY_COMMAND);
      if (id.stdout.length === 40 && (await exec.execute("true")).exitCode === 0) verified++;
      const hash = await exec.execute(`sha256sum ${path}`);
      if (hash.exitCode !== 0) {
        await exec.execute(
          `mkdir -p /tmp/dispatch-cloud && cat >${path}.tmp && chmod 0755 ${path}.tmp && mv ${path}.tmp ${path}`,
          {
            stdin: binary,
          },
        );
      }
      for (let r = 0; r < RUNNERS_PER_VM; r++) {
        const uuid = `zzzzz-bndl-${(runners++).toString(36).padStart(15, "0")}`;
        await exec.execute(`${path} --detach ${uuid}`, { stdin: `{"uuid":"${uuid}","token":"dcr_x"}` });
      }
    }
    const tDeploy = performance.now();

    let lines = 0;
    for (const inst of listed) {
      const res = await cloud.executorFor(inst).execute(`${path} --list`);
      lines += res.stdout.toString().split("\n").length - 1;
    }
    const tProbe = performance.now();
    expect(verified).toBe(VMS);
    expect(lines).toBe(VMS * RUNNERS_PER_VM);
    expect(cloud.runners("running")).toHaveLength(VMS * RUNNERS_PER_VM);

    const heapMiB = (process.memoryUsage().heapUsed - heapBefore) / 2 ** 20;
    const s = (a: number, b: number) => ((b - a) / 1000).toFixed(2);
    console.log(
      `scale: ${VMS} creates ${s(t0, tCreate)} s; 2 lists ${s(tCreate, tList)} s; ` +
        `identity+probe+deploy+${RUNNERS_PER_VM} detaches per VM (${VMS * (3 + RUNNERS_PER_VM) + 1} commands) ` +
        `${s(tList, tDeploy)} s; --list on each ${s(tDeploy, tProbe)} s; ` +
        `total ${s(t0, tProbe)} s; heap growth ${heapMiB.toFixed(0)} MiB ` +
        `(rss ${(process.memoryUsage().rss / 2 ** 20).toFixed(0)} MiB)`,
    );
    expect(tProbe - t0).toBeLessThan(20_000);
    expect(heapMiB).toBeLessThan(500);
  });
});
