import { Registry } from "prom-client";
import { describe, expect, it } from "vitest";
import { FakeClock } from "../test/fake-clock.ts";
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "./errors.ts";
import type { Instance, InstanceSet, InstanceType, Tags } from "./types.ts";
import {
  DRIVER_OPERATIONS,
  hasTags,
  instrumented,
  METRIC,
  rateLimited,
  withDefaultTags,
  withTagFilter,
  wrapInstanceSet,
} from "./wrappers.ts";

const TYPE: InstanceType = {
  name: "t.small",
  providerType: "p.small",
  vcpus: 2,
  ram: 2 ** 31,
  includedScratch: 0,
  addedScratch: 0,
  scratch: 0,
  price: 0.1,
  preemptible: false,
  gpu: null,
};

/** The cloud edge: an in-memory InstanceSet that ignores list filters and records when each call arrives. */
class FakeSet implements InstanceSet {
  readonly calls: { op: string; at: number }[] = [];
  readonly vms = new Map<string, Instance>();
  /** Errors thrown by the next calls, in order. */
  failures: Error[] = [];
  /** How long (FakeClock time) each call takes. */
  latencyMs = 0;
  stopped = false;
  private n = 0;

  constructor(private readonly clock: FakeClock) {}

  private async enter(op: string): Promise<void> {
    this.calls.push({ op, at: this.clock.now() });
    if (this.latencyMs > 0) await this.clock.sleep(this.latencyMs);
    const failure = this.failures.shift();
    if (failure !== undefined) throw failure;
  }

  async create(_type: InstanceType, _image: string, tags: Tags): Promise<Instance> {
    await this.enter("create");
    return this.add(`vm-${++this.n}`, tags);
  }

  add(id: string, tags: Tags): Instance {
    const set = this;
    let current = { ...tags };
    const vm: Instance = {
      id,
      address: "127.0.0.1",
      remoteUser: "root",
      providerType: TYPE.providerType,
      get tags() {
        return current;
      },
      async setTags(next) {
        await set.enter("setTags");
        current = { ...next };
      },
      async destroy() {
        await set.enter("destroy");
        set.vms.delete(id);
      },
    };
    this.vms.set(id, vm);
    return vm;
  }

  async instances(_filter: Tags): Promise<Instance[]> {
    await this.enter("list");
    return [...this.vms.values()];
  }

  quotaGroup(type: InstanceType): string {
    return type.providerType.split(".")[0] ?? "";
  }

  async stop(): Promise<void> {
    this.stopped = true;
  }
}

const create = (set: InstanceSet, tags: Tags = {}) =>
  set.create(TYPE, "img", tags, "true", "ssh-ed25519 AAAA");

/** Runs `promise` to completion while advancing the clock; returns the FakeClock time it took. */
async function timed<T>(
  clock: FakeClock,
  promise: Promise<T>,
  stepMs = 10,
): Promise<{ value: T; ms: number }> {
  const start = clock.now();
  let done = false;
  const settled = promise.finally(() => {
    done = true;
  });
  settled.catch(() => {});
  for (let i = 0; !done && i < 100_000; i++) await clock.advance(stepMs);
  return { value: await settled, ms: clock.now() - start };
}

describe("rateLimited", () => {
  it("spaces a burst of 50 calls 100 ms apart at 10/s: ~5 s of FakeClock time, no wall time", async () => {
    const wallStart = Date.now();
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    const set = rateLimited(inner, { maxOpsPerSecond: 10, clock });
    const t0 = clock.now();
    const burst = Promise.all(
      Array.from({ length: 50 }, (_, i) => (i % 2 ? create(set) : set.instances({}))),
    );
    const { value, ms } = await timed(clock, burst);
    expect(value).toHaveLength(50);
    expect(inner.calls).toHaveLength(50);
    const last = inner.calls.at(-1)!.at - t0;
    expect(last).toBeGreaterThanOrEqual(4900);
    expect(last).toBeLessThanOrEqual(5000);
    expect(ms).toBeLessThanOrEqual(5010);
    // FIFO and evenly spaced.
    inner.calls.forEach((call, i) => {
      expect(call.op).toBe(i % 2 ? "create" : "list");
      expect(call.at - t0).toBeCloseTo(i * 100, 6);
    });
    expect(Date.now() - wallStart).toBeLessThan(1000);
  });

  it("lets every call through at once when maxOpsPerSecond is 0", async () => {
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    const set = rateLimited(inner, { maxOpsPerSecond: 0, clock });
    const t0 = clock.now();
    await Promise.all(Array.from({ length: 50 }, () => create(set)));
    expect(inner.calls).toHaveLength(50);
    expect(inner.calls.every((c) => c.at === t0)).toBe(true);
  });

  it("holds all calls until a CloudRateLimitError's earliestRetry", async () => {
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    const set = rateLimited(inner, { maxOpsPerSecond: 0, clock });
    const t0 = clock.now();
    inner.failures.push(new CloudRateLimitError("slow down", { earliestRetry: t0 + 30_000 }));
    await expect(create(set)).rejects.toBeInstanceOf(CloudRateLimitError);
    const held = Promise.all([set.instances({}), create(set)]);
    const { ms } = await timed(clock, held, 1000);
    expect(ms).toBe(30_000);
    expect(inner.calls.map((c) => c.at - t0)).toEqual([0, 30_000, 30_000]);
  });

  it("holds calls already waiting for their slot when a rate-limit error arrives", async () => {
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    const set = rateLimited(inner, { maxOpsPerSecond: 1, clock });
    const t0 = clock.now();
    inner.latencyMs = 500;
    inner.failures.push(new CloudRateLimitError("slow down", { earliestRetry: t0 + 10_000 }));
    const first = create(set);
    first.catch(() => {});
    const second = set.instances({}); // due at t0 + 1 s, but the error arrives at t0 + 0.5 s
    await timed(clock, Promise.allSettled([first, second]), 100);
    await expect(first).rejects.toBeInstanceOf(CloudRateLimitError);
    expect(inner.calls.map((c) => c.at - t0)).toEqual([0, 10_000]);
  });

  it("rate-limits setTags and destroy of the instances it returns, on the same ticker", async () => {
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    const set = rateLimited(inner, { maxOpsPerSecond: 2, clock });
    const t0 = clock.now();
    const { value: vm } = await timed(clock, create(set));
    await timed(clock, Promise.all([vm.setTags({ a: "1" }), vm.destroy(), set.instances({})]));
    expect(inner.calls.map((c) => [c.op, c.at - t0])).toEqual([
      ["create", 0],
      ["setTags", 500],
      ["destroy", 1000],
      ["list", 1500],
    ]);
    expect(vm.tags).toEqual({ a: "1" });
  });
});

describe("withDefaultTags", () => {
  const defaults = { Owner: "ops", Team: "data" };
  const fixed = { DispatchCloudInstanceSetID: "zzzzz" };

  it("adds default tags on create; the caller wins except for the instance set ID tag", async () => {
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    const set = withDefaultTags(inner, defaults, fixed);
    const vm = await create(set, { Team: "ml", DispatchCloudInstanceSetID: "other", X: "y" });
    expect(vm.tags).toEqual({ Owner: "ops", Team: "ml", X: "y", DispatchCloudInstanceSetID: "zzzzz" });
    expect(inner.vms.get(vm.id)?.tags).toEqual(vm.tags);
  });

  it("keeps the default and instance set ID tags through setTags", async () => {
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    const set = withDefaultTags(inner, defaults, fixed);
    const vm = await create(set);
    await vm.setTags({ DispatchCloudInstanceSetID: "stolen", IdleBehavior: "hold" });
    expect(vm.tags).toEqual({ ...defaults, IdleBehavior: "hold", ...fixed });
    const [listed] = await set.instances({});
    await listed!.setTags({});
    expect(inner.vms.get(vm.id)?.tags).toEqual({ ...defaults, ...fixed });
  });
});

describe("withTagFilter", () => {
  it("drops foreign instances even when the inner set ignores the filter", async () => {
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    inner.add("mine-1", { DispatchCloudInstanceSetID: "zzzzz", Role: "a" });
    inner.add("mine-2", { DispatchCloudInstanceSetID: "zzzzz", Role: "b" });
    inner.add("foreign", { DispatchCloudInstanceSetID: "yyyyy", Role: "a" });
    inner.add("untagged", {});
    const set = withTagFilter(inner, { DispatchCloudInstanceSetID: "zzzzz" });
    expect((await set.instances({})).map((i) => i.id)).toEqual(["mine-1", "mine-2"]);
    expect((await set.instances({ Role: "a" })).map((i) => i.id)).toEqual(["mine-1"]);
    // A caller cannot widen the filter to another set's instances.
    expect((await set.instances({ DispatchCloudInstanceSetID: "yyyyy" })).map((i) => i.id).sort()).toEqual([
      "mine-1",
      "mine-2",
    ]);
    expect(inner.vms.size).toBe(4);
  });

  it("hasTags needs every pair, with equal values", () => {
    expect(hasTags({ a: "1", b: "2" }, { a: "1" })).toBe(true);
    expect(hasTags({ a: "1" }, { a: "2" })).toBe(false);
    expect(hasTags({}, { toString: "x" })).toBe(false);
    expect(hasTags({ a: "1" }, {})).toBe(true);
  });
});

/** The value of one series (a histogram's _count), or undefined if the series does not exist. */
async function value(registry: Registry, name: string, labels: Record<string, string>) {
  const metric = registry.getSingleMetric(name);
  if (metric === undefined) return undefined;
  const { values } = await metric.get();
  return values.find(
    (v) =>
      (name !== METRIC.duration || (v as { metricName?: string }).metricName === `${name}_count`) &&
      Object.entries(labels).every(([k, l]) => v.labels[k] === l),
  )?.value;
}

describe("instrumented", () => {
  it("creates every label combination at zero on a fresh registry", async () => {
    const clock = new FakeClock();
    const registry = new Registry();
    instrumented(new FakeSet(clock), { registry, clock, driver: "fake" });
    for (const operation of DRIVER_OPERATIONS) {
      for (const error of ["0", "1"]) {
        expect(await value(registry, METRIC.operations, { driver: "fake", operation, error })).toBe(0);
        expect(await value(registry, METRIC.duration, { driver: "fake", operation, error })).toBe(0);
      }
      for (const code of ["cloud.rate_limit", "cloud.quota", "cloud.capacity", "cloud.error"]) {
        expect(await value(registry, METRIC.errors, { driver: "fake", operation, code })).toBe(0);
      }
    }
    const text = await registry.metrics();
    expect(text).toContain(`${METRIC.operations}{driver="fake",operation="setTags",error="1"} 0`);
    expect(text).toContain(`${METRIC.errors}{driver="fake",operation="destroy",code="cloud.capacity"} 0`);
  });

  it("counts calls with the error label, errors by code, and cloud latency", async () => {
    const clock = new FakeClock();
    const registry = new Registry();
    const inner = new FakeSet(clock);
    const set = instrumented(inner, { registry, clock, driver: "fake" });
    inner.latencyMs = 2000;
    const vm = (await timed(clock, create(set))).value;
    await timed(clock, set.instances({}));
    inner.failures.push(new CloudQuotaError("quota"));
    await expect(timed(clock, create(set))).rejects.toBeInstanceOf(CloudQuotaError);
    inner.failures.push(new CapacityError("none", { scope: "instanceType", instanceType: "t.small" }));
    await expect(timed(clock, create(set))).rejects.toBeInstanceOf(CapacityError);
    inner.failures.push(new Error("socket hang up"));
    await expect(timed(clock, vm.setTags({ a: "b" }))).rejects.toThrow("socket hang up");
    await timed(clock, vm.setTags({ a: "c" }));
    inner.failures.push(new CloudRateLimitError("slow", { earliestRetry: 0 }));
    await expect(timed(clock, vm.destroy())).rejects.toBeInstanceOf(CloudRateLimitError);
    await timed(clock, vm.destroy());

    const op = (operation: string, error: string) =>
      value(registry, METRIC.operations, { driver: "fake", operation, error });
    expect([await op("create", "0"), await op("create", "1")]).toEqual([1, 2]);
    expect([await op("list", "0"), await op("list", "1")]).toEqual([1, 0]);
    expect([await op("setTags", "0"), await op("setTags", "1")]).toEqual([1, 1]);
    expect([await op("destroy", "0"), await op("destroy", "1")]).toEqual([1, 1]);

    const err = (operation: string, code: string) =>
      value(registry, METRIC.errors, { driver: "fake", operation, code });
    expect(await err("create", "cloud.quota")).toBe(1);
    expect(await err("create", "cloud.capacity")).toBe(1);
    expect(await err("setTags", "cloud.error")).toBe(1);
    expect(await err("destroy", "cloud.rate_limit")).toBe(1);
    expect(await err("create", "cloud.error")).toBe(0);

    const text = await registry.metrics();
    expect(text).toContain(`${METRIC.duration}_count{driver="fake",operation="create",error="1"} 2`);
    expect(text).toContain(`${METRIC.duration}_sum{driver="fake",operation="create",error="0"} 2`);
    expect(text).toContain(`${METRIC.duration}_bucket{le="1",driver="fake",operation="list",error="0"} 0`);
    expect(text).toContain(`${METRIC.duration}_bucket{le="2.5",driver="fake",operation="list",error="0"} 1`);
  });

  it("shares its metrics between two instance sets on one registry", async () => {
    const clock = new FakeClock();
    const registry = new Registry();
    const a = instrumented(new FakeSet(clock), { registry, clock, driver: "fake" });
    const b = instrumented(new FakeSet(clock), { registry, clock, driver: "fake" });
    await a.instances({});
    await b.instances({});
    expect(await value(registry, METRIC.operations, { driver: "fake", operation: "list", error: "0" })).toBe(
      2,
    );
  });
});

describe("wrapInstanceSet", () => {
  it("composes all four: tags, filter, rate limit and metrics, down to an instance's destroy", async () => {
    const clock = new FakeClock();
    const registry = new Registry();
    const inner = new FakeSet(clock);
    inner.add("foreign", { DispatchCloudInstanceSetID: "yyyyy" });
    const set = wrapInstanceSet(inner, {
      registry,
      clock,
      driver: "fake",
      maxOpsPerSecond: 4,
      defaultTags: { Owner: "ops" },
      instanceSetTags: { DispatchCloudInstanceSetID: "zzzzz" },
    });
    const t0 = clock.now();
    const { value: created } = await timed(
      clock,
      Promise.all([create(set, { DispatchCloudInstanceSetID: "x" }), create(set)]),
    );
    expect(created.map((vm) => vm.tags)).toEqual([
      { Owner: "ops", DispatchCloudInstanceSetID: "zzzzz" },
      { Owner: "ops", DispatchCloudInstanceSetID: "zzzzz" },
    ]);
    const { value: listed } = await timed(clock, set.instances({}));
    expect(listed.map((vm) => vm.id)).toEqual(["vm-1", "vm-2"]);
    await timed(clock, Promise.all(listed.map((vm) => vm.destroy())));
    expect(inner.calls.map((c) => [c.op, c.at - t0])).toEqual([
      ["create", 0],
      ["create", 250],
      ["list", 500],
      ["destroy", 750],
      ["destroy", 1000],
    ]);
    expect([...inner.vms.keys()]).toEqual(["foreign"]);
    const count = (operation: string) =>
      value(registry, METRIC.operations, { driver: "fake", operation, error: "0" });
    expect([await count("create"), await count("list"), await count("destroy")]).toEqual([2, 1, 2]);
    expect(set.quotaGroup(TYPE)).toBe("p");
    await set.stop();
    expect(inner.stopped).toBe(true);
  });

  it("passes errors through unchanged, with the provider error as cause", async () => {
    const clock = new FakeClock();
    const inner = new FakeSet(clock);
    const set = wrapInstanceSet(inner, {
      registry: new Registry(),
      clock,
      driver: "fake",
      maxOpsPerSecond: 0,
      defaultTags: {},
      instanceSetTags: { DispatchCloudInstanceSetID: "zzzzz" },
    });
    const cause = new Error("InternalError: 500");
    inner.failures.push(new CloudError("create failed", { cause }));
    const err = await create(set).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(CloudError);
    expect((err as CloudError).code).toBe("cloud.error");
    expect((err as CloudError).cause).toBe(cause);
  });
});
