/**
 * `dispatch-cloud dispatcher` serves the management API on management.listen (port 0 here): it prints the
 * URL, the token comes from the environment (env:), an active dispatcher answers the instance list, a
 * standby answers 503 management.not_active but still serves /metrics, and both close on stop.
 */
import { mkdtemp, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import type { CliIo } from "../cli/io.ts";
import { useTestDb } from "../test/dispatcher-harness.ts";

const TOKEN = "dcm-wiring-test-token-0123456789abcdef";

function io(argv: string[], cwd: string, signal: AbortSignal) {
  const errs: string[] = [];
  const value: CliIo = {
    argv,
    env: { DC_WIRING_MGMT_TOKEN: TOKEN },
    cwd,
    out: () => {},
    err: (l) => errs.push(l),
    progress: (l) => errs.push(l),
    signal,
  };
  return { io: value, errs };
}

const urlIn = (lines: string[]): string | undefined =>
  lines.map((l) => /management API at (http:\/\/\S+)/.exec(l)?.[1]).find((u) => u !== undefined);

describe("the dispatcher command serves the management API", () => {
  const getDb = useTestDb("pg");

  it("on management.listen with port 0, active and standby, token from env:", async () => {
    const dir = await mkdtemp(join(tmpdir(), "dc-mgmt-wiring-"));
    const file = join(dir, "config.yml");
    await writeFile(
      file,
      `clusterId: tst03\ndataDir: ${dir}/data\ndatabase: {url: "${getDb().url}"}\nlogging: {level: silent}\n` +
        "cloud: {driver: stub, driverParameters: {seed: 3}, deployPublicKey: false}\n" +
        'management: {listen: "127.0.0.1:0", token: "env:DC_WIRING_MGMT_TOKEN"}\n',
    );
    const auth = { authorization: `Bearer ${TOKEN}` };
    const stopFirst = new AbortController();
    const first = io(["dispatcher", "--config", file], dir, stopFirst.signal);
    const running = runCli(first.io);
    await expect.poll(() => first.errs.join("\n"), { timeout: 30_000 }).toContain("dispatcher: active");
    const url = urlIn(first.errs);
    expect(url).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
    expect(url).not.toMatch(/:0$/);
    const list = await fetch(`${url}/management/v1/instances`, { headers: auth });
    expect(list.status).toBe(200);
    expect(await list.json()).toEqual({ items: [] });
    expect((await fetch(`${url}/_health/ping`)).status).toBe(401);

    const stopSecond = new AbortController();
    const second = io(["dispatcher", "--config", file], dir, stopSecond.signal);
    const waiting = runCli(second.io);
    await expect.poll(() => second.errs.join("\n"), { timeout: 30_000 }).toContain("standby");
    const standbyUrl = urlIn(second.errs);
    expect(standbyUrl).not.toBe(url);
    const refused = await fetch(`${standbyUrl}/management/v1/bundles`, { headers: auth });
    expect(refused.status).toBe(503);
    expect(((await refused.json()) as { error: { code: string } }).error.code).toBe("management.not_active");
    expect((await fetch(`${standbyUrl}/metrics`, { headers: auth })).status).toBe(200);

    stopSecond.abort();
    expect(await waiting).toBe(0);
    stopFirst.abort();
    expect(await running).toBe(0);
    expect(first.errs.filter((l) => l.startsWith("dispatch-cloud:"))).toEqual([]);
    expect(first.errs.join("\n")).not.toContain(TOKEN);
    // Closed with the dispatcher.
    await expect(fetch(`${url}/_health/ping`, { headers: auth })).rejects.toThrow();
  });
});
