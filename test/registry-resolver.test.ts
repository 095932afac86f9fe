/**
 * The registry resolver (rest-server/image-registry.ts) against the real registries of scripts/test-services.sh:
 * a tag pinned to the digest the registry serves its manifest under, with basic auth when the registry asks,
 * nothing when it cannot say (wrong password, no such tag, nobody listening), one request for concurrent
 * questions, and a digest reference kept as it is without asking anyone.
 */
import { createHash } from "node:crypto";
import { describe, expect, it } from "vitest";
import { createRegistryResolver } from "../rest-server/image-registry.ts";

const HINT =
  "run `bash scripts/test-services.sh` as root (starts both registries on loopback) and load its export lines";
const env = (name: string) => {
  const v = process.env[name];
  if (v === undefined || v === "") throw new Error(`${name} is not set: ${HINT}`);
  return v;
};
const REG = {
  open: env("DISPATCH_CLOUD_TEST_REGISTRY"),
  auth: env("DISPATCH_CLOUD_TEST_REGISTRY_AUTH"),
  user: env("DISPATCH_CLOUD_TEST_REGISTRY_USER"),
  password: env("DISPATCH_CLOUD_TEST_REGISTRY_PASSWORD"),
};
for (const host of [REG.open, REG.auth]) {
  const ok = await fetch(`http://${host}/v2/`).then(
    () => true,
    () => false,
  );
  if (!ok) throw new Error(`no registry answers at ${host}: ${HINT}`);
}

const OWNER = "zzzzz-user-aaaaaaaaaaaaaaa";
const secrets: Record<string, string> = { "env:RIGHT": REG.password, "env:WRONG": "not-the-password" };
const readSecret = (ref: string) => secrets[ref] ?? "";

/** The manifest's bytes as the registry serves them under `digest`, and their sha256. */
async function manifestDigest(host: string, repo: string, digest: string, auth?: string): Promise<string> {
  const res = await fetch(`http://${host}/v2/${repo}/manifests/${digest}`, {
    headers: {
      accept: "application/vnd.docker.distribution.manifest.v2+json",
      ...(auth === undefined ? {} : { authorization: auth }),
    },
  });
  expect(res.status).toBe(200);
  return `sha256:${createHash("sha256")
    .update(Buffer.from(await res.arrayBuffer()))
    .digest("hex")}`;
}

describe("createRegistryResolver", () => {
  it("pins a tag of an open registry to its manifest's digest", async () => {
    const resolve = createRegistryResolver({ registries: {}, readSecret });
    const got = await resolve(`${REG.open}/dctest/busybox:1`, OWNER);
    expect(got?.store).toBeNull();
    const m = /^(.*)@(sha256:[0-9a-f]{64})$/.exec(got?.pinned ?? "");
    expect(m?.[1]).toBe(`${REG.open}/dctest/busybox`);
    expect(await manifestDigest(REG.open, "dctest/busybox", m?.[2] ?? "")).toBe(m?.[2]);
  });

  it("with configuredOnly, answers for the configured registries' images only", async () => {
    const registries = { [REG.auth]: { username: REG.user, password: "env:RIGHT" } };
    const resolve = createRegistryResolver({ registries, readSecret, configuredOnly: true });
    expect(await resolve(`${REG.open}/dctest/busybox:1`, OWNER)).toBeNull();
    expect((await resolve(`${REG.auth}/dctest/busybox:1`, OWNER))?.pinned).toMatch(
      new RegExp(`^${REG.auth}/dctest/busybox@sha256:[0-9a-f]{64}$`),
    );
  });

  it("answers the registry's basic auth challenge with the configured credentials, and gives up on wrong ones", async () => {
    const right = createRegistryResolver({
      registries: { [REG.auth]: { username: REG.user, password: "env:RIGHT" } },
      readSecret,
    });
    const got = await right(`${REG.auth}/dctest/pull:1`, OWNER);
    const digest = /@(sha256:[0-9a-f]{64})$/.exec(got?.pinned ?? "")?.[1] ?? "";
    const basic = `Basic ${Buffer.from(`${REG.user}:${REG.password}`).toString("base64")}`;
    expect(await manifestDigest(REG.auth, "dctest/pull", digest, basic)).toBe(digest);

    const wrong = createRegistryResolver({
      registries: { [REG.auth]: { username: REG.user, password: "env:WRONG" } },
      readSecret,
    });
    expect(await wrong(`${REG.auth}/dctest/pull:1`, OWNER)).toBeNull();
    const none = createRegistryResolver({ registries: {}, readSecret });
    expect(await none(`${REG.auth}/dctest/pull:1`, OWNER)).toBeNull();
  });

  it("says nothing for a missing tag, a registry nobody runs, or a reference that is not one", async () => {
    const resolve = createRegistryResolver({ registries: {}, readSecret, timeoutMs: 2000 });
    expect(await resolve(`${REG.open}/dctest/busybox:no-such-tag`, OWNER)).toBeNull();
    expect(await resolve("127.0.0.1:1/dctest/busybox:1", OWNER)).toBeNull();
    expect(await resolve("Not A Reference", OWNER)).toBeNull();
  });

  it("keeps a digest reference as it is, asking nobody", async () => {
    const calls: string[] = [];
    const resolve = createRegistryResolver({
      registries: {},
      readSecret,
      fetch: (async (url: string | URL | Request) => {
        calls.push(String(url));
        throw new Error("no network");
      }) as typeof fetch,
    });
    const ref = `127.0.0.1:1/x/y:1@sha256:${"c".repeat(64)}`;
    expect(await resolve(ref, OWNER)).toEqual({
      pinned: `127.0.0.1:1/x/y@sha256:${"c".repeat(64)}`,
      store: null,
    });
    expect(calls).toEqual([]);
  });

  it("asks once for concurrent and repeated questions about one reference within cacheMs", async () => {
    let calls = 0;
    let t = 0;
    const resolve = createRegistryResolver({
      registries: {},
      readSecret,
      cacheMs: 1000,
      now: () => t,
      fetch: ((input: string | URL | Request, init?: RequestInit) => {
        calls++;
        return fetch(input, init);
      }) as typeof fetch,
    });
    const ref = `${REG.open}/dctest/busybox:1`;
    const answers = await Promise.all(Array.from({ length: 20 }, () => resolve(ref, OWNER)));
    expect(new Set(answers.map((a) => a?.pinned)).size).toBe(1);
    expect(calls).toBe(1);
    t = 2000;
    await resolve(ref, OWNER);
    expect(calls).toBe(2);
  });
});
