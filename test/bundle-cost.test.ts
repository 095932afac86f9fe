/**
 * What a bundle is charged (costDollars): each attempt that ran, at the price per hour the dispatcher fixed when it
 * started it (its share of its instance's price then), for the time it ran, added up over the attempts whichever
 * way each left `running`. The store's transitions on both databases, then through the dispatcher on the stub
 * cloud with a spot market, the runner API and the users' API.
 */
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { pino } from "pino";
import { describe, expect, it } from "vitest";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { getBundle } from "../store/queries.ts";
import {
  finishBundle,
  killBundle,
  loseBundle,
  markRunning,
  requeueForUnavailableImage,
  stageBundle,
  startBundle,
} from "../store/transitions.ts";
import type { Bundle, TransitionResult } from "../store/types.ts";
import { createTestBundle, createTestUser, createTestUserWithToken, describeEachDb } from "./db.ts";
import { createHarness, GiB, stubConfig, useTestDb } from "./dispatcher-harness.ts";

const ok = (r: TransitionResult): Bundle => {
  if (!r.ok) throw new Error(`transition refused: ${r.reason} (state ${r.current?.state})`);
  return r.bundle;
};

/** As if the running attempt had started `minutes` earlier than it did (the database's clock is real). */
async function ranFor(db: Db, uuid: string, minutes: number): Promise<void> {
  await db.query(
    "UPDATE bundles SET running_at = running_at - make_interval(mins => $2::int) WHERE uuid = $1",
    [uuid, minutes],
  );
}

/** Hours in `minutes`: what an attempt shifted by ranFor ran, to within the test's few milliseconds. */
const hoursOf = (minutes: number) => minutes / 60;

describeEachDb("costDollars in the store", (getDb) => {
  let owner: string;
  const db = () => getDb();

  /** A new bundle started at `price` (per hour; null: none known) and running. */
  async function running(price: number | null, uuid?: string): Promise<Bundle> {
    owner ??= (await createTestUser(db())).uuid;
    const id = uuid ?? (await createTestBundle(db(), owner, { maxAttempts: 5 })).uuid;
    if (uuid === undefined) ok(await stageBundle(db(), id, { actor: "test" }));
    const b = ok(
      await startBundle(db(), id, {
        instanceId: "i-1",
        instanceType: "medium",
        runnerTokenHash: `hash-${id}-${Math.random()}`,
        gpuDevices: [],
        pricePerHour: price,
        actor: "dispatcher",
      }),
    );
    expect(b.pricePerHour).toBe(price);
    return ok(await markRunning(db(), id, b.attempt, { actor: "runner" }));
  }

  it("adds each attempt's price x running time whichever way it leaves running, across attempts", async () => {
    // Lost, then finished on a second attempt at another price.
    let b = await running(0.5);
    await ranFor(db(), b.uuid, 60);
    b = ok(await loseBundle(db(), b.uuid, b.attempt, { actor: "dispatcher", reason: "instance lost" }));
    expect(b.state).toBe("staged");
    expect(b.costDollars).toBeCloseTo(0.5 * hoursOf(60), 4);
    const first = b.costDollars!;
    b = await running(0.2, b.uuid);
    expect(b).toMatchObject({ attempt: 2, costDollars: first });
    await ranFor(db(), b.uuid, 30);
    b = ok(await finishBundle(db(), b.uuid, b.attempt, { exitCode: 0, actor: "runner" }));
    expect(b.state).toBe("ready");
    expect(b.costDollars).toBeCloseTo(first + 0.2 * hoursOf(30), 4);

    // Given back for an unavailable image (not counted as an attempt), then killed while running.
    b = await running(0.3);
    await ranFor(db(), b.uuid, 20);
    b = ok(
      await requeueForUnavailableImage(db(), b.uuid, b.attempt, {
        actor: "runner",
        reason: "registry down",
        uncounted: 1,
      }),
    );
    expect(b.costDollars).toBeCloseTo(0.3 * hoursOf(20), 4);
    const requeued = b.costDollars!;
    b = await running(0.3, b.uuid);
    await ranFor(db(), b.uuid, 40);
    b = ok(await killBundle(db(), b.uuid, { actor: "user", reason: "changed my mind" }));
    expect(b.costDollars).toBeCloseTo(requeued + 0.3 * hoursOf(40), 4);

    // A finish that says what the attempt cost: that, added to the earlier attempts'.
    b = await running(0.4);
    await ranFor(db(), b.uuid, 30);
    b = ok(await loseBundle(db(), b.uuid, b.attempt, { actor: "runner", reason: "preempted" }));
    const before = b.costDollars!;
    b = await running(0.4, b.uuid);
    b = ok(await finishBundle(db(), b.uuid, b.attempt, { exitCode: 1, costDollars: 0.07, actor: "runner" }));
    expect(b.state).toBe("failed");
    expect(b.costDollars).toBeCloseTo(before + 0.07, 10);
  });

  it("adds nothing for an attempt without a price, nor when it leaves another state", async () => {
    // A priced attempt lost, then one with no price known (a user's worker, a type without one): the first stays.
    let b = await running(0.6);
    await ranFor(db(), b.uuid, 10);
    b = ok(await loseBundle(db(), b.uuid, b.attempt, { actor: "dispatcher", reason: "instance lost" }));
    const first = b.costDollars!;
    expect(first).toBeCloseTo(0.6 * hoursOf(10), 4);
    b = await running(null, b.uuid);
    await ranFor(db(), b.uuid, 10);
    b = ok(await finishBundle(db(), b.uuid, b.attempt, { exitCode: 0, actor: "runner" }));
    expect(b.costDollars).toBe(first);

    // Killed while staged after a lost attempt: running_at is the lost attempt's, and is not charged again.
    b = await running(0.6);
    await ranFor(db(), b.uuid, 10);
    b = ok(await loseBundle(db(), b.uuid, b.attempt, { actor: "dispatcher", reason: "instance lost" }));
    const lost = b.costDollars!;
    await ranFor(db(), b.uuid, 600);
    b = ok(await killBundle(db(), b.uuid, { actor: "user", reason: "no longer needed" }));
    expect(b).toMatchObject({ state: "killed", costDollars: lost });

    // Killed while starting: it never ran.
    owner ??= (await createTestUser(db())).uuid;
    const s = await createTestBundle(db(), owner);
    ok(await stageBundle(db(), s.uuid, { actor: "test" }));
    ok(
      await startBundle(db(), s.uuid, {
        instanceId: "i-1",
        instanceType: "medium",
        runnerTokenHash: `hash-${s.uuid}`,
        gpuDevices: [],
        pricePerHour: 0.6,
        actor: "dispatcher",
      }),
    );
    b = ok(await killBundle(db(), s.uuid, { actor: "user", reason: "no longer needed" }));
    expect(b).toMatchObject({ state: "killed", costDollars: null, pricePerHour: 0.6 });
  });
});

const SPOT_TYPE = "  spot: {vcpus: 2, ram: 4GiB, includedScratch: 50GiB, price: 0.03, preemptible: true}\n";
const DAY = 24 * 3_600_000;

describe("costDollars through the dispatcher, on the stub cloud's spot market", () => {
  const getDb = useTestDb("pglite");

  it("each attempt at its share of the spot price when it started, for the time it ran; shown to the user", async () => {
    const db = getDb();
    // The market's price now (Instance.priceHistory): what the dispatcher reads when it starts an attempt.
    let spotPrice = 0.04;
    const h = await createHarness({
      db,
      logger: pino({ level: process.env["DC_TEST_LOG"] ?? "silent" }),
      config: stubConfig(SPOT_TYPE),
      cloud: {
        priceHistory: (vm, type) =>
          type.preemptible
            ? [{ startTime: 0, price: spotPrice }]
            : [{ startTime: vm.createdAt, price: type.price }],
      },
      // Every attempt runs until it is preempted or killed.
      runners: { duration: () => DAY },
    });
    let api: FastifyInstance | undefined;
    try {
      api = await createRestServer({
        db,
        logger: false,
        clusterId: "zzzzz",
        maxRequestBodySize: 2 ** 20,
        defaultMaxAttempts: 3,
        dataDir: join(tmpdir(), "dispatch-cloud-cost-test"),
      });
      const user = await createTestUserWithToken(db);
      const userToken = user.token;
      await h.startDispatcher();
      // One of spot's two vCPUs (its RAM share is smaller): half of the instance.
      const submitted = await createTestBundle(db, user.uuid, {
        preemptible: true,
        resources: { vcpus: 1, ram: GiB, scratch: GiB, gpu: null },
      });
      ok(await stageBundle(db, submitted.uuid, { actor: "test" }));
      const uuid: string | undefined = submitted.uuid;
      const runningAttempt = async (attempt: number) => {
        await h.drive(async () => {
          const b = await getBundle(db, uuid!);
          return b?.state === "running" && b.attempt === attempt;
        });
        const b = (await getBundle(db, uuid!))!;
        const vm = h.cloud.vm(b.instanceId ?? "");
        const doc = vm?.runners.get(uuid!)?.doc as { token: string } | undefined;
        if (vm === undefined || doc === undefined)
          throw new Error(`attempt ${attempt} has no runner on a VM`);
        return { b, vm, token: doc.token };
      };

      const one = await runningAttempt(1);
      expect(one.b).toMatchObject({ instanceType: "spot", pricePerHour: 0.04 * 0.5, costDollars: null });
      await ranFor(db, uuid!, 60);
      // The spot price doubles; the instance gets its interruption notice and the runner reports it.
      spotPrice = 0.08;
      one.vm.preempted = true;
      const res = await api.inject({
        method: "POST",
        url: "/api/v1/runner/preempted",
        headers: { authorization: `Bearer ${one.token}`, "content-type": "application/json" },
        payload: "{}",
      });
      expect(res.statusCode, res.body).toBe(200);
      const lost = (await getBundle(db, uuid!))!;
      expect(lost.state).toBe("staged");
      expect(lost.costDollars).toBeCloseTo(0.02 * hoursOf(60), 4);
      one.vm.endRunner(uuid!, null, "TERM");

      // The second attempt, on another instance, at the price of its start.
      const two = await runningAttempt(2);
      expect(two.b.instanceId).not.toBe(one.b.instanceId);
      expect(two.b).toMatchObject({ pricePerHour: 0.08 * 0.5, costDollars: lost.costDollars });
      await ranFor(db, uuid!, 30);
      // While it runs, the users' view adds the running attempt so far to what the lost one was charged.
      const runningView = await api.inject({
        method: "GET",
        url: `/api/v1/bundles/${uuid}`,
        headers: { authorization: `Bearer ${userToken}` },
      });
      expect(runningView.json()).toMatchObject({ state: "running", attempt: 2 });
      expect(runningView.json().costDollars).toBeCloseTo(0.02 * hoursOf(60) + 0.04 * hoursOf(30), 4);
      expect((await getBundle(db, uuid!))!.costDollars).toBe(lost.costDollars);
      const kill = await api.inject({
        method: "POST",
        url: `/api/v1/bundles/${uuid}/kill`,
        headers: { authorization: `Bearer ${userToken}`, "content-type": "application/json" },
        payload: "{}",
      });
      expect(kill.statusCode, kill.body).toBe(200);
      const view = await api.inject({
        method: "GET",
        url: `/api/v1/bundles/${uuid}`,
        headers: { authorization: `Bearer ${userToken}` },
      });
      expect(view.statusCode).toBe(200);
      const shown = view.json() as { state: string; attempt: number; costDollars: number };
      expect(shown).toMatchObject({ state: "killed", attempt: 2 });
      expect(shown.costDollars).toBeCloseTo(0.02 * hoursOf(60) + 0.04 * hoursOf(30), 4);
      expect(shown.costDollars).toBe((await getBundle(db, uuid!))!.costDollars);
      expect(h.runners.errors).toEqual([]);
    } finally {
      await api?.close();
      await h.close();
    }
  }, 120_000);
});
