import { describe, expect, it } from "vitest";
import { FrameReader, LogCursor, type LogEntry, sinceParam } from "./docker-logs.ts";

/** One frame of docker's multiplexed log stream. */
function frame(stream: 1 | 2, text: string, ts?: string): Buffer {
  const payload = Buffer.from(ts === undefined ? text : `${ts} ${text}`);
  const head = Buffer.alloc(8);
  head[0] = stream;
  head.writeUInt32BE(payload.length, 4);
  return Buffer.concat([head, payload]);
}
const T = (s: number, ns = 0) =>
  `2026-11-28T19:00:${String(s).padStart(2, "0")}.${String(ns).padStart(9, "0")}Z`;
const e = (stream: 1 | 2, ts: string, text = "x\n"): LogEntry => ({ stream, ts, data: Buffer.from(text) });
const read = (bytes: Buffer, chunk: number) => {
  const r = new FrameReader();
  const out: Array<[number, string, string]> = [];
  for (let i = 0; i < bytes.length; i += chunk) {
    r.push(bytes.subarray(i, i + chunk), (x) => out.push([x.stream, x.ts, x.data.toString()]));
  }
  return { out, leftover: r.leftover };
};

describe("FrameReader", () => {
  const last = frame(2, "2026-11-28 not a time stamp at all\n");
  const bytes = Buffer.concat([
    frame(1, "out 1\n", T(1)),
    frame(2, "err 1\n", T(1, 5)),
    frame(1, "", T(2)),
    frame(1, "no time\n"),
    last,
  ]);
  const expected = [
    [1, T(1), "out 1\n"],
    [2, T(1, 5), "err 1\n"],
    [1, T(2), ""],
    [1, "", "no time\n"],
    [2, "", "2026-11-28 not a time stamp at all\n"],
  ];

  it("splits frames into entries and takes docker's timestamp off, whatever the chunk boundaries", () => {
    for (const chunk of [1, 3, 7, 8, 9, 40, bytes.length]) {
      expect(read(bytes, chunk)).toEqual({ out: expected, leftover: 0 });
    }
  });

  it("keeps an incomplete last frame as leftover, not as an entry", () => {
    const cut = bytes.subarray(0, bytes.length - 3);
    expect(read(cut, 5)).toEqual({ out: expected.slice(0, 4), leftover: last.length - 3 });
  });
});

describe("LogCursor", () => {
  it("recognises, per stream, the entries delivered before a read again", () => {
    const c = new LogCursor();
    for (const x of [e(1, T(1)), e(2, T(2)), e(1, T(3)), e(1, T(3))]) c.record(x);
    const keep = c.unseen();
    // A read again from before: stdout's entries up to T(3) (two of them at T(3)) and stderr's up to T(2).
    const again = [e(1, T(1)), e(2, T(2)), e(1, T(3)), e(2, T(2, 9)), e(1, T(3)), e(1, T(3)), e(1, T(4))];
    expect(again.map(keep)).toEqual([false, false, false, true, false, true, true]);
  });

  it("keeps everything of a stream that delivered nothing", () => {
    const c = new LogCursor();
    c.record(e(1, T(5)));
    const keep = c.unseen();
    expect([e(2, T(1)), e(1, T(5)), e(1, T(6))].map(keep)).toEqual([true, false, true]);
  });

  it("says whether a read of the end reaches back to the last entry delivered", () => {
    const c = new LogCursor();
    expect(c.reachesBack([])).toBe(true);
    c.record(e(2, T(1)));
    c.record(e(1, T(4)));
    expect(c.reachesBack([e(2, T(3)), e(1, T(5))])).toBe(false);
    expect(c.reachesBack([e(1, T(4)), e(1, T(5))])).toBe(true);
    expect(c.reachesBack([e(1, T(3, 999_999_999)), e(2, T(6))])).toBe(true);
  });

  it("resumes a second before the older of the two streams' last timestamps", () => {
    const c = new LogCursor();
    expect(c.resumeSince()).toBeNull();
    c.record(e(1, T(30, 123_456_789)));
    c.record(e(2, T(20, 7)));
    const base = Date.parse("2026-11-28T19:00:20Z") / 1000;
    expect(c.resumeSince()).toBe(`${base - 1}.000000007`);
    expect(sinceParam(T(30, 123_456_789), 0)).toBe(`${base + 10}.123456789`);
  });

  it("marks a log without timestamps, which cannot be read again", () => {
    const c = new LogCursor();
    c.record(e(1, ""));
    expect(c.untimed).toBe(true);
    expect(c.delivered).toBe(false);
  });
});
