import { spawnSync } from "node:child_process";

/** `promtool check metrics` (Debian's `prometheus` package) on a Prometheus exposition text. */
export function promtool(text: string): { status: number | null; output: string } {
  const r = spawnSync("promtool", ["check", "metrics"], { input: text, encoding: "utf8" });
  if (r.error !== undefined) {
    throw new Error(
      `cannot run promtool (${r.error.message}): apt-get install prometheus (or run scripts/test-services.sh as root)`,
    );
  }
  return { status: r.status, output: `${r.stdout}${r.stderr}` };
}
