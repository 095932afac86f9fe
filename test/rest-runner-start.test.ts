/**
 * Runners' `start` calls that arrive together (a burst of bundles starting) share a statement
 * (rest-server/routes-runner.ts, store/transitions.ts markRunningByTokens), on PostgreSQL and PGlite: each
 * caller still gets its own bundle, and a bad, stale or repeated token gets the answer it gets alone.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pino } from "pino";
import { afterAll, beforeAll, expect, it } from "vitest";
import { newRunnerToken } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import type { Db } from "../store/db.ts";
import { getBundle, listEvents } from "../store/queries.ts";
import { stageBundle } from "../store/transitions.ts";
import { createTestBundle, createTestUser, describeEachDb, startWithRunnerToken } from "./db.ts";
import { restServerBasics } from "./fixtures.ts";
import { injectClient } from "./rest-client.ts";

describeEachDb("runner start calls", (getDb) => {
  let dir: string;
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-start-"));
  });
  afterAll(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  it("calls that arrive while two start statements run go together; each gets its own answer", async () => {
    const db = getDb();
    // The hashes each start statement carried. The first two statements of the burst are held back for a
    // second, so that every other call of the burst is surely in before they end (on PGlite a statement can
    // otherwise end before the next injected request reaches its handler).
    const groups: number[] = [];
    let holds = 0;
    const counted: Db = Object.create(db);
    counted.query = async (sql, params) => {
      if (sql.includes("state = 'running'")) {
        groups.push(((params ?? [])[0] as string[]).length);
        if (holds > 0) {
          holds--;
          await new Promise((r) => setTimeout(r, 1000));
        }
      }
      return db.query(sql, params);
    };
    const app = await createRestServer(restServerBasics(counted, join(dir, "data")));
    const api = injectClient(app);
    const owner = (await createTestUser(db)).uuid;
    const started: { uuid: string; token: string }[] = [];
    for (let i = 0; i < 8; i++) {
      const b = await createTestBundle(db, owner);
      await stageBundle(db, b.uuid, { actor: "test" });
      const { token } = await startWithRunnerToken(db, b.uuid, { instanceId: `i-${i}` });
      started.push({ uuid: b.uuid, token });
    }
    // The first bundle is already running (a retried start finds its own attempt running: success).
    expect((await api("POST", "/api/v1/runner/start", started[0]!.token, {})).status).toBe(200);
    groups.length = 0;
    holds = 2;
    const stranger = newRunnerToken();
    const answers = await Promise.all([
      ...started.map((s) => api("POST", "/api/v1/runner/start", s.token, {})),
      api("POST", "/api/v1/runner/start", stranger, {}),
    ]);
    // The first alone, the second at once beside it (two statements in flight, routes-runner.ts), then the seven
    // that came while both ran in one statement; the two it moved nothing for (running already, unknown) were
    // looked at alone.
    expect(groups).toEqual([1, 1, 7]);
    for (const [i, s] of started.entries()) {
      expect(answers[i]).toMatchObject({ status: 200, body: { uuid: s.uuid, state: "running", attempt: 1 } });
      const events = await listEvents(db, s.uuid);
      expect(events.filter((e) => e.toState === "running").map((e) => e.actor)).toEqual(["runner"]);
      expect((await getBundle(db, s.uuid))?.instanceId).toBe(`i-${i}`);
    }
    expect(answers[8]).toMatchObject({ status: 401, body: { error: { code: "auth.invalid_token" } } });
    await app.close();
  });

  it("a token given twice in one `starts` call moves its bundle once, logs it once, and answers both", async () => {
    const db = getDb();
    const lines: { msg?: string; bundleUuid?: string }[] = [];
    const logger = pino({ level: "info" }, { write: (line: string) => lines.push(JSON.parse(line)) });
    const app = await createRestServer({ ...restServerBasics(db, join(dir, "data-twice")), logger });
    try {
      const api = injectClient(app);
      const b = await createTestBundle(db, (await createTestUser(db)).uuid);
      await stageBundle(db, b.uuid, { actor: "test" });
      const { token } = await startWithRunnerToken(db, b.uuid);
      const res = await api("POST", "/api/v1/runner/starts", undefined, { tokens: [token, token] });
      expect(res.status).toBe(200);
      expect(res.body.items).toEqual([
        expect.objectContaining({ uuid: b.uuid, state: "running", attempt: 1 }),
        expect.objectContaining({ uuid: b.uuid, state: "running", attempt: 1 }),
      ]);
      expect(lines.filter((l) => l.msg === "bundle running" && l.bundleUuid === b.uuid)).toHaveLength(1);
      const events = await listEvents(db, b.uuid);
      expect(events.filter((e) => e.toState === "running")).toHaveLength(1);
    } finally {
      await app.close();
    }
  });
});
