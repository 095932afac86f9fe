/**
 * The registry resolver (rest-server/image-registry.ts) answering a Bearer challenge, against a real registry
 * (Debian's docker-registry, the CNCF distribution) configured for token auth on the open test registry's
 * storage. The token service is the only stand-in: an HTTP endpoint here that checks Basic credentials and signs
 * the JWT the registry verifies (RS256, its certificate in the header's x5c, trusted by the registry's
 * rootcertbundle), as a registry's auth server does.
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { createHash, createPrivateKey, randomBytes, sign, X509Certificate } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import http from "node:http";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createRegistryResolver } from "../rest-server/image-registry.ts";

const HINT =
  "run `bash scripts/test-services.sh` as root (installs docker-registry and openssl, starts the registries on loopback, pushes the test images) and load its export lines";
const DATA = process.env["DISPATCH_CLOUD_TEST_REGISTRY_DATA"] ?? "";
if (DATA === "") throw new Error(`DISPATCH_CLOUD_TEST_REGISTRY_DATA is not set: ${HINT}`);
for (const tool of ["docker-registry", "openssl"]) {
  try {
    execFileSync("sh", ["-c", `command -v ${tool}`], { stdio: "ignore" });
  } catch {
    throw new Error(`${tool} is not installed: ${HINT}`);
  }
}

const OWNER = "zzzzz-user-aaaaaaaaaaaaaaa";
const SERVICE = "dctest-registry";
const ISSUER = "dctest-token-issuer";
const USER = "puller";
const PASSWORD = randomBytes(12).toString("base64url");
const secrets: Record<string, string> = { "env:RIGHT": PASSWORD, "env:WRONG": "not-the-password" };
const readSecret = (ref: string) => secrets[ref] ?? "";
const b64url = (b: Buffer | string) => Buffer.from(b).toString("base64url");

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as net.AddressInfo).port;
      s.close(() => resolve(port));
    });
  });
}

describe("createRegistryResolver and a registry with token auth", () => {
  const dir = mkdtempSync(path.join(tmpdir(), "dc-registry-bearer-"));
  let registry: ChildProcess | undefined;
  let tokens: http.Server | undefined;
  let host = "";
  let realm = "";
  /** What the token service was asked: the query and whether the Basic credentials were right. */
  const asked: { service: string | null; scope: string | null; auth: "right" | "wrong" | "none" }[] = [];

  beforeAll(async () => {
    const key = path.join(dir, "key.pem");
    const cert = path.join(dir, "cert.pem");
    execFileSync(
      "openssl",
      ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1"].concat([
        "-subj",
        `/CN=${ISSUER}`,
      ]),
      { stdio: "ignore" },
    );
    const privateKey = createPrivateKey(readFileSync(key));
    const x5c = new X509Certificate(readFileSync(cert)).raw.toString("base64");
    const basic = `Basic ${Buffer.from(`${USER}:${PASSWORD}`).toString("base64")}`;

    tokens = http.createServer((req, res) => {
      const url = new URL(req.url ?? "/", "http://x");
      const given = req.headers.authorization;
      const auth = given === undefined ? "none" : given === basic ? "right" : "wrong";
      asked.push({ service: url.searchParams.get("service"), scope: url.searchParams.get("scope"), auth });
      if (auth !== "right") {
        res.writeHead(401, { "content-type": "application/json" }).end('{"details":"bad credentials"}');
        return;
      }
      // scope = repository:<name>:<actions>
      const [, name = "", actions = ""] =
        /^repository:(.+):([a-z,]+)$/.exec(url.searchParams.get("scope") ?? "") ?? [];
      const now = Math.floor(Date.now() / 1000);
      const header = b64url(JSON.stringify({ alg: "RS256", typ: "JWT", x5c: [x5c] }));
      const claims = b64url(
        JSON.stringify({
          iss: ISSUER,
          sub: USER,
          aud: SERVICE,
          exp: now + 300,
          nbf: now - 10,
          iat: now,
          jti: randomBytes(8).toString("hex"),
          access: [{ type: "repository", name, actions: actions.split(",").filter((a) => a === "pull") }],
        }),
      );
      const signature = b64url(sign("sha256", Buffer.from(`${header}.${claims}`), privateKey));
      res
        .writeHead(200, { "content-type": "application/json" })
        .end(JSON.stringify({ token: `${header}.${claims}.${signature}` }));
    });
    await new Promise<void>((resolve) => tokens?.listen(0, "127.0.0.1", resolve));
    realm = `http://127.0.0.1:${(tokens.address() as net.AddressInfo).port}/token`;

    host = `127.0.0.1:${await freePort()}`;
    const config = path.join(dir, "registry.yml");
    writeFileSync(
      config,
      [
        "version: 0.1",
        "log: {level: warn}",
        `storage: {filesystem: {rootdirectory: ${DATA}}}`,
        `http: {addr: "${host}"}`,
        `auth: {token: {realm: "${realm}", service: ${SERVICE}, issuer: ${ISSUER}, rootcertbundle: ${cert}}}`,
        "",
      ].join("\n"),
    );
    registry = spawn("docker-registry", ["serve", config], { stdio: ["ignore", "ignore", "pipe"] });
    let stderr = "";
    registry.stderr?.on("data", (d: Buffer) => {
      if (stderr.length < 10_000) stderr += d.toString();
    });
    for (let i = 0; ; i++) {
      const status = await fetch(`http://${host}/v2/`).then(
        (r) => r.status,
        () => 0,
      );
      if (status === 401) break;
      if (i > 80)
        throw new Error(`the token-auth registry did not come up on ${host} (HTTP ${status}): ${stderr}`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }, 30_000);

  afterAll(async () => {
    registry?.kill("SIGKILL");
    await new Promise<void>((resolve) => (tokens === undefined ? resolve() : tokens.close(() => resolve())));
    rmSync(dir, { recursive: true, force: true });
  });

  it("asks the challenge's realm for a token with the configured credentials and pins the tag with it", async () => {
    asked.length = 0;
    const resolve = createRegistryResolver({
      registries: { [host]: { username: USER, password: "env:RIGHT" } },
      readSecret,
    });
    const got = await resolve(`${host}/dctest/busybox:1`, OWNER);
    const m = /^(.*)@(sha256:[0-9a-f]{64})$/.exec(got?.pinned ?? "");
    expect(m?.[1], JSON.stringify(got)).toBe(`${host}/dctest/busybox`);
    expect(asked).toEqual([{ service: SERVICE, scope: "repository:dctest/busybox:pull", auth: "right" }]);

    // The digest is the manifest's as the registry serves it, fetched here with a token of our own.
    const tokenRes = await fetch(`${realm}?service=${SERVICE}&scope=repository:dctest/busybox:pull`, {
      headers: { authorization: `Basic ${Buffer.from(`${USER}:${PASSWORD}`).toString("base64")}` },
    });
    const { token } = (await tokenRes.json()) as { token: string };
    const manifest = await fetch(`http://${host}/v2/dctest/busybox/manifests/${m?.[2]}`, {
      headers: {
        accept: "application/vnd.docker.distribution.manifest.v2+json",
        authorization: `Bearer ${token}`,
      },
    });
    expect(manifest.status).toBe(200);
    const digest = `sha256:${createHash("sha256")
      .update(Buffer.from(await manifest.arrayBuffer()))
      .digest("hex")}`;
    expect(digest).toBe(m?.[2]);
  });

  it("says nothing when the realm refuses the credentials, or there are none to give", async () => {
    asked.length = 0;
    const wrong = createRegistryResolver({
      registries: { [host]: { username: USER, password: "env:WRONG" } },
      readSecret,
    });
    expect(await wrong(`${host}/dctest/busybox:1`, OWNER)).toBeNull();
    const none = createRegistryResolver({ registries: {}, readSecret });
    expect(await none(`${host}/dctest/busybox:1`, OWNER)).toBeNull();
    expect(asked.map((a) => a.auth)).toEqual(["wrong", "none"]);
    // Never the password itself, in the query or anywhere the token service could log it.
    expect(JSON.stringify(asked)).not.toContain(PASSWORD);
  });
});
