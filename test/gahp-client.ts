/**
 * A GAHP client for tests that behaves as HTCondor's gridmanager does with a GAHP (its gahp-client): it starts
 * `bin/dispatch-cloud gahp` as a process, reads the banner, splits reply lines its way (a backslash lets the next
 * character through, an unescaped CR is dropped, an unescaped space separates arguments), treats a line that is
 * only "R" as "results are waiting", and tracks request ids. It checks what the gridmanager checks of each
 * answer (the argument counts of result lines are checked by the callers, as gahp-client.cpp does per command).
 */
import { type ChildProcess, spawn } from "node:child_process";
import { BIN } from "./serve-process.ts";

/** Splits a reply line the way the gridmanager does. */
export function splitReply(line: string): string[] {
  const args: string[] = [];
  let cur = "";
  for (let i = 0; i < line.length; i++) {
    const c = line[i] as string;
    if (c === "\\") {
      i++;
      cur += line[i] ?? "";
    } else if (c === "\r") {
      // dropped
    } else if (c === " ") {
      args.push(cur);
      cur = "";
    } else cur += c;
  }
  args.push(cur);
  return args;
}

/** Escapes an argument as the gridmanager's escapeGahpString does. */
export const esc = (s: string): string => s.replace(/[ \\\r\n]/g, (c) => `\\${c}`);

export class GahpProcess {
  private buffer = "";
  private readonly lines: string[] = [];
  private waiters: (() => void)[] = [];
  /** Lines that were only "R" (async notifications), counted. */
  notifications = 0;
  stderr = "";
  readonly exited: Promise<number | null>;
  private nextReqid = 1;
  private readonly results = new Map<number, string[]>();

  private constructor(readonly child: ChildProcess) {
    child.stdout?.setEncoding("utf8");
    child.stdout?.on("data", (d: string) => {
      this.buffer += d;
      // A line ends at an LF that no backslash escapes.
      for (;;) {
        let end = -1;
        for (let i = 0; i < this.buffer.length; i++) {
          if (this.buffer[i] === "\\") i++;
          else if (this.buffer[i] === "\n") {
            end = i;
            break;
          }
        }
        if (end < 0) break;
        const line = this.buffer.slice(0, end);
        this.buffer = this.buffer.slice(end + 1);
        if (line === "R") this.notifications++;
        else this.lines.push(line);
      }
      this.wake();
    });
    child.stderr?.on("data", (d: Buffer) => {
      this.stderr += d.toString();
    });
    this.exited = new Promise((ok) => child.once("exit", (code) => ok(code)));
    void this.exited.then(() => this.wake());
  }

  private wake(): void {
    const w = this.waiters;
    this.waiters = [];
    for (const f of w) f();
  }

  static start(args: string[], env: NodeJS.ProcessEnv = process.env): GahpProcess {
    return new GahpProcess(spawn(BIN, ["gahp", ...args], { stdio: ["pipe", "pipe", "pipe"], env }));
  }

  /** The next reply line, raw (without its LF). */
  async line(ms = 30_000): Promise<string> {
    const until = Date.now() + ms;
    let exited = false;
    void this.exited.then(() => {
      exited = true;
    });
    while (this.lines.length === 0) {
      if (exited) throw new Error(`the GAHP exited; stderr:\n${this.stderr.slice(-3000)}`);
      if (Date.now() > until)
        throw new Error(`no reply line within ${ms} ms; stderr:\n${this.stderr.slice(-3000)}`);
      await new Promise<void>((ok) => {
        this.waiters.push(ok);
        setTimeout(ok, 200);
      });
    }
    return this.lines.shift() as string;
  }

  /** Writes raw bytes. */
  write(data: string | Buffer): void {
    this.child.stdin?.write(data);
  }

  /** Sends a request line (CRLF-terminated, as the gridmanager writes) and reads its return line's arguments. */
  async send(line: string | Buffer): Promise<string[]> {
    this.write(typeof line === "string" ? `${line}\r\n` : Buffer.concat([line, Buffer.from("\r\n")]));
    return splitReply(await this.line());
  }

  /** An asynchronous command with a fresh request id: expects S, returns the id. */
  async request(command: string, args: string): Promise<number> {
    const reqid = this.nextReqid++;
    const reply = await this.send(args === "" ? `${command} ${reqid}` : `${command} ${reqid} ${args}`);
    if (reply[0] !== "S") throw new Error(`${command} ${reqid}: return line ${JSON.stringify(reply)}`);
    return reqid;
  }

  /** RESULTS once: stores every result line by its request id; returns how many came. */
  async pollResults(): Promise<number> {
    const head = await this.send("RESULTS");
    if (head.length < 2 || head[0] !== "S") throw new Error(`RESULTS: ${JSON.stringify(head)}`);
    const n = Number(head[1]);
    for (let i = 0; i < n; i++) {
      const r = splitReply(await this.line());
      const reqid = Number(r[0]);
      if (!Number.isInteger(reqid) || reqid === 0) throw new Error(`bad result line ${JSON.stringify(r)}`);
      this.results.set(reqid, r);
    }
    return n;
  }

  /** Waits for the result of `reqid` (polling RESULTS every 200 ms, or sooner on an "R"). */
  async result(reqid: number, ms = 180_000): Promise<string[]> {
    const until = Date.now() + ms;
    for (;;) {
      const r = this.results.get(reqid);
      if (r !== undefined) {
        this.results.delete(reqid);
        return r;
      }
      if (Date.now() > until) throw new Error(`no result for request ${reqid} within ${ms} ms`);
      const seen = this.notifications;
      if ((await this.pollResults()) === 0) {
        const deadline = Date.now() + 200;
        while (this.notifications === seen && Date.now() < deadline)
          await new Promise((ok) => setTimeout(ok, 20));
      }
    }
  }

  /** Closes stdin and waits for the exit code. */
  async close(): Promise<number | null> {
    this.child.stdin?.end();
    const timer = setTimeout(() => this.child.kill("SIGKILL"), 20_000);
    const code = await this.exited;
    clearTimeout(timer);
    return code;
  }
}
