import { describe, expect, it } from "vitest";
import type { Bundle, BundleState } from "../store/types.ts";
import { decide } from "./bundle-manager.ts";

const A = "zzzzz-bndl-00000000000000a";
const B = "zzzzz-bndl-00000000000000b";

function bundle(allowFailedDependencies: boolean): Bundle {
  const dependencies = [A, B].map((uuid) => ({ bundle: uuid, subpath: "", name: uuid }));
  return { dependencies, allowFailedDependencies } as unknown as Bundle;
}
const states = (a: BundleState | null, b: BundleState | null) =>
  [
    { uuid: A, state: a },
    { uuid: B, state: b },
  ].filter((d) => d.state !== null);

describe("decide", () => {
  it("stages when every dependency is ready, waits while one is not final", () => {
    expect(decide(bundle(false), states("ready", "ready"))).toEqual({ action: "stage", reason: null });
    expect(decide(bundle(false), states("ready", "running"))).toEqual({ action: "wait" });
    expect(decide({ dependencies: [] } as unknown as Bundle, [])).toEqual({ action: "stage", reason: null });
  });

  it("fails naming the failed or killed dependency", () => {
    expect(decide(bundle(false), states("ready", "killed"))).toEqual({
      action: "fail",
      reason: `dependency ${B} is killed`,
    });
    expect(decide(bundle(false), states("failed", "running"))).toEqual({
      action: "fail",
      reason: `dependency ${A} is failed`,
    });
    expect(decide(bundle(false), states("ready", null))).toEqual({
      action: "fail",
      reason: `dependency ${B} does not exist`,
    });
  });

  it("with allowFailedDependencies, stages once every dependency is final", () => {
    expect(decide(bundle(true), states("failed", "running"))).toEqual({ action: "wait" });
    expect(decide(bundle(true), states("failed", "ready"))).toMatchObject({ action: "stage" });
  });
});
