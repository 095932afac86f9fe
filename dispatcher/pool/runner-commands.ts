/**
 * The commands the pool sends to an instance (dispatcher/README.md, "Commands sent to an instance"). Every
 * path follows the instance root convention; nothing secret is ever part of a command line.
 */

// biome-ignore lint/suspicious/noTemplateCurlyInString: a shell parameter expansion, run by the instance's shell.
const ROOT = "${DISPATCH_VM_ROOT:-}";

const SHA256 = /^[0-9a-f]{64}$/;
/** Bundle uuids (and nothing else) go into runner command lines. */
const UUID = /^[a-z0-9]{5}-bndl-[a-z0-9]{15}$/;
/** deployRunnerDirectory is validated as an absolute path; this keeps it safe inside double quotes too. */
const SAFE_DIR = /^\/[A-Za-z0-9._/+-]*$/;

export interface RunnerCommands {
  /** `R`, quoted: `"${DISPATCH_VM_ROOT:-}<dir>/crunch-run~<sha256>"`. */
  readonly path: string;
  /** Prints `<sha256>  <path>` when the runner is present. */
  readonly checksum: string;
  /** Installs the runner from stdin (written to a temporary name, then moved into place). */
  readonly deploy: string;
  readonly list: string;
  /** Prints the `--version` line (lib/runner-protocol.ts, VERSION_LINE). */
  readonly version: string;
  detach(uuid: string): string;
  kill(uuid: string, signal?: number): string;
}

export function runnerCommands(deployRunnerDirectory: string, sha256: string): RunnerCommands {
  if (!SHA256.test(sha256)) throw new Error("runner sha256 must be 64 hex digits");
  const dir = deployRunnerDirectory.replace(/\/+$/, "") || "/";
  if (!SAFE_DIR.test(dir))
    throw new Error(`unsafe runner directory ${JSON.stringify(deployRunnerDirectory)}`);
  const base = `${ROOT}${dir === "/" ? "" : dir}`;
  const path = `"${base}/crunch-run~${sha256}"`;
  const tmp = `"${base}/crunch-run~${sha256}.tmp"`;
  const uuidOf = (uuid: string) => {
    if (!UUID.test(uuid)) throw new Error(`not a bundle uuid: ${JSON.stringify(uuid)}`);
    return uuid;
  };
  return {
    path,
    checksum: `sha256sum ${path}`,
    deploy: `mkdir -p "${base}" && cat >${tmp} && chmod 0755 ${tmp} && mv -f ${tmp} ${path}`,
    list: `${path} --list`,
    version: `${path} --version`,
    detach: (uuid) => `${path} --detach ${uuidOf(uuid)}`,
    kill: (uuid, signal = 15) => `${path} --kill ${signal} ${uuidOf(uuid)}`,
  };
}

/** True when `sha256sum` output names the expected hash. */
export function checksumMatches(stdout: string, sha256: string): boolean {
  return stdout.trim().split(/\s+/)[0] === sha256;
}
