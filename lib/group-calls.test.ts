import { describe, expect, it } from "vitest";
import { groupCalls } from "./group-calls.ts";

/** A run whose groups the test sees and releases one at a time. */
function heldRun() {
  const groups: { items: number[]; release(): void }[] = [];
  const run = (items: number[]) =>
    new Promise<string[]>((resolve, reject) => {
      groups.push({
        items,
        release: () =>
          items.includes(13) ? reject(new Error("13 refused")) : resolve(items.map((i) => `r${i}`)),
      });
    });
  return { groups, run };
}

const ticks = async (n = 5) => {
  for (let i = 0; i < n; i++) await new Promise((r) => setImmediate(r));
};

describe("groupCalls", () => {
  it("calls made in the same turn go as one group; each caller gets its own result", async () => {
    const { groups, run } = heldRun();
    const g = groupCalls({ max: 100, run });
    const got = Promise.all([1, 2, 3].map((i) => g.call(i)));
    await ticks();
    expect(groups.map((x) => x.items)).toEqual([[1, 2, 3]]);
    groups[0]!.release();
    expect(await got).toEqual(["r1", "r2", "r3"]);
    expect(g.stats()).toEqual({ groups: 1, items: 3, largest: 3 });
  });

  it('with gather "io", the calls of one round of callbacks go together even when each group is back at once', async () => {
    // As a database in this thread (PGlite) answers: no I/O in between, so no other call is made meanwhile.
    const groupsOf = async (gather: "turn" | "io") => {
      const groups: number[][] = [];
      const g = groupCalls({
        max: 100,
        gather,
        run: async (items: number[]) => {
          groups.push(items);
          return items.map((i) => `r${i}`);
        },
      });
      // Three callbacks of one round, as three requests read in one pass over the sockets.
      const got = await new Promise<string[]>((resolve) => {
        const calls: Promise<string>[] = [];
        for (const i of [1, 2, 3]) setImmediate(() => calls.push(g.call(i)));
        setImmediate(() => void Promise.all(calls).then(resolve));
      });
      expect(got).toEqual(["r1", "r2", "r3"]);
      return groups;
    };
    expect(await groupsOf("io")).toEqual([[1, 2, 3]]);
    expect(await groupsOf("turn")).toEqual([[1], [2], [3]]);
  });

  it("calls that arrive while a group is in flight wait for it and go together, at most max at a time", async () => {
    const { groups, run } = heldRun();
    const g = groupCalls({ max: 2, run });
    const first = g.call(1);
    await ticks();
    const later = [2, 3, 4].map((i) => g.call(i));
    await ticks();
    // Nothing more runs until the first group is back.
    expect(groups.map((x) => x.items)).toEqual([[1]]);
    groups[0]!.release();
    await ticks();
    expect(groups.map((x) => x.items)).toEqual([[1], [2, 3]]);
    groups[1]!.release();
    await ticks();
    groups[2]!.release();
    expect(await first).toBe("r1");
    expect(await Promise.all(later)).toEqual(["r2", "r3", "r4"]);
    // A lone call later starts a new group at once.
    const alone = g.call(5);
    await ticks();
    expect(groups.at(-1)!.items).toEqual([5]);
    groups.at(-1)!.release();
    expect(await alone).toBe("r5");
  });

  it("with concurrency 2, calls that arrive while one group is in flight go at once; later ones wait for either", async () => {
    const { groups, run } = heldRun();
    const g = groupCalls({ max: 100, concurrency: 2, run });
    const first = g.call(1);
    await ticks();
    const second = [2, 3].map((i) => g.call(i));
    await ticks();
    // The second group did not wait for the first.
    expect(groups.map((x) => x.items)).toEqual([[1], [2, 3]]);
    const third = [4, 5].map((i) => g.call(i));
    await ticks();
    // Two in flight: these wait, and go together once one of them is back.
    expect(groups).toHaveLength(2);
    groups[1]!.release();
    await ticks();
    expect(groups.map((x) => x.items)).toEqual([[1], [2, 3], [4, 5]]);
    groups[0]!.release();
    groups[2]!.release();
    expect(await first).toBe("r1");
    expect(await Promise.all([...second, ...third])).toEqual(["r2", "r3", "r4", "r5"]);
    expect(g.stats()).toEqual({ groups: 3, items: 5, largest: 2 });
  });

  it("a group that fails is run again one item at a time, so only the bad item fails", async () => {
    const { groups, run } = heldRun();
    const g = groupCalls({ max: 100, run });
    const calls = [12, 13, 14].map((i) => g.call(i));
    const settled = Promise.allSettled(calls);
    for (let i = 0; i < 4; i++) {
      await ticks();
      groups[i]!.release();
    }
    const out = await settled;
    expect(groups.map((x) => x.items)).toEqual([[12, 13, 14], [12], [13], [14]]);
    expect(out.map((o) => (o.status === "fulfilled" ? o.value : (o.reason as Error).message))).toEqual([
      "r12",
      "13 refused",
      "r14",
    ]);
  });

  it("a run that gives the wrong number of results fails its calls instead of resolving them wrongly", async () => {
    const g = groupCalls<number, string>({ max: 100, run: async () => ["only one"] });
    const out = await Promise.allSettled([g.call(1), g.call(2)]);
    // The group of two is refused; each alone then gets its one result.
    expect(out.map((o) => o.status)).toEqual(["fulfilled", "fulfilled"]);
    const bad = groupCalls<number, string>({ max: 100, run: async () => [] });
    await expect(bad.call(1)).rejects.toThrow(/a group of 1 gave 0 results/);
  });
});
