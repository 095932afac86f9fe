/**
 * Debian's OpenSSH sshd as a local VM's SSH server: one sshd per VM on its own loopback address, in its own
 * mount namespace (`unshare --mount`) with private tmpfs mounts over /var/run, /var/lock and /tmp, so
 * sessions of different VMs share none of them. Paths that must stay visible inside (the state and root
 * directories, the Docker socket, resolv.conf) are bind-mounted back. Needs root.
 */
import { type ChildProcess, spawn } from "node:child_process";
import {
  chmodSync,
  closeSync,
  existsSync,
  mkdirSync,
  openSync,
  readFileSync,
  realpathSync,
  statSync,
  writeFileSync,
} from "node:fs";
import net from "node:net";
import path from "node:path";
import type { Logger } from "../../lib/logger.ts";
import { generateKeyPair, parseAuthorizedKeys } from "../ssh-server.ts";
import { findPids, mountNamespace, terminate } from "./procs.ts";

export { generateKeyPair } from "../ssh-server.ts";

export const SSHD_PATH = "/usr/sbin/sshd";
export const SERVICES_HINT = 'run `eval "$(bash scripts/test-services.sh)"` as root to install and set it up';

export interface OpenSshServer {
  host: string;
  port: number;
  pid: number;
  stop(): Promise<void>;
  /** Resolves when sshd exits (for whatever reason) with its exit code or signal. */
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  /** The mount namespace of sshd and every session it starts (`mnt:[...]`). */
  mountNs: string;
}

export interface OpenSshServerOptions {
  /** Its own loopback address, e.g. 127.0.0.2. */
  host: string;
  /** Default 22. */
  port?: number;
  /** The login user (must exist). */
  user: string;
  authorizedKeys: string[];
  /** The VM root, exported to sessions as DISPATCH_VM_ROOT (sshd's SetEnv). */
  rootDir: string;
  /** Where sshd's config, host key, authorized keys, pid file and log live (created if missing). */
  stateDir: string;
  /** Concurrent sessions (channels) per connection; default 10, as OpenSSH. */
  maxSessions?: number;
  logger?: Logger;
  /** How long to wait for sshd to accept connections; default 10 s. */
  startTimeoutMs?: number;
}

/** Quotes a string for sh. */
export function shQuote(s: string): string {
  return `'${s.replaceAll("'", `'\\''`)}'`;
}

/** Quotes a value for sshd_config (double quotes; sshd has no escape for them, so refuse them). */
function configQuote(s: string): string {
  if (/["\n\r]/.test(s)) throw new Error(`sshd config value must not contain quotes or newlines: ${s}`);
  return `"${s}"`;
}

export function sshdConfig(o: {
  host: string;
  port: number;
  user: string;
  rootDir: string;
  hostKeyFile: string;
  pidFile: string;
  authorizedKeysFile: string;
  maxSessions: number;
}): string {
  return [
    `ListenAddress ${o.host}:${o.port}`,
    `HostKey ${configQuote(o.hostKeyFile)}`,
    `PidFile ${configQuote(o.pidFile)}`,
    `AuthorizedKeysFile ${configQuote(o.authorizedKeysFile)}`,
    `AllowUsers ${o.user}`,
    "PubkeyAuthentication yes",
    "PasswordAuthentication no",
    "KbdInteractiveAuthentication no",
    "PermitRootLogin prohibit-password",
    "UsePAM yes",
    "StrictModes no",
    "UseDNS no",
    "PrintMotd no",
    "PrintLastLog no",
    "X11Forwarding no",
    "AllowAgentForwarding no",
    "PermitUserEnvironment no",
    `MaxSessions ${o.maxSessions}`,
    "MaxStartups 100:30:200",
    "LogLevel ERROR",
    `SetEnv ${configQuote(`DISPATCH_VM_ROOT=${o.rootDir}`)}`,
    "",
  ].join("\n");
}

/** The real directories behind /var/run, /var/lock and /tmp that get a private tmpfs (nested ones skipped). */
function maskedDirs(): string[] {
  const dirs = [...new Set(["/var/run", "/var/lock", "/tmp"].map((d) => realpathSync(d)))];
  return dirs.filter((d) => !dirs.some((other) => other !== d && isUnder(d, other)));
}

function isUnder(p: string, dir: string): boolean {
  return p === dir || p.startsWith(dir.endsWith("/") ? dir : `${dir}/`);
}

/**
 * The shell script run by `unshare --mount`: make mounts private, give each masked directory a fresh tmpfs
 * (built in a staging directory with the kept paths bound in, then moved over the original), and exec sshd.
 */
export function namespaceScript(o: {
  stateDir: string;
  keep: string[];
  configFile: string;
  authorizedKeysSource: string;
  authorizedKeysFile: string;
}): string {
  const lines = ["set -eu", "mount -n --make-rprivate /"];
  const masks = maskedDirs();
  for (const [i, mask] of masks.entries()) {
    const stage = path.join(o.stateDir, `mnt-${i}`);
    lines.push(
      `mkdir -p ${shQuote(stage)}`,
      `mount -n -t tmpfs -o mode=${mask === "/tmp" ? "1777" : "0755"} dispatch-cloud-vm ${shQuote(stage)}`,
    );
    for (const keep of o.keep.filter((k) => isUnder(k, mask) && existsSync(k))) {
      const target = path.join(stage, path.relative(mask, keep));
      const prepare = !isDirectory(keep) ? `: > ${shQuote(target)}` : `mkdir -p ${shQuote(target)}`;
      lines.push(
        `mkdir -p ${shQuote(path.dirname(target))}`,
        prepare,
        `mount -n --bind ${shQuote(keep)} ${shQuote(target)}`,
      );
    }
    lines.push(`mount -n --move ${shQuote(stage)} ${shQuote(mask)}`);
  }
  for (const dir of ["/var/run", "/var/lock"]) lines.push(`mkdir -p "$(readlink -f ${dir})"`);
  lines.push(
    `chmod 1777 "$(readlink -f /var/lock)"`,
    "mkdir -p -m 0755 /run/sshd",
    `install -m 0644 ${shQuote(o.authorizedKeysSource)} ${shQuote(o.authorizedKeysFile)}`,
    `exec ${SSHD_PATH} -D -e -f ${shQuote(o.configFile)}`,
  );
  return `${lines.join("\n")}\n`;
}

function isDirectory(p: string): boolean {
  return statSync(p).isDirectory();
}

/** Why this machine cannot run sshd VMs, or undefined if it can. */
export function openSshUnavailable(): string | undefined {
  if (process.getuid?.() !== 0) return `the openssh SSH server needs root; ${SERVICES_HINT}`;
  if (!existsSync(SSHD_PATH))
    return `${SSHD_PATH} is missing (Debian package openssh-server); ${SERVICES_HINT}`;
  if (!existsSync("/usr/bin/unshare")) return `/usr/bin/unshare is missing (util-linux); ${SERVICES_HINT}`;
  return undefined;
}

export async function startOpenSshServer(opts: OpenSshServerOptions): Promise<OpenSshServer> {
  const unavailable = openSshUnavailable();
  if (unavailable !== undefined) throw new Error(unavailable);
  parseAuthorizedKeys(opts.authorizedKeys);
  const port = opts.port ?? 22;
  const log = opts.logger?.child({ component: "sshd", host: opts.host });
  const stateDir = path.resolve(opts.stateDir);
  const rootDir = path.resolve(opts.rootDir);
  mkdirSync(stateDir, { recursive: true, mode: 0o700 });

  const files = {
    hostKeyFile: path.join(stateDir, "ssh_host_ed25519_key"),
    pidFile: path.join(stateDir, "sshd.pid"),
    configFile: path.join(stateDir, "sshd_config"),
    authorizedKeysSource: path.join(stateDir, "authorized_keys"),
    // Inside the namespace's private /run: readable by the login user whatever the state dir's modes.
    authorizedKeysFile: "/run/dispatch-cloud-authorized_keys",
    logFile: path.join(stateDir, "sshd.log"),
    script: path.join(stateDir, "sshd-namespace.sh"),
  };
  if (!existsSync(files.hostKeyFile)) {
    writeFileSync(files.hostKeyFile, generateKeyPair().privateKey, { mode: 0o600 });
  }
  chmodSync(files.hostKeyFile, 0o600);
  writeFileSync(files.authorizedKeysSource, `${opts.authorizedKeys.map((k) => k.trim()).join("\n")}\n`);
  writeFileSync(
    files.configFile,
    sshdConfig({
      ...files,
      host: opts.host,
      port,
      user: opts.user,
      rootDir,
      maxSessions: opts.maxSessions ?? 10,
    }),
  );
  const keep = [stateDir, rootDir, "/var/run/docker.sock", "/etc/resolv.conf"]
    .filter((p) => existsSync(p))
    .map((p) => realpathSync(p));
  writeFileSync(files.script, namespaceScript({ ...files, stateDir, keep }));

  const logFd = openSync(files.logFile, "a");
  let child: ChildProcess;
  try {
    child = spawn("/usr/bin/unshare", ["--mount", "/bin/sh", files.script], {
      stdio: ["ignore", logFd, logFd],
      env: { PATH: "/usr/sbin:/usr/bin:/sbin:/bin", DISPATCH_VM_ROOT: rootDir },
    });
  } finally {
    closeSync(logFd);
  }
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => {
    child.on("exit", (code, signal) => resolve({ code, signal }));
    child.on("error", () => resolve({ code: null, signal: null }));
  });
  const pid = child.pid;
  const failed = (why: string) =>
    new Error(`sshd on ${opts.host}:${port} ${why}; see ${files.logFile}: ${tail(files.logFile)}`);
  if (pid === undefined) throw failed("could not be started");

  const deadline = Date.now() + (opts.startTimeoutMs ?? 10_000);
  let done = false;
  void exited.then(() => {
    done = true;
  });
  for (;;) {
    if (done) throw failed("exited before accepting connections");
    if (await canConnect(opts.host, port)) break;
    if (Date.now() > deadline) {
      await terminate([pid], 500);
      throw failed("did not accept connections in time");
    }
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  const mountNs = mountNamespace(pid) ?? "";
  log?.debug({ pid, port }, "sshd started");

  return {
    host: opts.host,
    port,
    pid,
    exited,
    mountNs,
    async stop() {
      // sshd's per-connection processes and their sessions are in their own sessions, but all share its
      // mount namespace.
      const others = mountNs === "" ? [] : findPids({ mountNs }).filter((p) => p !== pid);
      await terminate([pid, ...others], 2000);
      await exited;
    },
  };
}

function canConnect(host: string, port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = net.connect({ host, port });
    socket.once("connect", () => {
      socket.destroy();
      resolve(true);
    });
    socket.once("error", () => resolve(false));
  });
}

function tail(file: string): string {
  try {
    const text = readFileSync(file, "utf8").trim();
    return text.slice(-500) || "(empty)";
  } catch {
    return "(no log)";
  }
}
