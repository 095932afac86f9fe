import { chmodSync, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import {
  closedDirOnTheWay,
  type IsolationFacts,
  isolationWarning,
  planIsolation,
  rangeMapped,
} from "./runtime-process.ts";

const UIDS = { first: 1_900_000_000, count: 65_536 };
const HOST_MAP = "         0          0 4294967295\n";
const facts = (over: Partial<IsolationFacts>): IsolationFacts => ({
  uid: 0,
  uidMap: HOST_MAP,
  gidMap: HOST_MAP,
  closedDir: null,
  ...over,
});

describe("who the process runtime runs a bundle as", () => {
  it("a uid of its own when the runner is root, the range is mapped and the work dirs are reachable", () => {
    const plan = planIsolation(facts({}), UIDS);
    expect(plan).toEqual({ kind: "own-uid", uids: UIDS });
    const warning = isolationWarning(plan);
    expect(warning).toContain("a uid and gid from 1900000000-1900065535, not the runner's");
    expect(warning).toContain("cannot read the runner's memory or its token");
    expect(warning).toContain("NO CONTAINER");
    expect(warning).toContain("metadata service");
  });

  it("the runner's own user when it is not root, saying that the command can read the token", () => {
    const plan = planIsolation(facts({ uid: 1001 }), UIDS);
    expect(plan).toEqual({ kind: "same-user", uid: 1001, why: null });
    const warning = isolationWarning(plan);
    expect(warning).toMatch(/^process runtime: NO ISOLATION — the runner is not root/);
    expect(warning).toContain("the runner's own user (uid 1001)");
    expect(warning).toContain(
      "can read the runner's memory (/proc/<pid>/mem) and in it this attempt's runner token",
    );
    expect(warning).toContain("other bundles' work dirs on this instance included");
  });

  it("root itself, saying why, when the range is not mapped in the user namespace", () => {
    const plan = planIsolation(facts({ uidMap: "0 100000 65536\n" }), UIDS);
    expect(plan).toMatchObject({ kind: "same-user", uid: 0 });
    expect(isolationWarning(plan)).toContain(
      "NO ISOLATION — the bundle runs as root, the runner's own user, because the uids 1900000000-1900065535 are not mapped",
    );
    expect(planIsolation(facts({ gidMap: null }), UIDS).kind).toBe("same-user");
  });

  it("root itself, naming the directory, when other users cannot reach the work dirs", () => {
    const plan = planIsolation(facts({ closedDir: "/srv/vm" }), UIDS);
    expect(isolationWarning(plan)).toContain("because other users cannot enter /srv/vm");
  });
});

describe("rangeMapped", () => {
  it("needs the whole range inside one line of the map", () => {
    expect(rangeMapped(HOST_MAP, UIDS)).toBe(true);
    expect(rangeMapped("0 0 1\n1000 1000 1\n", { first: 1000, count: 1 })).toBe(true);
    expect(rangeMapped("0 0 1\n1000 1000 1\n", { first: 1000, count: 2 })).toBe(false);
    expect(rangeMapped("0 100000 65536\n", { first: 65_535, count: 1 })).toBe(true);
    expect(rangeMapped("", UIDS)).toBe(false);
    expect(rangeMapped(null, UIDS)).toBe(false);
  });
});

describe("closedDirOnTheWay", () => {
  const base = mkdtempSync(path.join(tmpdir(), "dc-closed-"));
  afterAll(() => rmSync(base, { recursive: true, force: true }));

  it("names the first directory others cannot enter", () => {
    const work = path.join(base, "vm", "tmp", "crunch-run");
    mkdirSync(work, { recursive: true, mode: 0o755 });
    chmodSync(base, 0o700); // as mkdtemp makes it
    expect(closedDirOnTheWay(work)).toBe(base);
    chmodSync(base, 0o711);
    expect(closedDirOnTheWay(work)).toBeNull();
    chmodSync(path.join(base, "vm", "tmp"), 0o770);
    expect(closedDirOnTheWay(work)).toBe(path.join(base, "vm", "tmp"));
    expect(closedDirOnTheWay(path.join(base, "missing"))).toBe(path.join(base, "missing"));
  });
});
