/**
 * The files of one local VM, all under `<stateDir>/<id>/`, shared by the driver (in the dispatcher) and the
 * VM process (vm-main.ts). Files that change are replaced atomically (write to a temporary name, rename).
 */
import { randomBytes } from "node:crypto";
import { readFileSync, renameSync, writeFileSync } from "node:fs";
import path from "node:path";

/** What the driver decides at create time (vm.json). */
export interface VmRecord {
  id: string;
  providerType: string;
  imageId: string;
  sshServer: "embedded" | "openssh";
  /** openssh: the VM's own loopback address; embedded: 127.0.0.1 (the port is chosen at boot). */
  host: string;
  /** The OS user SSH sessions run as. */
  remoteUser: string;
  bootDelayMs: number;
  /** Milliseconds since the epoch. */
  createdAt: number;
}

export function vmFiles(dir: string) {
  return {
    dir,
    /** The VM's root, exported to its commands as DISPATCH_VM_ROOT. */
    root: path.join(dir, "root"),
    record: path.join(dir, "vm.json"),
    tags: path.join(dir, "tags.json"),
    authorizedKeys: path.join(dir, "authorized_keys"),
    hostKey: path.join(dir, "ssh_host_ed25519_key"),
    /** The init command; the VM reads it once, then deletes it (it holds the instance secret). */
    init: path.join(dir, "init.sh"),
    /** The VM process's pid (it leads its process group). */
    pid: path.join(dir, "pid"),
    /** `host:port` of its SSH server, written once the server accepts connections. */
    address: path.join(dir, "address"),
    /** Why the VM failed to start. */
    error: path.join(dir, "error"),
    /** openssh: the mount namespace of its sshd and sessions. */
    sshdNamespace: path.join(dir, "sshd.ns"),
    sshdDir: path.join(dir, "sshd"),
    log: path.join(dir, "vm.log"),
  };
}

export type VmFiles = ReturnType<typeof vmFiles>;

export function writeFileAtomic(file: string, data: string, mode = 0o600): void {
  const tmp = `${file}.tmp-${randomBytes(4).toString("hex")}`;
  writeFileSync(tmp, data, { mode });
  renameSync(tmp, file);
}

/** The file's text, or undefined if it does not exist. */
export function readIfExists(file: string): string | undefined {
  try {
    return readFileSync(file, "utf8");
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return undefined;
    throw err;
  }
}
