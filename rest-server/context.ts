/**
 * What the REST server's routes need (routes-users.ts, routes-runner.ts, routes-tokens.ts), built once by
 * createRestServer (server.ts), which registers the routes.
 */
import type { ClaimsInFlight } from "../lib/claims-in-flight.ts";
import type { Db } from "../store/db.ts";
import type { Bundle } from "../store/types.ts";
import type { TokenCache } from "./auth.ts";
import type { BundleMinimums } from "./bundle-request.ts";
import type { BlobBackend } from "./cas/backend.ts";
import type { CasMetrics } from "./cas/metrics.ts";
import type { ReadableCache } from "./cas/readable-cache.ts";
import type { StoredOutputs } from "./cas/stored-outputs.ts";
import type { ImageResolver } from "./image-resolve.ts";
import type { LogNotifier } from "./logs.ts";
import type { OutputStore } from "./outputs.ts";
import type { SubmitLimits } from "./quotas.ts";
import type { SubmitCoalescer } from "./submit-coalescer.ts";

/** The runner artifact workers upgrade to (the file the dispatcher deploys): its bytes and their sha256. */
export interface WorkerArtifact {
  sha256: string;
  content: Buffer;
}

/** What the routes need, built once by createRestServer. */
export interface RouteContext {
  db: Db;
  clusterId: string;
  defaultMaxAttempts: number;
  nowMs(): number;
  outputs: OutputStore;
  maxOutputSize: number;
  maxOutputFiles: number;
  maxLogBytesPerStream: number;
  /**
   * A log chunk of at most this many bytes (its Content-Length) is stored without a token lookup before its body
   * (routes-runner.ts): it arrives within restServer.requestTimeout at restServer.minUploadRate, so it needs no
   * runner's allowance to be slow, which only that lookup can give.
   */
  smallLogChunk: number;
  logNotifier: LogNotifier;
  logPollInterval: number;
  bundleMinimums: BundleMinimums;
  submitLimits: SubmitLimits;
  /** Groups single submissions that no limit applies to into multi-row inserts. */
  submitCoalescer: SubmitCoalescer;
  /**
   * Told of bundle rows this server wrote, once committed: the bundles a submission created, and those a runner
   * moved (`start`, `starts`, `finish`, `preempted`, `requeue`). RestServerOptions.onBundlesWritten: in `serve`,
   * the dispatcher's queue in the same process; null without a listener. With one, a batch answered briefly
   * still reads the whole rows back from its insert, for the listener.
   */
  bundlesWritten: ((bundles: readonly Bundle[]) => void) | null;
  /**
   * The claims of a dispatcher in the same process still in flight (`serve`; null otherwise): a runner's `start`
   * waits here for its token's claim before it looks the token up (lib/claims-in-flight.ts).
   */
  claimsInFlight: ClaimsInFlight | null;
  /** Live tokens looked up in the last second (auth.ts); cleared when a token is revoked. */
  tokenCache: TokenCache;
  /** Largest body of a batch submission (restServer.maxBatchRequestBodySize). */
  maxBatchBodySize: number;
  maxTokensPerUser: number;
  /** The content-addressed store's backend (set by createRestServer before the routes are registered). */
  casBackend: BlobBackend | null;
  /** Outputs kept as manifests in the store (bundles whose runner finished with an outputManifest). */
  storedOutputs: StoredOutputs;
  /** What each user was recently found to be able to read in the store (cas/readable-cache.ts). */
  casReadable: ReadableCache;
  /** The store's metrics (runners report their staging figures at finish); null without a registry. */
  casMetrics: CasMetrics | null;
  /**
   * Submit-time image resolution, tried in order (our store first, then registries; image-resolve.ts). Empty when
   * no registry resolver is configured: the insert statements resolve images in the store on their own.
   */
  imageResolvers: ImageResolver[];
  /** Requeues for an unavailable registry that do not use up an attempt (containers.unavailableImageRequeues). */
  unavailableImageRequeues: number;
  /** The runner artifact users' workers upgrade to (rest-server/workers/); null when the server has none. */
  runnerArtifact: WorkerArtifact | null;
}
