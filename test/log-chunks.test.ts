/**
 * appendLogChunk (store/queries.ts, the function append_log_chunk of migration 014) on both databases: chunks of
 * one stream from writers at once, the stream's limit and its notice, gaps, and attempts that are not current;
 * appendLogChunkByToken (append_log_chunk_by_token, migration 016): the same by the runner's token.
 */
import { expect, it } from "vitest";
import { hashToken } from "../lib/tokens.ts";
import { appendLogChunk, appendLogChunkByToken, readLogChunks } from "../store/queries.ts";
import { finishBundle, markRunning, stageBundle } from "../store/transitions.ts";
import { createTestBundle, createTestUser, describeEachDb, startWithRunnerToken } from "./db.ts";

describeEachDb("log chunks in one statement", (getDb) => {
  /** A running bundle's uuid and attempt (and its runner token's hash). */
  const running = async (): Promise<{ uuid: string; attempt: number; tokenHash: string }> => {
    const db = getDb();
    const b = await createTestBundle(db, (await createTestUser(db)).uuid);
    expect((await stageBundle(db, b.uuid, { actor: "test" })).ok).toBe(true);
    const { bundle, token } = await startWithRunnerToken(db, b.uuid);
    expect((await markRunning(db, b.uuid, bundle.attempt, { actor: "test" })).ok).toBe(true);
    return { uuid: b.uuid, attempt: bundle.attempt, tokenHash: hashToken(token) };
  };
  const stream = async (b: { uuid: string; attempt: number }, name: "stdout" | "stderr" = "stdout") =>
    Buffer.concat(
      (await readLogChunks(getDb(), { ...b, stream: name, from: 0, limit: 10_000 })).map((c) => c.data),
    ).toString();

  it("stores each byte once when overlapping chunks of one stream arrive at once", async () => {
    const b = await running();
    const text = Array.from({ length: 400 }, (_, i) => String.fromCharCode(97 + (i % 26))).join("");
    // 37 writers: chunks of 40 bytes every 10 bytes, so each overlaps its neighbours; all sent together.
    const chunk = (i: number) =>
      appendLogChunk(getDb(), {
        ...b,
        stream: "stdout",
        offset: i * 10,
        data: Buffer.from(text.slice(i * 10, i * 10 + 40)),
      });
    const answers = await Promise.all(Array.from({ length: 37 }, (_, i) => chunk(i)));
    // Each is stored (the answer is where the stream ends after it, at least the chunk's own end), or refused
    // as a gap (a writer ahead of the bytes before it): sent again in order, as a runner sends from the offset
    // it is told.
    const gaps: number[] = [];
    for (const [i, a] of answers.entries()) {
      if (a.ok) expect(a.stored).toBeGreaterThanOrEqual(i * 10 + 40);
      else {
        expect(a).toMatchObject({ reason: "gap" });
        gaps.push(i);
      }
    }
    for (const i of gaps) {
      const again = await chunk(i);
      expect(again.ok && again.stored >= i * 10 + 40).toBe(true);
    }
    expect(await stream(b)).toBe(text);
  });

  it("keeps the first maxBytes of a stream, then one notice, then acknowledges and drops", async () => {
    const b = await running();
    const put = (offset: number, data: string) =>
      appendLogChunk(getDb(), { ...b, stream: "stderr", offset, data: Buffer.from(data), maxBytes: 10 });
    expect(await put(0, "12345678")).toEqual({ ok: true, stored: 8 });
    const notice =
      "\n[dispatch-cloud] the stderr log reached its limit of 10 bytes (restServer.maxLogBytesPerStream); later bytes were dropped\n";
    expect(await put(8, "abcdefgh")).toEqual({ ok: true, stored: 10 + notice.length, truncated: true });
    expect(await stream(b, "stderr")).toBe(`12345678ab${notice}`);
    expect(await put(16, "more")).toEqual({ ok: true, stored: 10 + notice.length, truncated: true });
    expect(await put(500, "more")).toEqual({ ok: true, stored: 504, truncated: true });
    expect(await stream(b, "stderr")).toBe(`12345678ab${notice}`);
  });

  it("refuses a gap with where the stream ends, and an attempt that is not current with the bundle's", async () => {
    const b = await running();
    const put = (args: { uuid: string; attempt: number }, offset: number) =>
      appendLogChunk(getDb(), { ...args, stream: "stdout", offset, data: Buffer.from("xy") });
    expect(await put(b, 0)).toEqual({ ok: true, stored: 2 });
    expect(await put(b, 3)).toEqual({ ok: false, reason: "gap", stored: 2 });
    expect(await put({ uuid: b.uuid, attempt: b.attempt + 1 }, 2)).toEqual({
      ok: false,
      reason: "not_current",
      current: { state: "running", attempt: b.attempt },
    });
    expect(await put({ uuid: "zzzzz-bndl-000000000000000", attempt: 1 }, 0)).toEqual({
      ok: false,
      reason: "not_current",
      current: null,
    });
    expect(await stream(b)).toBe("xy");
  });

  it("stores a chunk by the runner's token for its bundle's attempt, under the same rules; nothing for a token that is not current", async () => {
    const b = await running();
    const put = (tokenHash: string, offset: number, data = "xy") =>
      appendLogChunkByToken(getDb(), {
        tokenHash,
        stream: "stdout",
        offset,
        data: Buffer.from(data),
        maxBytes: 6,
      });
    const self = { uuid: b.uuid, attempt: b.attempt };
    expect(await put(b.tokenHash, 0)).toEqual({ bundle: self, result: { ok: true, stored: 2 } });
    expect(await put(b.tokenHash, 0, "xyz")).toEqual({ bundle: self, result: { ok: true, stored: 3 } });
    expect(await put(b.tokenHash, 5)).toEqual({
      bundle: self,
      result: { ok: false, reason: "gap", stored: 3 },
    });
    expect(await put(b.tokenHash, 3, "abcd")).toMatchObject({
      bundle: self,
      result: { ok: true, truncated: true },
    });
    expect(await put(hashToken("dcr_unknown"), 0)).toBeNull();
    expect(await stream(b)).toMatch(/^xyzabc\n\[dispatch-cloud\] the stdout log reached its limit/);
    // A finished bundle's token (its hash cleared) stores nothing.
    const done = await running();
    const fin = await finishBundle(getDb(), done.uuid, done.attempt, { exitCode: 0, actor: "test" });
    expect(fin.ok).toBe(true);
    expect(await put(done.tokenHash, 0)).toBeNull();
    expect(await stream(done)).toBe("");
  });
});
