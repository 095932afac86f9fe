import { Writable } from "node:stream";
import { afterEach, expect, it } from "vitest";
import { createLogger } from "../lib/logger.ts";
import { type NotifiedLoop, type NotifiedLoopOptions, notifiedLoop } from "../rest-server/notified-loop.ts";
import { describeEachDb } from "./db.ts";
import { silentLogger } from "./fixtures.ts";

const CHANNEL = "dc_test_notified_loop";
const HOUR = 3_600_000;

function deferred(): { promise: Promise<void>; resolve: () => void } {
  let resolve!: () => void;
  const promise = new Promise<void>((r) => {
    resolve = r;
  });
  return { promise, resolve };
}

/** A pass that counts itself and waits, the n-th time, until release(n); started(n) resolves as it begins. */
function gatedPass() {
  const starts = new Map<number, ReturnType<typeof deferred>>();
  const releases = new Map<number, ReturnType<typeof deferred>>();
  const of = (m: Map<number, ReturnType<typeof deferred>>, n: number) => {
    const d = m.get(n) ?? deferred();
    m.set(n, d);
    return d;
  };
  let count = 0;
  let finished = 0;
  return {
    pass: async () => {
      const n = ++count;
      of(starts, n).resolve();
      await of(releases, n).promise;
      finished = n;
    },
    started: (n: number) => of(starts, n).promise,
    release: (n: number) => of(releases, n).resolve(),
    get count() {
      return count;
    },
    get finished() {
      return finished;
    },
  };
}

describeEachDb("notifiedLoop", (getDb) => {
  let loop: NotifiedLoop | undefined;
  afterEach(async () => {
    await loop?.stop();
    loop = undefined;
  });

  /** A filter taking `go` payloads that records every payload; seen(n) resolves once n payloads arrived. */
  function recordingFilter() {
    const payloads: string[] = [];
    const waiters: { n: number; resolve: () => void }[] = [];
    return {
      payloads,
      filter: (payload: string) => {
        payloads.push(payload);
        for (const w of waiters) if (payloads.length >= w.n) w.resolve();
        return payload === "go";
      },
      seen: (n: number) =>
        new Promise<void>((resolve) => {
          if (payloads.length >= n) resolve();
          else waiters.push({ n, resolve });
        }),
    };
  }

  /** Starts the suite's loop: on CHANNEL, polling hourly, every payload taken, silent, unless over says. */
  async function startLoop(
    over: Partial<NotifiedLoopOptions> & Pick<NotifiedLoopOptions, "pass">,
  ): Promise<NotifiedLoop> {
    const started = notifiedLoop({
      db: getDb(),
      channel: CHANNEL,
      filter: () => true,
      pollInterval: HOUR,
      log: silentLogger,
      name: "test loop",
      ...over,
    });
    loop = started;
    await started.start();
    return started;
  }

  const notify = (payload: string) => getDb().query("SELECT pg_notify($1, $2)", [CHANNEL, payload]);

  it("runs a first pass on start, and once more after it for any number of passes requested during it", async () => {
    const p = gatedPass();
    const f = recordingFilter();
    const l = await startLoop({ pass: p.pass, filter: f.filter });
    await p.started(1);
    await notify("go");
    await notify("go");
    await f.seen(2);
    expect(p.count).toBe(1);
    p.release(1);
    await p.started(2);
    p.release(2);
    await l.stop();
    expect(p.count).toBe(2);
    expect(p.finished).toBe(2);
    expect(f.payloads).toEqual(["go", "go"]);
  });

  it("stop resolves only once the running pass has ended", async () => {
    const p = gatedPass();
    const l = await startLoop({ pass: p.pass });
    await p.started(1);
    const stopping = l.stop().then(() => "stopped");
    // Long enough for a stop that did not wait to end (a slow machine can only hide such a bug, never fail a
    // correct stop: it cannot end while the pass is held).
    const waiting = new Promise((r) => setTimeout(r, 200, "waiting"));
    expect(await Promise.race([stopping, waiting])).toBe("waiting");
    p.release(1);
    expect(await stopping).toBe("stopped");
    expect(p.finished).toBe(1);
    expect(p.count).toBe(1);
  });

  it("polls without notifications, and a pass that throws is logged and the loop goes on", async () => {
    const lines: { level: number; msg: string; err?: { message: string } }[] = [];
    const sink = new Writable({
      write(chunk: Buffer, _enc, done) {
        for (const l of chunk.toString().split("\n")) if (l !== "") lines.push(JSON.parse(l));
        done();
      },
    });
    const third = deferred();
    let count = 0;
    const l = await startLoop({
      filter: () => false,
      pollInterval: 5,
      pass: async () => {
        count++;
        if (count === 1) throw new Error("first pass broke");
        if (count === 3) third.resolve();
      },
      log: createLogger({ level: "warn", format: "json", destination: sink }),
    });
    await third.promise;
    await l.stop();
    expect(count).toBeGreaterThanOrEqual(3);
    const errors = lines.filter((line) => line.level === 50);
    expect(errors).toHaveLength(1);
    expect(errors[0]).toMatchObject({ msg: "test loop pass failed", err: { message: "first pass broke" } });
  });
});
