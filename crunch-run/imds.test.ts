/**
 * The IMDSv2 client and the spot notice poller against test/fake-imds.ts (a real HTTP server speaking IMDSv2).
 * A small switching proxy stands in for "the service restarted": tokens it handed out no longer work.
 */
import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import http from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { FakeImds } from "../test/fake-imds.ts";
import {
  createImdsClient,
  DEFAULT_IMDS_ENDPOINT,
  ImdsError,
  imdsEndpoint,
  type PollLogger,
  parseNotice,
  type SpotNotice,
  startSpotPoller,
} from "./imds.ts";
import { runnerPaths } from "./paths.ts";

/** A logger that keeps its lines. */
function recordingLogger(): PollLogger & { lines: { level: string; msg: string }[] } {
  const lines: { level: string; msg: string }[] = [];
  return {
    lines,
    info: (_obj, msg) => lines.push({ level: "info", msg }),
    debug: (_obj, msg) => lines.push({ level: "debug", msg }),
  };
}

/**
 * Forwards `/latest/...` to the fake IMDS as instance `target`'s requests; `failNext` answers that many requests
 * 500 itself. Switching `target` is a service that no longer knows the tokens it gave out.
 */
async function startProxy(imds: FakeImds, target: string) {
  const state = { target, failNext: 0 };
  const server = http.createServer((req, res) => {
    if (state.failNext > 0) {
      state.failNext--;
      req.resume();
      res.statusCode = 500;
      res.end("injected failure");
      return;
    }
    const up = new URL(imds.endpointFor(state.target));
    const fwd = http.request(
      {
        hostname: up.hostname,
        port: up.port,
        method: req.method,
        path: `${up.pathname}${req.url ?? ""}`,
        headers: req.headers,
      },
      (answer) => {
        res.writeHead(answer.statusCode ?? 502, answer.headers);
        answer.pipe(res);
      },
    );
    fwd.on("error", () => {
      res.statusCode = 502;
      res.end();
    });
    req.pipe(fwd);
  });
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  return {
    state,
    url,
    close: () =>
      new Promise<void>((ok) => {
        server.closeAllConnections();
        server.close(() => ok());
      }),
  };
}

/** A port nothing listens on (a server is opened and closed). */
async function closedPortUrl(): Promise<string> {
  const s = http.createServer();
  await new Promise<void>((ok) => s.listen(0, "127.0.0.1", ok));
  const port = (s.address() as AddressInfo).port;
  await new Promise<void>((ok) => s.close(() => ok()));
  return `http://127.0.0.1:${port}`;
}

describe("IMDSv2 client", () => {
  const imds = new FakeImds();
  beforeAll(async () => {
    await imds.start();
  });
  afterAll(async () => {
    await imds.stop();
  });

  it("gets a token, then asks for the notice with it: 404 is no notice; the token is reused", async () => {
    const id = "i-token-flow";
    const client = createImdsClient({ endpoint: imds.endpointFor(id) });
    expect(await client.spotNotice()).toBeNull();
    expect(await client.spotNotice()).toBeNull();
    expect(client.tokenRequests).toBe(1);
    const mine = imds.requests.filter((r) => r.instanceId === id);
    expect(mine.map((r) => [r.method, r.path, r.tokenValid])).toEqual([
      ["PUT", "/latest/api/token", false],
      ["GET", "/latest/meta-data/spot/instance-action", true],
      ["GET", "/latest/meta-data/spot/instance-action", true],
    ]);
  });

  it("returns the notice once the instance is interrupted", async () => {
    const id = "i-notice";
    const client = createImdsClient({ endpoint: `${imds.endpointFor(id)}/` });
    expect(await client.spotNotice()).toBeNull();
    imds.interrupt(id, "stop");
    const notice = await client.spotNotice();
    expect(notice).toEqual({
      action: "stop",
      time: expect.stringMatching(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$/),
    });
  });

  it("asks for a new token before the old one's TTL runs out", async () => {
    const id = "i-renew";
    let now = 1_000_000;
    const client = createImdsClient({ endpoint: imds.endpointFor(id), tokenTtlSeconds: 600, now: () => now });
    await client.spotNotice();
    now += 530_000; // 70 s before expiry: still good
    await client.spotNotice();
    expect(client.tokenRequests).toBe(1);
    now += 20_000; // 50 s before expiry: within the renewal margin
    await client.spotNotice();
    expect(client.tokenRequests).toBe(2);
    expect(
      imds.requests.filter((r) => r.instanceId === id && r.method === "GET").every((r) => r.tokenValid),
    ).toBe(true);
  });

  it("answers a 401 (the token is no longer valid) with a new token and one retry", async () => {
    const proxy = await startProxy(imds, "i-before");
    try {
      const client = createImdsClient({ endpoint: proxy.url });
      expect(await client.spotNotice()).toBeNull();
      // The service "restarts": the token it gave out means nothing to it now.
      proxy.state.target = "i-after";
      imds.interrupt("i-after");
      expect(await client.spotNotice()).toMatchObject({ action: "terminate" });
      expect(client.tokenRequests).toBe(2);
      const after = imds.requests.filter((r) => r.instanceId === "i-after");
      expect(after.map((r) => [r.method, r.tokenValid])).toEqual([
        ["GET", false],
        ["PUT", false],
        ["GET", true],
      ]);
    } finally {
      await proxy.close();
    }
  });

  it("fails with ImdsError on other answers and when nothing listens", async () => {
    // No instance under this base URL: the token request itself is 404.
    const err = await createImdsClient({ endpoint: imds.url })
      .spotNotice()
      .catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ImdsError);
    expect((err as ImdsError).status).toBe(404);
    const down = await createImdsClient({ endpoint: await closedPortUrl(), timeoutMs: 1000 })
      .token()
      .catch((e: unknown) => e);
    expect(down).toBeInstanceOf(ImdsError);
    expect((down as ImdsError).status).toBeNull();
  });

  it("parses only well-formed notices", () => {
    expect(parseNotice('{"action":"terminate","time":"2026-01-01T00:02:00Z"}')).toEqual({
      action: "terminate",
      time: "2026-01-01T00:02:00Z",
    });
    for (const bad of ["", "nope", "[]", '{"action":"terminate"}', '{"action":"x\\ny","time":"t"}']) {
      expect(() => parseNotice(bad), bad).toThrow(ImdsError);
    }
  });
});

describe("spot notice poller", () => {
  const imds = new FakeImds();
  beforeAll(async () => {
    await imds.start();
  });
  afterAll(async () => {
    await imds.stop();
  });

  it("polls until a notice arrives, reports it once and stops", async () => {
    const id = "i-poll";
    const log = recordingLogger();
    const notices: SpotNotice[] = [];
    const poller = startSpotPoller({
      client: createImdsClient({ endpoint: imds.endpointFor(id) }),
      intervalMs: 20,
      log,
      onNotice: (n) => notices.push(n),
    });
    await waitFor(() => imds.polled(id));
    imds.interrupt(id);
    await poller.done;
    expect(notices).toEqual([{ action: "terminate", time: expect.any(String) }]);
    // Once the notice came, no more requests.
    const count = imds.requests.filter((r) => r.instanceId === id).length;
    poller.stop();
    expect(imds.requests.filter((r) => r.instanceId === id).length).toBe(count);
  });

  it("gives up at once, saying so once, when the very first token request fails (no IMDS here)", async () => {
    for (const endpoint of [await closedPortUrl(), imds.url]) {
      const log = recordingLogger();
      const poller = startSpotPoller({
        client: createImdsClient({ endpoint, timeoutMs: 1000 }),
        intervalMs: 10,
        log,
        onNotice: () => {
          throw new Error("no notice expected");
        },
      });
      await poller.done;
      expect(log.lines).toEqual([
        {
          level: "info",
          msg: "no instance metadata service answers: spot interruption notices are not watched",
        },
      ]);
    }
  });

  it("keeps polling through later failures (logged at debug), and stops when told", async () => {
    const proxy = await startProxy(imds, "i-flaky");
    try {
      const log = recordingLogger();
      const notices: SpotNotice[] = [];
      const poller = startSpotPoller({
        client: createImdsClient({ endpoint: proxy.url }),
        intervalMs: 10,
        log,
        onNotice: (n) => notices.push(n),
      });
      await waitFor(() => imds.polled("i-flaky"));
      proxy.state.failNext = 3;
      await waitFor(() => proxy.state.failNext === 0);
      imds.interrupt("i-flaky");
      await poller.done;
      expect(notices).toHaveLength(1);
      const failures = log.lines.filter((l) => l.msg === "spot notice poll failed");
      expect(failures.length).toBeGreaterThanOrEqual(1);
      expect(log.lines.filter((l) => l.level !== "debug")).toEqual([]);

      const quiet = startSpotPoller({
        client: createImdsClient({ endpoint: imds.endpointFor("i-quiet") }),
        intervalMs: 10,
        log,
        onNotice: (n) => notices.push(n),
      });
      await waitFor(() => imds.polled("i-quiet"));
      quiet.stop();
      await quiet.done;
      imds.interrupt("i-quiet");
      expect(notices).toHaveLength(1);
    } finally {
      await proxy.close();
    }
  });
});

describe("the IMDS endpoint of an instance", () => {
  let root: string;
  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), "dc-imds-endpoint-"));
  });
  afterAll(async () => {
    await rm(root, { recursive: true, force: true });
  });

  it("is the first line of <DISPATCH_VM_ROOT>/etc/dispatch-cloud/imds-endpoint, else 169.254.169.254", async () => {
    const paths = runnerPaths({ DISPATCH_VM_ROOT: root });
    expect(paths.imdsEndpointFile).toBe(join(root, "etc/dispatch-cloud/imds-endpoint"));
    expect(imdsEndpoint(paths)).toBe(DEFAULT_IMDS_ENDPOINT);
    expect(DEFAULT_IMDS_ENDPOINT).toBe("http://169.254.169.254");
    await mkdir(join(root, "etc/dispatch-cloud"), { recursive: true });
    await writeFile(paths.imdsEndpointFile, " http://127.0.0.1:8111/i/i-0abc/ \nignored\n");
    expect(imdsEndpoint(paths)).toBe("http://127.0.0.1:8111/i/i-0abc");
    for (const bad of ["", "not a url\n", "ftp://x/\n"]) {
      await writeFile(paths.imdsEndpointFile, bad);
      expect(() => imdsEndpoint(paths), bad).toThrow(ImdsError);
    }
  });
});

async function waitFor(check: () => boolean, ms = 10_000): Promise<void> {
  const end = Date.now() + ms;
  while (!check()) {
    if (Date.now() > end) throw new Error("condition not met in time");
    await new Promise((r) => setTimeout(r, 10));
  }
}
