import type { CliIo } from "./io.ts";

/**
 * The process entry of `dispatch-cloud` (bin/dispatch-cloud runs this file; the one-file build starts here).
 * The same program is crunch-run on a VM: an argument list starting with an option (`--detach`, `--list`,
 * `--kill`, `--version`, ...) runs crunch-run. Both are loaded lazily so that crunch-run never pays for loading
 * the REST server and the dispatcher.
 */
async function main(argv: string[]): Promise<number> {
  if (argv[0]?.startsWith("--") === true && argv[0] !== "--help") {
    const { runCrunchRun } = await import("../crunch-run/main.ts");
    return runCrunchRun(argv);
  }
  if (argv[0] === "__local-vm") {
    // Hidden: a local VM process started by the local driver from the built artifact; it exits by itself.
    const { runLocalVm } = await import("../cloud-drivers/local/vm-main.ts");
    return new Promise<number>(() => runLocalVm(argv[1]));
  }
  // Output to a closed pipe (`dispatch-cloud config defaults | head`) ends the command quietly: whoever read
  // the output has what they wanted.
  for (const stream of [process.stdout, process.stderr]) {
    stream.on("error", (err: NodeJS.ErrnoException) => {
      if (err.code === "EPIPE") process.exit(process.exitCode ?? 0);
      throw err;
    });
  }
  const { runCli } = await import("./cli.ts");
  const io: CliIo = {
    argv,
    env: process.env,
    cwd: process.cwd(),
    out: (line) => process.stdout.write(`${line}\n`),
    err: (line) => process.stderr.write(`${line}\n`),
    progress: (line) => process.stderr.write(`${line}\n`),
  };
  const code = await runCli(io);
  // A command that has returned is done: if something it opened still holds the event loop (a server that
  // failed half-way, a timer), the process ends anyway rather than hang. Unref'd, so a clean exit is not delayed.
  setTimeout(() => process.exit(code), 3000).unref();
  return code;
}

main(process.argv.slice(2)).then(
  (code) => {
    process.exitCode = code;
  },
  (err: unknown) => {
    process.stderr.write(
      `dispatch-cloud: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`,
    );
    process.exitCode = 1;
  },
);
