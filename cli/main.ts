import { runCli } from "./cli.ts";
import type { CliIo } from "./io.ts";

/** The process entry of `dispatch-cloud` (bin/dispatch-cloud runs this file). */
const io: CliIo = {
  argv: process.argv.slice(2),
  env: process.env,
  cwd: process.cwd(),
  out: (line) => process.stdout.write(`${line}\n`),
  err: (line) => process.stderr.write(`${line}\n`),
  progress: (line) => process.stderr.write(`${line}\n`),
};
process.exitCode = await runCli(io);
