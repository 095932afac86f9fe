/**
 * The `local` cloud: each instance is a real process on this machine (vm-main.ts), started detached so it
 * outlives the dispatcher, with its own root directory, SSH server on a loopback address, tags in a file
 * and init command run at "boot". Its state lives under `driverParameters.stateDir`, one directory per VM
 * (layout.ts); a VM is alive while its process is.
 */
import { spawn, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import {
  chmodSync,
  chownSync,
  existsSync,
  mkdirSync,
  readdirSync,
  renameSync,
  rmSync,
  statSync,
  unlinkSync,
  writeFileSync,
} from "node:fs";
import { userInfo } from "node:os";
import path from "node:path";
import { Registry } from "prom-client";
import { systemClock } from "../../lib/clock.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { Logger } from "../../lib/logger.ts";
import { CloudError, CloudQuotaError } from "../errors.ts";
import { generateKeyPair, parseAuthorizedKeys } from "../ssh-server.ts";
import type { CloudDriver, Instance, InstanceSet, InstanceType, Tags } from "../types.ts";
import { removeVmContainers } from "./containers.ts";
import { VM_MAIN_PATTERN, vmMainArgs } from "./launch.ts";
import { readIfExists, type VmFiles, type VmRecord, vmFiles, writeFileAtomic } from "./layout.ts";
import { type LocalParameters, parseLocalParameters } from "./params.ts";
import { findPids, isAlive, lookupUser, readCmdline, terminate } from "./procs.ts";
import { openSshUnavailable } from "./ssh-openssh.ts";

const ID_PREFIX = "local-";
const ADDRESSES_DIR = ".addresses";
/** How long create waits for the VM's SSH server. */
const START_TIMEOUT_MS = 30_000;
/** A VM directory with no live process younger than this may still be starting. */
const STARTING_GRACE_MS = 60_000;
const DESTROY_GRACE_MS = 5000;

export const localDriver: CloudDriver = {
  async instanceSet(params, _instanceSetId, _sharedTags, deps) {
    const p = parseLocalParameters(params);
    const log = deps.logger.child({ component: "local-driver" });
    mkdirSync(p.stateDir, { recursive: true, mode: 0o711 });
    if (p.sshServer === "openssh") checkOpenSsh(p);
    return new LocalInstanceSet(p, log);
  },
};

function invalid(key: string, message: string): DispatchCloudError {
  return new DispatchCloudError("cloud.invalid_parameters", message, {
    path: `cloud.driverParameters.${key}`,
  });
}

/** openssh mode needs root, sshd, the login user, and a state dir that user can reach. */
function checkOpenSsh(p: LocalParameters): void {
  const unavailable = openSshUnavailable();
  if (unavailable !== undefined) throw invalid("sshServer", `local driver: ${unavailable}`);
  const user = lookupUser(p.user);
  if (user === undefined) {
    throw invalid(
      "user",
      `local driver: user ${JSON.stringify(p.user)} does not exist; ` +
        'run `eval "$(bash scripts/test-services.sh)"` as root to create dcvm, or name an existing user',
    );
  }
  // VM roots are under stateDir, and the login user writes in them.
  chmodSync(p.stateDir, statSync(p.stateDir).mode | 0o111);
  const probe = spawnSync("/bin/sh", ["-c", 'cd "$1"', "sh", p.stateDir], { uid: user.uid, gid: user.gid });
  if (probe.status !== 0) {
    throw invalid(
      "stateDir",
      `local driver: user ${p.user} cannot reach ${p.stateDir}; every directory above it needs o+x`,
    );
  }
}

type Scanned =
  | { state: "running"; id: string; files: VmFiles; pid: number; address: string }
  | { state: "starting"; id: string; files: VmFiles }
  | { state: "dead"; id: string; files: VmFiles };

class LocalInstanceSet implements InstanceSet {
  private vmMain: Promise<string[]> | undefined;

  constructor(
    private readonly p: LocalParameters,
    private readonly log: Logger,
  ) {}

  quotaGroup(type: InstanceType): string {
    return type.providerType;
  }

  async stop(): Promise<void> {
    // VMs are processes of their own; nothing here holds them.
  }

  async instances(filter: Tags): Promise<Instance[]> {
    const result: Instance[] = [];
    for (const vm of this.scan()) {
      if (vm.state === "dead") {
        await this.cleanUp(vm.files, "its process is gone").catch((err: unknown) =>
          this.log.warn({ err, instanceId: vm.id }, "cannot remove a dead local VM"),
        );
        continue;
      }
      if (vm.state !== "running") continue;
      const instance = this.load(vm.files, vm.address);
      if (instance !== undefined && matches(instance.tags, filter)) result.push(instance);
    }
    return result;
  }

  /**
   * From the quota check to the VM directory's creation (which counts against the quota and holds the
   * address claim) nothing awaits, so concurrent creates in one process cannot both take the last slot.
   */
  async create(
    type: InstanceType,
    imageId: string,
    tags: Tags,
    initCommand: string,
    publicKey: string,
  ): Promise<Instance> {
    try {
      parseAuthorizedKeys([publicKey]);
    } catch (err) {
      throw new DispatchCloudError("ssh.invalid_key", `local driver: publicKey: ${(err as Error).message}`, {
        path: "publicKey",
      });
    }
    if (this.p.maxInstances > 0) {
      const count = this.scan().filter((vm) => vm.state !== "dead").length;
      if (count >= this.p.maxInstances) {
        throw new CloudQuotaError(
          `local driver: at maxInstances (${this.p.maxInstances}); destroy an instance first`,
        );
      }
    }
    const id = ID_PREFIX + randomBytes(8).toString("hex");
    const files = vmFiles(path.join(this.p.stateDir, id));
    const openssh = this.p.sshServer === "openssh";
    const user = openssh ? lookupUser(this.p.user) : undefined;
    if (openssh && user === undefined)
      throw invalid("user", `local driver: user ${this.p.user} does not exist`);

    mkdirSync(files.dir, { mode: 0o711 });
    chmodSync(files.dir, 0o711);
    try {
      for (const sub of ["var/run", "var/lock", "tmp"])
        mkdirSync(path.join(files.root, sub), { recursive: true });
      chmodSync(path.join(files.root, "tmp"), 0o1777);
      chmodSync(files.root, 0o755);
      if (user !== undefined) {
        for (const d of [files.root, "var", "var/run", "var/lock", "tmp"]) {
          chownSync(path.resolve(files.root, d), user.uid, user.gid);
        }
      }
      const host = openssh ? this.claimAddress(id) : "127.0.0.1";
      const record: VmRecord = {
        id,
        providerType: type.providerType,
        imageId,
        sshServer: this.p.sshServer,
        host,
        remoteUser: openssh ? this.p.user : userInfo().username,
        bootDelayMs: this.p.bootDelayMs,
        createdAt: Date.now(),
      };
      writeFileAtomic(files.record, `${JSON.stringify(record, null, 2)}\n`);
      writeFileAtomic(files.tags, `${JSON.stringify(checkTags(tags), null, 2)}\n`);
      writeFileSync(files.authorizedKeys, `${publicKey.trim()}\n`, { mode: 0o644 });
      if (!openssh) writeFileSync(files.hostKey, generateKeyPair().privateKey, { mode: 0o600 });
      writeFileSync(files.init, initCommand, { mode: 0o600 });
    } catch (err) {
      await this.cleanUp(files, "create failed");
      if (err instanceof DispatchCloudError) throw err;
      throw new CloudError(`local driver: cannot prepare VM ${id}: ${(err as Error).message}`, {
        cause: err,
      });
    }

    this.vmMain ??= vmMainArgs(this.log);
    const vmMain = await this.vmMain;
    const started = Date.now();
    const child = spawn(process.execPath, [...vmMain, files.dir], {
      detached: true,
      stdio: "ignore",
      cwd: files.dir,
      env: {
        PATH: process.env["PATH"] ?? "/usr/local/bin:/usr/bin:/bin",
        HOME: process.env["HOME"] ?? "/",
        USER: userInfo().username,
        DISPATCH_VM_ROOT: files.root,
      },
    });
    child.on("error", () => {});
    child.unref();
    if (child.pid !== undefined) writeFileAtomic(files.pid, String(child.pid), 0o644);
    let exited = child.pid === undefined;
    child.once("exit", () => {
      exited = true;
    });

    let failure: string | undefined;
    let address: string | undefined;
    while (address === undefined && failure === undefined) {
      address = readIfExists(files.address);
      if (address !== undefined) break;
      failure = readIfExists(files.error);
      if (failure !== undefined) break;
      if (exited) failure = "the VM process exited";
      else if (Date.now() - started > START_TIMEOUT_MS)
        failure = `no SSH server after ${START_TIMEOUT_MS} ms`;
      else await new Promise((resolve) => setTimeout(resolve, 5));
    }
    if (address === undefined) {
      const log = path.join(this.p.stateDir, `failed-${id}.log`);
      await this.destroyVm(files, "failed to start");
      this.log.error({ instanceId: id, reason: failure, log }, "local VM failed to start");
      throw new CloudError(`local driver: VM ${id} failed to start: ${failure}; see ${log}`);
    }
    this.log.info({ instanceId: id, address, ms: Date.now() - started }, "local VM started");
    return this.load(files, address) ?? this.gone(id);
  }

  private gone(id: string): never {
    throw new DispatchCloudError("cloud.instance_gone", `local driver: VM ${id} disappeared while starting`);
  }

  /** Every VM directory, with whether its process is alive. */
  private scan(): Scanned[] {
    let names: string[];
    try {
      names = readdirSync(this.p.stateDir);
    } catch {
      return [];
    }
    const out: Scanned[] = [];
    for (const id of names) {
      if (!id.startsWith(ID_PREFIX) || id.includes(".")) continue;
      const files = vmFiles(path.join(this.p.stateDir, id));
      const pid = Number(readIfExists(files.pid));
      if (pid > 0 && isOurVm(pid, files.dir)) {
        const address = readIfExists(files.address);
        out.push(
          address === undefined
            ? { state: "starting", id, files }
            : { state: "running", id, files, pid, address },
        );
        continue;
      }
      let age = Number.POSITIVE_INFINITY;
      try {
        age = Date.now() - statSync(files.dir).mtimeMs;
      } catch {
        continue; // Removed meanwhile.
      }
      const noProcessYet = !(pid > 0) && !existsSync(files.error);
      out.push(
        noProcessYet && age < STARTING_GRACE_MS
          ? { state: "starting", id, files }
          : { state: "dead", id, files },
      );
    }
    return out;
  }

  private load(files: VmFiles, address: string): LocalInstance | undefined {
    const recordText = readIfExists(files.record);
    const tagsText = readIfExists(files.tags);
    if (recordText === undefined || tagsText === undefined) return undefined;
    const record = JSON.parse(recordText) as VmRecord;
    return new LocalInstance(record, address.trim(), JSON.parse(tagsText) as Tags, files, (f) =>
      this.destroyVm(f),
    );
  }

  /** openssh VMs each get their own 127.0.0.x, claimed by creating `.addresses/<ip>` (exclusive create). */
  private claimAddress(id: string): string {
    const dir = path.join(this.p.stateDir, ADDRESSES_DIR);
    mkdirSync(dir, { recursive: true, mode: 0o700 });
    for (let last = 2; last <= 254; last++) {
      const host = `${this.p.addressPrefix}${last}`;
      const claim = path.join(dir, host);
      const owner = readIfExists(claim);
      if (owner !== undefined) {
        if (existsSync(path.join(this.p.stateDir, owner.trim()))) continue;
        rmSync(claim, { force: true }); // Its VM is gone.
      }
      try {
        writeFileSync(claim, id, { flag: "wx", mode: 0o600 });
        return host;
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === "EEXIST") continue;
        throw err;
      }
    }
    throw new CloudQuotaError(`local driver: all 253 addresses ${this.p.addressPrefix}2-254 are in use`);
  }

  private releaseAddress(files: VmFiles): void {
    const record = readIfExists(files.record);
    if (record === undefined) return;
    const { host, id } = JSON.parse(record) as VmRecord;
    const claim = path.join(this.p.stateDir, ADDRESSES_DIR, host);
    if (readIfExists(claim)?.trim() === id) unlinkSync(claim);
  }

  /** Ends the VM's process group and every process left with its root, then removes its directory. */
  private async destroyVm(files: VmFiles, why = "destroyed"): Promise<void> {
    const pid = Number(readIfExists(files.pid));
    if (pid > 0 && isOurVm(pid, files.dir)) await terminate([-pid], DESTROY_GRACE_MS);
    await this.cleanUp(files, why);
  }

  private async cleanUp(files: VmFiles, why: string): Promise<void> {
    const mountNs = readIfExists(files.sshdNamespace)?.trim();
    const leftovers = findPids({
      env: ["DISPATCH_VM_ROOT", files.root],
      ...(mountNs ? { mountNs } : {}),
    });
    if (leftovers.length > 0) await terminate(leftovers, 2000);
    try {
      const removed = await removeVmContainers(files.root);
      if (removed.length > 0)
        this.log.info(
          { instanceId: path.basename(files.dir), containers: removed.length },
          "containers removed",
        );
    } catch (err) {
      this.log.warn({ err, instanceId: path.basename(files.dir) }, "could not remove the VM's containers");
    }
    if (why !== "destroyed" && existsSync(files.log)) {
      try {
        renameSync(files.log, path.join(this.p.stateDir, `failed-${path.basename(files.dir)}.log`));
      } catch {
        // Best effort: the log only helps a person.
      }
    }
    this.releaseAddress(files);
    rmSync(files.dir, { recursive: true, force: true });
    this.log.info({ instanceId: path.basename(files.dir), why }, "local VM removed");
  }
}

class LocalInstance implements Instance {
  readonly id: string;
  readonly providerType: string;
  readonly remoteUser: string;
  private currentTags: Tags;

  constructor(
    record: VmRecord,
    readonly address: string,
    tags: Tags,
    private readonly files: VmFiles,
    private readonly destroyVm: (files: VmFiles) => Promise<void>,
  ) {
    this.id = record.id;
    this.providerType = record.providerType;
    this.remoteUser = record.remoteUser;
    this.currentTags = tags;
  }

  get tags(): Tags {
    return { ...this.currentTags };
  }

  async setTags(tags: Tags): Promise<void> {
    const next = checkTags(tags);
    if (!existsSync(this.files.record)) {
      throw new DispatchCloudError(
        "cloud.instance_gone",
        `local driver: instance ${this.id} no longer exists`,
      );
    }
    writeFileAtomic(this.files.tags, `${JSON.stringify(next, null, 2)}\n`);
    this.currentTags = { ...next };
  }

  async destroy(): Promise<void> {
    await this.destroyVm(this.files);
  }
}

/** Whether pid is the vm-main process of this VM directory (and not a recycled pid). */
function isOurVm(pid: number, dir: string): boolean {
  if (!isAlive(pid)) return false;
  const args = readCmdline(pid) ?? [];
  return args.some((a) => VM_MAIN_PATTERN.test(a)) && args.includes(dir);
}

function matches(tags: Tags, filter: Tags): boolean {
  return Object.entries(filter).every(([k, v]) => tags[k] === v);
}

function checkTags(tags: Tags): Tags {
  for (const [k, v] of Object.entries(tags)) {
    if (typeof v !== "string") {
      throw new DispatchCloudError("cloud.error", `local driver: tag ${JSON.stringify(k)} must be a string`);
    }
  }
  return { ...tags };
}

/**
 * The local VMs under `stateDir`, seen outside any dispatcher, with `use` applied to them; for tests,
 * benchmarks and clean-up (local VMs, like cloud VMs, outlive the dispatcher that made them).
 */
export async function withLocalVms<T>(
  stateDir: string,
  logger: Logger,
  use: (vms: Instance[]) => Promise<T>,
): Promise<T> {
  const set = await localDriver.instanceSet(
    { stateDir },
    "local",
    {},
    { logger, clock: systemClock, registry: new Registry() },
  );
  try {
    return await use(await set.instances({}));
  } finally {
    await set.stop();
  }
}

/** Destroys every local VM under `stateDir`; returns how many there were. */
export function destroyLocalVms(stateDir: string, logger: Logger): Promise<number> {
  return withLocalVms(stateDir, logger, async (vms) => {
    for (const vm of vms) await vm.destroy();
    return vms.length;
  });
}
