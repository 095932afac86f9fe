/**
 * `dispatch-cloud gahp` as a process, on the protocol alone: the start-up the gridmanager performs, every kind of
 * malformed line answered E with a reason (and the GAHP still serving after each), backpressure with
 * "E Threads\ limit\ reached" while requests hang on a REST server that does not answer, and a clean exit when
 * stdin closes with requests still in progress.
 */
import { randomBytes } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { GahpProcess } from "./gahp-client.ts";

const ALL_COMMANDS = [
  "ASYNC_MODE_OFF",
  "ASYNC_MODE_ON",
  "BOINC_ABORT_JOBS",
  "BOINC_FETCH_OUTPUT",
  "BOINC_PING",
  "BOINC_QUERY_BATCHES",
  "BOINC_RETIRE_BATCH",
  "BOINC_SELECT_PROJECT",
  "BOINC_SET_LEASE",
  "BOINC_SUBMIT",
  "COMMANDS",
  "QUIT",
  "RESPONSE_PREFIX",
  "RESULTS",
  "VERSION",
];

describe("dispatch-cloud gahp: the wire protocol", () => {
  let dir: string;
  let server: http.Server;
  let apiUrl: string;
  const held: http.ServerResponse[] = [];

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-gahp-"));
    // A REST server that takes requests and never answers them (until the end of the test file).
    server = http.createServer((_req, res) => {
      held.push(res);
    });
    await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
    apiUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  });

  afterAll(async () => {
    for (const res of held) res.destroy();
    server.closeAllConnections();
    await new Promise((ok) => server.close(ok));
    await rm(dir, { recursive: true, force: true });
  });

  const start = async (yaml: string) => {
    const config = join(dir, `gahp-${randomBytes(4).toString("hex")}.yml`);
    await writeFile(config, `apiUrl: ${apiUrl}\ntoken: literal-test-token\n${yaml}`);
    const g = GahpProcess.start(["--config", config]);
    return g;
  };

  it("starts as the gridmanager expects: banner, COMMANDS, ASYNC_MODE_ON, and serves after every malformed line", async () => {
    const g = await start("maxRequestBytes: 512KiB\napps: {}\n");
    // The banner: what VERSION answers, without the S.
    const banner = await g.line();
    expect(banner).toMatch(/^\$GahpVersion: \d+\.\d+\.\d+ [A-Z][a-z]{2} \d{1,2} \d{4} \S.* \$$/);
    expect(Buffer.byteLength(banner)).toBeLessThan(150);
    const commands = await g.send("COMMANDS");
    expect(commands[0]).toBe("S");
    expect(commands.slice(1).sort()).toEqual(ALL_COMMANDS);
    expect(await g.send("ASYNC_MODE_ON")).toEqual(["S"]);
    expect(await g.send("RESULTS")).toEqual(["S", "0"]);
    // Commands are case-insensitive.
    const version = await g.send("version");
    expect(version[0]).toBe("S");
    expect(`${version.slice(1).join(" ")}`).toBe(banner.replaceAll("\\ ", " "));

    const garbage = randomBytes(4096).map((b) => (b === 0x0a || b === 0x5c ? 0x00 : b));
    const malformed: [string, string | Buffer, RegExp][] = [
      ["an unknown command", "FROBNICATE 1 2", /^gahp\.unknown_command: unknown command "FROBNICATE"/],
      ["an empty line", "", /^gahp\.unknown_command: /],
      [
        "a request id that is not a number",
        "BOINC_PING one",
        /^gahp\.bad_arguments: BOINC_PING needs a request id/,
      ],
      ["request id 0", "BOINC_PING 0", /^gahp\.bad_arguments: /],
      [
        "too many arguments",
        "BOINC_PING 5 extra",
        /^gahp\.bad_arguments: BOINC_PING takes only a request id/,
      ],
      ["an argument to RESULTS", "RESULTS now", /^gahp\.bad_arguments: RESULTS takes no arguments/],
      ["too few for RETIRE", "BOINC_RETIRE_BATCH 6", /^gahp\.bad_arguments: /],
      ["too few for SET_LEASE", "BOINC_SET_LEASE 7 b", /^gahp\.bad_arguments: /],
      ["a lease that is not a time", "BOINC_SET_LEASE 7 b soon", /^gahp\.bad_arguments: the lease end/],
      [
        "submit bounds cut short",
        "BOINC_SUBMIT 8 b app 1 j 0 0 NULL",
        /^gahp\.bad_arguments: after the jobs come 6 values/,
      ],
      ["a submit's job count past its jobs", "BOINC_SUBMIT 8 b app 3 j 0 0", /^gahp\.bad_arguments: /],
      [
        "batch count and names disagree",
        "BOINC_QUERY_BATCHES 9 0 2 one",
        /^gahp\.bad_arguments: #batches is 2/,
      ],
      [
        "a fetch mode that is neither",
        "BOINC_FETCH_OUTPUT 10 j /d /d/e MOST 0",
        /^gahp\.bad_arguments: mode must be/,
      ],
      ["SELECT_PROJECT with one argument", "BOINC_SELECT_PROJECT http://x", /^gahp\.bad_arguments: /],
      ["a bad escape", "BOINC_PING\\x 11", /^gahp\.malformed_line: bad escape/],
      ["a tab escaped", "BOINC_RETIRE_BATCH 12 a\\\tb", /^gahp\.malformed_line: bad escape/],
      ["binary garbage", Buffer.from(garbage), /^gahp\.malformed_line: /],
      ["a NUL byte", Buffer.from("BOINC_PING 13\u0000"), /^gahp\.malformed_line: control character 0x00/],
      [
        "a 400 KB argument list",
        `BOINC_ABORT_JOBS 14 ${"j ".repeat(200_000)}`,
        /^gahp\.bad_arguments: job name is empty/,
      ],
      [
        "a 1 MB line",
        `BOINC_PING 15 ${"x".repeat(1_000_000)}`,
        /^gahp\.line_too_long: a request line of 1000015 bytes passes maxRequestBytes \(524288\)/,
      ],
    ];
    for (const [what, line, reason] of malformed) {
      const reply = await g.send(line);
      expect(reply[0], what).toBe("E");
      expect(reply, what).toHaveLength(2);
      expect(reply[1], what).toMatch(reason);
      // Still serving, and still in step: the next answer is this one's.
      expect(await g.send("RESULTS"), what).toEqual(["S", "0"]);
    }
    // A project URL that is not one: a malformed argument of a synchronous command.
    const f = await g.send("BOINC_SELECT_PROJECT not\\ a\\ url token");
    expect(f[0]).toBe("E");
    expect(f[1]).toBe(`gahp.bad_arguments: not a URL: "not a url"`);
    expect(await g.send("QUIT")).toEqual(["S"]);
    expect(await g.exited).toBe(0);
  }, 120_000);

  it('answers "E Threads\\ limit\\ reached" past maxPendingRequests, and exits 0 when stdin closes mid-request', async () => {
    const g = await start("maxPendingRequests: 3\napps: {}\n");
    await g.line();
    await g.send("ASYNC_MODE_ON");
    const before = held.length;
    for (let reqid = 1; reqid <= 3; reqid++) expect(await g.send(`BOINC_PING ${reqid}`)).toEqual(["S"]);
    g.write("BOINC_PING 4\r\n");
    expect(await g.line()).toBe("E Threads\\ limit\\ reached");
    // The three are really in progress: the REST server holds them.
    while (held.length < before + 3) await new Promise((ok) => setTimeout(ok, 50));
    expect(await g.send("RESULTS")).toEqual(["S", "0"]);
    expect(await g.close()).toBe(0);
    expect(g.stderr).toMatch(/stdin closed: stopping/);
  }, 60_000);
});
