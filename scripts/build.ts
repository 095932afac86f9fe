/**
 * The one-file build of dispatch-cloud (the CLI, the REST server, the dispatcher and crunch-run):
 *
 *   npm run build      -> dist/dispatch-cloud.cjs  (CommonJS behind a two-line launcher, executable)
 *   npm run build:sea  -> dist/dispatch-cloud      (a Node single executable application of that file)
 *
 * What goes into the file and how (`buildArtifact`, also used by cli/runner-artifact.ts when the
 * dispatcher runs from TypeScript sources, so both deploy the same program):
 * - esbuild bundles cli/main.ts with every package; the CLI and crunch-run are loaded by dynamic import, which
 *   esbuild turns into lazily initialised modules, so crunch-run modes do not load the dispatcher.
 * - `import.meta.url` becomes the URL of the file itself (under SEA, of the executable) with the fragment
 *   `#bundled`: relative URLs resolve beside the file, and the "run directly" idiom
 *   `import.meta.url === pathToFileURL(process.argv[1]).href` stays false for every module inside it.
 * - store/migrations-embedded.ts is replaced by a generated module holding the SQL migrations.
 * - PGlite's wasm, initdb wasm and file-system bundle (gzip, base64) go into a comment after the code (the SEA:
 *   an asset); the generated store/pglite-assets.ts reads them back when a PGlite database opens.
 * - native addons (ssh2's optional crypto binding, cpu-features) are left out: a stub that throws, which
 *   ssh2 catches and then uses its JavaScript code.
 * - the cloud SDKs (LAZY_GROUPS: AWS for the ec2 driver, Azure for the azure driver; about 8 MiB of code) are
 *   bundled apart, gzipped, and carried like PGlite's files (trailer comments, or SEA assets): V8 would otherwise
 *   parse them at every start of every command, crunch-run included, which never uses them. The drivers' imports
 *   of those packages become a module that compiles its group on first use.
 */
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import {
  chmodSync,
  copyFileSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  renameSync,
  rmSync,
  writeFileSync,
} from "node:fs";
import { readFile } from "node:fs/promises";
import { createRequire, isBuiltin } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { gzipSync } from "node:zlib";
import type { BuildOptions, Plugin } from "esbuild";

/** The repository root (this file is scripts/build.ts). */
export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
export const DIST = path.join(ROOT, "dist");
export const ARTIFACT_NAME = "dispatch-cloud.cjs";
export const SEA_NAME = "dispatch-cloud";

/** The name import.meta.url is replaced with; the banner defines it. */
const META_URL = "__dispatchCloudFileUrl";
/** The function packages' `import("<node built-in>")` calls are turned into; the banner defines it. */
const IMPORT_BUILTIN = "__dispatchCloudImportBuiltin";

const SQL_FILE = /^\d+_[a-z0-9_]+\.sql$/;

/** The module holding the migrations, as store/migrations-embedded.ts's replacement. */
function migrationsModule(root: string): string {
  const dir = path.join(root, "store", "migrations");
  const migrations = readdirSync(dir)
    .filter((f) => SQL_FILE.test(f))
    .sort()
    .map((name) => ({ name, sql: readFileSync(path.join(dir, name), "utf8") }));
  return `export const EMBEDDED_MIGRATIONS = ${JSON.stringify(migrations)};\n`;
}

/** PGlite's files the artifact carries, in this order. */
const PGLITE_FILES = ["pglite.wasm", "initdb.wasm", "pglite.data"] as const;
/** Starts the comment at the end of the .cjs that holds PGlite's files (gzip, base64). */
export const PGLITE_TRAILER_MARKER = "/*DISPATCH_CLOUD_PGLITE_ASSETS:";
/** The name of the SEA asset holding the same gzip bytes. */
export const PGLITE_SEA_ASSET = "pglite-assets";

/** Packages bundled apart and loaded on first use, by group (the drivers that use them load lazily too). */
export const LAZY_GROUPS: Readonly<Record<string, readonly string[]>> = {
  aws: ["@aws-sdk/client-ec2"],
  azure: ["@azure/arm-compute", "@azure/arm-network", "@azure/identity"],
};
/** Starts a trailer comment holding one lazy group's code (gzip, base64): `<marker><group>:<base64>*\/`. */
export const LAZY_TRAILER_MARKER = "/*DISPATCH_CLOUD_LAZY_MODULE:";
/** The SEA asset holding a lazy group's gzipped code. */
export const lazySeaAsset = (group: string): string => `lazy-${group}`;
const LAZY_LOADER = "dispatch-cloud:lazy-loader";

interface LazyGroup {
  name: string;
  gz: Buffer;
  inputs: string[];
}

/** What every bundle of the build shares: one CommonJS file for Node 20, in memory, with its metafile. */
const BUNDLE_OPTIONS = {
  bundle: true,
  platform: "node",
  format: "cjs",
  target: "node20",
  write: false,
  minifySyntax: true,
  legalComments: "none",
  logLevel: "silent",
  metafile: true,
} as const satisfies BuildOptions;

/** Bundles one lazy group: a CommonJS module whose exports are `{ "<package>": <its exports>, ... }`. */
async function buildLazyGroup(root: string, name: string, packages: readonly string[]): Promise<LazyGroup> {
  const { build } = await import("esbuild");
  const result = await build({
    absWorkingDir: root,
    stdin: {
      contents: `module.exports = {${packages.map((p) => `${JSON.stringify(p)}: require(${JSON.stringify(p)})`).join(", ")}};`,
      resolveDir: root,
      sourcefile: `lazy-${name}.cjs`,
      loader: "js",
    },
    ...BUNDLE_OPTIONS,
  });
  const out = result.outputFiles?.[0];
  if (out === undefined) throw new Error(`esbuild produced no output for the lazy group ${name}`);
  return {
    name,
    gz: gzipSync(Buffer.from(out.contents), { level: 6 }),
    inputs: Object.keys(result.metafile?.inputs ?? {})
      .filter((p) => !p.includes(":") && !p.startsWith("<"))
      .map((p) => path.resolve(root, p)),
  };
}

/** The module that compiles a lazy group (from the SEA asset or the file's trailer) on first use. */
function lazyLoaderModule(): string {
  return `"use strict";
const groups = new Map();
function payload(group) {
  const sea = require("node:sea");
  if (sea.isSea()) return Buffer.from(sea.getAsset("lazy-" + group));
  const text = require("node:fs").readFileSync(__filename);
  const marker = ${JSON.stringify(LAZY_TRAILER_MARKER)} + group + ":";
  const start = text.lastIndexOf(marker);
  const end = start < 0 ? -1 : text.indexOf("*/", start);
  if (end < 0) throw new Error(__filename + " has lost the " + group + " cloud SDK built into it; rebuild it");
  return Buffer.from(text.subarray(start + marker.length, end).toString("latin1"), "base64");
}
exports.lazyGroup = function lazyGroup(group) {
  let exported = groups.get(group);
  if (exported === undefined) {
    const Module = require("node:module");
    const code = require("node:zlib").gunzipSync(payload(group)).toString("utf8");
    const name = __filename + "#lazy-" + group;
    const m = new Module(name, module);
    m.filename = name;
    m.paths = [];
    m._compile(code, name);
    exported = m.exports;
    groups.set(group, exported);
  }
  return exported;
};
`;
}

function pgliteDistDir(root: string): string {
  const require = createRequire(path.join(root, "package.json"));
  return path.dirname(require.resolve("@electric-sql/pglite"));
}

/**
 * PGlite's files, concatenated and gzipped. They do not go into the code as string literals: V8 would scan
 * 20 MB of literals at every start. The .cjs carries them in a comment after the code, which the PGlite
 * opener reads back from the file; the SEA carries them as an asset.
 */
function pglitePayload(root: string): { gz: Buffer; lengths: number[]; sha256: string } {
  const dist = pgliteDistDir(root);
  const parts = PGLITE_FILES.map((f) => readFileSync(path.join(dist, f)));
  const raw = Buffer.concat(parts);
  return {
    gz: gzipSync(raw, { level: 6 }),
    lengths: parts.map((p) => p.length),
    sha256: createHash("sha256").update(raw).digest("hex"),
  };
}

/** The module replacing store/pglite-assets.ts: finds the payload (SEA asset or trailer) on first use. */
function pgliteAssetsModule(payload: { lengths: number[]; sha256: string }): string {
  return `import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import * as sea from "node:sea";
import { fileURLToPath } from "node:url";
import { gunzipSync } from "node:zlib";
const LENGTHS = ${JSON.stringify(payload.lengths)};
const SHA256 = ${JSON.stringify(payload.sha256)};
let assets;
function payload() {
  if (sea.isSea()) return Buffer.from(sea.getAsset(${JSON.stringify(PGLITE_SEA_ASSET)}));
  const file = fileURLToPath(import.meta.url);
  const text = readFileSync(file);
  const marker = text.lastIndexOf(${JSON.stringify(PGLITE_TRAILER_MARKER)});
  const end = text.lastIndexOf("*/");
  if (marker < 0 || end < marker) throw new Error(file + " has lost the PGlite files built into it; rebuild it");
  return Buffer.from(text.subarray(marker + ${PGLITE_TRAILER_MARKER.length}, end).toString("latin1"), "base64");
}
async function load() {
  const raw = gunzipSync(payload());
  if (createHash("sha256").update(raw).digest("hex") !== SHA256) throw new Error("the PGlite files built into this program are damaged; rebuild it");
  const part = (i) => raw.subarray(LENGTHS.slice(0, i).reduce((a, b) => a + b, 0), LENGTHS.slice(0, i + 1).reduce((a, b) => a + b, 0));
  const [pgliteWasmModule, initdbWasmModule] = await Promise.all([WebAssembly.compile(part(0)), WebAssembly.compile(part(1))]);
  return { pgliteWasmModule, initdbWasmModule, fsBundle: new Blob([part(2)]) };
}
export function pgliteAssets() {
  assets ??= load();
  return assets;
}
`;
}

function embedPlugin(root: string, pglite: { lengths: number[]; sha256: string }): Plugin {
  const replaced = new Map<string, () => string>([
    [path.join(root, "store", "migrations-embedded.ts"), () => migrationsModule(root)],
    [path.join(root, "store", "pglite-assets.ts"), () => pgliteAssetsModule(pglite)],
  ]);
  return {
    name: "dispatch-cloud-embed",
    setup(build) {
      build.onLoad({ filter: /\.ts$/ }, (args) => {
        const generate = replaced.get(args.path);
        if (generate === undefined) return undefined;
        return {
          contents: generate(),
          loader: "js",
          resolveDir: path.dirname(args.path),
          watchFiles: [path.join(root, "store", "migrations")],
        };
      });
      // A SEA's main script cannot import(): packages' dynamic imports of Node built-ins become require()
      // through a function of the banner (a plain `require` could be shadowed: PGlite declares its own).
      build.onLoad({ filter: /[\\/]node_modules[\\/].*\.m?js$/ }, async (args) => {
        const text = await readFile(args.path, "utf8");
        if (!text.includes("import(")) return undefined;
        let changed = false;
        const contents = text.replace(/\bimport\((["'])([a-z_:/]+)\1\)/g, (call, _q: string, id: string) => {
          if (!isBuiltin(id)) return call;
          changed = true;
          return `${IMPORT_BUILTIN}(${JSON.stringify(id)})`;
        });
        return changed ? { contents, loader: "js", resolveDir: path.dirname(args.path) } : undefined;
      });
      // The cloud SDKs: a module that takes the package from its lazy group, compiled on first use.
      const lazy = new Map(
        Object.entries(LAZY_GROUPS).flatMap(([group, packages]) => packages.map((p) => [p, group] as const)),
      );
      build.onResolve({ filter: /^@(aws-sdk|azure)\// }, (args) =>
        lazy.has(args.path) ? { path: args.path, namespace: "lazy-package" } : undefined,
      );
      build.onLoad({ filter: /.*/, namespace: "lazy-package" }, (args) => ({
        contents: `module.exports = require(${JSON.stringify(LAZY_LOADER)}).lazyGroup(${JSON.stringify(lazy.get(args.path))})[${JSON.stringify(args.path)}];`,
        loader: "js",
      }));
      build.onResolve({ filter: /^dispatch-cloud:lazy-loader$/ }, () => ({
        path: LAZY_LOADER,
        namespace: "lazy-loader",
      }));
      build.onLoad({ filter: /.*/, namespace: "lazy-loader" }, () => ({
        contents: lazyLoaderModule(),
        loader: "js",
      }));
      // Native addons cannot live in one file: a module that throws, as a missing optional addon does.
      build.onResolve({ filter: /\.node$|^cpu-features$/ }, (args) => ({
        path: args.path,
        namespace: "native-addon-left-out",
      }));
      build.onLoad({ filter: /.*/, namespace: "native-addon-left-out" }, (args) => ({
        contents: `throw new Error(${JSON.stringify(`${args.path}: native addon left out of the one-file build`)});`,
        loader: "js",
      }));
    },
  };
}

/**
 * The artifact's first two lines: a shell script and JavaScript at once. Run as a program (`./file`, or as
 * crunch-run on an instance), /bin/sh reads line 2 as `":"` (a no-op) and then starts node with a few lines that
 * compile the file as CommonJS whatever is around it: an enclosing package.json's `"type": "module"`, a name
 * ending in .mjs or .js, or NODE_OPTIONS (unset first: `--experimental-default-type=module`, `--import` loaders)
 * cannot change how it loads. Node (`node file.cjs`) reads line 1 as a hashbang and line 2 as a string
 * statement and a comment. The code keeps argv as node would give it to a script (argv[1] = the file, absolute),
 * so the program re-runs itself (lib/self.ts) through the same lines.
 */
export const ARTIFACT_LAUNCHER: readonly string[] = [
  "#!/bin/sh",
  `":" //; unset NODE_OPTIONS; exec node --input-type=commonjs -e '${[
    'const p=require("path"),f=p.resolve(process.argv[1]),M=require("module"),m=new M(f,null);',
    "process.argv[1]=f;m.filename=f;m.paths=M._nodeModulePaths(p.dirname(f));",
    'm._compile(require("fs").readFileSync(f,"utf8"),f)',
  ].join("")}' "$0" "$@"`,
];

/**
 * The esbuild options of the one-file artifact (shared by `npm run build` and loadRunnerArtifact). `pglite`
 * describes the PGlite payload the generated store/pglite-assets.ts expects.
 */
export function artifactBuildOptions(
  root: string,
  pglite: { lengths: number[]; sha256: string },
): BuildOptions {
  return {
    absWorkingDir: root,
    entryPoints: [path.join(root, "cli", "main.ts")],
    ...BUNDLE_OPTIONS,
    // Only imported on the from-sources paths (building vm-main, building this artifact).
    external: ["esbuild"],
    define: { "import.meta.url": META_URL },
    banner: {
      js: [
        ...ARTIFACT_LAUNCHER,
        `var ${META_URL} = require("node:url").pathToFileURL(__filename).href + "#bundled";`,
        `var ${IMPORT_BUILTIN} = (id) => Promise.resolve().then(() => { const m = require(id); return { ...m, default: m }; });`,
      ].join("\n"),
    },
    plugins: [embedPlugin(root, pglite)],
  };
}

export interface BuiltArtifact {
  /** The whole .cjs: the code, then PGlite's files in a trailing comment. */
  content: Buffer;
  /** The code alone (the SEA's main script). */
  code: Buffer;
  /** PGlite's files, gzipped (the SEA's asset). */
  pgliteGz: Buffer;
  /** The lazy groups' code, gzipped (the SEA's `lazy-<group>` assets). */
  lazyGz: Record<string, Buffer>;
  /** Every file the build read (absolute paths), for cache validation. */
  inputs: string[];
}

/** Builds the one-file artifact in memory. */
export async function buildArtifact(root: string = ROOT): Promise<BuiltArtifact> {
  const { build } = await import("esbuild");
  const pglite = pglitePayload(root);
  let result: Awaited<ReturnType<typeof build>>;
  try {
    result = await build(artifactBuildOptions(root, pglite));
  } catch (err) {
    const errors = (err as { errors?: { text: string; location?: { file: string; line: number } | null }[] })
      .errors;
    if (errors === undefined) throw err;
    const lines = errors.map(
      (e) => `${e.location ? `${e.location.file}:${e.location.line}: ` : ""}${e.text}`,
    );
    throw new Error(`esbuild failed:\n  ${lines.join("\n  ")}`, { cause: err });
  }
  const out = result.outputFiles?.[0];
  if (out === undefined) throw new Error("esbuild produced no output");
  const code = Buffer.from(out.contents);
  const lazy = await Promise.all(
    Object.entries(LAZY_GROUPS).map(([name, packages]) => buildLazyGroup(root, name, packages)),
  );
  // PGlite's trailer stays last: its reader takes the file's last `*/` as its end.
  const trailer = Buffer.from(
    [
      "",
      ...lazy.map((g) => `${LAZY_TRAILER_MARKER}${g.name}:${g.gz.toString("base64")}*/`),
      `${PGLITE_TRAILER_MARKER}${pglite.gz.toString("base64")}*/`,
      "",
    ].join("\n"),
    "latin1",
  );
  const inputs = Object.keys(result.metafile?.inputs ?? {})
    .filter((p) => !p.includes(":"))
    .map((p) => path.resolve(root, p));
  // The embedded files are read by the plugin and pglitePayload, not by esbuild: list them too.
  const migrations = path.join(root, "store", "migrations");
  inputs.push(
    ...lazy.flatMap((g) => g.inputs),
    ...PGLITE_FILES.map((f) => path.join(pgliteDistDir(root), f)),
    ...readdirSync(migrations)
      .filter((f) => SQL_FILE.test(f))
      .map((f) => path.join(migrations, f)),
  );
  return {
    content: Buffer.concat([code, trailer]),
    code,
    pgliteGz: pglite.gz,
    lazyGz: Object.fromEntries(lazy.map((g) => [g.name, g.gz])),
    inputs: [...new Set(inputs)].sort(),
  };
}

function writeExecutable(file: string, content: Buffer): void {
  const tmp = `${file}.tmp-${process.pid}`;
  writeFileSync(tmp, content, { mode: 0o755 });
  chmodSync(tmp, 0o755);
  renameSync(tmp, file);
}

/** Writes dist/dispatch-cloud.cjs (mode 0755); returns its path and the build. */
export async function buildCjs(outDir: string = DIST): Promise<{ file: string; built: BuiltArtifact }> {
  const built = await buildArtifact();
  mkdirSync(outDir, { recursive: true });
  const file = path.join(outDir, ARTIFACT_NAME);
  writeExecutable(file, built.content);
  return { file, built };
}

/** The NODE_SEA_FUSE sentinel postject flips (node's documented value). */
const SEA_FUSE = "NODE_SEA_FUSE_fce680ab2cc467b6e072b8b5df1996b2";

/**
 * Makes dist/dispatch-cloud from the .cjs: the SEA blob (node --experimental-sea-config), a copy of this
 * node, the blob injected with postject. Returns the executable's path.
 */
export async function buildSea(outDir: string = DIST): Promise<string> {
  const { built } = await buildCjs(outDir);
  const main = path.join(outDir, "sea-main.cjs");
  const asset = path.join(outDir, `${PGLITE_SEA_ASSET}.gz`);
  const blob = path.join(outDir, "dispatch-cloud.blob");
  const seaConfig = path.join(outDir, "sea-config.json");
  writeFileSync(main, built.code);
  writeFileSync(asset, built.pgliteGz);
  const lazyAssets = Object.entries(built.lazyGz).map(([group, gz]) => {
    const file = path.join(outDir, `${lazySeaAsset(group)}.gz`);
    writeFileSync(file, gz);
    return [lazySeaAsset(group), file] as const;
  });
  writeFileSync(
    seaConfig,
    `${JSON.stringify(
      {
        main,
        output: blob,
        disableExperimentalSEAWarning: true,
        useCodeCache: true,
        assets: { [PGLITE_SEA_ASSET]: asset, ...Object.fromEntries(lazyAssets) },
      },
      null,
      2,
    )}\n`,
  );
  execFileSync(process.execPath, ["--experimental-sea-config", seaConfig], { stdio: "inherit" });
  const exe = path.join(outDir, SEA_NAME);
  const tmp = `${exe}.tmp-${process.pid}`;
  copyFileSync(process.execPath, tmp);
  chmodSync(tmp, 0o755);
  const postject = "postject"; // untyped package
  const { inject } = (await import(postject)) as {
    inject: (file: string, name: string, data: Buffer, opts: { sentinelFuse: string }) => Promise<void>;
  };
  await inject(tmp, "NODE_SEA_BLOB", readFileSync(blob), { sentinelFuse: SEA_FUSE });
  renameSync(tmp, exe);
  for (const f of [main, asset, blob, ...lazyAssets.map(([, file]) => file)]) rmSync(f, { force: true });
  return exe;
}

/** The median wall time (ms) of 5 runs of a command, and its output. */
function timeRuns(command: string[]): { ms: number; stdout: string } {
  const times: number[] = [];
  let stdout = "";
  for (let i = 0; i < 5; i++) {
    const started = process.hrtime.bigint();
    stdout = execFileSync(command[0]!, command.slice(1), { encoding: "utf8" }).trim();
    times.push(Number(process.hrtime.bigint() - started) / 1e6);
  }
  times.sort((x, y) => x - y);
  return { ms: Math.round(times[2]!), stdout };
}

/** Size, and the time `--version` takes beside a bare `node -e 0`, for the build output. */
function measure(command: string[], file: string): string {
  const size = readFileSync(file).length;
  const version = timeRuns([...command, "--version"]);
  const bare = timeRuns([process.execPath, "-e", "0"]);
  return (
    `${path.relative(process.cwd(), file)}: ${(size / 1024 / 1024).toFixed(1)} MiB; ` +
    `--version (${version.stdout}) takes ${version.ms} ms (node -e 0: ${bare.ms} ms)`
  );
}

async function main(args: string[]): Promise<void> {
  const started = Date.now();
  if (args.includes("--sea")) {
    const exe = await buildSea();
    process.stdout.write(`built in ${Date.now() - started} ms\n${measure([exe], exe)}\n`);
  } else {
    const { file } = await buildCjs();
    process.stdout.write(`built in ${Date.now() - started} ms\n${measure([file], file)}\n`);
  }
}

if (process.argv[1] !== undefined && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  main(process.argv.slice(2)).catch((err: unknown) => {
    process.stderr.write(`build failed: ${err instanceof Error ? err.message : String(err)}\n`);
    process.exitCode = 1;
  });
}
