/**
 * `POST /api/v1/runner/requeue` on PostgreSQL and PGlite: a runner gives back a running bundle whose container
 * the instance could not start (running -> staged while attempts remain, else failed), with its reason and the
 * instance in the state reason; 409 for an attempt that is not the running one; bad bodies refused with the path
 * of the bad field.
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

const WHY =
  "the container runtime failed: error running hook #0: no such file or directory (this instance's fault)";

describeEachDb("REST runner requeue", (getDb) => {
  let app: FastifyInstance;
  let api: ReturnType<typeof injectClient>;
  let dataDir: string;
  let owner: string;

  beforeAll(async () => {
    dataDir = await mkdtemp(join(tmpdir(), "dc-rest-requeue-"));
    app = await createRestServer({
      db: getDb(),
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 64 * 1024,
      defaultMaxAttempts: 3,
      dataDir,
      unavailableImageRequeues: 2,
    });
    api = injectClient(app);
    owner = (await createTestUser(getDb())).uuid;
  });
  afterAll(async () => {
    await app?.close();
    if (dataDir) await rm(dataDir, { recursive: true, force: true });
  });

  /** A bundle taken to starting on i-rt, and its runner token; `run` also calls start. */
  const dispatched = async (over: Partial<NewBundle> = {}, run = true) => {
    const b = await createTestBundle(getDb(), owner, over);
    expect((await stageBundle(getDb(), b.uuid, { actor: "test" })).ok).toBe(true);
    const { token } = await startWithRunnerToken(getDb(), b.uuid, { instanceId: "i-rt" });
    if (run) expect((await api("POST", "/api/v1/runner/start", token, {})).status).toBe(200);
    return { uuid: b.uuid, token };
  };
  const requeue = (token: string, body: unknown) =>
    api("POST", "/api/v1/runner/requeue", token, body as object);

  it("requeues the running bundle while attempts remain, with the reason and the instance; the token stops working", async () => {
    const { uuid, token } = await dispatched();
    const res = await requeue(token, { reason: WHY });
    expect(res.status, JSON.stringify(res.body)).toBe(200);
    expect(res.body).toEqual({ uuid, state: "staged", attempt: 1 });
    const reason = `requeued by its runner on instance i-rt: ${WHY}`;
    expect(await getBundle(getDb(), uuid)).toMatchObject({
      state: "staged",
      attempt: 1,
      instanceId: null,
      stateReason: reason,
    });
    expect((await listEvents(getDb(), uuid)).at(-1)).toMatchObject({
      fromState: "running",
      toState: "staged",
      actor: "runner",
      reason,
    });
    const again = await requeue(token, { reason: WHY });
    expect(again.status).toBe(401);
    expect(again.body.error.code).toBe("auth.invalid_token");
  });

  it("fails the bundle when its attempts are used up, saying so", async () => {
    const { uuid, token } = await dispatched({ maxAttempts: 1 });
    const res = await requeue(token, { reason: "x" });
    expect(res.body).toEqual({ uuid, state: "failed", attempt: 1 });
    expect((await getBundle(getDb(), uuid))?.stateReason).toBe(
      "requeued by its runner on instance i-rt: x (attempts exhausted: 1 of 1)",
    );
  });

  it("does not use up an attempt for an unavailable registry, up to unavailableImageRequeues times", async () => {
    const UNAVAILABLE =
      "image r.io/x:1 could not be pulled: registry r.io is unavailable (connection refused)";
    const { uuid, token } = await dispatched({ maxAttempts: 1 });
    const first = await requeue(token, { reason: UNAVAILABLE, code: "crunchrun.image_unavailable" });
    expect(first.body).toEqual({ uuid, state: "staged", attempt: 1 });
    expect(await getBundle(getDb(), uuid)).toMatchObject({
      state: "staged",
      maxAttempts: 2,
      stateReason: `requeued by its runner on instance i-rt: ${UNAVAILABLE} (not counted as an attempt: 1 of 2 such requeues)`,
    });
    // Attempt 2 (the one given back), then attempt 3 once the limit is reached: that one counts.
    const again = async () => {
      const { token: t } = await startWithRunnerToken(getDb(), uuid, { instanceId: "i-rt" });
      expect((await api("POST", "/api/v1/runner/start", t, {})).status).toBe(200);
      return requeue(t, { reason: UNAVAILABLE, code: "crunchrun.image_unavailable" });
    };
    expect((await again()).body).toMatchObject({ state: "staged", attempt: 2 });
    expect(await getBundle(getDb(), uuid)).toMatchObject({ maxAttempts: 3 });
    expect((await again()).body).toMatchObject({ state: "failed", attempt: 3 });
    expect((await getBundle(getDb(), uuid))?.stateReason).toBe(
      `requeued by its runner on instance i-rt: ${UNAVAILABLE} (attempts exhausted: 3 of 3)`,
    );
  });

  it("refuses a requeue code other than crunchrun.image_unavailable", async () => {
    const { uuid, token } = await dispatched();
    const res = await requeue(token, { reason: "x", code: "crunchrun.runtime_failed" });
    expect(res.status).toBe(400);
    expect(res.body.error.path).toBe("code");
    expect((await getBundle(getDb(), uuid))?.state).toBe("running");
  });

  it("answers 409 runner.not_current when the attempt is not running (its runner never called start)", async () => {
    const { uuid, token } = await dispatched({}, false);
    const res = await requeue(token, { reason: WHY });
    expect(res.status).toBe(409);
    expect(res.body.error.code).toBe("runner.not_current");
    expect(await getBundle(getDb(), uuid)).toMatchObject({ state: "starting", attempt: 1 });
  });

  it.each([
    ["no reason", {}, "reason", "request.invalid_body"],
    ["an empty reason", { reason: "" }, "reason", "request.invalid_body"],
    ["a control character", { reason: "hook\nfailed" }, "reason", "request.invalid_body"],
    ["an overlong reason", { reason: "x".repeat(1001) }, "reason", "request.invalid_body"],
    ["a number", { reason: 5 }, "reason", "request.invalid_body"],
    ["an unknown field", { reason: "x", state: "ready" }, "state", "request.unknown_field"],
  ])("refuses %s with 400 and the field's path, leaving the bundle running", async (_n, body, path, code) => {
    const { uuid, token } = await dispatched();
    const res = await requeue(token, body);
    expect(res.status).toBe(400);
    expect(res.body.error).toMatchObject({ code, path });
    expect((await getBundle(getDb(), uuid))?.state).toBe("running");
  });

  it("needs a runner token", async () => {
    expect((await api("POST", "/api/v1/runner/requeue", undefined, { reason: "x" })).status).toBe(401);
    expect((await requeue(`dcr_${"x".repeat(43)}`, { reason: "x" })).status).toBe(401);
  });
});
