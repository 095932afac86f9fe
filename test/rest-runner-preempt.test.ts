/**
 * `POST /api/v1/runner/preempted` on PostgreSQL and PGlite: a spot interruption notice requeues the running
 * bundle (running -> staged while attempts remain, else failed), answers 409 for an attempt that is not the
 * running one, and refuses bad bodies with the path of the bad field.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, expect, it } from "vitest";
import { createRestServer } from "../rest-server/server.ts";
import { getBundle, listEvents } from "../store/queries.ts";
import { stageBundle } from "../store/transitions.ts";
import type { NewBundle } from "../store/types.ts";
import { createTestBundle, createTestUser, describeEachDb, startWithRunnerToken } from "./db.ts";
import { injectClient } from "./rest-client.ts";

const TIME = "2026-03-01T10:02:00Z";

describeEachDb("REST runner preempted", (getDb) => {
  let app: FastifyInstance;
  let api: ReturnType<typeof injectClient>;
  let dataDir: string;
  let owner: string;

  beforeAll(async () => {
    dataDir = await mkdtemp(join(tmpdir(), "dc-rest-preempt-"));
    app = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 64 * 1024,
      defaultMaxAttempts: 3,
      dataDir,
    });
    api = injectClient(app);
    owner = (await createTestUser(getDb())).uuid;
  });
  afterAll(async () => {
    await app?.close();
    if (dataDir) await rm(dataDir, { recursive: true, force: true });
  });

  /** A bundle taken to starting on i-spot, and its runner token; `run` also calls start. */
  const dispatched = async (over: Partial<NewBundle> = {}, run = true) => {
    const b = await createTestBundle(getDb(), owner, over);
    expect((await stageBundle(getDb(), b.uuid, { actor: "test" })).ok).toBe(true);
    const { token } = await startWithRunnerToken(getDb(), b.uuid, { instanceId: "i-spot" });
    if (run) expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
    return { uuid: b.uuid, token };
  };
  const preempted = (token: string, body: unknown) =>
    api("POST", "/api/v1/runner/preempted", token, body as object);

  it("requeues the running bundle while attempts remain, with the notice in the reason; the token stops working", async () => {
    const { uuid, token } = await dispatched();
    const res = await preempted(token, { action: "terminate", time: TIME });
    expect(res.status, JSON.stringify(res.body)).toBe(200);
    expect(res.body).toEqual({ uuid, state: "staged", attempt: 1 });
    const b = await getBundle(getDb(), uuid);
    expect(b).toMatchObject({
      state: "staged",
      attempt: 1,
      instanceId: null,
      stateReason: `preempted: spot interruption notice (terminate at ${TIME})`,
    });
    const last = (await listEvents(getDb(), uuid)).at(-1);
    expect(last).toMatchObject({
      fromState: "running",
      toState: "staged",
      actor: "runner",
      reason: `preempted: spot interruption notice (terminate at ${TIME})`,
    });
    // A retried report (its first answer lost) finds the token gone with the attempt.
    const again = await preempted(token, { action: "terminate", time: TIME });
    expect(again.status).toBe(401);
    expect(again.body.error.code).toBe("auth.invalid_token");
  });

  it("fails the bundle when its attempts are used up, saying so", async () => {
    const { uuid, token } = await dispatched({ maxAttempts: 1 });
    const res = await preempted(token, {});
    expect(res.status, JSON.stringify(res.body)).toBe(200);
    expect(res.body).toEqual({ uuid, state: "failed", attempt: 1 });
    expect((await getBundle(getDb(), uuid))?.stateReason).toBe(
      "preempted: spot interruption notice (unknown action at an unknown time) (attempts exhausted: 1 of 1)",
    );
  });

  it("answers 409 runner.not_current when the attempt is not running (its runner never called start)", async () => {
    const { uuid, token } = await dispatched({}, false);
    const res = await preempted(token, { action: "terminate", time: TIME });
    expect(res.status).toBe(409);
    expect(res.body.error.code).toBe("runner.not_current");
    expect(await getBundle(getDb(), uuid)).toMatchObject({ state: "starting", attempt: 1 });
  });

  it.each([
    ["a number as action", { action: 5 }, "action", "request.invalid_body"],
    ["a control character", { time: "10:02\nrm" }, "time", "request.invalid_body"],
    ["an overlong time", { time: "x".repeat(101) }, "time", "request.invalid_body"],
    ["an unknown field", { action: "terminate", instance: "i-1" }, "instance", "request.unknown_field"],
  ])("refuses %s with 400 and the field's path, leaving the bundle running", async (_n, body, path, code) => {
    const { uuid, token } = await dispatched();
    const res = await preempted(token, body);
    expect(res.status).toBe(400);
    expect(res.body.error).toMatchObject({ code, path });
    expect((await getBundle(getDb(), uuid))?.state).toBe("running");
  });

  it("refuses a body that is not an object", async () => {
    const { token } = await dispatched();
    const res = await api("POST", "/api/v1/runner/preempted", token, "[1]", {
      "content-type": "application/json",
    });
    expect(res.status).toBe(400);
    expect(res.body.error.code).toBe("request.invalid_body");
  });

  it("needs a runner token", async () => {
    expect((await api("POST", "/api/v1/runner/preempted", undefined, {})).status).toBe(401);
    expect((await preempted(`dcr_${"x".repeat(43)}`, {})).status).toBe(401);
  });
});
