/**
 * Options of a benchmark: `--help` prints its usage; an unknown or malformed option prints what is wrong and the
 * usage, and exits 2 (not a stack trace).
 */
import { type ParseArgsConfig, parseArgs } from "node:util";

export function benchArgs<const T extends ParseArgsConfig>(
  usage: string,
  config: T,
): ReturnType<typeof parseArgs<T>> {
  const argv = config.args ?? process.argv.slice(2);
  if (argv.includes("--help") || argv.includes("-h")) {
    process.stdout.write(`${usage}\n`);
    process.exit(0);
  }
  try {
    return parseArgs(config);
  } catch (err) {
    process.stderr.write(`${err instanceof Error ? err.message : String(err)}\n${usage}\n`);
    process.exit(2);
  }
}
