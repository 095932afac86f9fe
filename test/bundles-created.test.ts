/**
 * `serve` hands the bundles its REST server creates straight to its own dispatcher's queue
 * (RestServerOptions.onBundlesCreated -> Dispatcher.bundlesCreated), so the scheduler need not wait for their
 * NOTIFY and the read it wakes (docs/performance.md, bench:dispatch).
 */
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pino } from "pino";
import { describe, expect, it } from "vitest";
import { createRestServer } from "../rest-server/server.ts";
import { insertBundleRows } from "../store/queries.ts";
import type { Bundle } from "../store/types.ts";
import { createTestUserWithToken, testBundleUuid, testNewBundle } from "./db.ts";
import { createHarness, settle, useTestDb } from "./dispatcher-harness.ts";
import { restServerBasics } from "./fixtures.ts";

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
        onBundlesCreated: (bundles) => {
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
        d.bundlesCreated(rows);
        unsubscribe();
        expect(uuids.map((u) => d.parts?.queue.get(u)?.state)).toEqual(["staged", "staged", "staged"]);
        // The listeners (the scheduler's wake-up among them) hear of a batch once.
        expect(told).toEqual([3]);
        await h.drive(async () => [...(await h.states(uuids)).values()].every((s) => s === "ready"));
        // A standby (or stopped) dispatcher has no queue: it ignores them.
        await d.stop();
        expect(() => d.bundlesCreated(rows)).not.toThrow();
      } finally {
        await h.close();
      }
    });
  });
