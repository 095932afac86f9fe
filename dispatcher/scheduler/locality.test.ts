/**
 * Locality (dispatcher/README.md "A bundle's way"; docs/storage.md "Locality"): among instances with room at the
 * same price or less, the scheduler prefers the one whose cache holds the most of a bundle's input bytes, never
 * waiting for it. One runOnce() pass over an in-memory queue and the stub pool, as in scheduler.test.ts.
 */
import { describe, expect, it } from "vitest";
import type { InputManifest } from "../../store/types.ts";
import { testInstanceType } from "../../test/fixtures.ts";
import { useSchedulerHarness } from "../../test/scheduler-harness.ts";
import { testBundle } from "../../test/stub-pool.ts";

const GiB = 2 ** 30;
const small = testInstanceType("small", { vcpus: 4, ramGiB: 16, price: 0.1, providerType: "m5.xlarge" });
const small2 = testInstanceType("small2", { vcpus: 4, ramGiB: 16, price: 0.1, providerType: "m6.xlarge" });
const medium = testInstanceType("medium", { vcpus: 8, ramGiB: 32, price: 0.2, providerType: "m5.2xlarge" });

const digest = (c: string, size = 100): string => `${c.repeat(64)}/${size}`;
/** Two input trees: 1.5 GiB (a) and 0.5 GiB (b). */
const A: InputManifest = { digest: digest("a"), bytes: 1.5 * GiB };
const B: InputManifest = { digest: digest("b"), bytes: 0.5 * GiB };

const h = useSchedulerHarness([small, small2, medium]);

describe("locality", () => {
  it("starts a bundle on the idle instance whose cache holds its inputs, and says so", async () => {
    h.pool.addWorker({ id: "i-1", type: small });
    h.pool.addWorker({ id: "i-2", type: small, cached: [digest("f"), A.digest, B.digest] });
    const [b] = h.staged(testBundle({ inputs: [A, B] }));
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(r.started).toEqual([b!.uuid]);
    expect(h.startedOn()).toEqual([[b!.uuid, "i-2"]]);
    const why = "placed for its cache: 2.0 GiB of 2.0 GiB of inputs held there";
    expect(h.pool.calls.start[0]!.placement).toBe(why);
    expect(s.statusOf(b!.uuid)).toBe(`starting on i-2 (${why})`);
    expect(s.placementOf(b!.uuid)).toBe(why);
    expect(h.pool.calls.create).toEqual([]);
  });

  it("prefers the instance holding more of the input bytes, and only counts what it holds", async () => {
    h.pool.addWorker({ id: "i-1", type: small, cached: [B.digest] });
    h.pool.addWorker({ id: "i-2", type: small, cached: [A.digest] });
    h.pool.addWorker({ id: "i-3", type: small });
    const [b] = h.staged(testBundle({ inputs: [A, B] }));
    const s = h.scheduler();
    await s.runOnce();
    expect(h.startedOn()).toEqual([[b!.uuid, "i-2"]]);
    expect(s.statusOf(b!.uuid)).toBe(
      "starting on i-2 (placed for its cache: 1.5 GiB of 2.0 GiB of inputs held there)",
    );
  });

  it("does not wait for a holder that is full: it starts at once on another instance that fits", async () => {
    const running = testBundle({ vcpus: 4, state: "running" });
    h.queue.set(running);
    h.pool.addWorker({ id: "i-1", type: small });
    h.pool.addWorker({ id: "i-2", type: small, cached: [A.digest], runners: [running.uuid] });
    const [b] = h.staged(testBundle({ inputs: [A] }));
    const s = h.scheduler();
    const r = await s.runOnce();
    expect(h.startedOn()).toEqual([[b!.uuid, "i-1"]]);
    expect(r.waiting).toBe(0);
    expect(h.pool.calls.create).toEqual([]);
    expect(s.statusOf(b!.uuid)).toBe("starting on i-1");
    expect(s.placementOf(b!.uuid)).toBeUndefined();
  });

  it("does not wait for a holder at maxRunningBundlesPerInstance, nor for one still booting", async () => {
    const running = testBundle({ vcpus: 1, state: "running" });
    h.queue.set(running);
    h.pool.addWorker({ id: "i-1", type: small });
    h.pool.addWorker({ id: "i-2", type: small, cached: [A.digest], runners: [running.uuid] });
    h.pool.addWorker({ id: "i-3", type: small, cached: [A.digest], state: "booting" });
    const [b] = h.staged(testBundle({ inputs: [A] }));
    await h.scheduler([small, small2, medium], { maxRunningBundlesPerInstance: 1 }).runOnce();
    expect(h.startedOn()).toEqual([[b!.uuid, "i-1"]]);
  });

  it("never pays more for locality: a dearer holder loses to a cheaper instance that fits", async () => {
    h.pool.addWorker({ id: "i-1", type: small });
    h.pool.addWorker({ id: "i-2", type: medium, cached: [A.digest] });
    // small2 costs the same as small: a holder of that type is as good.
    h.pool.addWorker({ id: "i-3", type: small2, cached: [B.digest] });
    const [b] = h.staged(testBundle({ inputs: [A, B] }));
    await h.scheduler().runOnce();
    expect(h.startedOn()).toEqual([[b!.uuid, "i-3"]]);
  });

  it("weighs locality over packing among instances of the same price", async () => {
    const running = testBundle({ vcpus: 1, state: "running" });
    h.queue.set(running);
    h.pool.addWorker({ id: "i-busy", type: small, runners: [running.uuid] });
    h.pool.addWorker({ id: "i-holder", type: small, cached: [A.digest] });
    const [withInputs, without] = h.staged(testBundle({ inputs: [A] }), testBundle());
    await h.scheduler().runOnce();
    // Without inputs, packing as before: the instance already running a bundle.
    expect(h.startedOn()).toEqual([
      [withInputs!.uuid, "i-holder"],
      [without!.uuid, "i-busy"],
    ]);
  });

  it("leaves bundles without inputs (or with inputs no instance holds) where they went before", async () => {
    h.pool.addWorker({ id: "i-1", type: small });
    h.pool.addWorker({ id: "i-2", type: small, cached: [A.digest] });
    const [plain, other] = h.staged(
      testBundle({ vcpus: 4 }),
      testBundle({ vcpus: 4, inputs: [{ digest: digest("c"), bytes: GiB }] }),
    );
    const s = h.scheduler();
    await s.runOnce();
    expect(h.startedOn()).toEqual([
      [plain!.uuid, "i-1"],
      [other!.uuid, "i-2"],
    ]);
    expect(h.pool.calls.start.map((c) => c.placement)).toEqual([undefined, undefined]);
    expect(s.statusOf(plain!.uuid)).toBe("starting on i-1");
  });

  it("sees a new cache line on the next pass, and forgets a placement once the bundle leaves the queue", async () => {
    h.pool.addWorker({ id: "i-1", type: small });
    h.pool.addWorker({ id: "i-2", type: small });
    const s = h.scheduler();
    const [first] = h.staged(testBundle({ vcpus: 4, inputs: [A] }));
    await s.runOnce();
    expect(h.startedOn()).toEqual([[first!.uuid, "i-1"]]);
    h.pool.removeRunner("i-1", first!.uuid);
    h.queue.apply({ ...first!, state: "ready", changeSeq: first!.changeSeq + 1000 });
    h.pool.setCached("i-2", [A.digest]);
    const [second] = h.staged(testBundle({ vcpus: 4, inputs: [A] }));
    await s.runOnce();
    expect(h.startedOn()[1]).toEqual([second!.uuid, "i-2"]);
    expect(s.placementOf(second!.uuid)).toBe("placed for its cache: 1.5 GiB of 1.5 GiB of inputs held there");
    h.queue.apply({ ...second!, state: "running", changeSeq: second!.changeSeq + 1000 });
    expect(s.placementOf(second!.uuid)).toBeDefined();
    h.queue.apply({ ...second!, state: "ready", changeSeq: second!.changeSeq + 2000 });
    expect(s.placementOf(second!.uuid)).toBeUndefined();
    // The holder's cache emptied (a later probe): no preference left.
    h.pool.setCached("i-2", []);
    h.pool.removeRunner("i-2", second!.uuid);
    const [third] = h.staged(testBundle({ vcpus: 4, inputs: [A] }));
    await s.runOnce();
    expect(h.startedOn()[2]).toEqual([third!.uuid, "i-1"]);
  });
});
