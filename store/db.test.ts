import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../lib/errors.ts";
import { testPgUrl } from "../test/db.ts";
import { openDb, redactDbUrl, withRetries } from "./db.ts";

describe("openDb", () => {
  it.each([
    "mysql://u:hunter2@localhost/db",
    "pglite:",
    "",
    "postgres//u:hunter2@host/db",
    "postgres://u:hunter2@[bad/db",
  ])("rejects %j with store.invalid_url and no password", async (url) => {
    const err = await openDb(url).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(DispatchCloudError);
    expect(err).toMatchObject({ code: "store.invalid_url", path: "database.url", status: 400 });
    expect((err as Error).message).not.toContain("hunter2");
  });

  it("opens an in-memory PGlite database", async () => {
    const db = await openDb("pglite:memory:");
    try {
      expect(db.kind).toBe("pglite");
      const { rows } = await db.query<{ n: number }>("SELECT $1::int8 + 1 AS n", [41]);
      expect(rows).toEqual([{ n: 42 }]);
    } finally {
      await db.close();
    }
  });
});

describe("openDb pglite:<dir>", () => {
  it("creates the directory and keeps data across reopen", async () => {
    const dir = join(mkdtempSync(join(tmpdir(), "dc-pglite-")), "nested", "db");
    try {
      const db = await openDb(`pglite:${dir}`);
      await db.query("CREATE TABLE t (v text); INSERT INTO t VALUES ('kept')");
      await db.close();
      const again = await openDb(`pglite:${dir}`);
      try {
        expect((await again.query("SELECT v FROM t")).rows).toEqual([{ v: "kept" }]);
      } finally {
        await again.close();
      }
    } finally {
      rmSync(dirname(dirname(dir)), { recursive: true, force: true });
    }
  });
});

describe("redactDbUrl", () => {
  it("hides the password", () => {
    expect(redactDbUrl("postgres://alice:s3cret@db:5432/x")).toBe("postgres://alice:***@db:5432/x");
    expect(redactDbUrl("postgres://alice@db/x")).toBe("postgres://alice@db/x");
    expect(redactDbUrl("postgres//alice:s3cret@db/x")).toBe("postgres:...");
  });
});

describe("withRetries", () => {
  it("re-runs after serialization failures and deadlocks", async () => {
    const codes = ["40001", "40P01"];
    let calls = 0;
    const out = await withRetries(async () => {
      const code = codes[calls++];
      if (code) throw Object.assign(new Error("retry me"), { code });
      return "done";
    });
    expect(out).toBe("done");
    expect(calls).toBe(3);
  });

  it("does not retry other errors, and gives up after the given attempts", async () => {
    let calls = 0;
    const unique = Object.assign(new Error("duplicate"), { code: "23505" });
    await expect(
      withRetries(async () => {
        calls++;
        throw unique;
      }),
    ).rejects.toBe(unique);
    expect(calls).toBe(1);
    calls = 0;
    await expect(
      withRetries(
        async () => {
          calls++;
          throw Object.assign(new Error("always"), { code: "40001" });
        },
        { attempts: 3 },
      ),
    ).rejects.toThrow("always");
    expect(calls).toBe(3);
  });
});

describe("openDb postgres", () => {
  // pg's pool closes a connection idle for 10 s; ours keeps them (a burst after a quiet spell finds them).
  it("keeps its idle connections open past pg's 10 s default", async () => {
    const db = await openDb(testPgUrl());
    try {
      const backends = async () => {
        const answers = await Promise.all(
          [0, 1, 2].map(() => db.query<{ pid: number }>("SELECT pg_backend_pid() AS pid, pg_sleep(0.2)")),
        );
        return new Set(answers.map((a) => a.rows[0]?.pid));
      };
      const before = await backends();
      expect(before.size).toBe(3);
      await new Promise((r) => setTimeout(r, 10_500));
      expect(await backends()).toEqual(before);
    } finally {
      await db.close();
    }
  }, 30_000);
});
