/**
 * The operator commands' own parts: the tables they print, where they find the management token and URL,
 * and their errors before any server answers. test/e2e-management.test.ts runs them against a real system.
 */
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../cli/cli.ts";
import { formatInstances } from "../cli/commands/instance.ts";
import { formatQueue } from "../cli/commands/queue.ts";
import type { CliIo } from "../cli/io.ts";
import {
  connectManagement,
  DEFAULT_MANAGEMENT_URL,
  findManagementToken,
  type ManagementBundle,
  type ManagementInstance,
} from "../cli/management-client.ts";
import { DispatchCloudError } from "../lib/errors.ts";

function io(argv: string[], env: Record<string, string | undefined>, cwd: string) {
  const out: string[] = [];
  const err: string[] = [];
  const value: CliIo = {
    argv,
    env,
    cwd,
    out: (l) => out.push(l),
    err: (l) => err.push(l),
    progress: (l) => err.push(l),
  };
  return { io: value, out, err };
}

const instance = (over: Partial<ManagementInstance>): ManagementInstance => ({
  instanceId: "local-0001",
  address: "127.0.0.2",
  instanceType: "m.small",
  providerType: "local.small",
  price: 0.05,
  state: "idle",
  idleBehavior: "run",
  runningBundles: [],
  lastBusyAt: null,
  stateSince: "2025-01-01T00:00:00.000Z",
  secondsInState: 12,
  ...over,
});

const bundle = (over: Partial<ManagementBundle>): ManagementBundle => ({
  uuid: "e2e01-b0000-000000000000001",
  state: "staged",
  priority: 500,
  resources: { vcpus: 1, ram: 134217728 },
  eligibleTypes: ["m.small", "m.large"],
  firstSeenAt: "2025-01-01T00:00:00.000Z",
  schedulingStatus: "waiting for instance local-0001 to boot",
  instanceId: null,
  ...over,
});

describe("instance list table", () => {
  it("prints one aligned row per instance, a header only with --header", () => {
    const items = [
      instance({ state: "running", runningBundles: ["b1", "b2"], price: 1.25 }),
      instance({
        instanceId: "placeholder-7",
        address: "",
        state: "booting",
        idleBehavior: "drain",
        instanceType: "m.large",
        providerType: "local.large",
      }),
    ];
    expect(formatInstances(items, false)).toEqual([
      "local-0001     127.0.0.2  running  run    m.small  local.small  1.2500  b1,b2  -",
      "placeholder-7  -          booting  drain  m.large  local.large  0.0500  -      -",
    ]);
    const withHeader = formatInstances(items, true);
    expect(withHeader).toHaveLength(3);
    expect(withHeader[0]).toBe(
      "INSTANCE       ADDRESS    STATE    IDLE BEHAVIOR  TYPE     PROVIDER TYPE  PRICE   RUNNING BUNDLES  PROBLEM",
    );
    expect(withHeader[1]).toBe(
      "local-0001     127.0.0.2  running  run            m.small  local.small    1.2500  b1,b2            -",
    );
    expect(formatInstances([], false)).toEqual([]);
  });

  it("marks an instance with a spot interruption notice as preempted in its state", () => {
    const items = [
      instance({ state: "running", preempted: true, problem: "preempted (spot interruption notice)" }),
      instance({ instanceId: "local-0002", problem: null }),
    ];
    expect(formatInstances(items, false)).toEqual([
      "local-0001  127.0.0.2  running,preempted  run  m.small  local.small  0.0500  -  preempted (spot interruption notice)",
      "local-0002  127.0.0.2  idle               run  m.small  local.small  0.0500  -  -",
    ]);
  });
});

describe("queue table", () => {
  it("prints the first eligible type, waiting since and the status sentence last", () => {
    const lines = formatQueue(
      [
        bundle({}),
        bundle({
          uuid: "e2e01-b0000-000000000000002",
          state: "running",
          priority: 1,
          eligibleTypes: [],
          schedulingStatus: null,
          instanceId: "local-0003",
        }),
      ],
      true,
    );
    expect(lines).toEqual([
      "UUID                         STATE    PRIORITY  TYPE     WAITING SINCE             STATUS",
      "e2e01-b0000-000000000000001  staged   500       m.small  2025-01-01T00:00:00.000Z  waiting for instance local-0001 to boot",
      "e2e01-b0000-000000000000002  running  1         -        2025-01-01T00:00:00.000Z  on local-0003",
    ]);
  });
});

describe("management token and URL", () => {
  let dir: string;
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "dc-cli-mgmt-"));
    await writeFile(join(dir, "token"), "from-file\n");
    await writeFile(join(dir, "empty"), "\n");
  });
  afterAll(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  it("takes --token-file over the environment, else DISPATCH_CLOUD_MANAGEMENT_TOKEN, else its _FILE", async () => {
    const env = { DISPATCH_CLOUD_MANAGEMENT_TOKEN: " from-env \n" };
    expect(await findManagementToken(io([], env, dir).io, "token")).toBe("from-file");
    expect(await findManagementToken(io([], env, dir).io, undefined)).toBe("from-env");
    const fileEnv = { DISPATCH_CLOUD_MANAGEMENT_TOKEN_FILE: join(dir, "token") };
    expect(await findManagementToken(io([], fileEnv, dir).io, undefined)).toBe("from-file");
  });

  it("fails with cli.no_token when there is none, the file is missing or empty", async () => {
    for (const file of [undefined, "missing", "empty"]) {
      const err = await findManagementToken(io([], {}, dir).io, file).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(DispatchCloudError);
      expect((err as DispatchCloudError).code).toBe("cli.no_token");
    }
  });

  it("takes the URL from --management-url, else the environment, else the default", async () => {
    const env = { DISPATCH_CLOUD_MANAGEMENT_TOKEN: "t", DISPATCH_CLOUD_MANAGEMENT_URL: "http://10.0.0.1:1" };
    expect((await connectManagement(io([], env, dir).io, { "management-url": "http://x:2" })).url).toBe(
      "http://x:2",
    );
    expect((await connectManagement(io([], env, dir).io, {})).url).toBe("http://10.0.0.1:1");
    expect((await connectManagement(io([], { DISPATCH_CLOUD_MANAGEMENT_TOKEN: "t" }, dir).io, {})).url).toBe(
      DEFAULT_MANAGEMENT_URL,
    );
  });

  it("says where it tried when nothing listens, without the token, and exits 1", async () => {
    const server = net.createServer();
    await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
    const port = (server.address() as net.AddressInfo).port;
    await new Promise<void>((ok) => server.close(() => ok()));
    const url = `http://127.0.0.1:${port}`;
    const secret = "dcm-secret-never-printed";
    for (const argv of [["instance", "list"], ["queue"], ["instance", "drain", "i-1", "i-2"]]) {
      const c = io(
        argv,
        { DISPATCH_CLOUD_MANAGEMENT_URL: url, DISPATCH_CLOUD_MANAGEMENT_TOKEN: secret },
        dir,
      );
      expect(await runCli(c.io)).toBe(1);
      expect(c.err).toEqual([
        expect.stringMatching(/cannot reach the management API at .*\[cli\.unreachable\]$/),
      ]);
      expect([...c.out, ...c.err].join("\n")).not.toContain(secret);
    }
  });

  it("rejects malformed command lines with exit 2", async () => {
    const env = { DISPATCH_CLOUD_MANAGEMENT_TOKEN: "t" };
    for (const argv of [
      ["instance"],
      ["instance", "reboot", "i-1"],
      ["instance", "hold"],
      ["instance", "list", "extra"],
      ["instance", "hold", "i-1", "--reason", "x"],
      ["queue", "extra"],
      ["queue", "show"],
    ]) {
      const c = io(argv, env, dir);
      expect(await runCli(c.io), argv.join(" ")).toBe(2);
      expect(c.err.join("\n")).toContain("[cli.usage]");
    }
  });
});
