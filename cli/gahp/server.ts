/**
 * The GAHP protocol engine (docs/htcondor.md "The protocol"): the banner, the generic commands (COMMANDS,
 * VERSION, QUIT, RESULTS, ASYNC_MODE_ON/OFF, RESPONSE_PREFIX), the queue of results, backpressure, and the
 * dispatch of the back end's commands. It reads request lines from a byte stream and writes reply lines through
 * `write`; it knows nothing of BOINC or of the REST server (those are the CommandSet's).
 */
import { DispatchCloudError } from "../../lib/errors.ts";
import { boundedLine, clip, formatLine, LineReader, parseRequest } from "./wire.ts";

/** A reason on the wire: "<code>: <message>". */
export function reason(err: unknown): string {
  if (err instanceof DispatchCloudError) return clip(`${err.code}: ${err.message}`);
  return clip(err instanceof Error ? err.message : String(err));
}

export const protocolError = (code: "gahp.bad_arguments" | "gahp.unknown_command", message: string) =>
  new DispatchCloudError(code, message);

/** A synchronous command: its return line's arguments after "S", or a failure (answered F with the reason). */
export interface SyncCommand {
  kind: "sync";
  run(args: string[]): string[];
}

/**
 * An asynchronous command: `parse` checks the arguments after the request id (throwing what makes the return
 * line E) and gives the work; the work's answer becomes the result line after the request id, and a thrown
 * error becomes a one-argument result, its reason.
 */
export interface AsyncCommand {
  kind: "async";
  parse(args: string[]): (signal: AbortSignal) => Promise<string[]>;
}

export type CommandSet = Record<string, SyncCommand | AsyncCommand>;

export interface EngineOptions {
  /** The banner and VERSION's answer: `$GahpVersion: x.y.z Mon d yyyy description $`. */
  version: string;
  commands: CommandSet;
  maxPending: number;
  maxRequestBytes: number;
  write: (text: string) => void;
  log: (line: string) => void;
}

const GENERIC = [
  "ASYNC_MODE_OFF",
  "ASYNC_MODE_ON",
  "COMMANDS",
  "QUIT",
  "RESPONSE_PREFIX",
  "RESULTS",
  "VERSION",
];

export class GahpEngine {
  private readonly reader: LineReader;
  private readonly results: string[] = [];
  private readonly pending = new Set<string>();
  private readonly controller = new AbortController();
  private asyncMode = false;
  private rSent = false;
  private prefix = "";
  private quitting = false;
  private readonly work = new Set<Promise<void>>();

  constructor(private readonly opts: EngineOptions) {
    this.reader = new LineReader(opts.maxRequestBytes);
  }

  get signal(): AbortSignal {
    return this.controller.signal;
  }

  /** Whether QUIT was received (the caller stops reading and ends). */
  get quit(): boolean {
    return this.quitting;
  }

  start(): void {
    this.opts.write(`${this.opts.version}\n`);
  }

  /** Feeds bytes read from the client. */
  feed(chunk: Buffer): void {
    for (const frame of this.reader.push(chunk)) {
      if (this.quitting) return;
      if (frame.kind === "too_long") {
        this.reply([
          "E",
          `gahp.line_too_long: a request line of ${frame.bytes} bytes passes maxRequestBytes (${this.opts.maxRequestBytes}); dropped`,
        ]);
        continue;
      }
      this.handle(frame.bytes);
    }
  }

  /** The input ended: a last unterminated line is handled, in-progress work is abandoned. */
  end(): void {
    for (const frame of this.reader.end()) {
      if (this.quitting) break;
      if (frame.kind === "line" && frame.bytes.length > 0) this.handle(frame.bytes);
    }
    this.stop();
  }

  /** Aborts in-progress work (its HTTP requests); results not yet fetched are lost with the client. */
  stop(): void {
    this.controller.abort(new Error("the GAHP is stopping"));
  }

  /** Resolves when every piece of started work has settled (after stop(), promptly). */
  async settled(): Promise<void> {
    while (this.work.size > 0) await Promise.allSettled([...this.work]);
  }

  private reply(args: readonly string[]): void {
    // Return lines are short (S, E with a clipped reason); results go through queueResult's bound.
    this.opts.write(`${this.prefix}${formatLine(args)}\n`);
  }

  private handle(bytes: Buffer): void {
    const parsed = parseRequest(bytes);
    if (!parsed.ok) {
      this.reply(["E", `gahp.malformed_line: ${parsed.reason}`]);
      return;
    }
    const [rawName = "", ...args] = parsed.args;
    const name = rawName.toUpperCase();
    try {
      this.dispatch(name, rawName, args);
    } catch (err) {
      this.reply(["E", reason(err)]);
    }
  }

  private dispatch(name: string, rawName: string, args: string[]): void {
    const none = () => {
      if (args.length !== 0)
        throw protocolError("gahp.bad_arguments", `${name} takes no arguments (got ${args.length})`);
    };
    switch (name) {
      case "COMMANDS":
        none();
        this.reply(["S", ...[...GENERIC, ...Object.keys(this.opts.commands)].sort()]);
        return;
      case "VERSION":
        none();
        this.opts.write(`${this.prefix}S ${this.opts.version}\n`);
        return;
      case "QUIT":
        none();
        this.reply(["S"]);
        this.quitting = true;
        this.stop();
        return;
      case "ASYNC_MODE_ON":
        none();
        this.asyncMode = true;
        this.rSent = false;
        this.reply(["S"]);
        return;
      case "ASYNC_MODE_OFF":
        none();
        this.asyncMode = false;
        this.reply(["S"]);
        return;
      case "RESPONSE_PREFIX":
        if (args.length !== 1)
          throw protocolError("gahp.bad_arguments", `RESPONSE_PREFIX takes 1 argument (got ${args.length})`);
        this.reply(["S"]);
        this.prefix = args[0] as string;
        return;
      case "RESULTS": {
        none();
        const lines = this.results.splice(0);
        this.rSent = false;
        this.opts.write([`S ${lines.length}`, ...lines].map((l) => `${this.prefix}${l}\n`).join(""));
        return;
      }
    }
    const command = this.opts.commands[name];
    if (command === undefined) {
      throw protocolError(
        "gahp.unknown_command",
        `unknown command ${JSON.stringify(clip(rawName, 80))}; COMMANDS lists the commands`,
      );
    }
    if (command.kind === "sync") {
      let out: string[];
      try {
        out = command.run(args);
      } catch (err) {
        if (err instanceof DispatchCloudError && err.code === "gahp.bad_arguments") throw err;
        this.reply(["F", reason(err)]);
        return;
      }
      this.reply(["S", ...out]);
      return;
    }
    const [reqid, ...rest] = args;
    if (reqid === undefined || !/^[0-9]{1,10}$/.test(reqid) || Number(reqid) === 0) {
      throw protocolError(
        "gahp.bad_arguments",
        `${name} needs a request id, a positive whole number, first (got ${reqid === undefined ? "none" : JSON.stringify(clip(reqid, 40))})`,
      );
    }
    if (this.pending.has(reqid))
      throw protocolError("gahp.bad_arguments", `request id ${reqid} is already in progress`);
    if (this.pending.size >= this.opts.maxPending) {
      this.reply(["E", "Threads limit reached"]);
      return;
    }
    const job = command.parse(rest);
    this.pending.add(reqid);
    this.reply(["S"]);
    const p = (async () => {
      let out: string[];
      try {
        out = await job(this.controller.signal);
      } catch (err) {
        if (!(err instanceof DispatchCloudError)) this.opts.log(`${name} ${reqid} failed: ${reason(err)}`);
        out = [reason(err)];
      }
      this.pending.delete(reqid);
      if (!this.controller.signal.aborted) this.queueResult(reqid, out);
    })();
    this.work.add(p);
    void p.finally(() => this.work.delete(p));
  }

  private queueResult(reqid: string, out: string[]): void {
    const line =
      boundedLine([reqid, ...out]) ??
      formatLine([
        reqid,
        `gahp.bad_arguments: the answer passes the protocol's 500 KB line; ask for less at once`,
      ]);
    this.results.push(line);
    if (this.asyncMode && !this.rSent) {
      this.rSent = true;
      this.opts.write(`${this.prefix}R\n`);
    }
  }
}
