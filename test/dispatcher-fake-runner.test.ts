import { tmpdir } from "node:os";
import { join } from "node:path";
import { expect, it } from "vitest";
import { StubCloud } from "../cloud-drivers/stub/driver.ts";
import { runnerCommands } from "../dispatcher/pool/runner-commands.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { getBundle, listEvents } from "../store/queries.ts";
import { stageBundle } from "../store/transitions.ts";
import { createTestBundle, createTestUser, describeEachDb, startWithRunnerToken } from "./db.ts";
import { FakeClock } from "./fake-clock.ts";
import { attachFakeRunners, defaultDuration, defaultExitCode } from "./fake-runner.ts";
import { testInstanceType } from "./fixtures.ts";

const TYPE = testInstanceType("t1", { vcpus: 2, ramGiB: 2, price: 0.1, scratchGiB: 0 });

const RUNNER = Buffer.from("#!/bin/sh\n");

async function setup(db: Db) {
  const clock = new FakeClock();
  const cloud = new StubCloud({ clock });
  const api = await createRestServer({
    db,
    logger: false,
    clusterId: "zzzzz",
    maxRequestBodySize: 2 ** 20,
    defaultMaxAttempts: 3,
    clock,
    // The fake runners upload no outputs: nothing is ever written there.
    dataDir: join(tmpdir(), "dispatch-cloud-fake-runners"),
  });
  const fake = attachFakeRunners({ cloud, api, clock });
  const instance = await cloud.instanceSet("set").create(TYPE, "img", {}, "", "");
  const sha = cloud.sha256(RUNNER);
  const cmds = runnerCommands("/tmp/dc", sha);
  const vm = cloud.vm(instance.id);
  vm?.files.set(`/tmp/dc/crunch-run~${sha}`, RUNNER);
  const exec = cloud.executorFor(instance);
  const owner = (await createTestUser(db)).uuid;
  /** A bundle made starting on the VM and detached there, as the pool would. */
  const detach = async (command: string[]) => {
    const b = await createTestBundle(db, owner, { command });
    await stageBundle(db, b.uuid, { actor: "test" });
    const { token } = await startWithRunnerToken(db, b.uuid, {
      instanceId: instance.id,
      instanceType: TYPE.name,
      actor: "test",
    });
    const doc = {
      uuid: b.uuid,
      attempt: 1,
      apiUrl: "http://unused",
      token,
      instanceType: TYPE.name,
      gpuDevices: [],
    };
    const res = await exec.execute(cmds.detach(b.uuid), { stdin: JSON.stringify(doc) });
    expect(res.exitCode).toBe(0);
    return b.uuid;
  };
  const list = async () => (await exec.execute(cmds.list)).stdout.toString().trim();
  const waitFor = async (uuid: string, state: string) => {
    for (let i = 0; i < 200 && (await getBundle(db, uuid))?.state !== state; i++) await clock.advance(0);
    expect((await getBundle(db, uuid))?.state).toBe(state);
  };
  return { clock, cloud, api, fake, exec, cmds, detach, list, waitFor };
}

it("reads durations and exit codes from the command", () => {
  expect(defaultDuration({ command: ["sleep", "30"] })).toBe(30_000);
  expect(defaultDuration({ command: ["sh", "-c", "sleep 2.5; exit 3"] })).toBe(2500);
  expect(defaultDuration({ command: ["echo", "hi"] })).toBe(1000);
  expect(defaultExitCode({ command: ["sh", "-c", "sleep 2; exit 3"] })).toBe(3);
  expect(defaultExitCode({ command: ["sleep", "2"] })).toBe(0);
});

describeEachDb("fake runners through the real runner API", (getDb) => {
  it("start, run for the command's sleep, finish, and leave --list", async () => {
    const t = await setup(getDb());
    const ok = await t.detach(["sleep", "30"]);
    const bad = await t.detach(["sh", "-c", "sleep 10; exit 3"]);
    await t.waitFor(ok, "running");
    await t.waitFor(bad, "running");
    // Running once /start is stored; each fake starts its (fake-clock) sleep only once the answer and its spec
    // reach it, and the clock must not move before both sleeps are set (nothing else sleeps here).
    await logged(t.fake, 2);
    await expect.poll(() => t.clock.pending).toBe(2);
    expect(t.fake.errors).toEqual([]);
    expect((await t.list()).split("\n").sort()).toEqual([ok, bad].sort());
    await t.clock.advance(10_000);
    await t.waitFor(bad, "failed");
    expect((await getBundle(getDb(), bad))?.exitCode).toBe(3);
    expect(await t.list()).toBe(ok);
    await t.clock.advance(20_000);
    await t.waitFor(ok, "ready");
    expect(await t.list()).toBe("");
    const events = (await listEvents(getDb(), ok)).map((e) => `${e.toState}:${e.actor}`);
    expect(events.slice(1)).toEqual(["staged:test", "starting:test", "running:runner", "ready:runner"]);
    expect(t.fake.errors).toEqual([]);
    expect(t.fake.active).toBe(0);
    t.fake.detach();
    await t.api.close();
  });

  it("stops without finishing when the stub runner is killed", async () => {
    const t = await setup(getDb());
    const uuid = await t.detach(["sleep", "30"]);
    await t.waitFor(uuid, "running");
    // The bundle is running once /start is stored; the fake logs "started" when the answer reaches it.
    await logged(t.fake, 1);
    expect((await t.exec.execute(t.cmds.kill(uuid))).exitCode).toBe(0);
    await t.clock.advance(60_000);
    await logged(t.fake, 2);
    expect((await getBundle(getDb(), uuid))?.state).toBe("running");
    expect(t.fake.log.map((e) => e.event)).toEqual(["started", "stopped"]);
    expect(t.fake.active).toBe(0);
    expect(await t.list()).toBe("");
    t.fake.detach();
    await t.api.close();
  });
});

/** Waits (real time, 10 s at most) until the fake runners have logged at least `n` events. */
async function logged(fake: { readonly log: readonly unknown[] }, n: number): Promise<void> {
  const end = Date.now() + 10_000;
  while (fake.log.length < n) {
    if (Date.now() > end) throw new Error(`the fake runners logged ${fake.log.length} events, not ${n}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}
