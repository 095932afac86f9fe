import { describe, expect, it } from "vitest";
import { type CommandSet, GahpEngine } from "./server.ts";
import { MAX_REPLY_BYTES } from "./wire.ts";

/** An engine over a command WAIT whose answers the test releases, and everything it wrote. */
function harness(maxPending = 3) {
  const out: string[] = [];
  const release = new Map<string, (answer: string[]) => void>();
  const commands: CommandSet = {
    WAIT: {
      kind: "async",
      parse: (args) => {
        if (args.length !== 1) throw new Error("WAIT takes a name");
        const name = args[0] as string;
        return () => new Promise<string[]>((ok) => release.set(name, ok));
      },
    },
  };
  const engine = new GahpEngine({
    version: "$GahpVersion: 1.0.0 Nov 26 2026 test $",
    commands,
    maxPending,
    maxRequestBytes: 1024,
    write: (text) => out.push(...text.split("\n").filter((l) => l !== "")),
    log: () => undefined,
  });
  const send = (line: string) => engine.feed(Buffer.from(`${line}\r\n`));
  const settle = () => new Promise((ok) => setImmediate(ok));
  return { out, release, engine, send, settle };
}

describe("GAHP engine", () => {
  it("answers results in the order they complete, with one R until the next RESULTS", async () => {
    const h = harness();
    h.send("ASYNC_MODE_ON");
    h.send("WAIT 1 a");
    h.send("wait 2 b");
    h.send("Wait 3 c");
    expect(h.out).toEqual(["S", "S", "S", "S"]);
    h.release.get("c")?.(["NULL", "third sent"]);
    await h.settle();
    h.release.get("a")?.(["NULL"]);
    await h.settle();
    expect(h.out.slice(4)).toEqual(["R"]);
    h.send("RESULTS");
    expect(h.out.slice(5)).toEqual(["S 2", "3 NULL third\\ sent", "1 NULL"]);
    h.release.get("b")?.(["x"]);
    await h.settle();
    expect(h.out.slice(8)).toEqual(["R"]);
    h.send("RESULTS");
    h.send("RESULTS");
    expect(h.out.slice(9)).toEqual(["S 1", "2 x", "S 0"]);
  });

  it('refuses a request past maxPending with "E Threads limit reached" and takes one again once one ends', async () => {
    const h = harness(2);
    h.send("WAIT 1 a");
    h.send("WAIT 2 b");
    h.send("WAIT 3 c");
    expect(h.out).toEqual(["S", "S", "E Threads\\ limit\\ reached"]);
    // A request id still in progress is refused whatever the load.
    h.release.get("a")?.(["NULL"]);
    await h.settle();
    h.send("WAIT 2 again");
    h.send("WAIT 3 c");
    expect(h.out.slice(3)).toEqual([
      "E gahp.bad_arguments:\\ request\\ id\\ 2\\ is\\ already\\ in\\ progress",
      "S",
    ]);
  });

  it("answers a result too long for the gridmanager's buffer with an error in its place", async () => {
    const h = harness();
    h.send("WAIT 1 a");
    h.release.get("a")?.(["NULL", "x".repeat(MAX_REPLY_BYTES)]);
    await h.settle();
    h.send("RESULTS");
    expect(h.out[1]).toBe("S 1");
    expect(h.out[2]).toMatch(/^1 gahp\.bad_arguments:\\ the\\ answer\\ passes/);
  });

  it("puts RESPONSE_PREFIX before every later line, R included", async () => {
    const h = harness();
    h.send("ASYNC_MODE_ON");
    h.send("RESPONSE_PREFIX GAHP:");
    h.send("WAIT 1 a");
    h.release.get("a")?.(["NULL"]);
    await h.settle();
    h.send("RESULTS");
    expect(h.out).toEqual(["S", "S", "GAHP:S", "GAHP:R", "GAHP:S 1", "GAHP:1 NULL"]);
  });
});
