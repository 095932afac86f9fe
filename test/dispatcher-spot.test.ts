/**
 * Spot interruptions in the dispatcher, on the stub cloud with FakeClock (test/dispatcher-harness.ts): a VM whose
 * `crunch-run --list` says `preempted` gets no new bundle, is drained and destroyed once idle (even when held);
 * a bundle its runner reported through the real runner API is re-probed for at once and runs again elsewhere;
 * a bundle whose runner left without reporting is requeued by the pool with the reason.
 */
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { pino } from "pino";
import { Registry } from "prom-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { StubVm } from "../cloud-drivers/stub/vm.ts";
import type { WorkerPool } from "../dispatcher/pool/pool.ts";
import { createRestServer } from "../rest-server/server.ts";
import { getBundle, listEvents } from "../store/queries.ts";
import { createHarness, type Harness, settle, stubConfig, useTestDb } from "./dispatcher-harness.ts";
import { defaultDuration } from "./fake-runner.ts";

const logger = pino({ level: process.env["DC_TEST_LOG"] ?? "silent" });
const SPOT_TYPE = "  spot: {vcpus: 2, ram: 4GiB, includedScratch: 50GiB, price: 0.03, preemptible: true}\n";

async function metric(registry: Registry, name: string, labels: Record<string, string>): Promise<number> {
  const m = registry.getSingleMetric(name);
  if (m === undefined) throw new Error(`no metric ${name}`);
  const { values } = await m.get();
  const v = values.find((x) => Object.entries(labels).every(([k, l]) => x.labels[k] === l));
  if (v === undefined) throw new Error(`no series ${name}${JSON.stringify(labels)}`);
  return v.value;
}

describe("dispatcher: spot interruptions on the stub driver", () => {
  const getDb = useTestDb("pglite");
  let api: FastifyInstance;

  beforeAll(async () => {
    api = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 2 ** 20,
      defaultMaxAttempts: 3,
      dataDir: join(tmpdir(), "dispatch-cloud-spot-test"),
    });
  });
  afterAll(async () => {
    await api?.close();
  });

  /** A harness whose first attempts run for their `sleep N`, later ones for a second. */
  const start = async () => {
    const h = await createHarness({
      db: getDb(),
      logger,
      config: stubConfig(SPOT_TYPE),
      runners: { duration: (spec) => (spec.attempt === 1 ? defaultDuration(spec) : 1000) },
    });
    const registry = new Registry();
    const d = await h.startDispatcher({ registry });
    const pool = d.parts?.pool;
    if (pool === undefined) throw new Error("the dispatcher is not active");
    return { h, d, pool, registry };
  };

  /** Submits a preemptible bundle and drives until it runs and is listed; its VM and its start document. */
  const runningSpotBundle = async (h: Harness, pool: WorkerPool) => {
    const [uuid] = await h.submit(1, () => ({ command: ["sleep", "3600"], preemptible: true }));
    await h.drive(async () => (await h.states([uuid!])).get(uuid!) === "running");
    const b = await getBundle(getDb(), uuid!);
    // Until a probe's --list has shown the runner, the pool knows it only as one it started.
    await h.drive(async () => pool.worker(b?.instanceId ?? "")?.runners.get(uuid!)?.state === "running");
    const vm = h.cloud.vm(b?.instanceId ?? "");
    if (vm === undefined) throw new Error("no VM runs the bundle");
    const doc = vm.runners.get(uuid!)?.doc as {
      token: string;
      preemptible: boolean;
      spotCheckIntervalMs: number;
    };
    return { uuid: uuid!, vm, doc };
  };

  /** `--detach` calls and `--list` calls per VM, as they happen. */
  const watchCommands = (h: Harness) => {
    const seen: { vm: string; kind: "list" | "detach"; at: number }[] = [];
    h.cloud.on("command", (vm: StubVm, command: string) => {
      const kind = command.includes("--list") ? "list" : command.includes("--detach") ? "detach" : null;
      if (kind !== null) seen.push({ vm: vm.id, kind, at: h.clock.now() });
    });
    return seen;
  };

  it("a reported notice: requeued, the instance re-probed at once, drained, given nothing, destroyed; the bundle runs again elsewhere", async () => {
    const { h, d, pool, registry } = await start();
    try {
      const seen = watchCommands(h);
      const { uuid, vm, doc } = await runningSpotBundle(h, pool);
      expect(doc).toMatchObject({ preemptible: true, spotCheckIntervalMs: 5000 });
      expect(
        await metric(registry, "dispatchcloud_instances_preempted_total", { instance_type: "spot" }),
      ).toBe(0);

      // No time passes from here until the instance has been probed again.
      const at = h.clock.now();
      const listsBefore = seen.filter((c) => c.vm === vm.id && c.kind === "list").length;
      // What crunch-run does on a notice: the preempted file (so --list says it), then the report.
      vm.preempted = true;
      const res = await api.inject({
        method: "POST",
        url: "/api/v1/runner/preempted",
        headers: { authorization: `Bearer ${doc.token}`, "content-type": "application/json" },
        payload: JSON.stringify({ action: "terminate", time: "2026-01-01T00:02:00Z" }),
      });
      expect(res.statusCode, res.body).toBe(200);
      expect(res.json()).toMatchObject({ state: "staged" });

      // The scheduler sees the bundle staged while its runner is still listed (its pass runs on the queue's
      // change, and here once more), keeps it off every instance and has the pool probe the instance at once.
      await d.runOnce();
      await pool.settled();
      expect(h.clock.now()).toBe(at);
      const listsNow = seen.filter((c) => c.vm === vm.id && c.kind === "list").length;
      expect(listsNow).toBeGreaterThan(listsBefore);
      // At most one immediate probe per worker per second: asking again at the same instant does nothing.
      pool.probeNow(vm.id);
      pool.probeNow(vm.id);
      await pool.settled();
      expect(seen.filter((c) => c.vm === vm.id && c.kind === "list").length).toBe(listsNow);
      expect(pool.worker(vm.id)).toMatchObject({ preempted: true, broken: true, idleBehavior: "drain" });
      expect(
        await metric(registry, "dispatchcloud_instances_preempted_total", { instance_type: "spot" }),
      ).toBe(1);
      expect((await getBundle(getDb(), uuid))?.state).toBe("staged");

      // Another bundle that would fit on it goes elsewhere.
      const [other] = await h.submit(1, () => ({ command: ["sleep", "1"], preemptible: true }));
      // The supervisor stops the container and exits.
      vm.endRunner(uuid, null, "TERM");
      await h.drive(async () => {
        const s = await h.states([uuid, other!]);
        return s.get(uuid) === "ready" && s.get(other!) === "ready";
      });
      const again = await getBundle(getDb(), uuid);
      expect(again).toMatchObject({ state: "ready", attempt: 2 });
      expect(again?.instanceId).not.toBe(vm.id);
      expect((await getBundle(getDb(), other!))?.instanceId).not.toBe(vm.id);
      const detachesAfter = seen.filter((c) => c.vm === vm.id && c.kind === "detach" && c.at >= at);
      expect(detachesAfter).toEqual([]);
      const requeue = (await listEvents(getDb(), uuid)).find((e) => e.fromState === "running");
      expect(requeue).toMatchObject({
        toState: "staged",
        actor: "runner",
        reason: "preempted: spot interruption notice (terminate at 2026-01-01T00:02:00Z)",
      });
      // Drained and idle: shut down and destroyed.
      await h.drive(async () => vm.destroyed, { stallMs: 30_000 });
      expect(h.runners.errors).toEqual([]);
    } finally {
      await h.close();
    }
  }, 120_000);

  it("a runner that left without reporting: the pool requeues its bundle, naming the preemption; even a held instance goes", async () => {
    const { h, pool } = await start();
    try {
      const { uuid, vm } = await runningSpotBundle(h, pool);
      await pool.setIdleBehavior(vm.id, "hold");
      vm.preempted = true;
      vm.endRunner(uuid, null, "TERM");
      await h.drive(async () => (await listEvents(getDb(), uuid)).some((e) => e.fromState === "running"));
      const requeue = (await listEvents(getDb(), uuid)).find((e) => e.fromState === "running");
      expect(requeue).toMatchObject({
        toState: "staged",
        actor: "dispatcher",
        reason: `preempted: spot interruption notice on instance ${vm.id} (its runner did not report it)`,
      });
      await h.drive(async () => (await h.states([uuid])).get(uuid) === "ready");
      expect((await getBundle(getDb(), uuid))?.instanceId).not.toBe(vm.id);
      await h.drive(async () => vm.destroyed, { stallMs: 30_000 });
      expect(pool.worker(vm.id)).toBeUndefined();
      await settle();
    } finally {
      await h.close();
    }
  }, 120_000);
});
