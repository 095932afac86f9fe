/**
 * One local VM: `node vm-main.ts <vm dir>` (from the built artifact: `dispatch-cloud __local-vm <vm dir>`),
 * started detached by the local driver so it outlives the dispatcher. It starts the VM's SSH server
 * (embedded, in this process; or an sshd it supervises), writes the server's address, then after the boot
 * delay runs the init command with DISPATCH_VM_ROOT set. On SIGTERM it ends its SSH server, every command it
 * started and every process that carries its DISPATCH_VM_ROOT, then exits. Everything it has to say goes
 * to `<vm dir>/vm.log`.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { appendFileSync, closeSync, createWriteStream, openSync, readFileSync, unlinkSync } from "node:fs";
import path from "node:path";
import { createLogger, type Logger } from "../../lib/logger.ts";
import { startEmbeddedSshServer } from "../ssh-server.ts";
import { readIfExists, type VmFiles, type VmRecord, vmFiles, writeFileAtomic } from "./layout.ts";
import { findPids, lookupUser, terminate } from "./procs.ts";
import { type OpenSshServer, startOpenSshServer } from "./ssh-openssh.ts";

const SSHD_RESTART_DELAY_MS = 1000;

async function main(dir: string): Promise<void> {
  const files = vmFiles(dir);
  writeFileAtomic(files.pid, String(process.pid), 0o644);
  const record = JSON.parse(readFileSync(files.record, "utf8")) as VmRecord;
  const logger = createLogger({
    level: "info",
    format: "json",
    destination: createWriteStream(files.log, { flags: "a" }),
  }).child({ component: "local-vm", instanceId: record.id });
  const initScript = readIfExists(files.init) ?? "";
  if (initScript !== "") unlinkSync(files.init);
  const authorizedKeys = readFileSync(files.authorizedKeys, "utf8")
    .split("\n")
    .filter((l) => l.trim() !== "");
  const vmEnv = { DISPATCH_VM_ROOT: files.root };

  let stopping = false;
  const stoppers: (() => Promise<void>)[] = [];
  let init: ChildProcess | undefined;
  const bootAbort = new AbortController();

  const shutdown = async (why: string) => {
    if (stopping) return;
    stopping = true;
    bootAbort.abort();
    logger.info({ why }, "VM shutting down");
    const targets: number[] = [];
    if (init?.pid !== undefined && init.exitCode === null) targets.push(-init.pid);
    await Promise.allSettled([...stoppers.map((stop) => stop()), terminate(targets, 2000)]);
    await terminate(findPids({ env: ["DISPATCH_VM_ROOT", files.root] }), 2000);
    logger.info("VM stopped");
    await new Promise<void>((resolve) => logger.flush(() => resolve()));
    process.exit(0);
  };
  process.on("SIGTERM", () => void shutdown("SIGTERM"));
  process.on("SIGINT", () => void shutdown("SIGINT"));

  let address: string;
  if (record.sshServer === "embedded") {
    const server = await startEmbeddedSshServer({
      host: record.host,
      port: 0,
      hostKey: readFileSync(files.hostKey),
      authorizedKeys,
      env: vmEnv,
      streamLocalUnder: files.root,
      logger,
    });
    stoppers.push(() => server.close());
    address = `${server.host}:${server.port}`;
  } else {
    const start = () =>
      startOpenSshServer({
        host: record.host,
        user: record.remoteUser,
        authorizedKeys,
        rootDir: files.root,
        stateDir: files.sshdDir,
        logger,
      });
    let server = await start();
    const supervise = (s: OpenSshServer) => {
      writeFileAtomic(files.sshdNamespace, s.mountNs, 0o644);
      void s.exited.then(async (how) => {
        if (stopping) return;
        logger.warn({ ...how }, "sshd exited; restarting it");
        await terminate(findPids({ mountNs: s.mountNs }), 1000);
        await new Promise((resolve) => setTimeout(resolve, SSHD_RESTART_DELAY_MS));
        if (stopping) return;
        try {
          server = await start();
          supervise(server);
        } catch (err) {
          logger.error({ err }, "sshd restart failed");
          void shutdown("sshd restart failed");
        }
      });
    };
    supervise(server);
    stoppers.push(() => server.stop());
    address = `${server.host}:${server.port}`;
  }
  writeFileAtomic(files.address, address, 0o644);
  logger.info({ address }, "SSH server up");

  try {
    await sleep(record.bootDelayMs, bootAbort.signal);
  } catch {
    return;
  }
  init = runInit(initScript, record, files, vmEnv, logger);
}

/** Runs the init script with `sh` in its own process group, as the login user in openssh mode. */
function runInit(
  script: string,
  record: VmRecord,
  files: VmFiles,
  vmEnv: Record<string, string>,
  logger: Logger,
): ChildProcess {
  const user = record.sshServer === "openssh" ? lookupUser(record.remoteUser) : undefined;
  const env: Record<string, string> = {
    PATH: process.env["PATH"] ?? "/usr/local/bin:/usr/bin:/bin",
    HOME: user?.home ?? process.env["HOME"] ?? "/",
    USER: record.remoteUser,
    LOGNAME: record.remoteUser,
    ...vmEnv,
  };
  const logFd = openSync(files.log, "a");
  // The script arrives on fd 3, never on a command line: it carries the instance secret.
  const child = spawn("/bin/sh", ["-c", 'script=$(cat <&3); exec 3<&-; eval "$script"'], {
    detached: true,
    cwd: files.root,
    env,
    stdio: ["ignore", logFd, logFd, "pipe"],
    ...(user === undefined ? {} : { uid: user.uid, gid: user.gid }),
  });
  closeSync(logFd);
  const scriptPipe = child.stdio[3] as NodeJS.WritableStream & { on(e: "error", l: () => void): void };
  scriptPipe.on("error", () => {});
  scriptPipe.end(script);
  logger.info({ pid: child.pid }, "init command started");
  child.on("error", (err) => logger.error({ err }, "init command could not start"));
  child.on("exit", (code, signal) => logger.info({ exitCode: code, signal }, "init command finished"));
  return child;
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) {
      reject(new Error("aborted"));
      return;
    }
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(new Error("aborted"));
    });
  });
}

/**
 * Runs one local VM in this process until it is told to stop: `vm-main.ts <dir>` from sources, or the
 * hidden `dispatch-cloud __local-vm <dir>` command of the built artifact (cloud-drivers/local/launch.ts).
 */
export function runLocalVm(dir: string | undefined): void {
  if (dir === undefined || !path.isAbsolute(dir)) {
    process.stderr.write("usage: vm-main.ts <absolute VM directory>\n");
    process.exit(2);
  }
  main(dir).catch((err: unknown) => {
    const files = vmFiles(dir);
    const message = err instanceof Error ? err.message : String(err);
    try {
      appendFileSync(
        files.log,
        `${JSON.stringify({ time: new Date().toISOString(), msg: "VM failed to start", error: message })}\n`,
      );
      writeFileAtomic(files.error, message, 0o644);
    } finally {
      process.exit(1);
    }
  });
}

// Run as a script (this file, or its own bundle vm-main-<hash>.cjs); not when imported by the CLI.
if (/(^|\/)vm-main(-[0-9a-f]+)?\.(ts|js|cjs|mjs)$/.test(process.argv[1] ?? "")) runLocalVm(process.argv[2]);
