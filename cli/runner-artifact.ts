import { mkdir, readdir, readFile, rename, stat, unlink, writeFile } from "node:fs/promises";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { artifactOf, type RunnerArtifact } from "../dispatcher/runner-artifact.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import type { Logger } from "../lib/logger.ts";
import { isSea } from "../lib/self.ts";

export interface LoadRunnerArtifactOptions {
  /** cloud.deployRunnerBinary: a file to deploy instead of this program ("" = this program). */
  deployRunnerBinary: string;
  logger: Logger;
}

/** Where the running code lives: this module's file, or (one-file build, SEA) the artifact it is part of. */
function ownFile(): string {
  return fileURLToPath(import.meta.url);
}

/** True when this module runs from TypeScript sources (tsx, vitest), not from a built artifact. */
export function runningFromSources(): boolean {
  return !isSea() && new URL(import.meta.url).pathname.endsWith(".ts");
}

async function readArtifact(file: string, what: string, configPath?: string): Promise<RunnerArtifact> {
  try {
    return artifactOf(await readFile(file));
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code ?? "error";
    throw new DispatchCloudError("config.unreadable_file", `cannot read ${what} ${file} (${code})`, {
      ...(configPath === undefined ? {} : { path: configPath }),
      cause: err,
    });
  }
}

export async function loadRunnerArtifact(opts: LoadRunnerArtifactOptions): Promise<RunnerArtifact> {
  const log = opts.logger.child({ component: "runner-artifact" });
  let artifact: RunnerArtifact;
  let source: string;
  if (opts.deployRunnerBinary !== "") {
    source = path.resolve(opts.deployRunnerBinary);
    artifact = await readArtifact(source, "the runner binary", "cloud.deployRunnerBinary");
  } else if (isSea()) {
    source = process.execPath;
    artifact = await readArtifact(source, "this program's executable");
  } else if (!runningFromSources()) {
    source = ownFile();
    artifact = await readArtifact(source, "this program's file");
  } else {
    const built = await buildFromSources(log);
    source = built.file;
    artifact = built.artifact;
  }
  log.info({ source, bytes: artifact.content.length, sha256: artifact.sha256 }, "runner artifact loaded");
  return artifact;
}

interface CacheManifest {
  /** The artifact file name in the cache directory. */
  file: string;
  /** Every input of the build with its size and mtime when it was built. */
  inputs: Record<string, { size: number; mtimeMs: number }>;
}

async function fingerprint(files: string[]): Promise<CacheManifest["inputs"] | null> {
  const out: CacheManifest["inputs"] = {};
  try {
    for (const file of files) {
      const st = await stat(file);
      out[file] = { size: st.size, mtimeMs: st.mtimeMs };
    }
  } catch {
    return null;
  }
  return out;
}

function sameInputs(a: CacheManifest["inputs"], b: CacheManifest["inputs"] | null): boolean {
  if (b === null) return false;
  const keys = Object.keys(a);
  if (keys.length !== Object.keys(b).length) return false;
  return keys.every((k) => b[k] !== undefined && b[k].size === a[k]!.size && b[k].mtimeMs === a[k]!.mtimeMs);
}

/**
 * The one-file artifact of these sources: the cached build when none of its inputs changed since, else a
 * fresh build (written to the cache under its content hash, then the manifest).
 */
async function buildFromSources(log: Logger): Promise<{ file: string; artifact: RunnerArtifact }> {
  const root = path.resolve(path.dirname(ownFile()), "..");
  const dir = path.join(root, "node_modules", ".cache", "dispatch-cloud");
  const manifestFile = path.join(dir, "runner-artifact.json");
  try {
    const manifest = JSON.parse(await readFile(manifestFile, "utf8")) as CacheManifest;
    if (sameInputs(manifest.inputs, await fingerprint(Object.keys(manifest.inputs)))) {
      const file = path.join(dir, manifest.file);
      return { file, artifact: artifactOf(await readFile(file)) };
    }
  } catch {
    // No usable cache: build.
  }
  // Not a literal specifier, so that no bundler pulls the build script (and esbuild) into an artifact.
  const buildScript = new URL("../scripts/build.ts", import.meta.url).href;
  const { buildArtifact } = (await import(buildScript)) as typeof import("../scripts/build.ts");
  const started = Date.now();
  const built = await buildArtifact(root);
  const artifact = artifactOf(built.content);
  const name = `dispatch-cloud-${artifact.sha256.slice(0, 16)}.cjs`;
  const file = path.join(dir, name);
  await mkdir(dir, { recursive: true });
  await writeAtomic(file, built.content, 0o755);
  const inputs = await fingerprint(built.inputs);
  if (inputs !== null) {
    const manifest: CacheManifest = { file: name, inputs };
    await writeAtomic(manifestFile, `${JSON.stringify(manifest)}\n`, 0o644);
  }
  log.info({ file, ms: Date.now() - started }, "built the runner artifact from sources");
  await pruneOldArtifacts(dir, name);
  return { file, artifact };
}

/** Removes artifacts of older sources (over an hour old: another process may still be reading one). */
async function pruneOldArtifacts(dir: string, keep: string): Promise<void> {
  for (const name of await readdir(dir).catch(() => [])) {
    if (name === keep || !/^dispatch-cloud-[0-9a-f]{16}\.cjs$/.test(name)) continue;
    const file = path.join(dir, name);
    try {
      if (Date.now() - (await stat(file)).mtimeMs > 3_600_000) await unlink(file);
    } catch {
      // Another process pruned it first.
    }
  }
}

async function writeAtomic(file: string, content: Buffer | string, mode: number): Promise<void> {
  const tmp = `${file}.tmp-${process.pid}-${Math.random().toString(36).slice(2)}`;
  await writeFile(tmp, content, { mode });
  await rename(tmp, file);
}
