import { mkdtempSync, readdirSync, rmSync } from "node:fs";
import http from "node:http";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterEach, describe, expect, it } from "vitest";
import { warmUpSpare } from "./spare-warmup.ts";

/** TCP handles (the warm-up's server and its connection). */
const openHandles = () =>
  process.getActiveResourcesInfo().filter((r) => r === "TCPServerWrap" || r === "TCPSocketWrap").length;

/** Waits (up to 2 s) until the TCP handles are back to `n`; the client's side closes once it reads the end. */
async function handlesBackTo(n: number): Promise<number> {
  for (let i = 0; i < 200 && openHandles() !== n; i++) await new Promise((r) => setTimeout(r, 10));
  return openHandles();
}

describe("warmUpSpare", () => {
  const savedTmp = process.env["TMPDIR"];
  const dirs: string[] = [];
  afterEach(() => {
    if (savedTmp === undefined) delete process.env["TMPDIR"];
    else process.env["TMPDIR"] = savedTmp;
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });

  it("answers its own start call and leaves no server, connection, lock or directory behind", async () => {
    const tmp = mkdtempSync(path.join(tmpdir(), "dc-warm-test-"));
    dirs.push(tmp);
    process.env["TMPDIR"] = tmp;
    const requests: string[] = [];
    const seen = (req: http.IncomingMessage) => requests.push(`${req.method} ${req.url}`);
    // Every server the warm-up makes is seen through http.Server's request event.
    const emit = http.Server.prototype.emit;
    http.Server.prototype.emit = function (this: http.Server, event: string | symbol, ...args: unknown[]) {
      if (event === "request") seen(args[0] as http.IncomingMessage);
      return Reflect.apply(emit, this, [event, ...args]) as boolean;
    } as typeof emit;
    const before = openHandles();
    try {
      await warmUpSpare();
    } finally {
      http.Server.prototype.emit = emit;
    }
    expect(requests).toEqual(["POST /api/v1/runner/start"]);
    expect(await handlesBackTo(before)).toBe(before);
    expect(readdirSync(tmp)).toEqual([]);
  });

  it("never fails, even where it cannot make its lock directory", async () => {
    process.env["TMPDIR"] = "/nonexistent/dc-warm-test";
    const before = openHandles();
    await expect(warmUpSpare()).resolves.toBeUndefined();
    expect(await handlesBackTo(before)).toBe(before);
  });
});
