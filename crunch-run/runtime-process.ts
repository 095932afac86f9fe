/**
 * The process runtime: NO ISOLATION. The bundle's command runs as an ordinary child process of the
 * supervisor (no shell), in its own process group, with cwd and DISPATCH_OUTPUT_DIR the host's out/
 * directory and DISPATCH_INPUT_DIR the host's in/ directory. The image is not used, the memory limit and
 * the CPU count are not enforced, the network is not cut off. For trying dispatch-cloud on a machine
 * without Docker only; the supervisor says so in its own log and in the bundle's stderr.
 */
import { spawn } from "node:child_process";
import { readdirSync, readFileSync } from "node:fs";
import { constants as osConstants } from "node:os";
import { PassThrough } from "node:stream";
import { processGroupAlive } from "./lock.ts";
import {
  type ContainerConfig,
  type ContainerExit,
  type ContainerRuntime,
  containerEnv,
  type RunningContainer,
} from "./runtime.ts";

const CLOCK_TICKS = 100; // USER_HZ on Linux
const PAGE_SIZE = 4096;

export function createProcessRuntime(): ContainerRuntime {
  return {
    name: "process",
    warnings: [
      "process runtime: NO ISOLATION — the bundle runs as a plain process of the runner's user with full access " +
        "to this instance; its image is not used and its memory limit, CPU count and network setting are not enforced",
    ],
    async prepare() {},
    async start(config: ContainerConfig): Promise<RunningContainer> {
      const [cmd, ...args] = config.spec.command;
      const env = containerEnv(config.spec, config.outDir, config.inDir);
      const stdout = new PassThrough();
      const stderr = new PassThrough();
      const child = spawn(cmd ?? "", args, {
        cwd: config.outDir,
        env,
        detached: true,
        stdio: ["ignore", "pipe", "pipe"],
      });
      const exited = new Promise<ContainerExit>((resolve) => {
        child.once("error", (err) => {
          stderr.end(`cannot run ${JSON.stringify(cmd)}: ${err.message}\n`);
          stdout.end();
          resolve({ exitCode: 127, oomKilled: false });
        });
        child.once("exit", (code, signal) => {
          const signo = signal === null ? 0 : ((osConstants.signals as Record<string, number>)[signal] ?? 0);
          resolve({ exitCode: code ?? 128 + signo, oomKilled: false });
        });
      });
      child.stdout?.pipe(stdout);
      child.stderr?.pipe(stderr);
      const pgid = child.pid ?? 0;
      const kill = (signal: NodeJS.Signals) => {
        if (pgid > 0 && processGroupAlive(pgid)) {
          try {
            process.kill(-pgid, signal);
          } catch {
            // gone meanwhile
          }
        }
      };
      return {
        ref: { runtime: "process", pgid },
        stdout,
        stderr,
        wait: () => exited,
        async stats() {
          const u = groupUsage(pgid);
          return { cpuSeconds: u.cpuSeconds, memoryBytes: u.memoryBytes, maxMemoryBytes: u.memoryBytes };
        },
        writableLayerBytes: async () => 0,
        async stop(graceSeconds: number) {
          const gone = async (ms: number) => {
            const deadline = Date.now() + ms;
            while (Date.now() < deadline && pgid > 0 && processGroupAlive(pgid)) {
              await new Promise((r) => setTimeout(r, 50));
            }
          };
          kill("SIGTERM");
          await gone(graceSeconds * 1000);
          kill("SIGKILL");
          // Returns once the group is gone (a SIGKILLed process still takes a moment to exit).
          await gone(2000);
        },
        async remove() {
          kill("SIGKILL");
          // Children that outlive the leader may hold the pipes open; don't wait for them.
          child.stdout?.destroy();
          child.stderr?.destroy();
        },
      };
    },
  };
}

/** CPU seconds and resident memory of every process in the group, from /proc. */
export function groupUsage(pgid: number): { cpuSeconds: number; memoryBytes: number } {
  let ticks = 0;
  let pages = 0;
  let pids: string[];
  try {
    pids = readdirSync("/proc").filter((n) => /^\d+$/.test(n));
  } catch {
    return { cpuSeconds: 0, memoryBytes: 0 };
  }
  for (const pid of pids) {
    let stat: string;
    try {
      stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    } catch {
      continue;
    }
    // After the ")" : field 3 state is f[0], field 5 pgrp f[2], 14 utime f[11], 15 stime f[12], 24 rss f[21].
    const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    if (Number(f[2]) !== pgid) continue;
    ticks += Number(f[11] ?? 0) + Number(f[12] ?? 0);
    pages += Number(f[21] ?? 0);
  }
  return { cpuSeconds: ticks / CLOCK_TICKS, memoryBytes: pages * PAGE_SIZE };
}
