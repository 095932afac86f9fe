/**
 * End to end, a spot interruption: `rest-server` and `dispatcher` apart on PostgreSQL, local VMs behind OpenSSH
 * sshd, real dockerd, a preemptible instance type, and the fake IMDS (test/fake-imds.ts). Each VM's init command
 * points crunch-run at its own IMDS endpoint (the VM's id is the name of the directory above its
 * DISPATCH_VM_ROOT). The test interrupts the instance a bundle runs on: the bundle goes back to staged with the
 * notice as its reason, runs again on another instance and is ready at attempt 2; the preempted instance starts
 * nothing after the notice and is destroyed.
 */
import { execFileSync } from "node:child_process";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { E2eSystem, until } from "./e2e-harness.ts";
import { FakeImds } from "./fake-imds.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";

const IMAGE = requireDockerImage();
const TYPE = "e2e.spot";

interface EventView {
  fromState: string | null;
  toState: string;
  attempt: number;
  reason: string | null;
  actor: string;
}

/** Names of the containers (any state) crunch-run made for the VM whose root is `root`. */
function containersOfVm(root: string): string[] {
  return execFileSync(
    "docker",
    ["ps", "-a", "--filter", `label=dispatch-cloud.vm-root=${root}`, "--format", "{{.Names}}"],
    { encoding: "utf8" },
  )
    .split("\n")
    .filter(Boolean);
}

describe("end to end: a spot interruption notice (PostgreSQL, OpenSSH VMs, Docker, fake IMDS)", () => {
  const imds = new FakeImds();
  let sys: E2eSystem;

  beforeAll(async () => {
    await imds.start();
    // Single-quoted in YAML; run by the VM's shell at boot, after the instance secret is written.
    const init =
      'mkdir -p "$DISPATCH_VM_ROOT/etc/dispatch-cloud" && ' +
      `echo "${imds.url}/i/$(basename "$(dirname "$DISPATCH_VM_ROOT")")" ` +
      '> "$DISPATCH_VM_ROOT/etc/dispatch-cloud/imds-endpoint"';
    sys = await E2eSystem.start({
      database: "pg",
      sshServer: "openssh",
      runtimeEngine: "docker",
      split: true,
      addressPrefix: "127.0.14.",
      management: true,
      cloudYaml: ["  spotInterruptionCheckInterval: 250ms", `  instanceInitCommand: '${init}'`].join("\n"),
      instanceTypesYaml: [
        `  ${TYPE}:`,
        "    vcpus: 16",
        "    ram: 16GiB",
        "    includedScratch: 20GiB",
        "    price: 0.05",
        "    preemptible: true",
      ].join("\n"),
    });
  }, 180_000);

  afterAll(async () => {
    await sys?.stop();
    await imds.stop();
  }, 120_000);

  it("requeues the running bundle on a notice; it completes on another instance; the preempted one is destroyed", async () => {
    const uuid = await sys.submit({
      image: IMAGE,
      command: ["sh", "-c", "sleep 30; echo done > /out/x"],
      preemptible: true,
    });
    const running = await sys.waitState(uuid, ["running"], 180_000);
    const first = running.instanceId as string;
    expect(running).toMatchObject({ attempt: 1, instanceType: TYPE });
    const root = join(sys.dir, "vms", first, "root");
    await until("the supervisor asks the IMDS with a token", () => (imds.polled(first) ? true : undefined));
    await until("the container runs", () => (containersOfVm(root).length > 0 ? true : undefined));

    // From the notice until the instance is gone: every container and supervisor log the VM ever has.
    const containers = new Set<string>();
    const logs = new Set<string>();
    let watching = true;
    const watcher = (async () => {
      while (watching) {
        for (const c of containersOfVm(root)) containers.add(c);
        try {
          for (const f of readdirSync(join(root, "var", "log", "crunch-run"))) logs.add(f);
        } catch {
          // The VM is gone.
        }
        await new Promise((r) => setTimeout(r, 250));
      }
    })();

    imds.interrupt(first);
    // A bundle that would fit on the preempted instance, submitted once crunch-run there has the notice (its
    // supervisor asks every 250 ms here; a start handed to a warm spare before that runs, and is requeued with
    // the others when the notice is seen).
    await until("crunch-run has the notice", () =>
      existsSync(join(root, "var", "lock", "crunch-run-preempted")) ? true : undefined,
    );
    const other = await sys.submit({
      image: IMAGE,
      command: ["sh", "-c", "echo other > /out/y"],
      preemptible: true,
    });

    const requeue = await until("the bundle is requeued", async () => {
      const { items } = await sys.json<{ items: EventView[] }>("GET", `/bundles/${uuid}/events`);
      return items.find((e) => e.fromState === "running");
    });
    expect(requeue, sys.output().slice(-4000)).toMatchObject({
      toState: "staged",
      attempt: 1,
      actor: "runner",
    });
    expect(requeue.reason).toMatch(
      /^preempted: spot interruption notice \(terminate at \d{4}-\d\d-\d\dT[\d:]+Z\)$/,
    );

    // The management API shows the instance preempted until it is gone.
    await until("the instance shows preempted", async () => {
      const { items } = await sys.manage<{ items: { instanceId: string; preempted: boolean }[] }>(
        "GET",
        "/instances",
      );
      return items.some((i) => i.instanceId === first && i.preempted) ? true : undefined;
    });

    const done = await sys.waitState(uuid, ["ready", "failed", "killed"], 180_000);
    expect(done, sys.output().slice(-4000)).toMatchObject({ state: "ready", exitCode: 0, attempt: 2 });
    expect(done.instanceId).not.toBe(first);
    expect(await sys.text(`/bundles/${uuid}/outputs/x`)).toEqual({ status: 200, body: "done\n" });
    const { items } = await sys.json<{ items: EventView[] }>("GET", `/bundles/${uuid}/events`);
    expect(items.map((e) => `${e.fromState}->${e.toState}#${e.attempt}`)).toEqual([
      "null->created#0",
      "created->staged#0",
      "staged->starting#1",
      "starting->running#1",
      "running->staged#1",
      "staged->starting#2",
      "starting->running#2",
      "running->ready#2",
    ]);
    const otherDone = await sys.waitState(other, ["ready", "failed", "killed"], 120_000);
    expect(otherDone).toMatchObject({ state: "ready" });
    expect(otherDone.instanceId).not.toBe(first);
    // The first attempt's log tells the user why it stopped.
    const stderr = await sys.text(`/bundles/${uuid}/logs?stream=stderr&attempt=1`);
    expect(stderr.body).toMatch(
      /\[crunch-run\] spot interruption notice \(terminate at .*\): this instance is being preempted; the bundle is stopped and requeued/,
    );

    // The preempted instance is shut down and destroyed (its directory goes with it).
    await until(
      "the preempted instance is destroyed",
      () => (existsSync(join(sys.dir, "vms", first)) ? undefined : true),
      120_000,
    );
    watching = false;
    await watcher;
    // Nothing but the first attempt ever ran there: one container. (A start that raced the notice may leave a
    // supervisor log of its refusal, so logs other than the first attempt's are allowed, containers are not.)
    expect([...containers]).toEqual([`crunch-run-${uuid}-1`]);
    expect(logs).toContain(`${uuid}.log`);
    expect(containersOfVm(root)).toEqual([]);

    const metrics = await fetch(`${sys.management!.url}/metrics`, {
      headers: { authorization: `Bearer ${sys.management!.token}` },
    }).then((r) => r.text());
    expect(metrics).toContain(`dispatchcloud_instances_preempted_total{instance_type="${TYPE}"} 1`);
  }, 300_000);
});
