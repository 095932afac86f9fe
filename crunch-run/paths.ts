/**
 * Where crunch-run keeps its files on an instance. Every path is `${DISPATCH_VM_ROOT:-}` + an absolute path,
 * so many local "VMs" can share one machine (the local driver sets DISPATCH_VM_ROOT per VM).
 */
import path from "node:path";

export interface RunnerPaths {
  /** DISPATCH_VM_ROOT, or "" on a real VM. */
  root: string;
  lockDir: string;
  logDir: string;
  workRoot: string;
  /** The file whose presence makes `--list` print `broken`. */
  brokenFile: string;
  /**
   * Written (the notice's JSON) when a spot interruption notice arrives: `--list` prints `preempted`, and no
   * new bundle starts on the instance while it exists.
   */
  preemptedFile: string;
  /** Its first line, when present, is the instance metadata service's base URL (else 169.254.169.254). */
  imdsEndpointFile: string;
  /**
   * One line per container-start failure of the runtime since the last successful start (runtime-failures.ts);
   * enough of them in a row make the instance mark itself broken.
   */
  runtimeFailuresFile: string;
  /** The process runtime's uid leases, one file per uid in use (runtime-process.ts). Root's only. */
  uidLeaseDir: string;
  /**
   * The cache of the content-addressed store's blobs on the instance (cas-cache.ts), shared by the
   * supervisors of every bundle that runs there; kept across bundles.
   */
  casCacheDir: string;
}

export function runnerPaths(env: NodeJS.ProcessEnv): RunnerPaths {
  const root = (env["DISPATCH_VM_ROOT"] ?? "").replace(/\/+$/, "");
  return {
    root,
    lockDir: `${root}/var/lock`,
    logDir: `${root}/var/log/crunch-run`,
    workRoot: `${root}/tmp/crunch-run`,
    brokenFile: `${root}/var/lock/crunch-run-broken`,
    preemptedFile: `${root}/var/lock/crunch-run-preempted`,
    imdsEndpointFile: `${root}/etc/dispatch-cloud/imds-endpoint`,
    runtimeFailuresFile: `${root}/var/lock/crunch-run-runtime-failures`,
    uidLeaseDir: `${root}/var/lock/crunch-run-uids`,
    casCacheDir: `${root}/var/cache/dispatch-cloud/cas`,
  };
}

export const lockFile = (p: RunnerPaths, uuid: string): string =>
  path.join(p.lockDir, `crunch-run-${uuid}.lock`);
export const logFile = (p: RunnerPaths, uuid: string): string => path.join(p.logDir, `${uuid}.log`);
export const workDir = (p: RunnerPaths, uuid: string, attempt: number): string =>
  path.join(p.workRoot, `${uuid}-${attempt}`);

export const BUNDLE_UUID_RE = /^[a-z0-9]{5}-bndl-[a-z0-9]{15}$/;
