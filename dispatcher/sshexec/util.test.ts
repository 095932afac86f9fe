import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../../lib/errors.ts";
import { SshError } from "../../lib/executor.ts";
import { constantTimeEqual as secretsEqual } from "../../lib/tokens.ts";
import { backoffDelay, CappedBuffer, DEFAULT_BACKOFF, firstWord, parseAddress } from "./util.ts";

describe("parseAddress", () => {
  it("takes the default port when the address has none", () => {
    expect(parseAddress("10.0.0.5", 22)).toEqual({ host: "10.0.0.5", port: 22 });
    expect(parseAddress("vm.example", 2222)).toEqual({ host: "vm.example", port: 2222 });
  });

  it("reads host:port and [v6]:port", () => {
    expect(parseAddress("127.0.0.7:2200", 22)).toEqual({ host: "127.0.0.7", port: 2200 });
    expect(parseAddress("[fd00::1]:2200", 22)).toEqual({ host: "fd00::1", port: 2200 });
    expect(parseAddress("[fd00::1]", 22)).toEqual({ host: "fd00::1", port: 22 });
    expect(parseAddress("fd00::1", 22)).toEqual({ host: "fd00::1", port: 22 });
  });

  it.each(["", ":22", "host:", "host:abc", "host:0", "host:65536", "a b:22"])("rejects %j", (address) => {
    expect(() => parseAddress(address, 22)).toThrow(
      expect.objectContaining({ code: "ssh.connect_failed", message: expect.stringContaining("invalid") }),
    );
  });
});

describe("backoffDelay", () => {
  it("starts at 1 s, doubles, and stops at 30 s", () => {
    const delays = [1, 2, 3, 4, 5, 6, 7, 20].map((n) => backoffDelay(n, DEFAULT_BACKOFF));
    expect(delays).toEqual([1_000, 2_000, 4_000, 8_000, 16_000, 30_000, 30_000, 30_000]);
    expect(backoffDelay(0, DEFAULT_BACKOFF)).toBe(0);
  });
});

describe("constantTimeEqual (the secret check on connect)", () => {
  it("is true only for identical strings", () => {
    expect(secretsEqual("abc123", "abc123")).toBe(true);
    expect(secretsEqual("abc123", "abc124")).toBe(false);
    expect(secretsEqual("abc123", "abc1234")).toBe(false);
    expect(secretsEqual("", "x")).toBe(false);
  });
});

describe("firstWord", () => {
  it("keeps only the command's first word, shortened", () => {
    expect(firstWord("  docker run --env X=secret img")).toBe("docker");
    expect(firstWord("x".repeat(100))).toBe(`${"x".repeat(40)}...`);
  });
});

describe("CappedBuffer", () => {
  it("keeps up to its cap and flags the rest as dropped", () => {
    const b = new CappedBuffer(10);
    b.push(Buffer.from("12345"));
    expect(b.truncated).toBe(false);
    b.push(Buffer.from("6789abc"));
    b.push(Buffer.from("more"));
    expect(b.toBuffer().toString()).toBe("123456789a");
    expect(b.truncated).toBe(true);
  });

  it("is not truncated at exactly its cap", () => {
    const b = new CappedBuffer(4);
    b.push(Buffer.from("1234"));
    expect(b.truncated).toBe(false);
    expect(b.toBuffer().length).toBe(4);
  });
});

describe("SshError", () => {
  it("is a DispatchCloudError with its code and status", () => {
    const err = new SshError("ssh.timeout", "x timed out");
    expect(err).toBeInstanceOf(DispatchCloudError);
    expect(err.code).toBe("ssh.timeout");
    expect(err.status).toBe(504);
    expect(err.name).toBe("SshError");
  });
});
