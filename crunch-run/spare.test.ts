/**
 * A spare's side of its channel to the warm pool (waitForWork), driven message by message: the pool's `start`
 * answer may come before the spare took the bundle, and an answer for a bundle the spare refused (or a malformed
 * one) must not become another bundle's start. The pool and real spares run in test/crunch-run-warm-pool.test.ts.
 */
import { describe, expect, it } from "vitest";
import type { FromSpare, PoolStart, SpareChannel, SpareWork, ToSpare } from "./spare.ts";
import { waitForWork } from "./spare.ts";

/** A channel whose pool side is the test: `sent` is what the spare said, `deliver` speaks to it. */
function testChannel() {
  const sent: FromSpare[] = [];
  let listener: (m: ToSpare) => void = () => {};
  const channel: SpareChannel = {
    send: (m, callback) => {
      sent.push(m);
      queueMicrotask(() => callback?.(null));
    },
    onMessage: (l) => {
      listener = l;
    },
    onClose: () => {},
    leave: () => {},
  };
  return { channel, sent, deliver: (m: unknown) => listener(m as ToSpare) };
}

const work = (uuid: string): SpareWork => ({ mode: "start", uuid, doc: "{}" });
const ok = (uuid: string): PoolStart => ({ ok: true, body: { uuid, state: "running", attempt: 1 } });
const ticks = async () => {
  for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r));
};

describe("waitForWork (a spare's wait for a bundle and its start answer)", () => {
  it("keeps an answer that comes before the spare took its bundle, and uses it once `took` is sent", async () => {
    const { channel, sent, deliver } = testChannel();
    let release: (refusal: string | null) => void = () => {};
    const got = waitForWork(channel, () => new Promise((r) => (release = r)));
    deliver({ type: "work", work: work("zzzzz-bndl-aaaaaaaaaaaaaaa") });
    deliver({ type: "started", uuid: "zzzzz-bndl-aaaaaaaaaaaaaaa", start: ok("zzzzz-bndl-aaaaaaaaaaaaaaa") });
    await ticks();
    expect(sent).toEqual([{ type: "ready" }]);
    release(null);
    expect(await got).toEqual({
      work: work("zzzzz-bndl-aaaaaaaaaaaaaaa"),
      start: ok("zzzzz-bndl-aaaaaaaaaaaaaaa"),
    });
    expect(sent).toEqual([{ type: "ready" }, { type: "took", pid: process.pid }]);
  });

  it("ignores an answer for a bundle it refused, and one naming another bundle; a second hand-off meanwhile waits", async () => {
    const { channel, sent, deliver } = testChannel();
    const got = waitForWork(channel, async (w) => (w.uuid.endsWith("a") ? "refused for the test" : null));
    deliver({ type: "work", work: work("zzzzz-bndl-aaaaaaaaaaaaaaa") });
    await ticks();
    // The pool's answer for the refused bundle comes late, then the next bundle.
    deliver({ type: "started", uuid: "zzzzz-bndl-aaaaaaaaaaaaaaa", start: ok("zzzzz-bndl-aaaaaaaaaaaaaaa") });
    deliver({ type: "work", work: work("zzzzz-bndl-bbbbbbbbbbbbbbb") });
    // Not looked at while the spare holds a hand-off.
    deliver({ type: "work", work: work("zzzzz-bndl-ccccccccccccccc") });
    await ticks();
    deliver({ type: "started", uuid: "zzzzz-bndl-aaaaaaaaaaaaaaa", start: ok("zzzzz-bndl-aaaaaaaaaaaaaaa") });
    deliver({ type: "started", uuid: "zzzzz-bndl-ccccccccccccccc", start: ok("zzzzz-bndl-ccccccccccccccc") });
    await ticks();
    expect(sent).toEqual([
      { type: "ready" },
      { type: "refused", why: "refused for the test" },
      { type: "took", pid: process.pid },
    ]);
    const refusal: PoolStart = { ok: false, status: 409, code: "runner.not_current", message: "no" };
    deliver({ type: "started", uuid: "zzzzz-bndl-bbbbbbbbbbbbbbb", start: refusal });
    expect(await got).toEqual({ work: work("zzzzz-bndl-bbbbbbbbbbbbbbb"), start: refusal });
  });

  it("takes an answer of the wrong shape as no answer (the spare then calls `start` itself)", async () => {
    const { channel, deliver } = testChannel();
    const got = waitForWork(channel, async () => null);
    deliver({ type: "work", work: work("zzzzz-bndl-aaaaaaaaaaaaaaa") });
    await ticks();
    deliver({ type: "started", uuid: "zzzzz-bndl-aaaaaaaaaaaaaaa", start: { ok: true, body: "running" } });
    expect(await got).toEqual({
      work: work("zzzzz-bndl-aaaaaaaaaaaaaaa"),
      start: { ok: null, why: "not a start answer" },
    });
  });
});
