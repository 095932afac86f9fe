/**
 * appendLogChunk (store/queries.ts, the function append_log_chunk of migration 014) on both databases: chunks of
 * one stream from writers at once, the stream's limit and its notice, gaps, and attempts that are not current.
 */
import { expect, it } from "vitest";
import { appendLogChunk, readLogChunks } from "../store/queries.ts";
import { markRunning, stageBundle } from "../store/transitions.ts";
import { createTestBundle, createTestUser, describeEachDb, startWithRunnerToken } from "./db.ts";

describeEachDb("log chunks in one statement", (getDb) => {
  /** A running bundle's uuid and attempt. */
  const running = async (): Promise<{ uuid: string; attempt: number }> => {
    const db = getDb();
    const b = await createTestBundle(db, (await createTestUser(db)).uuid);
    expect((await stageBundle(db, b.uuid, { actor: "test" })).ok).toBe(true);
    const { bundle } = await startWithRunnerToken(db, b.uuid);
    expect((await markRunning(db, b.uuid, bundle.attempt, { actor: "test" })).ok).toBe(true);
    return { uuid: b.uuid, attempt: bundle.attempt };
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
});
