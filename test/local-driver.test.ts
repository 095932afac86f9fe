/**
 * The local cloud driver with real VM processes and real SSH servers, in both SSH modes: create, list,
 * SSH in, init at boot, setTags, destroy; quota; VMs outliving the process that created them.
 */
import { execFileSync, spawn } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, readlinkSync, rmSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { Registry } from "prom-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { CloudQuotaError } from "../cloud-drivers/errors.ts";
import { localDriver } from "../cloud-drivers/local/driver.ts";
import { readIfExists } from "../cloud-drivers/local/layout.ts";
import { findPids, isAlive } from "../cloud-drivers/local/procs.ts";
import { generateKeyPair } from "../cloud-drivers/ssh-server.ts";
import type { Instance, InstanceSet } from "../cloud-drivers/types.ts";
import { systemClock } from "../lib/clock.ts";
import { createLogger } from "../lib/logger.ts";
import { GiB, instanceType } from "./fixtures.ts";
import {
  connect,
  processesUnder,
  requireDockerImage,
  requireOpenSsh,
  run,
  waitFor,
} from "./local-driver-helpers.ts";

const logger = createLogger({ level: "warn", format: "json" });
const deps = () => ({ logger, clock: systemClock, registry: new Registry() });
const key = generateKeyPair();
const type = instanceType("small", { providerType: "local.small", vcpus: 1, ram: GiB });
// biome-ignore lint/suspicious/noTemplateCurlyInString: a shell parameter expansion, as on a real instance
const INIT = 'umask 0177; echo -n s3cret > "${DISPATCH_VM_ROOT:-}/var/run/dispatch-cloud-instance-secret"';
const SECRET_FILE = "var/run/dispatch-cloud-instance-secret";
const TEST_IMAGE = requireDockerImage();
const vmContainers = (root: string) =>
  execFileSync("docker", ["ps", "-aq", "--filter", `label=dispatch-cloud.vm-root=${root}`], {
    encoding: "utf8",
  })
    .split("\n")
    .filter(Boolean);

/** Per mode, a different address prefix, so this file's sshd VMs never collide with other test files'. */
const MODES = [
  { mode: "embedded", extra: {} },
  { mode: "openssh", extra: { addressPrefix: "127.0.3." } },
] as const;

describe.each(MODES)("local driver, $mode SSH server", ({ mode, extra }) => {
  let stateDir: string;
  let params: Record<string, unknown>;
  let set: InstanceSet;
  let vm: Instance;
  let createdAt: number;
  const startTimes: number[] = [];

  const create = async (s: InstanceSet, tags: Record<string, string>, init = INIT) => {
    const t0 = Date.now();
    const instance = await s.create(type, "image-1", tags, init, key.publicKey);
    startTimes.push(Date.now() - t0);
    return instance;
  };

  beforeAll(async () => {
    const user = mode === "openssh" ? requireOpenSsh() : undefined;
    stateDir = mkdtempSync(path.join(tmpdir(), `local-driver-${mode}-`));
    params = { stateDir, sshServer: mode, bootDelay: "1s", ...extra, ...(user ? { user } : {}) };
    set = await localDriver.instanceSet(params, "test", {}, deps());
    // The first create also bundles vm-main; keep that out of the measured start times.
    await (await create(set, { Warmup: "1" }, "true")).destroy();
    startTimes.length = 0;
    createdAt = Date.now();
    vm = await create(set, { Role: "main", Group: "a" });
  });

  afterAll(async () => {
    if (set !== undefined) {
      for (const i of await set.instances({})) await i.destroy();
      await set.stop();
    }
    if (stateDir !== undefined) {
      expect(processesUnder(stateDir)).toEqual([]);
      rmSync(stateDir, { recursive: true, force: true });
    }
    console.log(`${mode}: VM start times (ms): ${startTimes.join(", ")}`);
  });

  it("lists a created VM with its tags, and filters by tag", async () => {
    expect(vm.id).toMatch(/^local-[0-9a-f]{16}$/);
    expect(vm.providerType).toBe("local.small");
    expect(vm.address).toMatch(mode === "embedded" ? /^127\.0\.0\.1:\d+$/ : /^127\.0\.3\.\d+:22$/);
    const listed = await set.instances({ Group: "a" });
    expect(listed.map((i) => [i.id, i.tags, i.address, i.remoteUser])).toEqual([
      [vm.id, { Role: "main", Group: "a" }, vm.address, vm.remoteUser],
    ]);
    expect(await set.instances({ Group: "b" })).toEqual([]);
    expect(set.quotaGroup(type)).toBe("local.small");
  });

  it("accepts SSH with the given key; commands see DISPATCH_VM_ROOT", async () => {
    const client = await connect(vm.address, vm.remoteUser, key.privateKey);
    try {
      const r = await run(client, 'echo "$DISPATCH_VM_ROOT"; id -un');
      expect(r.code).toBe(0);
      expect(r.stdout).toBe(`${path.join(stateDir, vm.id, "root")}\n${vm.remoteUser}\n`);
    } finally {
      client.end();
    }
    await expect(connect(vm.address, vm.remoteUser, generateKeyPair().privateKey)).rejects.toThrow();
  });

  it("runs the init command after bootDelay; its secret file is readable over SSH", async () => {
    const secretPath = path.join(stateDir, vm.id, "root", SECRET_FILE);
    await waitFor(
      "the init command",
      () => existsSync(secretPath) && readFileSync(secretPath, "utf8") !== "",
    );
    expect(Date.now() - createdAt).toBeGreaterThanOrEqual(1000);
    const client = await connect(vm.address, vm.remoteUser, key.privateKey);
    try {
      const r = await run(client, `cat "\${DISPATCH_VM_ROOT:-}/${SECRET_FILE}"`);
      expect(r).toMatchObject({ code: 0, stdout: "s3cret" });
    } finally {
      client.end();
    }
    // The init command came through a file the VM deleted, not a command line.
    expect(existsSync(path.join(stateDir, vm.id, "init.sh"))).toBe(false);
  });

  it("replaces tags with setTags", async () => {
    await vm.setTags({ Role: "other" });
    expect(vm.tags).toEqual({ Role: "other" });
    const again = await localDriver.instanceSet(params, "test", {}, deps());
    expect((await again.instances({})).map((i) => [i.id, i.tags])).toEqual([[vm.id, { Role: "other" }]]);
  });

  it("destroy ends the VM, its SSH server and the processes its commands left behind", async () => {
    const other = await create(set, { Role: "doomed" });
    const client = await connect(other.address, other.remoteUser, key.privateKey);
    const root = path.join(stateDir, other.id, "root");
    let sshdNamespace: string | undefined;
    try {
      // A daemon in its own session, and a command still running on an open connection.
      await run(client, "setsid sleep 300 </dev/null >/dev/null 2>&1 &");
      client.exec("sleep 300", () => {});
      await waitFor("both sleeps", () => processesUnder(root).length >= 2);
      // A container started from inside the VM, labelled with its root as crunch-run labels them.
      const started = await run(
        client,
        `docker run -d --network none --label "dispatch-cloud.vm-root=$DISPATCH_VM_ROOT" ${TEST_IMAGE} sleep 300`,
      );
      expect(started.code, started.stderr).toBe(0);
      expect(vmContainers(root)).toHaveLength(1);
    } finally {
      // openssh: sshd's per-connection processes mention no VM path; they share its mount namespace.
      const ns = readIfExists(path.join(stateDir, other.id, "sshd.ns"));
      if (mode === "openssh") expect(ns).toMatch(/^mnt:/);
      sshdNamespace = ns;
      await other.destroy();
      client.destroy();
    }
    expect(processesUnder(path.join(stateDir, other.id))).toEqual([]);
    expect(vmContainers(root)).toEqual([]);
    if (sshdNamespace !== undefined) expect(findPids({ mountNs: sshdNamespace })).toEqual([]);
    expect(existsSync(path.join(stateDir, other.id))).toBe(false);
    expect((await set.instances({})).map((i) => i.id)).toEqual([vm.id]);
    // Destroying again is harmless.
    await other.destroy();
  });

  it("keeps a VM running, with its tags, after the process that created it is SIGKILLed", async () => {
    const creatorScript = fileURLToPath(new URL("./local-driver-creator.ts", import.meta.url));
    const tsx = pathToFileURL(createRequire(import.meta.url).resolve("tsx")).href;
    const creator = spawn(
      process.execPath,
      ["--import", tsx, creatorScript, JSON.stringify(params), key.publicKey],
      {
        stdio: ["ignore", "pipe", "inherit"],
      },
    );
    const line = await new Promise<string>((resolve, reject) => {
      let out = "";
      creator.stdout.on("data", (d: Buffer) => {
        out += d.toString();
        if (out.includes("\n")) resolve(out.trim());
      });
      creator.on("exit", (code) => reject(new Error(`creator exited with ${code}`)));
    });
    const { id } = JSON.parse(line) as { id: string };
    creator.kill("SIGKILL");
    await waitFor("the creator to die", () => creator.exitCode !== null || creator.signalCode !== null);

    const fresh = await localDriver.instanceSet(params, "test", {}, deps());
    const survivor = (await fresh.instances({ Creator: "killed" }))[0];
    expect(survivor?.id).toBe(id);
    expect(survivor?.tags).toEqual({ Creator: "killed", Keep: "yes" });
    const client = await connect(survivor!.address, survivor!.remoteUser, key.privateKey);
    try {
      expect((await run(client, "echo alive")).stdout).toBe("alive\n");
    } finally {
      client.end();
    }
    const pid = Number(readFileSync(path.join(stateDir, id, "pid"), "utf8"));
    await survivor!.destroy();
    expect(isAlive(pid)).toBe(false);
  });

  it("throws CloudQuotaError past maxInstances", async () => {
    const limited = await localDriver.instanceSet({ ...params, maxInstances: 2 }, "test", {}, deps());
    const second = await create(limited, { Role: "second" }, "true");
    const err = await limited.create(type, "image-1", {}, "true", key.publicKey).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(CloudQuotaError);
    expect(err).toMatchObject({ code: "cloud.quota" });
    await second.destroy();
  });
});

describe("finding a local VM's processes", () => {
  it("never matches by this process's own mount namespace, only by a VM's", async () => {
    const marker = `dc-procs-${process.pid}-${Date.now()}`;
    const child = spawn("sleep", ["30"], { env: { PATH: process.env.PATH, DC_PROCS_MARKER: marker } });
    try {
      const pid = child.pid ?? 0;
      await new Promise((resolve) => setTimeout(resolve, 100));
      const own = readlinkSync(`/proc/${process.pid}/ns/mnt`);
      expect(readlinkSync(`/proc/${pid}/ns/mnt`)).toBe(own);
      // Matched by its environment, as a VM's processes are; not by the host's namespace.
      expect(findPids({ env: ["DC_PROCS_MARKER", marker] })).toEqual([pid]);
      expect(findPids({ mountNs: own })).toEqual([]);
      expect(findPids({ env: ["DC_PROCS_MARKER", marker], mountNs: own })).toEqual([pid]);
    } finally {
      child.kill("SIGKILL");
    }
  });
});
