import { Writable } from "node:stream";
import { type Logger, pino } from "pino";

export type { Logger } from "pino";

export interface LoggerOptions {
  level: string;
  /** `auto`: text when the destination is a terminal (people read it), JSON otherwise (programs do). */
  format: "json" | "text" | "auto";
  /** Where log lines go; stderr by default so command output on stdout stays clean. */
  destination?: NodeJS.WritableStream;
}

/** The format `auto` stands for on this destination. */
export function resolveLogFormat(
  format: LoggerOptions["format"],
  destination: NodeJS.WritableStream = process.stderr,
): "json" | "text" {
  if (format !== "auto") return format;
  return (destination as { isTTY?: boolean }).isTTY === true ? "text" : "json";
}

/** Paths pino blanks out wherever they appear, so a secret that reaches a log call is never written. */
export const REDACTED_PATHS = [
  "token",
  "*.token",
  "password",
  "*.password",
  "secret",
  "*.secret",
  "req.headers.authorization",
  "headers.authorization",
];

/** The one logger of a process; components take `logger.child({ component })`. */
export function createLogger(opts: LoggerOptions): Logger {
  const destination = opts.destination ?? process.stderr;
  const stream =
    resolveLogFormat(opts.format, destination) === "text" ? textStream(destination) : destination;
  return pino(
    {
      level: opts.level,
      base: { pid: process.pid },
      redact: { paths: REDACTED_PATHS, censor: "[redacted]" },
      timestamp: pino.stdTimeFunctions.isoTime,
    },
    stream,
  );
}

const LEVELS: Record<number, string> = {
  10: "TRACE",
  20: "DEBUG",
  30: "INFO",
  40: "WARN",
  50: "ERROR",
  60: "FATAL",
};
const OMIT = new Set(["level", "time", "msg", "pid", "hostname", "component"]);

/** Renders pino's JSON lines as `time LEVEL [component] message key=value ...` for people at a terminal. */
function textStream(out: NodeJS.WritableStream): Writable {
  return new Writable({
    write(chunk: Buffer, _enc, done) {
      for (const line of chunk.toString("utf8").split("\n")) {
        if (line === "") continue;
        try {
          const rec = JSON.parse(line) as Record<string, unknown>;
          const fields = Object.entries(rec)
            .filter(([k]) => !OMIT.has(k))
            .map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`);
          const component = rec["component"] === undefined ? "" : ` [${String(rec["component"])}]`;
          const level = LEVELS[Number(rec["level"])] ?? String(rec["level"]);
          out.write(
            `${String(rec["time"])} ${level}${component} ${String(rec["msg"] ?? "")} ${fields.join(" ")}\n`,
          );
        } catch {
          out.write(`${line}\n`);
        }
      }
      done();
    },
  });
}
