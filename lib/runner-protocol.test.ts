import { describe, expect, it } from "vitest";
import {
  CACHE_KEY_HEX,
  cacheKey,
  clampSpotCheckIntervalMs,
  detachAnswerSpare,
  formatDetachAnswer,
  formatHandOff,
  formatHandOffs,
  formatList,
  MAX_CACHED_MANIFESTS,
  MAX_HAND_OFF_DOC,
  MAX_HAND_OFFS,
  manyAnswer,
  parseHandOff,
  parseHandOffs,
  parseList,
  parseManyAnswers,
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
      cachedManifests: [],
      cacheProblem: null,
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

  it("names a warm pool's socket in --detach's answer, and reads back only a socket path", () => {
    const sock = "/vm/1/var/run/cr-spare-0123456789.sock";
    const uuid = "zzzzz-bndl-000000000000001";
    expect(formatDetachAnswer({ uuid, pid: 42, spare: null })).toBe(`{"uuid":"${uuid}","pid":42}`);
    expect(detachAnswerSpare(formatDetachAnswer({ uuid, pid: 42, spare: sock }))).toBe(sock);
    expect(detachAnswerSpare(`${formatDetachAnswer({ uuid, pid: 42, spare: sock })}\n`)).toBe(sock);
    expect(detachAnswerSpare(formatDetachAnswer({ uuid, pid: 42, spare: null }))).toBeNull();
    for (const bad of ["relative.sock", "/a b.sock", "/x/../y.sock", "/x/y", 7, null]) {
      expect(detachAnswerSpare(JSON.stringify({ uuid, pid: 1, spare: bad }))).toBeNull();
    }
    for (const text of ["", "pid 42", "[", "null", '"x"']) expect(detachAnswerSpare(text)).toBeNull();
  });

  it("parses --list: preempted (a spot interruption notice) beside runners, broken and a spare", () => {
    const out = parseList(`${UUID}\npreempted\nspare /vm/1/var/run/cr-spare-0123456789.sock\n`);
    expect(out).toEqual({
      runners: new Map([[UUID, "running"]]),
      broken: false,
      preempted: true,
      spare: "/vm/1/var/run/cr-spare-0123456789.sock",
      cachedManifests: [],
      cacheProblem: null,
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
    expect(parseList(`${lines.join("\n")}\n`)).toEqual({
      ...list,
      cachedManifests: [],
      cacheProblem: null,
      unknown: [],
    });
    expect(formatList({ runners: new Map(), broken: false, preempted: false, spare: null })).toEqual([]);
  });

  it("writes and reads the cache line: keys of whole digests or hashes, most recent first, bounded", () => {
    const hashes = Array.from(
      { length: 300 },
      (_, i) => `${i.toString(16).padStart(16, "0")}${"b".repeat(48)}`,
    );
    const digests = hashes.map((h, i) => `${h}/${1000 + i}`);
    expect(cacheKey(digests[0]!)).toBe(hashes[0]!.slice(0, CACHE_KEY_HEX));
    expect(cacheKey(hashes[1]!)).toBe(hashes[1]!.slice(0, 16));
    for (const bad of ["", "abc", `${"A".repeat(64)}/1`, `${"a".repeat(63)}/1`, `${"a".repeat(65)}`]) {
      expect(cacheKey(bad)).toBeNull();
    }
    const lines = formatList({
      runners: new Map([[UUID, "running"]]),
      broken: false,
      preempted: false,
      spare: null,
      // Repeats and what is not a digest are left out; a bare hash counts.
      cachedManifests: [digests[0]!, "not a digest", digests[0]!, hashes[1]!, ...digests.slice(2)],
    });
    expect(lines[0]).toBe(UUID);
    expect(lines).toHaveLength(2);
    const words = lines[1]!.split(" ");
    expect(words[0]).toBe("cache");
    expect(words.slice(1)).toEqual(hashes.slice(0, MAX_CACHED_MANIFESTS).map((h) => h.slice(0, 16)));
    const parsed = parseList(`${lines.join("\n")}\n`);
    expect(parsed.cachedManifests).toEqual(words.slice(1));
    expect(parsed.cacheProblem).toBeNull();
    expect([...parsed.runners.keys()]).toEqual([UUID]);
    expect(parsed.unknown).toEqual([]);
    // Nothing cached: no line at all (what an older runner prints too).
    expect(
      formatList({ runners: new Map(), broken: false, preempted: false, spare: null, cachedManifests: [] }),
    ).toEqual([]);
  });

  it("ignores garbage in a cache line with a reason, and never lets it spoil the rest of the list", () => {
    const k1 = "0123456789abcdef";
    const k2 = "fedcba9876543210";
    const out = parseList(
      `${UUID}\ncache ${k1} NOT-HEX ${k1} 0123 ${k2} ${"e".repeat(64)}\nbroken\ncache ${k2}\nspare /vm/1/x.sock\n`,
    );
    expect(out.runners.get(UUID)).toBe("running");
    expect(out.broken).toBe(true);
    expect(out.spare).toBe("/vm/1/x.sock");
    expect(out.cachedManifests).toEqual([k1, k2]);
    expect(out.cacheProblem).toBe(
      'cache line: 3 word(s) that are not 16 hex characters ignored (first: "NOT-HEX"); a second cache line ignored',
    );
    // Not an unknown line: a booting instance's probe takes unknown lines for a runner that cannot run.
    expect(out.unknown).toEqual([]);
    // Too many keys: the first 256 count.
    const many = Array.from({ length: MAX_CACHED_MANIFESTS + 4 }, (_, i) => i.toString(16).padStart(16, "0"));
    const long = parseList(`cache ${many.join(" ")}\n`);
    expect(long.cachedManifests).toEqual(many.slice(0, MAX_CACHED_MANIFESTS));
    expect(long.cacheProblem).toBe("cache line: 4 key(s) past the first 256 ignored");
    expect(parseList("cache\n")).toMatchObject({ cachedManifests: [], cacheProblem: null, unknown: [] });
    // A word that only starts like the line is not it.
    expect(parseList(`cached ${k1}\n`)).toMatchObject({ cachedManifests: [], unknown: [`cached ${k1}`] });
  });

  it("frames a hand-off and its answers both ways", () => {
    const doc = '{"uuid":"x"}\nsecond line';
    expect(parseHandOff(formatHandOff({ mode: "start", uuid: UUID, doc }))).toEqual({
      mode: "start",
      uuid: UUID,
      doc,
    });
    expect(parseHandOff(`detach ${UUID}\n`)).toEqual({ mode: "detach", uuid: UUID, doc: "" });
    expect(parseHandOff(`start ${UUID}\n${"x".repeat(MAX_HAND_OFF_DOC)}`)?.uuid).toBe(UUID);
    for (const bad of [
      "",
      "start\n{}",
      `run ${UUID}\n{}`,
      `start ${UUID} extra\n{}`,
      `start ${UUID}`,
      `start ${UUID}\n${"x".repeat(MAX_HAND_OFF_DOC + 1)}`,
    ]) {
      expect(parseHandOff(bad)).toBeNull();
    }
    expect(parsePidAnswer(pidAnswer(4242))).toBe(4242);
    expect(refusedAnswer("busy\nnow")).toBe("refused busy now\n");
    expect(parsePidAnswer(refusedAnswer("busy"))).toBeNull();
    expect(parsePidAnswer("pid 12")).toBeNull();
  });

  it("frames several hand-offs of one instance in one exchange, and their answers by uuid", () => {
    const U2 = UUID.replace(/.$/, (c) => (c === "a" ? "b" : "a"));
    const hs = [
      { mode: "start" as const, uuid: UUID, doc: '{"uuid":"one"}\n' },
      { mode: "start" as const, uuid: U2, doc: '{"uuid":"two"}' },
    ];
    const text = formatHandOffs(hs);
    expect(text).toBe(`many 2\nstart ${UUID}\n{"uuid":"one"}\nstart ${U2}\n{"uuid":"two"}\n`);
    expect(parseHandOffs(text)).toEqual([
      { mode: "start", uuid: UUID, doc: '{"uuid":"one"}\n' },
      { mode: "start", uuid: U2, doc: '{"uuid":"two"}\n' },
    ]);
    const refused = [
      "many 0\n",
      `many 3\n${formatHandOff(hs[0]!)}`, // fewer than it says
      `many 1\nstart ${UUID}\n{"a":\n1}\n`, // a document over two lines
      formatHandOffs([hs[0]!, hs[0]!]), // the same bundle twice
      formatHandOffs(Array.from({ length: MAX_HAND_OFFS + 1 }, () => hs[0]!)),
      `many 1\nrun ${UUID}\n{}\n`,
      formatHandOff(hs[0]!),
      formatHandOffs([{ mode: "start", uuid: UUID, doc: `"${"x".repeat(MAX_HAND_OFF_DOC)}"` }]), // too large
    ];
    for (const bad of refused) expect(parseHandOffs(bad)).toBeNull();
    const answers = parseManyAnswers(
      manyAnswer(U2, refusedAnswer("busy\nnow")) + manyAnswer(UUID, pidAnswer(7)) + "garbage\n",
    );
    expect(answers).toEqual(
      new Map([
        [U2, "refused busy now\n"],
        [UUID, "pid 7\n"],
      ]),
    );
    expect(parsePidAnswer(answers.get(UUID) ?? "")).toBe(7);
  });

  it("matches its own --version line, and keeps spot check intervals in bounds", () => {
    expect(VERSION_LINE.exec(versionLine("1.2.3"))?.[1]).toBe("1.2.3");
    expect(VERSION_LINE.test(`${versionLine("1.2.3")} extra`)).toBe(false);
    expect([0, -5, 3, 5000, 1e9].map(clampSpotCheckIntervalMs)).toEqual([0, 0, 10, 5000, 3_600_000]);
  });
});
