/**
 * `serve` hands the bundle rows its REST server writes (new bundles, and the transitions of the runners' calls)
 * straight to its own dispatcher's queue (RestServerOptions.onBundlesWritten -> Dispatcher.bundlesWritten), so
 * the scheduler need not wait for their NOTIFY and the read it wakes (docs/performance.md, bench:dispatch).
 */
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pino } from "pino";
import { describe, expect, it } from "vitest";
import { ClaimsInFlight } from "../lib/claims-in-flight.ts";
import { hashToken, newRunnerToken } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import { getBundle, insertBundleRows } from "../store/queries.ts";
import { stageBundle, startBundle } from "../store/transitions.ts";
import type { Bundle } from "../store/types.ts";
import {
  createTestBundle,
  createTestUser,
  createTestUserWithToken,
  startWithRunnerToken,
  testBundleUuid,
  testNewBundle,
} from "./db.ts";
import { createHarness, settle, useTestDb } from "./dispatcher-harness.ts";
import { restServerBasics } from "./fixtures.ts";
import { injectClient } from "./rest-client.ts";

const logger = pino({ level: process.env["DC_TEST_LOG"] ?? "silent" });

for (const kind of ["pg", "pglite"] as const)
  describe(`new bundles reach the dispatcher's queue without their NOTIFY [${kind}]`, () => {
    const getDb = useTestDb(kind);

    it("the REST server tells of committed rows of single and batch submissions, brief answers too", async () => {
      const db = getDb();
      const told: Bundle[][] = [];
      let failing = false;
      const app = await createRestServer({
        ...restServerBasics(db, join(tmpdir(), "dispatch-cloud-bundles-created")),
        onBundlesWritten: (bundles) => {
          told.push([...bundles]);
          if (failing) throw new Error("the listener broke");
        },
      });
      try {
        const { token } = await createTestUserWithToken(db);
        const headers = { authorization: `Bearer ${token}` };
        const body = { command: ["true"], image: "busybox", resources: { vcpus: 1, ram: "256MiB" } };
        const one = await app.inject({ method: "POST", url: "/api/v1/bundles", headers, payload: body });
        expect(one.statusCode).toBe(201);
        const batch = await app.inject({
          method: "POST",
          url: "/api/v1/bundles/batch",
          headers,
          payload: { items: [body, body, body] },
        });
        expect(batch.statusCode).toBe(201);
        const brief = await app.inject({
          method: "POST",
          url: "/api/v1/bundles/batch",
          headers: { ...headers, prefer: "return=minimal" },
          payload: { items: [body] },
        });
        expect(brief.statusCode).toBe(201);
        // The caller still gets the brief answer; the listener gets whole rows.
        expect(brief.headers["preference-applied"]).toBe("return=minimal");
        const briefItems = brief.json<{ items: Record<string, unknown>[] }>().items;
        expect(briefItems.map((b) => Object.keys(b).sort())).toEqual([["state", "uuid"]]);
        const uuids = [
          [one.json<{ uuid: string }>().uuid],
          batch.json<{ items: { uuid: string }[] }>().items.map((b) => b.uuid),
          briefItems.map((b) => b["uuid"]),
        ];
        expect(told.map((bs) => bs.map((b) => b.uuid))).toEqual(uuids);
        // Committed rows, as the database has them now (a queue applies them by change_seq).
        for (const b of told.flat()) {
          const { rows } = await db.query<{ state: string; change_seq: string }>(
            "SELECT state, change_seq::text AS change_seq FROM bundles WHERE uuid = $1",
            [b.uuid],
          );
          expect(rows[0]).toEqual({ state: b.state, change_seq: String(b.changeSeq) });
          expect(b.state).toBe("staged");
        }
        // A refused submission tells nobody.
        const bad = await app.inject({
          method: "POST",
          url: "/api/v1/bundles",
          headers,
          payload: { ...body, command: [] },
        });
        expect(bad.statusCode).toBe(400);
        expect(told).toHaveLength(3);
        // A listener that throws does not fail a submission that is committed.
        failing = true;
        const still = await app.inject({ method: "POST", url: "/api/v1/bundles", headers, payload: body });
        expect(still.statusCode).toBe(201);
        expect(told).toHaveLength(4);
      } finally {
        await app.close();
      }
    });

    it("the REST server tells of the rows its runners' start, starts, finish, requeue and preempted calls move", async () => {
      const db = getDb();
      const told: { uuid: string; state: string; changeSeq: number }[][] = [];
      const app = await createRestServer({
        ...restServerBasics(db, join(tmpdir(), "dispatch-cloud-bundles-written")),
        onBundlesWritten: (bundles) =>
          told.push(bundles.map(({ uuid, state, changeSeq }) => ({ uuid, state, changeSeq }))),
      });
      try {
        const api = injectClient(app);
        const owner = (await createTestUser(db)).uuid;
        const runners: { uuid: string; token: string }[] = [];
        for (let i = 0; i < 4; i++) {
          const b = await createTestBundle(db, owner);
          await stageBundle(db, b.uuid, { actor: "test" });
          runners.push({ uuid: b.uuid, token: (await startWithRunnerToken(db, b.uuid)).token });
        }
        const [a, b, c, d] = runners as [
          (typeof runners)[0],
          (typeof runners)[0],
          (typeof runners)[0],
          (typeof runners)[0],
        ];
        // A finish before start is refused (409) and tells nobody.
        expect((await api("POST", "/api/v1/runner/finish", d.token, { exitCode: 0 })).status).toBe(409);
        expect(told).toEqual([]);
        expect((await api("POST", "/api/v1/runner/start", a.token, {})).status).toBe(200);
        const many = await api("POST", "/api/v1/runner/starts", undefined, { tokens: [b.token, c.token] });
        expect(many.status).toBe(200);
        expect((await api("POST", "/api/v1/runner/finish", a.token, { exitCode: 0 })).status).toBe(200);
        expect((await api("POST", "/api/v1/runner/requeue", b.token, { reason: "disk full" })).status).toBe(
          200,
        );
        expect((await api("POST", "/api/v1/runner/preempted", c.token, {})).status).toBe(200);
        // d starts; its retried start finds its attempt running and moves nothing: nobody is told again.
        expect((await api("POST", "/api/v1/runner/start", d.token, {})).status).toBe(200);
        expect((await api("POST", "/api/v1/runner/start", d.token, {})).status).toBe(200);
        const states = (t: typeof told) => t.map((rows) => rows.map((r) => `${r.uuid} ${r.state}`).sort());
        expect(states(told)).toEqual([
          [`${a.uuid} running`],
          [`${b.uuid} running`, `${c.uuid} running`].sort(),
          [`${a.uuid} ready`],
          [`${b.uuid} staged`],
          [`${c.uuid} staged`],
          [`${d.uuid} running`],
        ]);
        // Each is the committed row as the database has it now, or an earlier one (applied by change_seq).
        const last = new Map(told.flat().map((r) => [r.uuid, r]));
        for (const r of last.values()) {
          const { rows } = await db.query<{ state: string; change_seq: string }>(
            "SELECT state, change_seq::text AS change_seq FROM bundles WHERE uuid = $1",
            [r.uuid],
          );
          expect(rows[0]).toEqual({ state: r.state, change_seq: String(r.changeSeq) });
        }
      } finally {
        await app.close();
      }
    });

    it("a runner's `starts` waits for its token's claim still in flight in the process; elsewhere the token is unknown", async () => {
      const db = getDb();
      const claimsInFlight = new ClaimsInFlight();
      const basics = restServerBasics(db, join(tmpdir(), "dispatch-cloud-claims-in-flight"));
      const withClaims = await createRestServer({ ...basics, claimsInFlight });
      const without = await createRestServer(basics);
      try {
        const owner = (await createTestUser(db)).uuid;
        /** A staged bundle whose claim (with a new token) is made once `open` is called, recorded in flight. */
        const heldClaim = async () => {
          const b = await createTestBundle(db, owner);
          await stageBundle(db, b.uuid, { actor: "test" });
          const token = newRunnerToken();
          let open: () => void = () => {};
          const gate = new Promise<void>((r) => {
            open = r;
          });
          const claim = gate.then(() =>
            startBundle(db, b.uuid, {
              instanceId: "i-1",
              instanceType: "t",
              runnerTokenHash: hashToken(token),
              gpuDevices: [],
              actor: "test",
            }),
          );
          claimsInFlight.add(hashToken(token), claim);
          return { uuid: b.uuid, token, open, claim };
        };
        const x = await heldClaim();
        const answer = injectClient(withClaims)("POST", "/api/v1/runner/starts", undefined, {
          tokens: [x.token],
        });
        await new Promise((r) => setTimeout(r, 50));
        expect((await getBundle(db, x.uuid))?.state).toBe("staged");
        x.open();
        expect((await x.claim).ok).toBe(true);
        const res = await answer;
        expect(res.status).toBe(200);
        expect(res.body).toMatchObject({ items: [{ uuid: x.uuid, state: "running", attempt: 1 }] });
        expect(claimsInFlight.size).toBe(0);

        // A REST server that is not the dispatcher's (no claims in flight) answers at once: the token is unknown.
        const y = await heldClaim();
        const refused = await injectClient(without)("POST", "/api/v1/runner/starts", undefined, {
          tokens: [y.token],
        });
        expect(refused.body).toMatchObject({
          items: [{ status: 401, error: { code: "auth.invalid_token" } }],
        });
        y.open();
        await y.claim;
      } finally {
        await withClaims.close();
        await without.close();
      }
    });

    it("the dispatcher applies them to its queue at once and runs them", async () => {
      const h = await createHarness({ db: getDb(), logger });
      try {
        const d = await h.startDispatcher();
        expect(d.active).toBe(true);
        await settle();
        // Inserted without a NOTIFY (and FakeClock holds the poll): the queue has no way to know of it.
        const uuids = [testBundleUuid(), testBundleUuid(), testBundleUuid()];
        const rows = await insertBundleRows(
          h.db,
          uuids.map((uuid) => ({ uuid, bundle: testNewBundle(h.owner, { command: ["sleep", "1"] }) })),
          false,
          "submitted",
        );
        await settle();
        expect(uuids.map((u) => d.parts?.queue.get(u))).toEqual([undefined, undefined, undefined]);
        const told: number[] = [];
        const unsubscribe = d.parts!.queue.subscribe((changes) => told.push(changes.length));
        d.bundlesWritten(rows);
        unsubscribe();
        expect(uuids.map((u) => d.parts?.queue.get(u)?.state)).toEqual(["staged", "staged", "staged"]);
        // The listeners (the scheduler's wake-up among them) hear of a batch once.
        expect(told).toEqual([3]);
        await h.drive(async () => [...(await h.states(uuids)).values()].every((s) => s === "ready"));
        // A standby (or stopped) dispatcher has no queue: it ignores them.
        await d.stop();
        expect(() => d.bundlesWritten(rows)).not.toThrow();
      } finally {
        await h.close();
      }
    });
  });
