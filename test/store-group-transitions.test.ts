/**
 * The grouped transitions (store/transitions.ts startBundles, markRunningByTokens): many bundles in one guarded
 * statement, each with its own values, event and NOTIFY; a bundle the guard refuses is left out, never moved
 * wrongly. Raced against each other and against single transitions over separate pools on PostgreSQL (real
 * concurrent connections), and the same assertions on PGlite.
 */
import { beforeAll, expect, it } from "vitest";
import { getBundle, listEvents } from "../store/queries.ts";
import {
  killBundle,
  markRunningByTokens,
  type StartItem,
  stageBundle,
  startBundle,
  startBundles,
} from "../store/transitions.ts";
import { BUNDLE_CHANNEL, type Bundle, type TransitionResult } from "../store/types.ts";
import { createTestBundle, createTestUser, describeEachDb, useRacingDbs } from "./db.ts";

const N = 30;

function ok(r: TransitionResult): Bundle {
  if (!r.ok) throw new Error(`transition refused: ${r.reason}`);
  return r.bundle;
}

const item = (uuid: string, tag: string, gpuDevices: number[] = []): StartItem => ({
  uuid,
  instanceId: `i-${tag}`,
  instanceType: `t-${tag}`,
  runnerTokenHash: `h-${tag}-${uuid}`,
  gpuDevices,
});

describeEachDb("grouped transitions", (getDb) => {
  const racing = useRacingDbs(getDb, 5);
  let owner: string;
  beforeAll(async () => {
    owner = (await createTestUser(getDb())).uuid;
  });

  async function staged(n: number, maxAttempts = 3): Promise<Bundle[]> {
    const out: Bundle[] = [];
    for (let i = 0; i < n; i++) {
      const x = await createTestBundle(getDb(), owner, { maxAttempts });
      out.push(ok(await stageBundle(getDb(), x.uuid, { actor: "bundle-manager" })));
    }
    return out;
  }

  it("startBundles moves each staged bundle with its own values, event and NOTIFY; the others are left out", async () => {
    const db = getDb();
    const [x, y, z, done] = await staged(4);
    // Not staged any more, and staged with no attempt left: the guard refuses both.
    ok(await killBundle(db, done!.uuid, { actor: "operator", reason: "gone" }));
    const noneLeft = (await staged(1, 1))[0]!;
    ok(await startBundle(db, noneLeft.uuid, { ...item(noneLeft.uuid, "s"), actor: "dispatcher" }));
    await db.query("UPDATE bundles SET state = 'staged' WHERE uuid = $1", [noneLeft.uuid]);
    const payloads: string[] = [];
    const unlisten = await db.listen(BUNDLE_CHANNEL, (p) => payloads.push(p));
    const items = [
      item(x!.uuid, "x", [0, 1]),
      item(y!.uuid, "y"),
      item(z!.uuid, "z1"),
      item(z!.uuid, "z2"), // the same bundle twice: it moves once
      item(done!.uuid, "d"),
      item(noneLeft.uuid, "n"),
    ];
    const moved = await startBundles(db, items, "dispatcher");
    expect([...moved.values()].map((m) => m.uuid).sort()).toEqual([x!.uuid, y!.uuid, z!.uuid].sort());
    const mx = moved.get(`h-x-${x!.uuid}`)!;
    expect(mx).toMatchObject({
      state: "starting",
      attempt: 1,
      instanceId: "i-x",
      instanceType: "t-x",
      gpuDevices: [0, 1],
      runningAt: null,
    });
    expect(mx.startingAt).toBeInstanceOf(Date);
    expect(moved.get(`h-y-${y!.uuid}`)).toMatchObject({ instanceId: "i-y", gpuDevices: [] });
    // z moved with exactly one of its two items' values, and the map says which.
    const zs = [moved.get(`h-z1-${z!.uuid}`), moved.get(`h-z2-${z!.uuid}`)].filter((m) => m !== undefined);
    expect(zs).toHaveLength(1);
    const stored = await db.query<{ uuid: string; runner_token_hash: string }>(
      "SELECT uuid, runner_token_hash FROM bundles WHERE uuid = ANY($1::text[])",
      [[x!.uuid, z!.uuid]],
    );
    const hashOf = new Map(stored.rows.map((r) => [r.uuid, r.runner_token_hash]));
    expect(hashOf.get(x!.uuid)).toBe(`h-x-${x!.uuid}`);
    expect(moved.get(hashOf.get(z!.uuid)!)?.instanceId).toBe(zs[0]!.instanceId);
    for (const u of [x!, y!, z!]) {
      const events = (await listEvents(db, u.uuid)).map((e) => [e.fromState, e.toState, e.attempt, e.actor]);
      expect(events.at(-1)).toEqual(["staged", "starting", 1, "dispatcher"]);
      expect(events.filter((e) => e[1] === "starting")).toHaveLength(1);
    }
    expect((await getBundle(db, done!.uuid))?.state).toBe("killed");
    expect(await getBundle(db, noneLeft.uuid)).toMatchObject({ state: "staged", attempt: 1 });
    await expect
      .poll(() =>
        payloads
          .filter((p) => / starting \d+$/.test(p))
          .map((p) => p.split(" ")[0])
          .sort(),
      )
      .toEqual([x!.uuid, y!.uuid, z!.uuid].sort());
    await unlisten();
  });

  it(`two dispatchers claiming the same ${N} bundles in groups, in opposite orders: one winner each`, async () => {
    const bundles = await staged(N);
    const [ra, rb] = await Promise.all([
      startBundles(
        racing().a,
        bundles.map((x) => item(x.uuid, "a")),
        "dispatcher",
      ),
      startBundles(
        racing().b,
        [...bundles].reverse().map((x) => item(x.uuid, "b")),
        "dispatcher",
      ),
    ]);
    expect(ra.size + rb.size).toBe(N);
    for (const x of bundles) {
      const wonA = ra.has(`h-a-${x.uuid}`);
      const wonB = rb.has(`h-b-${x.uuid}`);
      expect(wonA !== wonB).toBe(true);
      expect(await getBundle(getDb(), x.uuid)).toMatchObject({
        state: "starting",
        attempt: 1,
        instanceId: wonA ? "i-a" : "i-b",
      });
      expect((await listEvents(getDb(), x.uuid)).filter((e) => e.toState === "starting")).toHaveLength(1);
    }
  });

  it(`runners' grouped start racing kills on ${N} bundles: each ends killed, with consistent events`, async () => {
    const bundles = await staged(N);
    const moved = await startBundles(
      getDb(),
      bundles.map((x) => item(x.uuid, "r")),
      "dispatcher",
    );
    expect(moved.size).toBe(N);
    const hashes = bundles.map((x) => `h-r-${x.uuid}`);
    const [running, kills] = await Promise.all([
      markRunningByTokens(racing().a, [...hashes, "no-such-hash"], "runner"),
      Promise.all(bundles.map((x) => killBundle(racing().b, x.uuid, { actor: "operator", reason: "race" }))),
    ]);
    expect(running.has("no-such-hash")).toBe(false);
    for (const [i, x] of bundles.entries()) {
      expect(kills[i]!.ok).toBe(true);
      const events = (await listEvents(getDb(), x.uuid))
        .filter((e) => e.fromState === "starting" || e.fromState === "running")
        .map((e) => `${e.fromState}->${e.toState}:${e.actor}`);
      if (running.has(hashes[i]!)) {
        expect(running.get(hashes[i]!)).toMatchObject({ uuid: x.uuid, state: "running", attempt: 1 });
        expect(events).toEqual(["starting->running:runner", "running->killed:operator"]);
      } else {
        expect(events).toEqual(["starting->killed:operator"]);
      }
      expect((await getBundle(getDb(), x.uuid))?.state).toBe("killed");
    }
    // A second start with the same tokens moves nothing: a token is one attempt's, and it is no longer starting.
    expect((await markRunningByTokens(getDb(), hashes, "runner")).size).toBe(0);
  });
});
