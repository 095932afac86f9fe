/**
 * The GAHP wire format (docs/htcondor.md "The protocol"): one request per line, arguments separated by single
 * spaces, a backslash escaping a space, a backslash, a CR or an LF inside an argument, lines ending with LF (a CR
 * before it is dropped). Replies use the same escaping. Nothing here does I/O: LineReader turns bytes into
 * framed lines (never holding more than the request limit), parseRequest turns a line into arguments or a
 * reason, and formatLine builds a reply line.
 */

/** The longest reply line the gridmanager reads (its buffer is 500 KB; a longer line makes it fail). */
export const MAX_REPLY_BYTES = 500 * 1024;

/** Escapes one argument for a reply line. */
export function escapeArg(arg: string): string {
  return arg.replace(/[ \\\r\n]/g, (c) => `\\${c}`);
}

/** A reply line (without its LF) from its arguments, each escaped. */
export function formatLine(args: readonly string[]): string {
  return args.map(escapeArg).join(" ");
}

/** A framed line: its bytes (without the LF), or a line that was cut because it passed the limit. */
export type Frame = { kind: "line"; bytes: Buffer } | { kind: "too_long"; bytes: number };

/**
 * Splits a byte stream into request lines. An LF ends a line unless a backslash escapes it (an escaped LF is
 * part of an argument). A line longer than `maxBytes` is not kept: its bytes are counted and dropped until its
 * end, and it comes out as `too_long`.
 */
export class LineReader {
  private parts: Buffer[] = [];
  private length = 0;
  private escaped = false;
  private overflow = false;

  constructor(private readonly maxBytes: number) {}

  /** Feeds a chunk; returns the lines it completed. */
  push(chunk: Buffer): Frame[] {
    const frames: Frame[] = [];
    let start = 0;
    for (let i = 0; i < chunk.length; i++) {
      const b = chunk[i];
      if (this.escaped) {
        this.escaped = false;
        continue;
      }
      if (b === 0x5c) {
        this.escaped = true;
        continue;
      }
      if (b !== 0x0a) continue;
      this.take(chunk.subarray(start, i));
      start = i + 1;
      frames.push(this.finish());
    }
    this.take(chunk.subarray(start));
    return frames;
  }

  /** What is left when the input ends: a last line without its LF, if any. */
  end(): Frame[] {
    if (this.length === 0 && !this.overflow && !this.escaped) return [];
    return [this.finish()];
  }

  private take(bytes: Buffer): void {
    if (bytes.length === 0) return;
    this.length += bytes.length;
    if (this.overflow) return;
    if (this.length > this.maxBytes) {
      this.overflow = true;
      this.parts = [];
      return;
    }
    this.parts.push(Buffer.from(bytes));
  }

  private finish(): Frame {
    const frame: Frame = this.overflow
      ? { kind: "too_long", bytes: this.length }
      : { kind: "line", bytes: Buffer.concat(this.parts) };
    this.parts = [];
    this.length = 0;
    this.overflow = false;
    this.escaped = false;
    return frame;
  }
}

export type ParsedLine = { ok: true; args: string[] } | { ok: false; reason: string };

const utf8 = new TextDecoder("utf-8", { fatal: true });

/**
 * A request line's arguments. Refused: bytes that are not UTF-8, control characters other than tab (unless
 * escaped CR or LF), a backslash before anything but space, backslash, CR or LF, and a backslash ending the line.
 * A CR just before the line's end is the CRLF's and is dropped.
 */
export function parseRequest(bytes: Buffer): ParsedLine {
  let text: string;
  try {
    text = utf8.decode(bytes);
  } catch {
    return { ok: false, reason: "the line is not UTF-8 text" };
  }
  if (text.endsWith("\r") && !/(^|[^\\])(\\\\)*\\\r$/.test(text)) text = text.slice(0, -1);
  const args: string[] = [];
  let cur = "";
  for (let i = 0; i < text.length; i++) {
    const c = text[i] as string;
    if (c === "\\") {
      const next = text[i + 1];
      if (next === undefined) return { ok: false, reason: "the line ends with a lone backslash" };
      if (next !== " " && next !== "\\" && next !== "\r" && next !== "\n") {
        return {
          ok: false,
          reason: `bad escape \\${printable(next)} at character ${i + 1} (only space, backslash, CR and LF are escaped)`,
        };
      }
      cur += next;
      i++;
      continue;
    }
    if (c === " ") {
      args.push(cur);
      cur = "";
      continue;
    }
    const code = c.charCodeAt(0);
    if ((code < 0x20 && c !== "\t") || code === 0x7f) {
      return {
        ok: false,
        reason: `control character ${printable(c)} at character ${i + 1} (binary data is not a request)`,
      };
    }
    cur += c;
  }
  args.push(cur);
  return { ok: true, args };
}

/** A character as it can be shown in a message: itself when printable, else its code. */
function printable(c: string): string {
  const code = c.codePointAt(0) ?? 0;
  return code < 0x20 || code === 0x7f ? `0x${code.toString(16).padStart(2, "0")}` : c;
}

/**
 * `args` as a reply line if it fits in MAX_REPLY_BYTES with its LF; otherwise undefined (the caller answers
 * with something shorter).
 */
export function boundedLine(args: readonly string[]): string | undefined {
  const line = formatLine(args);
  return Buffer.byteLength(line, "utf8") + 1 <= MAX_REPLY_BYTES ? line : undefined;
}

/** A message cut to `max` characters (reasons from servers can be long), marked when cut. */
export function clip(message: string, max = 2000): string {
  const oneLine = message.replace(/[\r\n]+/g, " ");
  return oneLine.length <= max ? oneLine : `${oneLine.slice(0, max)}...`;
}
