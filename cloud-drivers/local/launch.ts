/**
 * How to start a VM process (vm-main) fast. Run from TypeScript sources through the tsx loader, a fresh Node
 * process spends most of a second starting the loader; so the driver bundles vm-main and its own modules
 * into one CommonJS file with esbuild (packages stay external) under node_modules/.cache/dispatch-cloud,
 * named by its content hash, and runs that with plain `node`. Where that cannot be done, it falls back to
 * the tsx loader. Run from the built artifact (dist/dispatch-cloud.cjs or the SEA executable), there is no
 * vm-main file: VM processes are the artifact itself, `selfCommand() __local-vm <dir>`.
 */
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readdirSync, renameSync, statSync, unlinkSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import type { Logger } from "../../lib/logger.ts";
import { isSea, selfCommand } from "../../lib/self.ts";

const VM_MAIN = fileURLToPath(new URL("./vm-main.ts", import.meta.url));

/** The hidden CLI command of the built artifact that runs a local VM (cli/main.ts). */
export const LOCAL_VM_COMMAND = "__local-vm";

/**
 * Matches the argument that marks a VM process's command line: the vm-main script (from sources), or the
 * hidden command of the built artifact.
 */
export const VM_MAIN_PATTERN = /(^|\/)vm-main(-[0-9a-f]+)?\.(ts|js|cjs|mjs)$|^__local-vm$/;

/**
 * The arguments (after process.execPath, before the VM directory) that run a local VM: this artifact's own
 * hidden command when running from the built artifact, else vm-main bundled (or through tsx).
 */
export async function vmMainArgs(logger: Logger): Promise<string[]> {
  if (isSea() || !new URL(import.meta.url).pathname.endsWith(".ts")) {
    const [exec, ...args] = selfCommand();
    if (exec !== process.execPath) throw new Error(`cannot start VM processes: ${exec} is not this program`);
    return [...args, LOCAL_VM_COMMAND];
  }
  const require = createRequire(import.meta.url);
  try {
    const { build } = (await import("esbuild")) as typeof import("esbuild");
    const result = await build({
      entryPoints: [VM_MAIN],
      bundle: true,
      packages: "external",
      platform: "node",
      format: "cjs",
      target: "node20",
      write: false,
      logLevel: "silent",
    });
    const code = result.outputFiles[0]?.contents;
    if (code === undefined) throw new Error("esbuild produced no output");
    const hash = createHash("sha256").update(code).digest("hex").slice(0, 16);
    // In node_modules, so the bundle's require("ssh2") etc. find the installed packages.
    const nodeModules = path.resolve(path.dirname(require.resolve("ssh2/package.json")), "..");
    const dir = path.join(nodeModules, ".cache", "dispatch-cloud");
    const file = path.join(dir, `vm-main-${hash}.cjs`);
    if (!existsSync(file)) {
      mkdirSync(dir, { recursive: true });
      const tmp = `${file}.tmp-${process.pid}`;
      writeFileSync(tmp, code);
      renameSync(tmp, file);
      pruneOldBundles(dir, file);
    }
    return [file];
  } catch (err) {
    logger.warn({ err }, "cannot bundle vm-main; VMs start through the tsx loader (slower)");
    return ["--import", pathToFileURL(require.resolve("tsx")).href, VM_MAIN];
  }
}

/** Removes bundles of older code (running VMs have long since read theirs). */
function pruneOldBundles(dir: string, keep: string): void {
  for (const name of readdirSync(dir)) {
    const file = path.join(dir, name);
    if (file === keep || !VM_MAIN_PATTERN.test(file)) continue;
    try {
      if (Date.now() - statSync(file).mtimeMs > 3_600_000) unlinkSync(file);
    } catch {
      // Another process pruned it first.
    }
  }
}
