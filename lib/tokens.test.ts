import { describe, expect, it } from "vitest";
import {
  constantTimeEqual,
  hashToken,
  isTokenShaped,
  newBundleUuid,
  newRunnerToken,
  newUserToken,
  newUserUuid,
  RUNNER_TOKEN_PREFIX,
  USER_TOKEN_PREFIX,
} from "./tokens.ts";

describe("tokens", () => {
  it("makes prefixed 32-byte base64url tokens, each different", () => {
    const u = newUserToken();
    const r = newRunnerToken();
    expect(u).toMatch(/^dcu_[A-Za-z0-9_-]{43}$/);
    expect(r).toMatch(/^dcr_[A-Za-z0-9_-]{43}$/);
    expect(newUserToken()).not.toBe(u);
    expect(isTokenShaped(u, USER_TOKEN_PREFIX)).toBe(true);
    expect(isTokenShaped(u, RUNNER_TOKEN_PREFIX)).toBe(false);
    expect(isTokenShaped(`${u}x`, USER_TOKEN_PREFIX)).toBe(false);
  });

  it("hashes with sha256 hex", () => {
    expect(hashToken("abc")).toBe("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  });

  it("compares in constant time, including unequal lengths", () => {
    expect(constantTimeEqual("abc", "abc")).toBe(true);
    expect(constantTimeEqual("abc", "abd")).toBe(false);
    expect(constantTimeEqual("abc", "abcd")).toBe(false);
    expect(constantTimeEqual("", "")).toBe(true);
  });

  it("makes uuids from the cluster id", () => {
    expect(newBundleUuid("zzzzz")).toMatch(/^zzzzz-bndl-[a-z0-9]{15}$/);
    expect(newUserUuid("a1b2c")).toMatch(/^a1b2c-user-[a-z0-9]{15}$/);
    expect(() => newBundleUuid("BAD")).toThrow(/clusterId/);
  });
});
