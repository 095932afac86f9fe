/**
 * The CLI's `tokens create|list|revoke` against a real REST server on a port (PGlite), as a user and as an
 * admin.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { FastifyInstance } from "fastify";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import { hashToken, newUserToken, newUserUuid } from "../lib/tokens.ts";
import { createRestServer } from "../rest-server/server.ts";
import { createUser } from "../store/queries.ts";
import { openTestDb, type TestDb } from "./db.ts";

interface Captured {
  code: number;
  out: string[];
  err: string[];
}

const TOKEN_ID = /^zzzzz-tokn-[a-z0-9]{15}$/;

describe("CLI: tokens create, list, revoke", () => {
  let db: TestDb;
  let app: FastifyInstance;
  let apiUrl: string;
  let dir: string;
  const admin = { uuid: newUserUuid("zzzzz"), token: newUserToken() };
  const alice = { uuid: newUserUuid("zzzzz"), token: newUserToken() };
  const bob = { uuid: newUserUuid("zzzzz"), token: newUserToken() };

  const cli = async (token: string, argv: string[]): Promise<Captured> => {
    const out: string[] = [];
    const err: string[] = [];
    const io: CliIo = {
      argv,
      env: { DISPATCH_CLOUD_API_URL: apiUrl, DISPATCH_CLOUD_TOKEN: token },
      cwd: dir,
      out: (l) => out.push(l),
      err: (l) => err.push(l),
      progress: (l) => err.push(l),
    };
    const code = await runCli(io);
    return { code, out, err };
  };
  /** `tokens list --json` of a token's user. */
  const listJson = async (token: string, user?: string) => {
    const res = await cli(token, [
      "tokens",
      "list",
      "--json",
      ...(user === undefined ? [] : ["--user", user]),
    ]);
    expect(res.code, res.err.join("\n")).toBe(0);
    return JSON.parse(res.out.join("\n")) as {
      id: string;
      label: string;
      current: boolean;
      userUuid: string;
    }[];
  };

  beforeAll(async () => {
    db = await openTestDb("pglite");
    dir = await mkdtemp(join(tmpdir(), "dc-cli-tokens-"));
    for (const [u, name, isAdmin] of [
      [admin, "admin", true],
      [alice, "alice", false],
      [bob, "bob", false],
    ] as const) {
      await createUser(db, { uuid: u.uuid, name, isAdmin, tokenHash: hashToken(u.token) });
    }
    app = await createRestServer({
      db,
      logger: false,
      clusterId: "zzzzz",
      maxRequestBodySize: 2 ** 20,
      defaultMaxAttempts: 3,
      dataDir: join(dir, "data"),
    });
    apiUrl = await app.listen({ host: "127.0.0.1", port: 0 });
  });
  afterAll(async () => {
    await app?.close();
    await db?.close();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  it("creates a token (printed once, on stdout), lists the user's tokens, and revokes one", async () => {
    const made = await cli(alice.token, ["tokens", "create", "--label", "laptop", "--ttl", "1h"]);
    expect(made.code, made.err.join("\n")).toBe(0);
    expect(made.out).toHaveLength(1);
    const token = made.out[0]!;
    expect(token).toMatch(/^dcu_[A-Za-z0-9_-]{43}$/);
    const said = made.err.join("\n");
    expect(said).toMatch(/created token zzzzz-tokn-[a-z0-9]{15} for zzzzz-user-[a-z0-9]{15} \(expires 20/);
    expect(said).not.toContain(token);

    const table = await cli(token, ["tokens", "list"]);
    expect(table.code).toBe(0);
    expect(table.out[0]).toMatch(/^ID\s+CREATED\s+EXPIRES\s+LAST USED\s+STATUS\s+LABEL$/);
    expect(table.out).toHaveLength(3);
    const [firstRow, newRow] = table.out.slice(1);
    expect(firstRow).toMatch(/^zzzzz-tokn-\S+\s+\S+\s+never\s+\S+$/);
    expect(newRow).toMatch(/^zzzzz-tokn-\S+\s+\S+\s+20\S+\s+20\S+\s+current\s+laptop$/);
    expect(table.out.join("\n")).not.toContain(token);

    const tokens = await listJson(token);
    expect(tokens.map((t) => [t.label, t.current])).toEqual([
      ["", false],
      ["laptop", true],
    ]);
    const id = tokens[1]!.id;
    expect(id).toMatch(TOKEN_ID);
    expect(await cli(alice.token, ["tokens", "revoke", id])).toMatchObject({
      code: 0,
      out: [`${id}: revoked`],
    });
    const refused = await cli(token, ["tokens", "list"]);
    expect(refused.code).toBe(1);
    expect(refused.err.join("\n")).toContain("[auth.invalid_token]");
    expect((await listJson(alice.token)).map((t) => t.label)).toEqual([""]);
  });

  it("prints the new token as JSON with --json", async () => {
    const res = await cli(bob.token, ["tokens", "create", "--json", "--expires-at", "2999-01-01T00:00:00Z"]);
    expect(res.code).toBe(0);
    const t = JSON.parse(res.out.join("\n"));
    expect(t).toMatchObject({ userUuid: bob.uuid, expiresAt: "2999-01-01T00:00:00.000Z", current: false });
    expect(t.token).toMatch(/^dcu_/);
    expect(await cli(t.token, ["tokens", "revoke", t.id])).toMatchObject({ code: 0 });
  });

  it("lets a user revoke only their own tokens; an admin lists, makes and revokes another user's", async () => {
    const [bobsFirst] = await listJson(bob.token);
    const denied = await cli(alice.token, ["tokens", "revoke", bobsFirst!.id]);
    expect(denied.code).toBe(1);
    expect(denied.out.join("\n")).toContain(`${bobsFirst!.id}: error:`);
    expect(denied.out.join("\n")).toContain("[token.not_found]");
    const forbidden = await cli(alice.token, ["tokens", "list", "--user", bob.uuid]);
    expect(forbidden.code).toBe(1);
    expect(forbidden.err.join("\n")).toContain("[auth.forbidden]");

    expect((await listJson(admin.token, bob.uuid)).map((t) => t.id)).toEqual([bobsFirst!.id]);
    const made = await cli(admin.token, ["tokens", "create", "--user", bob.uuid, "--label", "reset"]);
    expect(made.code).toBe(0);
    const forBob = made.out[0]!;
    expect((await listJson(forBob)).map((t) => [t.label, t.current])).toEqual([
      ["", false],
      ["reset", true],
    ]);
    // Several ids at once; one that fails does not stop the others, and the exit code says something failed.
    const res = await cli(admin.token, ["tokens", "revoke", bobsFirst!.id, "zzzzz-tokn-000000000000000"]);
    expect(res.code).toBe(1);
    expect(res.out[0]).toBe(`${bobsFirst!.id}: revoked`);
    expect(res.out[1]).toContain("[token.not_found]");
    expect((await cli(bob.token, ["tokens", "list"])).err.join("\n")).toContain("[auth.invalid_token]");
  });

  it("reports bad usage and bad values with their codes", async () => {
    const both = await cli(alice.token, [
      "tokens",
      "create",
      "--ttl",
      "1h",
      "--expires-at",
      "2999-01-01T00:00:00Z",
    ]);
    expect(both.code).toBe(2);
    expect(both.err.join("\n")).toContain("[cli.usage]");
    expect((await cli(alice.token, ["tokens"])).code).toBe(2);
    expect((await cli(alice.token, ["tokens", "revoke"])).code).toBe(2);
    expect((await cli(alice.token, ["tokens", "rotate"])).code).toBe(2);
    const badTtl = await cli(alice.token, ["tokens", "create", "--ttl", "soon"]);
    expect(badTtl.code).toBe(1);
    expect(badTtl.err.join("\n")).toContain("[request.invalid_body]");
    expect(badTtl.err.join("\n")).toContain("ttl");
    const badId = await cli(alice.token, ["tokens", "revoke", "nope"]);
    expect(badId.code).toBe(1);
    expect(badId.out.join("\n")).toContain("[request.invalid_param]");
  });
});
