/**
 * How this program re-runs itself: crunch-run's `--detach` starts its supervisor this way, and the local
 * driver starts VM processes this way when it runs from the built artifact. Under a Node single executable
 * application the executable is the whole program; otherwise it is node, its flags (the tsx loader when run
 * from sources) and the script.
 */
let sea: boolean | undefined;

/** True when this process is a Node single executable application (`npm run build:sea`). */
export function isSea(): boolean {
  if (sea === undefined) {
    try {
      sea = process.getBuiltinModule("node:sea").isSea();
    } catch {
      sea = false;
    }
  }
  return sea;
}

/** The argv prefix that starts this same program again (append the program's own arguments). */
export function selfCommand(): string[] {
  if (isSea()) return [process.execPath];
  const script = process.argv[1];
  if (script === undefined) throw new Error("cannot tell which script this process runs");
  return [process.execPath, ...process.execArgv, script];
}
