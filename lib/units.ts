/**
 * Durations and sizes as people write them in config files and API bodies.
 *
 * Durations: one or more `<number><unit>` parts, e.g. `10s`, `1m30s`, `1.5h`, `500ms`, with units
 * ms, s, m, h, d; `0` alone is allowed. They parse to whole milliseconds (rounded). A bare number such as `10`
 * is an error: seconds or milliseconds would be a guess.
 * Sizes: `<number><unit>` with decimal units (KB = 1000 B) or binary ones (KiB = 1024 B), e.g. `4GiB`,
 * `1.5GB`, or a non-negative integer number of bytes (`1024` or `1024B`). They parse to whole bytes (rounded).
 *
 * Every parser throws DispatchCloudError("config.invalid_value") whose message says what is accepted;
 * callers re-map the code to their own context and set the path.
 */
import { DispatchCloudError } from "./errors.ts";

const DURATION_UNITS = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 } as const;
type DurationUnit = keyof typeof DURATION_UNITS;

const SIZE_UNITS = {
  B: 1,
  KB: 1e3,
  MB: 1e6,
  GB: 1e9,
  TB: 1e12,
  PB: 1e15,
  KiB: 2 ** 10,
  MiB: 2 ** 20,
  GiB: 2 ** 30,
  TiB: 2 ** 40,
  PiB: 2 ** 50,
} as const;
type SizeUnit = keyof typeof SIZE_UNITS;

export const DURATION_FORMAT = `a duration such as 10s, 1m30s, 1.5h or 500ms (units: ${Object.keys(DURATION_UNITS).join(", ")})`;
export const SIZE_FORMAT =
  `a size such as 4GiB, 512MiB or 1.5GB, or a whole number of bytes ` +
  `(units: ${Object.keys(SIZE_UNITS).join(", ")}; KB/MB/GB/TB/PB are powers of 1000, KiB/MiB/GiB/TiB/PiB of 1024)`;

const NUMBER = String.raw`(\d+(?:\.\d+)?|\.\d+)`;
const DURATION_PART = new RegExp(`${NUMBER}([a-zA-Zµ]*)`, "y");
const SIZE_RE = new RegExp(`^${NUMBER}\\s?([a-zA-Z]*)$`);

function invalid(message: string): DispatchCloudError {
  return new DispatchCloudError("config.invalid_value", message);
}

function show(value: unknown): string {
  const text = typeof value === "string" ? JSON.stringify(value) : String(value);
  return text.length > 40 ? `${text.slice(0, 37)}...` : text;
}

/** Parses a duration string to milliseconds. */
export function parseDuration(text: string): number {
  if (typeof text !== "string") {
    const hint = typeof text === "number" ? `; a bare number needs a unit, e.g. "${text}s"` : "";
    throw invalid(`must be ${DURATION_FORMAT}; got ${show(text)}${hint}`);
  }
  const s = text.trim();
  if (s === "0") return 0;
  if (s.startsWith("-")) throw invalid(`must not be negative; got ${show(text)}`);
  if (s === "") throw invalid(`must be ${DURATION_FORMAT}; got an empty string`);
  if (/^\d+(\.\d+)?$/.test(s)) {
    throw invalid(
      `must be ${DURATION_FORMAT}; got ${show(text)}, a number without a unit (write e.g. "${s}s")`,
    );
  }
  let total = 0;
  let pos = 0;
  while (pos < s.length) {
    DURATION_PART.lastIndex = pos;
    const m = DURATION_PART.exec(s);
    if (m === null) throw invalid(`must be ${DURATION_FORMAT}; got ${show(text)}`);
    const [all, num, unit] = m as unknown as [string, string, string];
    if (!(unit in DURATION_UNITS)) {
      const what = unit === "" ? "a number without a unit" : `unknown unit "${unit}"`;
      throw invalid(`${what} in ${show(text)}; valid units: ${Object.keys(DURATION_UNITS).join(", ")}`);
    }
    total += Number(num) * DURATION_UNITS[unit as DurationUnit];
    pos += all.length;
  }
  const ms = Math.round(total);
  if (!Number.isSafeInteger(ms)) throw invalid(`is too large; got ${show(text)}`);
  return ms;
}

/** Formats milliseconds as the shortest duration string parseDuration reads back to the same value. */
export function formatDuration(ms: number): string {
  if (!Number.isSafeInteger(ms) || ms < 0) {
    throw invalid(`a duration must be a non-negative whole number of milliseconds; got ${show(ms)}`);
  }
  if (ms === 0) return "0s";
  let rest = ms;
  let out = "";
  for (const unit of ["h", "m", "s", "ms"] as const) {
    const n = Math.floor(rest / DURATION_UNITS[unit]);
    if (n > 0) out += `${n}${unit}`;
    rest -= n * DURATION_UNITS[unit];
  }
  return out;
}

/** Parses a size (string with unit, or a whole number of bytes) to bytes. */
export function parseSize(value: string | number): number {
  if (typeof value === "number") {
    if (!Number.isFinite(value)) throw invalid(`must be ${SIZE_FORMAT}; got ${show(value)}`);
    if (value < 0) throw invalid(`must not be negative; got ${show(value)}`);
    if (!Number.isInteger(value))
      throw invalid(`a size without a unit must be a whole number of bytes; got ${value}`);
    if (!Number.isSafeInteger(value)) throw invalid(`is too large; got ${show(value)}`);
    return value;
  }
  if (typeof value !== "string") throw invalid(`must be ${SIZE_FORMAT}; got ${show(value)}`);
  const s = value.trim();
  if (s.startsWith("-")) throw invalid(`must not be negative; got ${show(value)}`);
  const m = SIZE_RE.exec(s);
  if (m === null) throw invalid(`must be ${SIZE_FORMAT}; got ${show(value)}`);
  const [, num, rawUnit] = m as unknown as [string, string, string];
  const unit = rawUnit === "" ? "B" : rawUnit;
  if (!(unit in SIZE_UNITS)) {
    throw invalid(
      `unknown size unit "${rawUnit}" in ${show(value)}; valid units: ${Object.keys(SIZE_UNITS).join(", ")}`,
    );
  }
  if (unit === "B" && num.includes(".")) {
    throw invalid(`a size in bytes must be a whole number; got ${show(value)}`);
  }
  const bytes = Math.round(Number(num) * SIZE_UNITS[unit as SizeUnit]);
  if (!Number.isSafeInteger(bytes)) throw invalid(`is too large; got ${show(value)}`);
  return bytes;
}

const FORMAT_UNITS: SizeUnit[] = ["PiB", "TiB", "GiB", "MiB", "KiB", "PB", "TB", "GB", "MB", "KB"];

/** Formats bytes as a short size string that parseSize reads back to exactly the same value. */
export function formatSize(bytes: number): string {
  if (!Number.isSafeInteger(bytes) || bytes < 0) {
    throw invalid(`a size must be a non-negative whole number of bytes; got ${show(bytes)}`);
  }
  if (bytes === 0) return "0B";
  // The largest unit that divides exactly (binary preferred), else bytes.
  for (const unit of FORMAT_UNITS) {
    if (bytes % SIZE_UNITS[unit] === 0) return `${bytes / SIZE_UNITS[unit]}${unit}`;
  }
  return `${bytes}B`;
}
