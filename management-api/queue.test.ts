/**
 * The management API's queue view on a whole dispatcher on the stub cloud: the scheduler's order and the
 * sentence that explains each queued bundle (waiting for boot, at quota, at capacity, no idle instance of a
 * fitting type, held instances only). Scheduler passes are run directly (Dispatcher.runOnce).
 */
import type { FastifyInstance } from "fastify";
import { pino } from "pino";
import { Registry } from "prom-client";
import { describe, expect, it } from "vitest";
import type { Config } from "../config/schema.ts";
import type { Dispatcher } from "../dispatcher/main.ts";
import { CAPACITY_BLOCK_MS } from "../dispatcher/pool/pool.ts";
import { hhmm } from "../dispatcher/scheduler/status.ts";
import type { Db } from "../store/db.ts";
import { setBundleInputManifests } from "../store/queries.ts";
import { killBundle, stageBundle } from "../store/transitions.ts";
import { createTestBundle } from "../test/db.ts";
import { createHarness, GiB, type Harness, stubConfig, useTestDb } from "../test/dispatcher-harness.ts";
import type { BundleItem } from "./schemas.ts";
import { createManagementServer } from "./server.ts";

const logger = pino({ level: process.env["DC_TEST_LOG"] ?? "silent" });
const TOKEN = "dcm-queue-test-token-0123456789";
const auth = { authorization: `Bearer ${TOKEN}` };

async function managementFor(h: Harness, d: Dispatcher): Promise<FastifyInstance> {
  const config = { ...h.config, management: { ...h.config.management, token: TOKEN } } as Config;
  return createManagementServer({
    config,
    dispatcher: d,
    db: h.db,
    registry: new Registry(),
    logger: false,
    clock: h.clock,
  });
}

async function queueOf(app: FastifyInstance): Promise<BundleItem[]> {
  const res = await app.inject({ url: "/management/v1/bundles", headers: auth });
  expect(res.statusCode).toBe(200);
  return res.json().items as BundleItem[];
}

/** Leaves no active bundle for the next test (the file shares one database). */
async function killAll(db: Db): Promise<void> {
  const { rows } = await db.query<{ uuid: string }>(
    "SELECT uuid FROM bundles WHERE state NOT IN ('ready', 'failed', 'killed')",
  );
  for (const r of rows) await killBundle(db, r.uuid, { actor: "test", reason: "test over" });
}

/** A whole small instance (2 vCPUs): only small is eligible (medium costs over maximumPriceFactor x small). */
const WHOLE_SMALL = { vcpus: 2, ram: GiB, scratch: GiB, gpu: null };

describe("management API: the queue in scheduler order, each bundle explained", () => {
  const getDb = useTestDb("pg");

  it("orders by priority then age, and says: waiting for boot, at quota, waiting for an idle instance, only held", async () => {
    const config = stubConfig();
    const h = await createHarness({
      db: getDb(),
      logger,
      config: { ...config, cloud: { ...config.cloud, maxInstances: 1 } } as Config,
    });
    const d = await h.startDispatcher();
    const app = await managementFor(h, d);
    try {
      h.cloud.holdCloudOps(["create"]);
      const [low] = await h.submit(1, () => ({
        priority: 1,
        resources: WHOLE_SMALL,
        command: ["sleep", "600"],
      }));
      const [high1, high2] = await h.submit(2, () => ({
        priority: 5,
        resources: WHOLE_SMALL,
        command: ["sleep", "600"],
      }));

      // First pass (the create call held in the cloud): the head gets a new instance, the others find the pool
      // at quota with no instance of the type yet.
      await d.runOnce();
      let q = await queueOf(app);
      expect(q.map((b) => b.uuid)).toEqual([high1, high2, low]);
      expect(q.map((b) => b.priority)).toEqual([5, 5, 1]);
      expect(q.every((b) => b.state === "staged" && b.instanceId === null)).toBe(true);
      expect(q.map((b) => b.eligibleTypes)).toEqual([["small"], ["small"], ["small"]]);
      expect(q.map((b) => b.schedulingStatus)).toEqual([
        "waiting in queue at position 1: waiting for a new small instance to boot",
        "waiting in queue at position 2: at quota: 1 of 1 instances",
        "waiting in queue at position 3: at quota: 1 of 1 instances",
      ]);
      for (const b of q) expect(Date.parse(b.firstSeenAt)).not.toBeNaN();

      // The create returns: the head waits for that instance to boot; an instance of the type exists now.
      h.cloud.releaseCloudOps();
      await d.parts!.pool.settled();
      await d.runOnce();
      const [inst] = (await app.inject({ url: "/management/v1/instances", headers: auth })).json().items;
      const id = inst.instanceId as string;
      expect(id).not.toMatch(/^creating-/);
      q = await queueOf(app);
      expect(q.map((b) => b.schedulingStatus)).toEqual([
        `waiting in queue at position 1: waiting for instance ${id} (small) to boot`,
        "waiting in queue at position 2: at quota: 1 of 1 instances; waiting for an idle instance of type small",
        "waiting in queue at position 3: at quota: 1 of 1 instances; waiting for an idle instance of type small",
      ]);
      const one = await app.inject({ url: `/management/v1/bundles/${high2}`, headers: auth });
      expect(one.json()).toEqual(q[1]);

      // The head runs; the others still wait for an idle small instance.
      await h.drive(async () => (await h.states([high1!])).get(high1!) === "running");
      await d.runOnce();
      q = await queueOf(app);
      expect(q.map((b) => [b.uuid, b.state])).toEqual([
        [high2, "staged"],
        [low, "staged"],
        [high1, "running"],
      ]);
      expect(q[2]).toMatchObject({ instanceId: id, schedulingStatus: null });
      expect(q[0]!.schedulingStatus).toBe(
        "waiting in queue at position 1: at quota: 1 of 1 instances; waiting for an idle instance of type small",
      );

      // Held: the only instance of the type gets no new bundles, and the sentence says so.
      const hold = await app.inject({
        method: "POST",
        url: `/management/v1/instances/hold?instance_id=${id}`,
        headers: auth,
      });
      expect(hold.statusCode).toBe(200);
      await d.runOnce();
      q = await queueOf(app);
      expect(q.slice(0, 2).map((b) => b.schedulingStatus)).toEqual([
        "waiting in queue at position 1: at quota: 1 of 1 instances; only held instances of type small could run it",
        "waiting in queue at position 2: at quota: 1 of 1 instances; only held instances of type small could run it",
      ]);

      // Run again: the sentence goes back to waiting for an idle instance.
      await app.inject({
        method: "POST",
        url: `/management/v1/instances/run?instance_id=${id}`,
        headers: auth,
      });
      await d.runOnce();
      expect((await queueOf(app))[0]!.schedulingStatus).toBe(
        "waiting in queue at position 1: at quota: 1 of 1 instances; waiting for an idle instance of type small",
      );
    } finally {
      await app.close();
      await h.close();
      await killAll(h.db);
    }
  });

  it("places a bundle on the idle instance holding its inputs, says so, and never waits for a busy holder", async () => {
    const config = stubConfig();
    const h = await createHarness({
      db: getDb(),
      logger,
      config: { ...config, cloud: { ...config.cloud, timeoutIdle: 3_600_000 } } as Config,
    });
    const d = await h.startDispatcher();
    const app = await managementFor(h, d);
    const input = { digest: `${"a".repeat(64)}/321`, bytes: 3 * GiB };
    /** A whole-small bundle with the input, staged only once its input_manifests are set. */
    const withInput = async (command: string[]) => {
      const b = await createTestBundle(h.db, h.owner, { resources: WHOLE_SMALL, command });
      await setBundleInputManifests(h.db, b.uuid, [input]);
      const r = await stageBundle(h.db, b.uuid, { actor: "test" });
      if (!r.ok) throw new Error(r.reason);
      return b.uuid;
    };
    const idle = () => d.parts!.pool.workers().filter((w) => w.state === "idle");
    try {
      // Two idle small instances (two whole-instance bundles ran on them).
      const warm = await h.submit(2, () => ({ resources: WHOLE_SMALL, command: ["sleep", "1"] }));
      await h.drive(async () => [...(await h.states(warm)).values()].every((s) => s === "ready"));
      await h.drive(async () => idle().length === 2);
      // The usual order (by id among equals) would pick the first; the second's cache holds the input.
      const [first, holder] = idle()
        .map((w) => w.id)
        .sort();
      h.cloud.vm(holder!)!.cachedManifests = [input.digest];
      await h.drive(async () => d.parts!.pool.worker(holder!)?.cachedManifests?.length === 1);

      const a = await withInput(["sleep", "600"]);
      // The dispatcher's view (what the management API shows) follows the row by its NOTIFY: wait for it there.
      await h.drive(async () => (await queueOf(app)).find((x) => x.uuid === a)?.state === "running");
      const why = "placed for its cache: 3.0 GiB of 3.0 GiB of inputs held there";
      expect((await queueOf(app)).find((b) => b.uuid === a)).toMatchObject({
        state: "running",
        instanceId: holder,
        placement: why,
      });

      // The holder is full now: the next bundle with the same input starts on the other instance at once.
      const b = await withInput(["sleep", "600"]);
      await d.runOnce();
      await h.drive(async () => (await queueOf(app)).find((x) => x.uuid === b)?.state === "running");
      const item = (await queueOf(app)).find((x) => x.uuid === b);
      expect(item).toMatchObject({ state: "running", instanceId: first });
      expect(item?.placement).toBeUndefined();
      expect(h.cloud.vms.size).toBe(2);
    } finally {
      await app.close();
      await h.close();
      await killAll(h.db);
    }
  });

  it("says when every eligible type is at capacity", async () => {
    const h = await createHarness({
      db: getDb(),
      logger,
      cloud: { capacityErrors: { instanceTypes: new Set(["small"]) } },
    });
    const d = await h.startDispatcher();
    const app = await managementFor(h, d);
    try {
      const [uuid] = await h.submit(1, () => ({
        resources: { vcpus: 1, ram: GiB, scratch: GiB, gpu: null },
      }));
      await d.runOnce();
      const erredAt = h.clock.now();
      await d.parts!.pool.settled(); // the create call fails: small is at capacity
      await d.runOnce();
      const q = await queueOf(app);
      expect(q).toEqual([
        expect.objectContaining({
          uuid,
          eligibleTypes: ["small"],
          schedulingStatus: `waiting in queue at position 1: no instance type is available: small at capacity until ${hhmm(erredAt + CAPACITY_BLOCK_MS)}`,
        }),
      ]);
      expect((await app.inject({ url: "/management/v1/instances", headers: auth })).json().items).toEqual([]);
    } finally {
      await app.close();
      await h.close();
      await killAll(h.db);
    }
  });
});
