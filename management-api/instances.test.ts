/**
 * The management API's instance and bundle routes on a whole dispatcher on the stub cloud (FakeClock): the
 * instance list (creates in flight as booting), hold/drain/run visible in the instance's tags, kills, unknown
 * ids and missing parameters.
 */
import type { FastifyInstance } from "fastify";
import { pino } from "pino";
import { Registry } from "prom-client";
import { describe, expect, it } from "vitest";
import type { Config } from "../config/schema.ts";
import type { Dispatcher } from "../dispatcher/main.ts";
import { getBundle } from "../store/queries.ts";
import { createHarness, type Harness, useTestDb } from "../test/dispatcher-harness.ts";
import { createManagementServer } from "./server.ts";

const logger = pino({ level: process.env["DC_TEST_LOG"] ?? "silent" });
const TOKEN = "dcm-instances-test-token-0123456789";
const auth = { authorization: `Bearer ${TOKEN}` };

async function managementFor(h: Harness, d: Dispatcher, registry = new Registry()): Promise<FastifyInstance> {
  const config = { ...h.config, management: { ...h.config.management, token: "env:DC_TEST_MGMT" } } as Config;
  return createManagementServer({
    config,
    dispatcher: d,
    db: h.db,
    registry,
    logger: false,
    clock: h.clock,
    env: { DC_TEST_MGMT: TOKEN },
  });
}

describe("management API: instances and kills on the stub cloud", () => {
  const getDb = useTestDb("pg");

  it("lists instances (a create in flight as booting), steers idle behaviour through the tags, and kills", async () => {
    const h = await createHarness({ db: getDb(), logger });
    const registry = new Registry();
    const d = await h.startDispatcher({ registry });
    const app = await managementFor(h, d, registry);
    const pool = d.parts!.pool;
    const list = async () => {
      const res = await app.inject({ url: "/management/v1/instances", headers: auth });
      expect(res.statusCode).toBe(200);
      return res.json().items as Array<Record<string, unknown>>;
    };
    expect(await list()).toEqual([]);

    // A create held in the cloud: the placeholder is listed as booting.
    h.cloud.holdCloudOps(["create"]);
    const [uuid] = await h.submit(1, () => ({ command: ["sleep", "30"] }));
    await d.runOnce();
    const [placeholder] = await list();
    expect(placeholder).toMatchObject({
      instanceId: expect.stringMatching(/^creating-\d+$/),
      address: "",
      instanceType: "small",
      price: 0.1,
      state: "booting",
      idleBehavior: "run",
      runningBundles: [],
      lastBusyAt: null,
      secondsInState: 0,
    });
    expect(typeof placeholder!["providerType"]).toBe("string");
    const queued = await app.inject({ url: "/management/v1/bundles", headers: auth });
    expect(queued.json().items).toEqual([
      expect.objectContaining({
        uuid,
        state: "staged",
        eligibleTypes: ["small"],
        instanceId: null,
        schedulingStatus: "waiting in queue at position 1: waiting for a new small instance to boot",
      }),
    ]);
    h.cloud.releaseCloudOps();

    await h.drive(async () => (await h.states([uuid!])).get(uuid!) === "running");
    const [inst] = await list();
    const id = inst!["instanceId"] as string;
    expect(id).not.toMatch(/^creating-/);
    expect(inst).toMatchObject({ state: "running", runningBundles: [uuid], idleBehavior: "run" });
    expect(inst!["address"]).not.toBe("");
    expect(Date.parse(inst!["stateSince"] as string)).toBeLessThanOrEqual(h.clock.now());
    await h.clock.advance(3000);
    expect(((await list())[0]!["secondsInState"] as number) >= 3).toBe(true);
    // The view is the dispatcher's queue, which learns of the runner's start call from the database's NOTIFY.
    const one = async () =>
      (await app.inject({ url: `/management/v1/bundles/${uuid}`, headers: auth })).json();
    await h.drive(async () => (await one()).state === "running");
    expect(await one()).toMatchObject({ uuid, state: "running", instanceId: id, schedulingStatus: null });

    // hold, drain, run: the answer, the pool and the instance's tag all agree.
    const tag = `${h.config.cloud.tagKeyPrefix}IdleBehavior`;
    for (const behavior of ["hold", "drain", "run"] as const) {
      const res = await app.inject({
        method: "POST",
        url: `/management/v1/instances/${behavior}?instance_id=${id}`,
        headers: auth,
      });
      expect(res.statusCode).toBe(200);
      expect(res.json()).toEqual({ instanceId: id, idleBehavior: behavior });
      expect(pool.worker(id)?.idleBehavior).toBe(behavior);
      expect(h.cloud.vm(id)?.tags[tag]).toBe(behavior);
      expect((await list())[0]!["idleBehavior"]).toBe(behavior);
    }

    // Unknown ids: 404 with the parameter's path; nothing changes.
    for (const action of ["hold", "drain", "run", "kill"]) {
      const res = await app.inject({
        method: "POST",
        url: `/management/v1/instances/${action}?instance_id=i-nonexistent`,
        headers: auth,
      });
      expect([action, res.statusCode, res.json().error]).toEqual([
        action,
        404,
        expect.objectContaining({ code: "management.unknown_instance", path: "instance_id" }),
      ]);
    }
    expect(h.cloud.vm(id)?.tags[tag]).toBe("run");

    // Kill: shut down at once; the VM is destroyed, its bundle lost and requeued.
    const kill = await app.inject({
      method: "POST",
      url: `/management/v1/instances/kill?instance_id=${id}&reason=investigating`,
      headers: auth,
    });
    expect(kill.statusCode).toBe(200);
    expect(kill.json()).toEqual({ instanceId: id, state: "shutdown" });
    expect(pool.worker(id)?.state).toBe("shutdown");
    await h.drive(
      async () => h.cloud.vm(id)?.destroyed === true || h.cloud.liveVms().every((vm) => vm.id !== id),
    );
    await h.drive(
      async () =>
        (await getBundle(h.db, uuid!))?.attempt === 2 || (await h.states([uuid!])).get(uuid!) !== "running",
    );

    // Kill the bundle: killed in the store and gone from the queue; again: 409; unknown: 404.
    const killB = await app.inject({
      method: "POST",
      url: `/management/v1/bundles/kill?uuid=${uuid}&reason=not%20needed`,
      headers: auth,
    });
    expect(killB.statusCode).toBe(200);
    expect(killB.json()).toEqual({ uuid, state: "killed" });
    const row = await getBundle(h.db, uuid!);
    expect([row?.state, row?.stateReason]).toEqual(["killed", "not needed"]);
    const { rows } = await h.db.query<{ actor: string }>(
      "SELECT actor FROM bundle_events WHERE bundle_uuid = $1 AND to_state = 'killed'",
      [uuid],
    );
    expect(rows.map((r) => r.actor)).toEqual(["operator"]);
    // The queue view drops it (a scheduler pass that was planning it may finish first).
    const queueUuids = async () =>
      (
        (await app.inject({ url: "/management/v1/bundles", headers: auth })).json().items as {
          uuid: string;
        }[]
      ).map((b) => b.uuid);
    await h.drive(async () => !(await queueUuids()).includes(uuid!));
    const gone = await app.inject({ url: `/management/v1/bundles/${uuid}`, headers: auth });
    expect([gone.statusCode, gone.json().error.code]).toEqual([404, "management.unknown_bundle"]);
    const again = await app.inject({
      method: "POST",
      url: `/management/v1/bundles/kill?uuid=${uuid}`,
      headers: auth,
    });
    expect([again.statusCode, again.json().error.code]).toEqual([409, "bundle.conflict"]);
    const unknown = await app.inject({
      method: "POST",
      url: "/management/v1/bundles/kill?uuid=zzzzz-bndl-000000000000000",
      headers: auth,
    });
    expect([unknown.statusCode, unknown.json().error]).toEqual([
      404,
      expect.objectContaining({ code: "management.unknown_bundle", path: "uuid" }),
    ]);

    // /metrics serves the dispatcher's registry.
    const metrics = await app.inject({ url: "/metrics", headers: auth });
    expect(metrics.body).toContain("dispatchcloud_instances");
    await app.close();
    await h.close();
  });

  it("kills a running bundle through the API: its runner is signalled", async () => {
    const h = await createHarness({ db: getDb(), logger });
    const d = await h.startDispatcher();
    const app = await managementFor(h, d);
    const kills: Array<{ uuid: string; signal: string }> = [];
    h.cloud.on("runner:kill", (_vm, r, signal) => kills.push({ uuid: r.uuid, signal }));
    const [uuid] = await h.submit(1, () => ({ command: ["sleep", "600"] }));
    // Running is stored at /start; wait until the runner has its spec too, or the kill may reach its /spec
    // call first (it then exits by itself, and there is nothing left to signal).
    await h.drive(async () => h.runners.working.has(uuid!));
    expect((await h.states([uuid!])).get(uuid!)).toBe("running");
    const res = await app.inject({
      method: "POST",
      url: `/management/v1/bundles/kill?uuid=${uuid}`,
      headers: auth,
    });
    expect(res.json()).toEqual({ uuid, state: "killed" });
    expect((await getBundle(h.db, uuid!))?.stateReason).toBe("killed by an operator");
    // Sync finds the runner of a bundle no longer active and signals it (TERM), as for a user's kill.
    await h.drive(async () => kills.some((k) => k.uuid === uuid && k.signal === "TERM"));
    expect(kills.filter((k) => k.uuid !== uuid)).toEqual([]);
    await app.close();
    await h.close();
  });
});
