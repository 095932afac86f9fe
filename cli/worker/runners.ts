/**
 * The worker's runners: crunch-run as child processes of this same program (lib/self.ts selfCommand), with
 * DISPATCH_VM_ROOT set to the worker's work directory, exactly as the dispatcher runs it on a cloud VM over SSH
 * (`--detach <uuid>` with the start document on stdin, `--list`, `--kill <signal> <uuid>`). The supervisors
 * `--detach` starts run in sessions of their own: they outlive the worker process, as they outlive an SSH
 * session on a VM.
 */
import { spawn } from "node:child_process";
import { readdir } from "node:fs/promises";
import { type ListedRunners, parseList, type StartDocumentSent } from "../../lib/runner-protocol.ts";
import { selfCommand } from "../../lib/self.ts";

export interface RunResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** A crunch-run command that ran too long is killed (a `--kill` waits about 1 s; `--list` asks docker). */
const COMMAND_TIMEOUT_MS = 60_000;

export class LocalRunners {
  private readonly env: NodeJS.ProcessEnv;
  private readonly command: string[];

  constructor(
    /** The worker's work directory: crunch-run's DISPATCH_VM_ROOT (absolute). */
    readonly root: string,
    env: NodeJS.ProcessEnv = process.env,
  ) {
    this.env = { ...env, DISPATCH_VM_ROOT: root };
    this.command = selfCommand();
  }

  /** `crunch-run <args>` to its end. */
  run(args: string[], stdin = ""): Promise<RunResult> {
    const [cmd, ...pre] = this.command;
    return new Promise((resolve) => {
      const child = spawn(cmd as string, [...pre, ...args], {
        env: this.env,
        stdio: ["pipe", "pipe", "pipe"],
        timeout: COMMAND_TIMEOUT_MS,
      });
      let stdout = "";
      let stderr = "";
      child.stdout.on("data", (d: Buffer) => {
        stdout += d.toString();
      });
      child.stderr.on("data", (d: Buffer) => {
        stderr += d.toString();
      });
      child.stdin.on("error", () => {});
      child.on("error", (err) => resolve({ code: null, stdout, stderr: `${stderr}${err.message}` }));
      child.on("close", (code) => resolve({ code, stdout, stderr }));
      child.stdin.end(stdin);
    });
  }

  /** `--list`, parsed; throws when it fails (the worker then reports what it knew before). */
  async list(): Promise<ListedRunners> {
    const r = await this.run(["--list"]);
    if (r.code !== 0) throw new Error(`crunch-run --list failed (${r.code}): ${lastLine(r.stderr)}`);
    return parseList(r.stdout);
  }

  /** `--detach <uuid>` with the start document on stdin (it carries the runner token: never on argv). */
  async detach(doc: StartDocumentSent): Promise<{ ok: true; pid: number } | { ok: false; why: string }> {
    const r = await this.run(["--detach", doc.uuid], JSON.stringify(doc));
    if (r.code === 0) {
      try {
        return { ok: true, pid: (JSON.parse(r.stdout) as { pid: number }).pid };
      } catch {
        return { ok: true, pid: 0 };
      }
    }
    return { ok: false, why: `crunch-run --detach exited ${r.code}: ${lastLine(r.stderr)}` };
  }

  /** `--kill <signal> <uuid>`: true once the bundle's supervisor (or what is left of it) is gone. */
  async kill(uuid: string, signal: "TERM" | "KILL"): Promise<boolean> {
    return (await this.run(["--kill", signal, uuid])).code === 0;
  }

  /**
   * The attempts of the bundles whose work directories exist (`<uuid>-<attempt>` under tmp/crunch-run): how a
   * worker that restarted (an upgrade) knows the attempts of the bundles it finds running.
   */
  async workDirAttempts(): Promise<Map<string, number>> {
    const out = new Map<string, number>();
    const names = await readdir(`${this.root}/tmp/crunch-run`).catch(() => [] as string[]);
    for (const name of names) {
      const m = /^([a-z0-9]{5}-bndl-[a-z0-9]{15})-(\d+)$/.exec(name);
      if (m === null) continue;
      const attempt = Number(m[2]);
      if (attempt > (out.get(m[1]!) ?? 0)) out.set(m[1]!, attempt);
    }
    return out;
  }
}

function lastLine(text: string): string {
  const lines = text.trim().split("\n");
  return (lines[lines.length - 1] ?? "").slice(0, 500);
}
