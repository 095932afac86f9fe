/**
 * The whole system as real processes for end-to-end tests: `dispatch-cloud serve` (PGlite or PostgreSQL), or
 * `rest-server` and `dispatcher` apart (PostgreSQL; the dispatcher can then be killed and started again), with
 * the local driver's VMs (embedded SSH or OpenSSH sshd), crunch-run deployed from sources, and a small client
 * of the users' API.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { chmod, mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { destroyLocalVms } from "../cloud-drivers/local/driver.ts";
import { openTestDb, type TestDb } from "./db.ts";
import { requireOpenSsh } from "./local-driver-helpers.ts";
import { BIN, quiet } from "./serve-process.ts";

export interface SystemOptions {
  database: "pg" | "pglite";
  sshServer: "embedded" | "openssh";
  runtimeEngine: "docker" | "process" | "auto";
  /** rest-server and dispatcher as two processes (PostgreSQL only). */
  split?: boolean;
  /** Loopback prefix for the VMs' addresses (keeps test files' sshd VMs apart). */
  addressPrefix?: string;
  /** More YAML appended to the config (top-level keys not otherwise set here). */
  extraYaml?: string;
  /** More cloud: keys (indented by the caller with two spaces). */
  cloudYaml?: string;
  /** More dispatcher: keys (indented by the caller with two spaces). */
  dispatcherYaml?: string;
  /** cloud.timeoutIdle (default 10m) and cloud.maxInstances (default 3). */
  timeoutIdle?: string;
  /** cloud.probeInterval (default 500ms). */
  probeInterval?: string;
  maxInstances?: number;
  /** Serve the management API on a free port, its token from the environment (`env:`). */
  management?: boolean;
  /**
   * Replaces the local driver's `driver:` and `driverParameters:` lines (indented by the caller with two spaces),
   * e.g. for the ec2 driver against a fake endpoint. The local VMs' stateDir stays `<dir>/vms`.
   */
  driverYaml?: string;
  /** Replaces the one default instance type (the `instanceTypes:` key's body, indented two spaces). */
  instanceTypesYaml?: string;
}

export interface BundleView {
  uuid: string;
  state: string;
  stateReason: string | null;
  exitCode: number | null;
  attempt: number;
  [key: string]: unknown;
}

/** The environment variable the management token reaches the processes through (config: `env:`). */
export const MANAGEMENT_TOKEN_ENV = "DC_E2E_MANAGEMENT_TOKEN";

const FINAL = new Set(["ready", "failed", "killed"]);

async function freePort(): Promise<number> {
  const server = net.createServer();
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const port = (server.address() as net.AddressInfo).port;
  await new Promise<void>((ok) => server.close(() => ok()));
  return port;
}

class Proc {
  out = "";
  readonly exited: Promise<number | null>;
  constructor(readonly child: ChildProcess) {
    child.stdout?.on("data", (d: Buffer) => {
      this.out += d.toString();
    });
    child.stderr?.on("data", (d: Buffer) => {
      this.out += d.toString();
    });
    this.exited = new Promise((ok) => child.once("exit", (code) => ok(code)));
  }

  async waitFor(pattern: RegExp, what: string, ms = 90_000): Promise<void> {
    const until = Date.now() + ms;
    let done = false;
    void this.exited.then(() => {
      done = true;
    });
    while (!pattern.test(this.out)) {
      if (done) throw new Error(`${what}: the process exited; output:\n${this.out.slice(-4000)}`);
      if (Date.now() > until)
        throw new Error(`${what}: not within ${ms} ms; output:\n${this.out.slice(-4000)}`);
      await new Promise((r) => setTimeout(r, 50));
    }
  }
}

export class E2eSystem {
  private rest: Proc | null = null;
  private dispatcherProc: Proc | null = null;
  private token = "";

  private constructor(
    readonly dir: string,
    readonly configFile: string,
    readonly apiUrl: string,
    private readonly opts: SystemOptions,
    private readonly db: TestDb | null,
    /** The management API's URL and token (systems started with `management: true`). */
    readonly management: { url: string; token: string } | null = null,
  ) {}

  static async start(opts: SystemOptions): Promise<E2eSystem> {
    const dir = await mkdtemp(join(tmpdir(), "dc-e2e-"));
    // The VMs' login user (openssh mode) must reach the VM directories under it.
    await chmod(dir, 0o755);
    const db = opts.database === "pg" ? await openTestDb("pg") : null;
    const url = db?.url ?? `pglite:${dir}/data/pglite`;
    const port = await freePort();
    const management =
      opts.management === true
        ? { url: `http://127.0.0.1:${await freePort()}`, token: `dcm-e2e-${randomBytes(16).toString("hex")}` }
        : null;
    const user = opts.sshServer === "openssh" ? requireOpenSsh() : undefined;
    const configFile = join(dir, "config.yml");
    const yaml = [
      "clusterId: e2e01",
      `dataDir: ${dir}/data`,
      `database:\n  url: "${url}"`,
      `restServer:\n  listen: "127.0.0.1:${port}"`,
      "logging:\n  level: info",
      `dispatcher:\n  runtimeEngine: ${opts.runtimeEngine}\n  pollInterval: 2s\n  staleLockTimeout: 20s`,
      ...(opts.dispatcherYaml === undefined ? [] : [opts.dispatcherYaml]),
      "cloud:",
      ...(opts.driverYaml !== undefined
        ? [opts.driverYaml]
        : [
            "  driver: local",
            "  driverParameters:",
            `    stateDir: ${dir}/vms`,
            `    sshServer: ${opts.sshServer}`,
            ...(user === undefined ? [] : [`    user: ${user}`]),
            ...(opts.addressPrefix === undefined ? [] : [`    addressPrefix: "${opts.addressPrefix}"`]),
          ]),
      `  probeInterval: ${opts.probeInterval ?? "500ms"}`,
      "  syncInterval: 5s",
      `  timeoutIdle: ${opts.timeoutIdle ?? "10m"}`,
      `  maxInstances: ${opts.maxInstances ?? 3}`,
      ...(opts.cloudYaml === undefined ? [] : [opts.cloudYaml]),
      "instanceTypes:",
      opts.instanceTypesYaml ??
        [
          "  e2e.medium:",
          "    vcpus: 16",
          "    ram: 16GiB",
          "    includedScratch: 20GiB",
          "    price: 0.2",
        ].join("\n"),
      ...(management === null
        ? ['management:\n  listen: "127.0.0.1:0"']
        : [
            `management:\n  listen: "${management.url.slice("http://".length)}"\n  token: env:${MANAGEMENT_TOKEN_ENV}`,
          ]),
      opts.extraYaml ?? "",
    ].join("\n");
    await writeFile(configFile, `${yaml}\n`);
    const system = new E2eSystem(dir, configFile, `http://127.0.0.1:${port}`, opts, db, management);
    try {
      await system.startRest();
      if (opts.split === true) await system.startDispatcher();
      system.token = (await readFile(join(dir, "data", "admin-token"), "utf8")).trim();
    } catch (err) {
      await system.stop();
      throw err;
    }
    return system;
  }

  private spawn(args: string[]): Proc {
    return new Proc(
      spawn(BIN, [...args, "--config", this.configFile], {
        cwd: this.dir,
        stdio: ["ignore", "pipe", "pipe"],
        env:
          this.management === null
            ? process.env
            : { ...process.env, [MANAGEMENT_TOKEN_ENV]: this.management.token },
      }),
    );
  }

  private async startRest(): Promise<void> {
    this.rest = this.spawn([this.opts.split === true ? "rest-server" : "serve"]);
    await this.rest.waitFor(/REST API at/, "REST server start");
    if (this.management !== null && this.opts.split !== true)
      await this.rest.waitFor(/management API at/, "management API start");
  }

  /** Starts the dispatcher process (split systems). */
  async startDispatcher(): Promise<void> {
    this.dispatcherProc = this.spawn(["dispatcher"]);
    await this.dispatcherProc.waitFor(/dispatcher: active/, "dispatcher start");
    if (this.management !== null)
      await this.dispatcherProc.waitFor(/management API at/, "management API start");
  }

  /** SIGKILLs the dispatcher process (split systems): no clean-up of any kind. */
  async killDispatcher(): Promise<void> {
    const p = this.dispatcherProc;
    if (p === null) throw new Error("no dispatcher process");
    p.child.kill("SIGKILL");
    await p.exited;
    this.dispatcherProc = null;
  }

  /** Everything the processes printed so far (for failure messages). */
  output(): string {
    return `${this.rest?.out ?? ""}\n${this.dispatcherProc?.out ?? ""}`;
  }

  async request(method: string, path: string, body?: unknown): Promise<Response> {
    return fetch(`${this.apiUrl}/api/v1${path}`, {
      method,
      headers: {
        authorization: `Bearer ${this.token}`,
        ...(body === undefined ? {} : { "content-type": "application/json" }),
      },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
  }

  async json<T>(method: string, path: string, body?: unknown): Promise<T> {
    const res = await this.request(method, path, body);
    const text = await res.text();
    if (!res.ok) throw new Error(`${method} ${path}: HTTP ${res.status} ${text}`);
    return JSON.parse(text) as T;
  }

  async submit(spec: Record<string, unknown>): Promise<string> {
    const b = await this.json<BundleView>("POST", "/bundles", {
      resources: { vcpus: 1, ram: "128MiB" },
      ...spec,
    });
    return b.uuid;
  }

  get(uuid: string): Promise<BundleView> {
    return this.json<BundleView>("GET", `/bundles/${uuid}`);
  }

  /** Polls until the bundle is in one of `states` (default: a final state). */
  async waitState(uuid: string, states: string[] = [...FINAL], ms = 120_000): Promise<BundleView> {
    const until = Date.now() + ms;
    for (;;) {
      const b = await this.get(uuid);
      if (states.includes(b.state)) return b;
      if (FINAL.has(b.state)) {
        const stderr = await this.text(`/bundles/${uuid}/logs?stream=stderr`).catch(() => null);
        throw new Error(
          `bundle ${uuid} ended ${b.state} (${b.stateReason}) while waiting for ${states.join("|")}; ` +
            `its stderr ends: ${stderr === null ? "(unreadable)" : JSON.stringify(stderr.body.slice(-1500))}`,
        );
      }
      if (Date.now() > until) {
        throw new Error(
          `bundle ${uuid} still ${b.state} (${String(b["schedulingStatus"])}) after ${ms} ms; output:\n${this.output().slice(-6000)}`,
        );
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  /** A management API call (`path` under /management/v1), its JSON answer; any HTTP error throws. */
  async manage<T>(method: string, path: string, query: Record<string, string> = {}): Promise<T> {
    if (this.management === null) throw new Error("the system was started without management: true");
    const url = new URL(`/management/v1${path}`, this.management.url);
    for (const [k, v] of Object.entries(query)) url.searchParams.set(k, v);
    const res = await fetch(url, { method, headers: { authorization: `Bearer ${this.management.token}` } });
    const text = await res.text();
    if (!res.ok) throw new Error(`${method} ${url.pathname}: HTTP ${res.status} ${text}`);
    return JSON.parse(text) as T;
  }

  /** Sums the management /metrics samples of counter `name` whose labels include every pair of `labels`. */
  async metricSum(name: string, labels: Record<string, string>): Promise<number> {
    if (this.management === null) throw new Error("the system was started without management: true");
    const res = await fetch(new URL("/metrics", this.management.url), {
      headers: { authorization: `Bearer ${this.management.token}` },
    });
    let sum = 0;
    for (const line of (await res.text()).split("\n")) {
      const m = /^([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)$/.exec(line);
      if (m === null || m[1] !== name) continue;
      const got = Object.fromEntries([...(m[2] ?? "").matchAll(/(\w+)="([^"]*)"/g)].map((x) => [x[1], x[2]]));
      if (Object.entries(labels).every(([k, v]) => got[k] === v)) sum += Number(m[3]);
    }
    return sum;
  }

  /** The reason of the bundle's first running -> staged transition (a requeue), or undefined if none. */
  async requeueReason(uuid: string): Promise<string | null | undefined> {
    const events = await this.json<{
      items: { fromState: string; toState: string; reason: string | null }[];
    }>("GET", `/bundles/${uuid}/events`);
    return events.items.find((e) => e.fromState === "running" && e.toState === "staged")?.reason;
  }

  async text(path: string): Promise<{ status: number; body: string }> {
    const res = await this.request("GET", path);
    return { status: res.status, body: await res.text() };
  }

  async stop(): Promise<void> {
    for (const p of [this.dispatcherProc, this.rest]) {
      if (p === null) continue;
      p.child.kill("SIGTERM");
      const timer = setTimeout(() => p.child.kill("SIGKILL"), 15_000);
      await p.exited;
      clearTimeout(timer);
    }
    await destroyLocalVms(join(this.dir, "vms"), quiet);
    await this.db?.close();
    await rm(this.dir, { recursive: true, force: true });
  }
}

/** Polls `probe` every 100 ms until it gives a value; throws naming `what` after `ms`. */
export async function until<T>(
  what: string,
  probe: () => Promise<T | undefined> | T | undefined,
  ms = 60_000,
): Promise<T> {
  const end = Date.now() + ms;
  for (;;) {
    const v = await probe();
    if (v !== undefined) return v;
    if (Date.now() > end) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}
