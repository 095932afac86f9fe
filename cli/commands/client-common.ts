import { ApiClient, DEFAULT_API_URL, findToken } from "../client.ts";
import type { CliIo } from "../io.ts";

export interface ClientFlags {
  "api-url"?: string | undefined;
  "token-file"?: string | undefined;
  "data-dir"?: string | undefined;
}

export async function connect(io: CliIo, flags: ClientFlags): Promise<ApiClient> {
  const apiUrl = flags["api-url"] ?? io.env["DISPATCH_CLOUD_API_URL"] ?? DEFAULT_API_URL;
  const token = await findToken(io, {
    ...(flags["token-file"] === undefined ? {} : { tokenFile: flags["token-file"] }),
    ...(flags["data-dir"] === undefined ? {} : { dataDir: flags["data-dir"] }),
  });
  return new ApiClient({ apiUrl, token }, io.signal);
}

/** The bundle as the users' API returns it (only the fields the CLI reads). */
export interface ApiBundle {
  uuid: string;
  name: string;
  state: string;
  stateReason: string | null;
  schedulingStatus: string | null;
  image: string;
  command: string[];
  attempt: number;
  maxAttempts: number;
  priority: number;
  exitCode: number | null;
  instanceType: string | null;
  createdAt: string;
  [key: string]: unknown;
}

export const FINAL = new Set(["ready", "failed", "killed"]);

/** Lays out rows as left-aligned columns separated by two spaces. */
export function table(rows: string[][]): string[] {
  const widths: number[] = [];
  for (const row of rows) {
    for (const [i, cell] of row.entries()) widths[i] = Math.max(widths[i] ?? 0, cell.length);
  }
  return rows.map((row) =>
    row
      .map((cell, i) => (i === row.length - 1 ? cell : cell.padEnd(widths[i] ?? 0)))
      .join("  ")
      .trimEnd(),
  );
}
