import { mkdtemp, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import { useTestDb } from "./dispatcher-harness.ts";

function io(argv: string[], cwd: string, signal?: AbortSignal) {
  const lines: string[] = [];
  const errs: string[] = [];
  const value: CliIo = {
    argv,
    env: {},
    cwd,
    out: (l) => lines.push(l),
    err: (l) => errs.push(l),
    progress: (l) => errs.push(l),
    ...(signal === undefined ? {} : { signal }),
  };
  return { io: value, lines, errs };
}

async function configFile(dbUrl: string): Promise<{ dir: string; file: string }> {
  const dir = await mkdtemp(join(tmpdir(), "dc-dispatcher-"));
  const file = join(dir, "config.yml");
  await writeFile(
    file,
    `clusterId: tst02\ndataDir: ${dir}/data\ndatabase: {url: "${dbUrl}"}\nlogging: {level: silent}\n` +
      "cloud: {driver: stub, driverParameters: {seed: 3}, deployPublicKey: false}\n" +
      'management: {listen: "127.0.0.1:0"}\n',
  );
  return { dir, file };
}

describe("dispatch-cloud dispatcher", () => {
  const getDb = useTestDb("pg");

  it("is listed in the usage and explains itself with --help", async () => {
    const help = io(["help"], tmpdir());
    expect(await runCli(help.io)).toBe(0);
    expect(help.lines.join("\n")).toMatch(/dispatcher \[--config F\]/);
    const own = io(["dispatcher", "--help"], tmpdir());
    expect(await runCli(own.io)).toBe(0);
    expect(own.lines.join("\n")).toContain("standby");
  });

  it("refuses PGlite with a clear error naming database.url", async () => {
    const { dir, file } = await configFile("pglite:memory:");
    const run = io(["dispatcher", "--config", file], dir);
    expect(await runCli(run.io)).toBe(1);
    expect(run.errs.join("\n")).toMatch(/needs PostgreSQL.*\[config\.invalid_value\]/);
    expect(run.errs.join("\n")).toContain("database.url");
  });

  it("runs on PostgreSQL (active, then a second one standby) and stops on its signal", async () => {
    const { dir, file } = await configFile(getDb().url);
    const stopFirst = new AbortController();
    const first = io(["dispatcher", "--config", file], dir, stopFirst.signal);
    const running = runCli(first.io);
    await expect.poll(() => first.errs.join("\n"), { timeout: 20_000 }).toContain("dispatcher: active");
    const stopSecond = new AbortController();
    const second = io(["dispatcher", "--config", file], dir, stopSecond.signal);
    const waiting = runCli(second.io);
    await expect.poll(() => second.errs.join("\n"), { timeout: 20_000 }).toContain("standby");
    stopSecond.abort();
    expect(await waiting).toBe(0);
    stopFirst.abort();
    expect(await running).toBe(0);
    expect(first.errs.filter((l) => l.startsWith("dispatch-cloud:"))).toEqual([]);
  });
});
