import { describe, expect, it } from "vitest";
import {
  clampSpotCheckIntervalMs,
  formatHandOff,
  formatList,
  parseHandOff,
  parseList,
  parsePidAnswer,
  pidAnswer,
  refusedAnswer,
  VERSION_LINE,
  versionLine,
} from "./runner-protocol.ts";

const UUID = "zzzzz-bndl-0123456789abcde";

describe("the runner protocol", () => {
  it("parses --list: running, stale, broken, and ignores junk", () => {
    const other = "zzzzz-bndl-bbbbbbbbbbbbbbb";
    const out = parseList(`${UUID}\n${other} stale\nbroken\n\nsomething odd\n${UUID} weird\n`);
    expect([...out.runners]).toEqual([
      [UUID, "running"],
      [other, "stale"],
    ]);
    expect(out.broken).toBe(true);
    expect(out.unknown).toEqual(["something odd", `${UUID} weird`]);
    expect(out.preempted).toBe(false);
    expect(parseList("")).toEqual({
      runners: new Map(),
      broken: false,
      preempted: false,
      spare: null,
      unknown: [],
    });
    expect(parseList("spare /vm/1/var/run/cr-spare-0123456789.sock\n").spare).toBe(
      "/vm/1/var/run/cr-spare-0123456789.sock",
    );
    // Anything else is not a socket path the pool will connect to.
    for (const bad of ["spare relative.sock", "spare /a b.sock", "spare /x/../y.sock", "spare /x/y"]) {
      expect(parseList(`${bad}\n`)).toMatchObject({ spare: null, unknown: [bad] });
    }
  });

  it("parses --list: preempted (a spot interruption notice) beside runners, broken and a spare", () => {
    const out = parseList(`${UUID}\npreempted\nspare /vm/1/var/run/cr-spare-0123456789.sock\n`);
    expect(out).toEqual({
      runners: new Map([[UUID, "running"]]),
      broken: false,
      preempted: true,
      spare: "/vm/1/var/run/cr-spare-0123456789.sock",
      unknown: [],
    });
    // Only the word on a line of its own.
    expect(parseList("preempted now\n")).toMatchObject({ preempted: false, unknown: ["preempted now"] });
  });

  it("reads back what crunch-run writes for --list, in order", () => {
    const list = {
      runners: new Map<string, "running" | "stale">([
        [UUID, "running"],
        ["zzzzz-bndl-bbbbbbbbbbbbbbb", "stale"],
      ]),
      broken: true,
      preempted: true,
      spare: "/vm/1/var/run/cr-spare-0123456789.sock",
    };
    const lines = formatList(list);
    expect(lines).toEqual([
      UUID,
      "zzzzz-bndl-bbbbbbbbbbbbbbb stale",
      "broken",
      "preempted",
      "spare /vm/1/var/run/cr-spare-0123456789.sock",
    ]);
    expect(parseList(`${lines.join("\n")}\n`)).toEqual({ ...list, unknown: [] });
    expect(formatList({ runners: new Map(), broken: false, preempted: false, spare: null })).toEqual([]);
  });

  it("frames a hand-off and its answers both ways", () => {
    const doc = '{"uuid":"x"}\nsecond line';
    expect(parseHandOff(formatHandOff({ mode: "start", uuid: UUID, doc }))).toEqual({
      mode: "start",
      uuid: UUID,
      doc,
    });
    expect(parseHandOff(`detach ${UUID}\n`)).toEqual({ mode: "detach", uuid: UUID, doc: "" });
    for (const bad of ["", "start\n{}", `run ${UUID}\n{}`, `start ${UUID} extra\n{}`, `start ${UUID}`]) {
      expect(parseHandOff(bad)).toBeNull();
    }
    expect(parsePidAnswer(pidAnswer(4242))).toBe(4242);
    expect(refusedAnswer("busy\nnow")).toBe("refused busy now\n");
    expect(parsePidAnswer(refusedAnswer("busy"))).toBeNull();
    expect(parsePidAnswer("pid 12")).toBeNull();
  });

  it("matches its own --version line, and keeps spot check intervals in bounds", () => {
    expect(VERSION_LINE.exec(versionLine("1.2.3"))?.[1]).toBe("1.2.3");
    expect(VERSION_LINE.test(`${versionLine("1.2.3")} extra`)).toBe(false);
    expect([0, -5, 3, 5000, 1e9].map(clampSpotCheckIntervalMs)).toEqual([0, 0, 10, 5000, 3_600_000]);
  });
});
