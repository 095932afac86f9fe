/**
 * Users' own machines as workers, end to end (docs/workers.md): `dispatch-cloud serve` with the local cloud driver
 * and real Docker bundles, two users, each with `dispatch-cloud worker` processes on this machine (their own work
 * directories, no listening socket). A's bundles run on A's worker first and on cloud instances once it is full;
 * B's never run on A's worker; a tagged bundle waits for a worker with the tag and says so; a SIGKILLed worker's
 * bundle goes back to the queue once and completes on another worker.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { mkdir, readdir, readFile, readlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type BundleView, E2eSystem, until } from "./e2e-harness.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";
import { BIN } from "./serve-process.ts";

const IMAGE = requireDockerImage();

interface UserHandle {
  uuid: string;
  token: string;
}

interface WorkerProc {
  id: string;
  child: ChildProcess;
  out: () => string;
  exited: Promise<number | null>;
}

/** Inodes of the listening TCP and Unix sockets of this machine's network namespace. */
async function listeningInodes(): Promise<Set<string>> {
  const inodes = new Set<string>();
  for (const file of ["/proc/net/tcp", "/proc/net/tcp6"]) {
    const text = await readFile(file, "utf8").catch(() => "");
    for (const line of text.split("\n").slice(1)) {
      const f = line.trim().split(/\s+/);
      if (f[3] === "0A" && f[9] !== undefined) inodes.add(f[9]);
    }
  }
  const unix = await readFile("/proc/net/unix", "utf8").catch(() => "");
  for (const line of unix.split("\n").slice(1)) {
    const f = line.trim().split(/\s+/);
    // Flags 00010000: __SO_ACCEPTCON, a listening socket.
    if (f[3] === "00010000" && f[6] !== undefined) inodes.add(f[6]);
  }
  return inodes;
}

/** Inodes of the sockets process pid holds open. */
async function socketInodes(pid: number): Promise<string[]> {
  const out: string[] = [];
  for (const fd of await readdir(`/proc/${pid}/fd`).catch(() => [])) {
    const target = await readlink(`/proc/${pid}/fd/${fd}`).catch(() => "");
    const m = /^socket:\[(\d+)\]$/.exec(target);
    if (m !== null) out.push(m[1]!);
  }
  return out;
}

describe("users' own machines as workers (serve, local driver, Docker)", () => {
  let sys: E2eSystem;
  const workers: WorkerProc[] = [];

  beforeAll(async () => {
    sys = await E2eSystem.start({
      database: "pglite",
      sshServer: "embedded",
      runtimeEngine: "docker",
      maxInstances: 2,
      management: true,
      extraYaml: ["workers:", "  longPoll: 2s", "  checkinTimeout: 20s", "  deliveryTimeout: 60s"].join("\n"),
    });
  }, 180_000);

  afterAll(async () => {
    if (process.env["DC_E2E_DUMP"] !== undefined) {
      await writeFile(
        process.env["DC_E2E_DUMP"],
        `${sys?.output()}\n${workers.map((w) => w.out()).join("\n")}`,
      );
    }
    for (const w of workers)
      if (w.child.exitCode === null && w.child.signalCode === null) w.child.kill("SIGKILL");
    await sys?.stop();
  });

  const as = async <T>(user: UserHandle, method: string, path: string, body?: unknown): Promise<T> => {
    const res = await fetch(`${sys.apiUrl}/api/v1${path}`, {
      method,
      headers: {
        authorization: `Bearer ${user.token}`,
        ...(body === undefined ? {} : { "content-type": "application/json" }),
      },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
    const text = await res.text();
    if (!res.ok) throw new Error(`${method} ${path}: HTTP ${res.status} ${text}`);
    return JSON.parse(text) as T;
  };
  const newUser = async (name: string): Promise<UserHandle> =>
    sys.json<UserHandle>("POST", "/users", { name });
  const submit = async (user: UserHandle, spec: Record<string, unknown>): Promise<string> =>
    (
      await as<BundleView>(user, "POST", "/bundles", {
        image: IMAGE,
        resources: { vcpus: 1, ram: "128MiB" },
        ...spec,
      })
    ).uuid;
  const get = (user: UserHandle, uuid: string) => as<BundleView>(user, "GET", `/bundles/${uuid}`);
  const waitFinal = async (user: UserHandle, uuid: string, ms = 180_000): Promise<BundleView> =>
    until(
      `${uuid} final`,
      async () => {
        const b = await get(user, uuid);
        return ["ready", "failed", "killed"].includes(b.state) ? b : undefined;
      },
      ms,
    );

  /** Makes a worker token for user and starts `dispatch-cloud worker` with it in its own work directory. */
  const startWorker = async (user: UserHandle, name: string, args: string[] = []): Promise<WorkerProc> => {
    const made = await as<{ worker: { id: string }; token: string }>(user, "POST", "/workers", { name });
    const dir = join(sys.dir, `worker-${name}`);
    await mkdir(dir, { recursive: true });
    const tokenFile = join(dir, "token");
    await writeFile(tokenFile, `${made.token}\n`, { mode: 0o600 });
    let out = "";
    const child = spawn(
      BIN,
      [
        "worker",
        "--api-url",
        sys.apiUrl,
        "--token-file",
        tokenFile,
        "--worker-id",
        made.worker.id,
        "--work-dir",
        join(dir, "work"),
        "--runtime",
        "docker",
        ...args,
      ],
      { cwd: dir, stdio: ["ignore", "pipe", "pipe"] },
    );
    child.stdout?.on("data", (d: Buffer) => {
      out += d.toString();
    });
    child.stderr?.on("data", (d: Buffer) => {
      out += d.toString();
    });
    const w: WorkerProc = {
      id: made.worker.id,
      child,
      out: () => out,
      exited: new Promise((ok) => child.once("exit", (code) => ok(code))),
    };
    workers.push(w);
    await until(
      `worker ${name} checked in`,
      async () => {
        const list = await as<{ items: { id: string; state: string }[] }>(user, "GET", "/workers");
        return list.items.find((i) => i.id === w.id && i.state === "active") !== undefined ? true : undefined;
      },
      60_000,
    ).catch((err: unknown) => {
      throw new Error(`${(err as Error).message}\nworker output:\n${out}`);
    });
    return w;
  };

  it("owner first, then the cloud; never another user's; tags wait and say so; a SIGKILLed worker's bundle completes elsewhere once", async () => {
    const a = await newUser("alice");
    const b = await newUser("bob");
    const wa = await startWorker(a, "a-laptop", ["--slots", "1"]);
    const wb = await startWorker(b, "b-server", ["--slots", "2"]);

    // A worker behind no inbound port: it holds no listening socket of any kind.
    const listening = await listeningInodes();
    for (const w of [wa, wb]) {
      const mine = await socketInodes(w.child.pid!);
      expect(mine.filter((i) => listening.has(i))).toEqual([]);
    }

    // Operators see them: the management API's worker list and the metrics.
    const listed = await sys.manage<{ items: { id: string; fresh: boolean; slots: number }[] }>(
      "GET",
      "/workers",
    );
    expect(listed.items.filter((i) => i.fresh).map((i) => i.id)).toEqual(
      expect.arrayContaining([wa.id, wb.id]),
    );
    await until("two active workers in the metrics", async () =>
      (await sys.metricSum("dispatchcloud_user_workers", { state: "active" })) === 2 ? true : undefined,
    );

    // A's three bundles: one on A's worker (one slot), the others on cloud instances.
    const aBundles = await Promise.all(
      [0, 1, 2].map((i) =>
        submit(a, { name: `a${i}`, command: ["sh", "-c", `sleep 4; echo a${i} > /out/x`] }),
      ),
    );
    const bBundles = await Promise.all(
      [0, 1].map((i) => submit(b, { name: `b${i}`, command: ["sh", "-c", `sleep 1; echo b${i}`] })),
    );
    const aDone = await Promise.all(aBundles.map((u) => waitFinal(a, u)));
    const bDone = await Promise.all(bBundles.map((u) => waitFinal(b, u)));
    for (const x of [...aDone, ...bDone]) expect(x.state, JSON.stringify(x)).toBe("ready");
    const onA = aDone.filter((x) => x.workerId === wa.id);
    expect(onA.length).toBeGreaterThanOrEqual(1);
    expect(aDone.filter((x) => typeof x.instanceId === "string").length).toBeGreaterThanOrEqual(1);
    for (const x of bDone) expect(x.workerId).not.toBe(wa.id);
    for (const x of aDone)
      expect(x.workerId === undefined || x.workerId === null || x.workerId === wa.id).toBe(true);

    // A bundle only A's workers may run starts on the laptop (A's only worker so far) and keeps running.
    const long = await submit(a, {
      name: "long",
      command: ["sh", "-c", "sleep 25; echo done > /out/done"],
      resources: { vcpus: 1, ram: "128MiB", workersOnly: true },
    });
    await until("the long bundle running on the laptop", async () => {
      const x = await get(a, long);
      return x.state === "running" && x.workerId === wa.id ? true : undefined;
    });

    // A tagged bundle: no instance type and no worker of A has "gpu", so it waits and says why.
    const tagged = await submit(a, {
      name: "tagged",
      command: ["sh", "-c", "echo tagged"],
      resources: { vcpus: 1, ram: "128MiB", tag: "gpu" },
    });
    const waiting = await until("the tagged bundle's sentence", async () => {
      const x = await get(a, tagged);
      return typeof x.schedulingStatus === "string" && x.schedulingStatus.includes("gpu") ? x : undefined;
    });
    expect(waiting.state).toBe("staged");
    expect(waiting.schedulingStatus).toContain("waiting for one of your workers with tag gpu");
    const wg = await startWorker(a, "a-gpu-box", ["--slots", "2", "--tag", "gpu"]);
    const taggedDone = await waitFinal(a, tagged);
    expect(taggedDone).toMatchObject({ state: "ready", workerId: wg.id });
    // A user's own machine: no price is known, so no cost is claimed (docs/workers.md); its usage is recorded.
    expect(taggedDone).toMatchObject({ instanceType: "worker", costDollars: null });
    expect(taggedDone.resourceUsage).not.toBeNull();

    // SIGKILL the laptop while the long bundle runs there: it goes back to the queue once (the laptop is lost
    // after workers.checkinTimeout) and completes on A's other worker.
    expect((await get(a, long)).state).toBe("running");
    wa.child.kill("SIGKILL");
    await wa.exited;
    const longDone = await waitFinal(a, long);
    expect(longDone).toMatchObject({ state: "ready", workerId: wg.id, attempt: 2 });
    const events = await as<{
      items: { fromState: string | null; toState: string; reason: string | null }[];
    }>(a, "GET", `/bundles/${long}/events`);
    const backToQueue = events.items.filter((e) => e.fromState === "running" && e.toState === "staged");
    expect(backToQueue).toHaveLength(1);
    expect(backToQueue[0]?.reason).toMatch(/stopped checking in/);
    expect(events.items.filter((e) => e.toState === "ready")).toHaveLength(1);
    const workersNow = await as<{ items: { id: string; state: string }[] }>(a, "GET", "/workers");
    expect(workersNow.items.find((w) => w.id === wa.id)?.state).toBe("lost");
  }, 600_000);
});
