/**
 * crunch-run on a preemptible instance, as real processes (process runtime) against a real REST server and the
 * fake IMDS: the supervisor polls for a spot interruption notice while the bundle runs; on one it writes the
 * preempted file, tells the user, reports `preempted` (the bundle goes back to staged), stops the command and
 * exits without finish; `--list` says `preempted`, and neither `--detach` nor the warm spare starts anything.
 * The same on Azure, where the notice is a Preempt event among the VM's Scheduled Events.
 */
import { existsSync } from "node:fs";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import net from "node:net";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { parseLock, processGroupAlive, readLockText } from "../crunch-run/lock.ts";
import { lockFile, runnerPaths } from "../crunch-run/paths.ts";
import { listEvents } from "../store/queries.ts";
import { type RunnerHarness, startRunnerHarness, supervisorLog } from "./crunch-run-harness.ts";
import { useTestDb } from "./db.ts";
import { FakeImds } from "./fake-imds.ts";

/**
 * For one describe: a runner harness on PGlite and a fake metadata service of `cloud`, started before its tests
 * and stopped after; `pointAt(X)` makes the harness's instance use X's metadata endpoint.
 */
function spotSetup(cloud: "ec2" | "azure") {
  const getDb = useTestDb("pglite");
  const setup = {
    getDb,
    imds: new FakeImds({ cloud }),
    h: undefined as RunnerHarness | undefined,
    async pointAt(instanceId: string) {
      const root = setup.h?.root ?? "";
      await mkdir(join(root, "etc", "dispatch-cloud"), { recursive: true });
      await writeFile(
        runnerPaths({ DISPATCH_VM_ROOT: root }).imdsEndpointFile,
        `${setup.imds.endpointFor(instanceId)}\n`,
      );
    },
  };
  beforeAll(async () => {
    await setup.imds.start();
    setup.h = await startRunnerHarness(getDb());
  });
  afterAll(async () => {
    await setup.h?.close();
    await setup.imds.stop();
  });
  return setup;
}

describe("crunch-run: spot interruption notices", () => {
  const setup = spotSetup("ec2");
  const { getDb, imds, pointAt } = setup;
  let h: RunnerHarness;
  beforeAll(() => {
    h = setup.h as RunnerHarness;
  });

  it("does not ask the metadata service when the instance type is not preemptible", async () => {
    await pointAt("i-on-demand");
    const b = await h.newStartingBundle({ command: ["sh", "-c", "sleep 1"] });
    expect((await h.detach(b, { preemptible: false, spotCheckIntervalMs: 50 })).code).toBe(0);
    expect((await h.waitFinal(b.uuid)).state, await supervisorLog(h.root, b.uuid)).toBe("ready");
    expect(imds.requests.filter((r) => r.instanceId === "i-on-demand")).toEqual([]);
  });

  it("requeues the running bundle on a notice, stops it, and starts nothing more on the instance", async () => {
    await pointAt("i-spot");
    const b = await h.newStartingBundle({
      command: ["sh", "-c", "sleep 60; echo done > $DISPATCH_OUTPUT_DIR/x"],
    });
    const detached = await h.detach(b, { preemptible: true, spotCheckIntervalMs: 100 });
    expect(detached.code, detached.stderr).toBe(0);
    await h.waitState(b.uuid, ["running"]);
    await until("the supervisor polls the IMDS", () => imds.polled("i-spot"));
    expect(await h.listBundles()).toBe(`${b.uuid}\n`);
    // The command's process group (the process runtime records it in the lock once it runs).
    let pgid = 0;
    await until("the command runs", async () => {
      const ref = parseLock((await readLockText(lockFile(runnerPaths(h.env), b.uuid))) ?? "")?.container;
      if (ref?.runtime === "process") pgid = ref.pgid;
      return pgid > 0;
    });
    expect(processGroupAlive(pgid)).toBe(true);

    imds.interrupt("i-spot");
    const requeued = await h.waitState(b.uuid, ["staged", "failed", "ready"]);
    expect(requeued.state, await supervisorLog(h.root, b.uuid)).toBe("staged");
    expect(requeued.stateReason).toMatch(/^preempted: spot interruption notice \(terminate at \d{4}-.*Z\)$/);
    const last = (await listEvents(getDb(), b.uuid)).at(-1);
    expect(last).toMatchObject({ fromState: "running", toState: "staged", actor: "runner" });

    // The supervisor stops the command and exits: the bundle leaves --list, which now says preempted.
    await until("the supervisor exits", async () => (await h.listBundles()) === "preempted\n");
    expect(processGroupAlive(pgid)).toBe(false);
    const file = runnerPaths({ DISPATCH_VM_ROOT: h.root }).preemptedFile;
    expect(JSON.parse(await readFile(file, "utf8"))).toEqual({
      action: "terminate",
      time: expect.any(String),
    });
    const log = await supervisorLog(h.root, b.uuid);
    expect(log).toContain("preemption reported: the bundle is staged");
    expect(log).not.toContain(b.token);
    expect(await h.log(b.uuid, "stderr")).toMatch(
      /\[crunch-run\] spot interruption notice \(terminate at .*\): this instance is being preempted; the bundle is stopped and requeued\n/,
    );
    // Nothing was uploaded and the work dir is gone.
    expect((await h.output(b.uuid, "x")).status).toBe(404);
    expect(existsSync(join(h.root, "tmp", "crunch-run", `${b.uuid}-1`))).toBe(false);

    // A start that races the notice fails fast: --detach refuses (the bundle stays starting, for the pool to
    // requeue), and so does the warm spare when the dispatcher hands it a bundle directly.
    const next = await h.newStartingBundle({ command: ["true"] });
    const refused = await h.detach(next, { preemptible: true });
    expect(refused.code).toBe(1);
    expect(refused.stderr).toContain("[crunchrun.preempted]");
    const spare = /^spare (\S+)$/m.exec((await h.crunchRun(["--list"])).stdout)?.[1];
    expect(spare, "a warm spare waits").toBeDefined();
    const doc = JSON.stringify({
      uuid: next.uuid,
      attempt: next.attempt,
      apiUrl: h.apiUrl,
      token: next.token,
      instanceType: "small",
      runtimeEngine: "process",
    });
    expect(await exchange(spare!, `start ${next.uuid}\n${doc}\n`)).toBe("refused instance preempted\n");
    expect(await h.listBundles()).toBe("preempted\n");
    expect((await h.waitState(next.uuid, ["starting"])).attempt).toBe(1);
  });
});

describe("crunch-run: spot evictions on Azure (Scheduled Events)", () => {
  const setup = spotSetup("azure");
  const { imds, pointAt } = setup;
  let h: RunnerHarness;
  beforeAll(() => {
    h = setup.h as RunnerHarness;
  });

  it("requeues the running bundle on a Preempt event and marks the instance preempted", async () => {
    await pointAt("dc-azspot");
    const b = await h.newStartingBundle({ command: ["sh", "-c", "sleep 60"] });
    const detached = await h.detach(b, { preemptible: true, spotCheckIntervalMs: 100 });
    expect(detached.code, detached.stderr).toBe(0);
    await h.waitState(b.uuid, ["running"]);
    await until("the supervisor reads the Scheduled Events", () => imds.polled("dc-azspot"));

    imds.interrupt("dc-azspot");
    const requeued = await h.waitState(b.uuid, ["staged", "failed", "ready"]);
    expect(requeued.state, await supervisorLog(h.root, b.uuid)).toBe("staged");
    expect(requeued.stateReason).toMatch(
      /^preempted: spot interruption notice \(preempt at \w{3}, .* GMT\)$/,
    );
    await until("the supervisor exits", async () => (await h.listBundles()) === "preempted\n");
    expect(await h.log(b.uuid, "stderr")).toMatch(
      /\[crunch-run\] spot interruption notice \(preempt at .* GMT\): this instance is being preempted/,
    );
    // It asked EC2's token path once (404 here), then only Azure's service, always with the Metadata header.
    const paths = imds.requests.filter((r) => r.instanceId === "dc-azspot").map((r) => r.path.split("?")[0]);
    expect(paths[0]).toBe("/latest/api/token");
    expect(new Set(paths.slice(1))).toEqual(
      new Set(["/metadata/instance/compute", "/metadata/scheduledevents"]),
    );
  });
});

/** One hand-off over a unix socket (what the pool does over SSH): sends `text`, reads the whole answer. */
function exchange(socket: string, text: string): Promise<string> {
  return new Promise((resolve, reject) => {
    let answer = "";
    const sock = net.connect(socket);
    sock.setEncoding("utf8");
    sock.on("error", reject);
    sock.on("connect", () => sock.end(text));
    sock.on("data", (c: string) => {
      answer += c;
    });
    sock.on("end", () => resolve(answer));
  });
}

async function until(what: string, check: () => boolean | Promise<boolean>, ms = 30_000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}
