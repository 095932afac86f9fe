/**
 * uid leases on the real filesystem and with real processes; needs root (as scripts/test.sh runs the tests),
 * since the lease directory must be root's and processes are started as the leased uids.
 */
import { spawn } from "node:child_process";
import { chmodSync, chownSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { procStartTime } from "./lock.ts";
import { killUidProcesses, leasedUids, leaseUid, uidPids } from "./uid-lease.ts";

const RANGE = { first: 1_900_100_000 + (process.pid % 1000) * 10, count: 3 };
const UUID = "zzzzz-bndl-aaaaaaaaaaaaaaa";

describe("uid leases", () => {
  const base = mkdtempSync(path.join(tmpdir(), "dc-uids-"));
  const dir = path.join(base, "var", "lock", "crunch-run-uids");
  beforeAll(() => {
    if (process.getuid?.() !== 0)
      throw new Error("the uid lease tests need root (as scripts/test.sh runs them)");
  });
  afterAll(async () => {
    for (let i = 0; i < RANGE.count; i++) await killUidProcesses(RANGE.first + i);
    rmSync(base, { recursive: true, force: true });
  });

  it("starts a new directory at a random place of the range", async () => {
    const starts = new Set<number>();
    for (let i = 0; i < 40; i++) {
      const fresh = path.join(base, `fresh-${i}`);
      const lease = await leaseUid(fresh, { first: RANGE.first, count: 1000 }, UUID);
      starts.add(lease.uid);
      await lease.release();
    }
    expect(starts.size).toBeGreaterThan(1);
  });

  it("hands out distinct uids round robin, and takes them back", async () => {
    mkdirSync(dir, { recursive: true, mode: 0o700 });
    writeFileSync(path.join(dir, "next"), "0\n");
    const a = await leaseUid(dir, RANGE, UUID);
    const b = await leaseUid(dir, RANGE, UUID);
    expect([a.uid, b.uid]).toEqual([RANGE.first, RANGE.first + 1]);
    expect(leasedUids(dir).sort()).toEqual([a.uid, b.uid]);
    await a.release();
    expect(leasedUids(dir)).toEqual([b.uid]);
    // Round robin: the next one is the third, not the one just given back.
    const c = await leaseUid(dir, RANGE, UUID);
    expect(c.uid).toBe(RANGE.first + 2);
    const d = await leaseUid(dir, RANGE, UUID);
    expect(d.uid).toBe(RANGE.first);
    const full = await leaseUid(dir, RANGE, UUID).catch((e: unknown) => e);
    expect(full).toBeInstanceOf(DispatchCloudError);
    expect((full as DispatchCloudError).code).toBe("crunchrun.runtime_failed");
    for (const l of [b, c, d]) await l.release();
    expect(leasedUids(dir)).toEqual([]);
  });

  it("takes over a dead supervisor's lease, but not a uid something still runs as", async () => {
    writeFileSync(path.join(dir, "next"), "0\n");
    // A lease whose supervisor is gone (pid 1's start time never matches "0").
    writeFileSync(
      path.join(dir, String(RANGE.first)),
      JSON.stringify({ uuid: UUID, pid: 1, startTime: "0" }),
    );
    // A process running as the second uid, with no lease at all.
    const sleeper = spawn("sleep", ["600"], { uid: RANGE.first + 1, gid: RANGE.first + 1, stdio: "ignore" });
    await new Promise<void>((resolve, reject) => {
      sleeper.once("spawn", resolve);
      sleeper.once("error", reject);
    });
    expect(uidPids(RANGE.first + 1)).toEqual([sleeper.pid]);
    const a = await leaseUid(dir, RANGE, UUID);
    expect(a.uid).toBe(RANGE.first);
    const b = await leaseUid(dir, RANGE, UUID);
    expect(b.uid).toBe(RANGE.first + 2);
    expect(await killUidProcesses(RANGE.first + 1)).toBe(0);
    expect(uidPids(RANGE.first + 1)).toEqual([]);
    await a.release();
    await b.release();
  });

  it("takes over a live supervisor's lease once it no longer holds that bundle's lock", async () => {
    // Supervisors go back to the warm pool after a bundle: a lease one could not give back names a live pid.
    writeFileSync(path.join(dir, "next"), "0\n");
    const self = { pid: process.pid, startTime: procStartTime(process.pid) ?? "" };
    const lockOf = (uuid: string) => path.join(base, "var", "lock", `crunch-run-${uuid}.lock`);
    const [ended, running] = ["zzzzz-bndl-endedendedended", "zzzzz-bndl-runningrunningru"];
    writeFileSync(path.join(dir, String(RANGE.first)), JSON.stringify({ uuid: ended, ...self }));
    writeFileSync(path.join(dir, String(RANGE.first + 1)), JSON.stringify({ uuid: running, ...self }));
    writeFileSync(lockOf(running), JSON.stringify({ uuid: running, ...self }));
    // A lock of the ended bundle taken since by another supervisor does not make the lease held either.
    writeFileSync(lockOf(ended), JSON.stringify({ uuid: ended, pid: 1, startTime: procStartTime(1) ?? "" }));
    // Without the locks to look at, both leases are held (a live pid), as before.
    const blind = await leaseUid(dir, RANGE, UUID);
    expect(blind.uid).toBe(RANGE.first + 2);
    await blind.release();
    writeFileSync(path.join(dir, "next"), "0\n");
    // This test's process supervises UUID, the bundle it leases for.
    writeFileSync(lockOf(UUID), JSON.stringify({ uuid: UUID, ...self }));
    const a = await leaseUid(dir, RANGE, UUID, lockOf);
    expect(a.uid, "the ended bundle's lease is taken over").toBe(RANGE.first);
    const b = await leaseUid(dir, RANGE, UUID, lockOf);
    expect(b.uid, "the running bundle's lease is left alone").toBe(RANGE.first + 2);
    const full = await leaseUid(dir, RANGE, UUID, lockOf).catch((e: unknown) => e);
    expect((full as DispatchCloudError).code).toBe("crunchrun.runtime_failed");
    for (const l of [a, b]) await l.release();
    rmSync(path.join(dir, String(RANGE.first + 1)));
    for (const uuid of [ended, running, UUID]) rmSync(lockOf(uuid));
    expect(leasedUids(dir)).toEqual([]);
  });

  it("refuses a lease directory that someone else could have made or changed", async () => {
    chmodSync(dir, 0o777);
    const err = await leaseUid(dir, RANGE, UUID).catch((e: unknown) => e);
    expect((err as DispatchCloudError).code).toBe("crunchrun.runtime_failed");
    expect((err as Error).message).toContain("must be a directory of root's with mode 0700");
    chmodSync(dir, 0o700);
    // Another user's directory, or a symbolic link to a good one: refused all the same.
    const theirs = path.join(base, "theirs");
    mkdirSync(theirs, { mode: 0o700 });
    chownSync(theirs, 1001, 1001);
    const link = path.join(base, "link");
    symlinkSync(dir, link);
    for (const bad of [theirs, link]) {
      const refused = await leaseUid(bad, RANGE, UUID).catch((e: unknown) => e);
      expect((refused as DispatchCloudError).code, bad).toBe("crunchrun.runtime_failed");
    }
    const good = await leaseUid(dir, RANGE, UUID);
    await good.release();
  });
});
