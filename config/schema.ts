/**
 * The one config schema: it gives the TypeScript type (Config), the validation (with messages that name the
 * accepted values) and the defaults. Durations decode to milliseconds and sizes to bytes through TypeBox
 * Transform types; secrets stay references (see secrets.ts).
 *
 * Annotations used beside JSON Schema: `description` (meaning, also the comment in defaults.yml), `expected`
 * (accepted values, for messages), `unit` ("duration" | "size" | "secret"), `secret` (never echo the value),
 * `example` (shown commented out in defaults.yml for optional objects without a default).
 */
import { isIP } from "node:net";
import {
  FormatRegistry,
  type StaticDecode,
  type TLiteral,
  type TSchema,
  type TUnsafe,
  Type,
} from "@sinclair/typebox";
import {
  DURATION_FORMAT,
  formatDuration,
  formatSize,
  parseDuration,
  parseSize,
  SIZE_FORMAT,
} from "../lib/units.ts";
import { MAX_TAGS, TAG_PATTERN } from "../lib/worker-protocol.ts";
import { SECRET_FORMAT, secretRefProblem } from "./secrets.ts";

export { resolveSecret, secretKind, secretRefProblem } from "./secrets.ts";

function succeeds(fn: () => unknown): boolean {
  try {
    fn();
    return true;
  } catch {
    return false;
  }
}

/** An IP address, or one with a prefix length within its family's bits (10.0.0.0/8, fd00::/8). */
function ipOrCidr(v: string): boolean {
  const slash = v.indexOf("/");
  const family = isIP(slash < 0 ? v : v.slice(0, slash));
  if (family === 0) return false;
  if (slash < 0) return true;
  const bits = v.slice(slash + 1);
  return /^\d{1,3}$/.test(bits) && Number(bits) <= (family === 4 ? 32 : 128);
}

const HOST_PORT = /^(\[[0-9a-fA-F:.]+\]|[^\s:[\]]+):(\d{1,5})$/;

// Idempotent: FormatRegistry is TypeBox's process-wide table of string formats.
FormatRegistry.Set("dc-duration", (v) => succeeds(() => parseDuration(v)));
FormatRegistry.Set("dc-duration-positive", (v) => {
  try {
    return parseDuration(v) > 0;
  } catch {
    return false;
  }
});
/** A duration that is 0 (off) or at least `minMs`: the format `dc-duration-off-or-<minMs>`, registered on first use. */
function offOrAtLeastFormat(minMs: number): string {
  const name = `dc-duration-off-or-${minMs}`;
  if (!FormatRegistry.Has(name)) {
    FormatRegistry.Set(name, (v) => {
      try {
        const ms = parseDuration(v);
        return ms === 0 || ms >= minMs;
      } catch {
        return false;
      }
    });
  }
  return name;
}
FormatRegistry.Set("dc-size", (v) => succeeds(() => parseSize(v)));
FormatRegistry.Set("dc-secret", (v) => secretRefProblem(v) === undefined);
FormatRegistry.Set("dc-host-port", (v) => {
  const m = HOST_PORT.exec(v);
  return m !== null && Number(m[2]) <= 65535;
});
FormatRegistry.Set("dc-ip-or-cidr", ipOrCidr);
FormatRegistry.Set("dc-http-url-or-empty", (v) => {
  if (v === "") return true;
  try {
    const url = new URL(v);
    return url.protocol === "http:" || url.protocol === "https:";
  } catch {
    return false;
  }
});

// ---- Building blocks -------------------------------------------------------------------------------------

/**
 * A duration leaf. `positive`: 0 is refused. `offOrAtLeast` (a duration): 0 means off, and anything else must be
 * at least that long (an interval whose every run costs the database a pass, where a typo such as "1ms" would
 * keep it busy).
 */
function Duration(
  def: string,
  description: string,
  opts: { positive?: boolean; offOrAtLeast?: string } = {},
) {
  const positive = opts.positive === true;
  const minMs = opts.offOrAtLeast === undefined ? undefined : parseDuration(opts.offOrAtLeast);
  const format =
    minMs !== undefined ? offOrAtLeastFormat(minMs) : positive ? "dc-duration-positive" : "dc-duration";
  const expected =
    minMs !== undefined
      ? `${DURATION_FORMAT}: 0 (off) or at least ${opts.offOrAtLeast}`
      : positive
        ? `${DURATION_FORMAT}, greater than 0`
        : DURATION_FORMAT;
  return Type.Transform(
    Type.String({
      format,
      default: def,
      description,
      unit: "duration",
      expected,
      ...(minMs === undefined ? {} : { offOrAtLeast: opts.offOrAtLeast }),
    }),
  )
    .Decode((v) => parseDuration(v))
    .Encode((ms) => formatDuration(ms));
}

function Size(description: string, def?: string | number) {
  return Type.Transform(
    Type.Union(
      [Type.String({ format: "dc-size" }), Type.Integer({ minimum: 0, maximum: Number.MAX_SAFE_INTEGER })],
      {
        description,
        unit: "size",
        expected: SIZE_FORMAT,
        ...(def === undefined ? {} : { default: def }),
      },
    ),
  )
    .Decode((v) => parseSize(v))
    .Encode((bytes) => formatSize(bytes));
}

function Secret(description: string) {
  return Type.String({
    format: "dc-secret",
    default: "",
    description,
    unit: "secret",
    secret: true,
    expected: SECRET_FORMAT,
  });
}

function OneOf<const T extends readonly string[]>(values: T, description: string, def?: T[number]) {
  // A union built from an array (not a tuple) would be typed `never`; the schema is the union, typed as the
  // literal union it validates.
  return Type.Union(values.map((v) => Type.Literal(v)) as TLiteral<T[number]>[], {
    description,
    expected: `one of: ${values.join(", ")}`,
    ...(def === undefined ? {} : { default: def }),
  }) as unknown as TUnsafe<T[number]>;
}

function Int(def: number | undefined, description: string, minimum: number, maximum?: number) {
  return Type.Integer({
    description,
    minimum,
    maximum: maximum ?? Number.MAX_SAFE_INTEGER,
    ...(def === undefined ? {} : { default: def }),
  });
}

function Num(def: number | undefined, description: string, minimum: number) {
  return Type.Number({ description, minimum, ...(def === undefined ? {} : { default: def }) });
}

function Bool(def: boolean, description: string) {
  return Type.Boolean({ default: def, description });
}

function Str(
  def: string,
  description: string,
  opts: { pattern?: string; format?: string; expected?: string } = {},
) {
  return Type.String({ default: def, description, ...opts });
}

function Section<T extends Record<string, TSchema>>(description: string, properties: T) {
  return Type.Object(properties, { additionalProperties: false, default: {}, description });
}

// ---- Sections ---------------------------------------------------------------------------------------------

const Database = Section("Where bundles, users and events are stored.", {
  url: Str(
    "pglite:./data/pglite",
    "Database to use: a PostgreSQL URL, or an embedded PGlite database in a directory (or in memory).",
    {
      pattern: "^(postgres(ql)?://\\S+|pglite:\\S+)$",
      expected: "postgres://..., postgresql://..., pglite:<directory> or 'pglite:memory:' (quoted in YAML)",
    },
  ),
  maxConnections: Int(10, "Maximum connections in the PostgreSQL pool.", 1, 1000),
  embeddedMaintenanceInterval: Duration(
    "1m",
    "PGlite only (PostgreSQL's autovacuum and checkpointer do this themselves): how often `serve` vacuums and " +
      "analyzes the embedded database's tables due by autovacuum's rules, and checkpoints it by the " +
      "checkpointer's; 0 = never (its tables and its write-ahead log then grow without bound).",
    { offOrAtLeast: "1s" },
  ),
});

const RestServer = Section("The users' and runners' REST API.", {
  listen: Str("127.0.0.1:8900", "Address to listen on, host:port.", {
    format: "dc-host-port",
    expected: "host:port, e.g. 127.0.0.1:8900 or [::1]:8900 (port 0..65535)",
  }),
  publicUrl: Str("", "URL runners and clients use to reach this server; empty = derived from listen.", {
    format: "dc-http-url-or-empty",
    expected: "empty or an http:// or https:// URL",
  }),
  maxRequestBodySize: Size("Largest request body accepted.", "1MiB"),
  maxBatchRequestBodySize: Size(
    "Largest body of a batch submission (POST /api/v1/bundles/batch, up to 10,000 bundles).",
    "64MiB",
  ),
  maxOutputSize: Size(
    "Largest output archive a runner may upload for one bundle (sum of its files' sizes).",
    "10GiB",
  ),
  maxOutputFiles: Int(
    50000,
    "Most files, directories and links one bundle's outputs may hold; an upload beyond it fails the bundle (runner.output_too_many_files).",
    1,
  ),
  maxLogBytesPerStream: Size(
    "Bytes of one log stream (stdout or stderr) kept per bundle attempt; beyond it a notice says the log was truncated and later bytes are dropped.",
    "64MiB",
  ),
  headersTimeout: Duration(
    "30s",
    "A request's line and headers must arrive within this long, else the answer is 408 and the connection is closed.",
    { positive: true },
  ),
  requestTimeout: Duration(
    "1m",
    "A request's body must arrive within this long after its headers, else the connection is closed (with a 408 answer if none was sent yet). Only what the client sends is timed: long answers such as a followed log are not.",
    { positive: true },
  ),
  minUploadRate: Size(
    "A runner's upload (outputs, log chunks) may take longer than requestTimeout while its bytes keep arriving at this average rate, per second; 0 = no longer.",
    "256KiB",
  ),
  trustedProxies: Type.Array(
    Type.String({ format: "dc-ip-or-cidr", expected: "an IP address or CIDR, e.g. 10.0.0.0/8 or ::1" }),
    {
      default: [],
      maxItems: 100,
      description:
        "Proxies in front of the REST server (IP addresses or CIDRs): a request that comes through them is taken to be from the address its X-Forwarded-For gives before them (the addresses in the refused-token warnings). Empty = none: every request is from its connection's address.",
    },
  ),
  minBundleRam: Size("Smallest resources.ram a bundle may ask for.", "16MiB"),
  minBundleVcpus: Num(
    0.01,
    "Smallest resources.vcpus a bundle may ask for (Docker's own minimum is 0.01).",
    0.01,
  ),
});

const Quotas = Section(
  "Per-user limits the REST server enforces. Admin users are exempt from the two submission limits (an admin can make any number of users, so a per-user cap would not bind one).",
  {
    maxQueuedBundlesPerUser: Int(
      1000,
      "Non-final bundles (created, staged, starting, running) one user may have at once; a submission beyond it is refused (429 quota.queued_bundles), and a pipeline's ready jobs past it wait for room (docs/pipelines.md). 0 = unlimited.",
      0,
    ),
    submissionsPerSecond: Num(
      10,
      "Bundles one user may submit per second over time (a token bucket refilled at this rate; 429 quota.rate_limited with Retry-After beyond it). 0 = unlimited.",
      0,
    ),
    submissionBurst: Int(
      100,
      "Bundles one user may submit at once before submissionsPerSecond paces them (the token bucket's size).",
      1,
    ),
    maxTokensPerUser: Int(
      100,
      "API tokens one user may hold (not revoked; expired ones count until revoked); 429 quota.tokens beyond it.",
      1,
      10000,
    ),
  },
);

const CasS3 = Section("The S3-compatible bucket of the content-addressed store (cas.backend: s3).", {
  bucket: Str("", "Bucket name."),
  endpoint: Str("", "Endpoint URL; empty = AWS's for the region.", {
    format: "dc-http-url-or-empty",
    expected: "empty or an http:// or https:// URL",
  }),
  region: Str("us-east-1", "Region."),
  prefix: Str("", "Key prefix of the blobs (e.g. dispatch-cloud/cas/); empty = the bucket's root."),
  forcePathStyle: Bool(false, "Path-style URLs (MinIO and most other S3-compatible servers need them)."),
});

const Cas = Section("The content-addressed store of bundle inputs and outputs (docs/storage.md).", {
  backend: OneOf(
    ["filesystem", "s3"] as const,
    "Where blobs are kept: the filesystem under <dataDir>/cas, or an S3-compatible bucket (cas.s3).",
    "filesystem",
  ),
  retention: Duration(
    "7d",
    "How long a blob lives after it was last uploaded or asked about when no live manifest names it (a manifest lives as long as it was touched within this or is a bundle's output).",
    { positive: true },
  ),
  gcInterval: Duration("1h", "How often the REST server collects garbage in the store; 0 = never.", {
    offOrAtLeast: "1s",
  }),
  maxBatchBytes: Size(
    "Largest batch upload or read: the bytes of its blobs (each blob at most 1 MiB).",
    "4MiB",
  ),
  s3: CasS3,
});

const Management = Section("The operators' management API, /metrics and health checks.", {
  listen: Str("127.0.0.1:8901", "Address to listen on, host:port.", {
    format: "dc-host-port",
    expected: "host:port, e.g. 127.0.0.1:8901 or [::1]:8901 (port 0..65535)",
  }),
  token: Secret("Bearer token operators must present; empty = the management API answers 403 to everything."),
  headersTimeout: Duration(
    "30s",
    "A request's line and headers must arrive within this long, else the answer is 408 and the connection is closed.",
    { positive: true },
  ),
  requestTimeout: Duration(
    "30s",
    "A request's body must arrive within this long after its headers, else the connection is closed (with a 408 answer if none was sent yet).",
    { positive: true },
  ),
});

const Logging = Section("Process logs (on stderr).", {
  level: OneOf(
    ["fatal", "error", "warn", "info", "debug", "trace", "silent"] as const,
    "Lowest level logged.",
    "info",
  ),
  format: OneOf(
    ["auto", "json", "text"] as const,
    "json: one JSON object per line; text: human-readable lines; auto: text when stderr is a terminal, else json.",
    "auto",
  ),
});

const Dispatcher = Section("Queue and scheduler.", {
  pollInterval: Duration(
    "10s",
    "Queue poll interval; only a fallback, the queue wakes on database notifications.",
    {
      positive: true,
    },
  ),
  staleLockTimeout: Duration(
    "1m",
    "A starting bundle whose runner has not appeared on its instance for this long is requeued; also how long to wait after a restart before requeueing bundles that run nowhere.",
  ),
  defaultMaxAttempts: Int(
    3,
    "Attempts a bundle gets when it does not set its own (instance lost, preempted).",
    1,
    10,
  ),
  reserveExtraRam: Size(
    "RAM kept free on each instance beyond what bundles ask for (runner, docker, OS).",
    "550MiB",
  ),
  maximumPriceFactor: Num(
    1.5,
    "A bundle may run on an instance type up to this many times the price of the cheapest type that fits it.",
    1,
  ),
  preemptiblePriceFactor: Num(
    0,
    "If > 0, add a preemptible (spot) variant `<name>.preemptible` of every type, priced at price x this factor; 0 = none.",
    0,
  ),
  alwaysUsePreemptibleInstances: Bool(
    false,
    "Run bundles that do not ask for preemptible instances on them anyway.",
  ),
  privateKey: Secret("SSH private key the dispatcher uses to reach instances (PEM or OpenSSH format)."),
  runtimeEngine: OneOf(
    ["docker", "process", "auto"] as const,
    "How crunch-run runs a bundle: docker, process (no isolation; only for trying dispatch-cloud out), or auto (docker if its daemon answers on the instance, else process; `serve` without --config uses auto).",
    "docker",
  ),
  processRuntimeFirstUid: Int(
    1_900_000_000,
    "The process runtime, with crunch-run running as root, gives each running bundle a uid (and gid) of its own from processRuntimeFirstUid on; none of them may belong to anyone else on the instances.",
    1000,
    4_000_000_000,
  ),
  processRuntimeUidCount: Int(
    65_536,
    "How many uids, from processRuntimeFirstUid, the process runtime hands out (at most this many process-runtime bundles run at once on an instance).",
    1,
    1_000_000,
  ),
  warmSupervisors: Int(
    2,
    "Warm spare supervisors crunch-run keeps ready on each instance (at most the instance's bundle slots: maxRunningBundlesPerInstance, else its vCPUs): that many bundles can start at once, back to back or in a burst, without waiting for a new process to start. Each idle one is a Node process (~70 MiB resident) that bundles cannot use: raise reserveExtraRam with it. 0 = none (every start runs crunch-run --detach).",
    0,
    64,
  ),
  handOffWithClaim: Bool(
    true,
    "serve only: hand an instance's warm pool a bundle's start document as the claim that makes the bundle starting leaves, not once it is back (a burst starts a few ms sooner); serve's REST server waits for that claim before it answers the pool's start call. Turn it off when other REST servers (rest-server) answer restServer.publicUrl too: they cannot wait, the pool asks them again for 2.5 s, and a claim slower than that costs the bundle an attempt. A dispatcher in a process of its own never does this.",
  ),
  containerLogMaxSize: Size(
    "The docker runtime's cap on docker's own log of a bundle's container, kept by the daemon on the instance's disk in two json-file files of this size (the bundle's log as users see it is restServer.maxLogBytesPerStream's business). Below 1MiB counts as 1MiB, above 1TiB as 1TiB.",
    "256MiB",
  ),
  schedulingStatusInterval: Duration("2s", "How often queued bundles' schedulingStatus text is refreshed.", {
    positive: true,
  }),
});

const Cloud = Section("Cloud instances: driver, limits and timeouts.", {
  driver: OneOf(
    ["local", "stub", "ec2", "azure"] as const,
    "Cloud driver: local (processes on this machine), stub (simulation), ec2, azure.",
    "local",
  ),
  driverParameters: Type.Record(Type.String(), Type.Unknown(), {
    default: {},
    description:
      "Driver-specific settings (region, subnets, credentials references...); see docs/ for each driver.",
  }),
  imageId: Str(
    "",
    "Image new instances boot from (AMI id, Azure image URL...); empty = the driver's default.",
  ),
  instanceInitCommand: Str(
    "",
    "Shell script run as root on each new instance at boot, after the instance secret is written.",
  ),
  sshPort: Int(22, "SSH port of instances.", 1, 65535),
  // Arvados's default is `systemctl is-system-running`; ours is `true` because the local driver's instances have
  // no systemd. Set it for real VMs.
  bootProbeCommand: Str(
    "true",
    "Command whose exit status 0 means an instance has finished booting (`true` suits the local driver; use e.g. `systemctl is-system-running` on real VMs).",
  ),
  probeInterval: Duration("10s", "Minimum time between two probes of one instance.", { positive: true }),
  maxProbesPerSecond: Int(
    0,
    "Operator's cap on probes started per second across all instances; 0 = no cap beyond maxConcurrentProbes and the SSH connection limits.",
    0,
  ),
  maxConcurrentProbes: Int(
    256,
    "Probes running at once across all instances, on connections already open (a probe waiting for its SSH connection does not count; one running longer than 5s stops counting, so hung instances never hold up the others); 0 = unlimited.",
    0,
  ),
  maxSshConnectsPerSecond: Int(
    50,
    "New SSH connections (TCP, key exchange, authentication, identity check) started per second across all instances; paced apart from probes on open connections. 0 = unlimited.",
    0,
  ),
  maxConcurrentSshConnects: Int(
    32,
    "SSH connections being set up at once across all instances (one taking longer than 5s stops counting, so unreachable instances never hold up the others); 0 = unlimited.",
    0,
  ),
  timeoutSignal: Duration("5s", "Time between repeated SIGTERMs to a bundle being killed."),
  timeoutStaleRunLock: Duration(
    "5s",
    "A runner lock held by a dead process for this long marks the instance broken.",
  ),
  timeoutTerm: Duration("2m", "Give up sending SIGTERM after this long and drain the instance."),
  maxCloudOpsPerSecond: Int(
    10,
    "Cloud API calls (create, list, destroy, set tags) per second; 0 = unlimited.",
    0,
  ),
  maxConcurrentInstanceCreateOps: Int(1, "Instance creations in flight at once; 0 = unlimited.", 0),
  maxInstances: Int(64, "Most instances at once; 0 = unlimited.", 0),
  maxRunningBundlesPerInstance: Int(0, "Most bundles on one instance; 0 = as many as fit.", 0),
  initialQuotaEstimate: Int(0, "Starting estimate of the cloud quota, in instances; 0 = maxInstances.", 0),
  syncInterval: Duration("1m", "Interval between full lists of the cloud's instances.", { positive: true }),
  timeoutIdle: Duration("1m", "An idle instance is shut down after this long."),
  timeoutBooting: Duration(
    "10m",
    "An instance that has not passed its boot probe after this long is shut down.",
  ),
  timeoutProbe: Duration("10m", "A booted instance with no successful probe for this long is shut down."),
  timeoutShutdown: Duration(
    "10s",
    "Repeat the destroy call if an instance is still listed this long after it.",
  ),
  spotInterruptionCheckInterval: Duration(
    "5s",
    "How often crunch-run asks a preemptible (spot) instance's metadata service (IMDSv2) for an interruption notice while a bundle runs; on one it requeues the bundle and the instance gets no new bundles. 0 = never.",
  ),
  deployRunnerBinary: Str(
    "",
    "crunch-run artifact copied to instances; empty = the artifact the dispatcher runs from.",
  ),
  deployRunnerDirectory: Str("/tmp/dispatch-cloud", "Directory on instances where the runner is installed.", {
    pattern: "^/",
    expected: "an absolute path",
  }),
  deployPublicKey: Bool(true, "Install the dispatcher's SSH public key on new instances."),
  resourceTags: Type.Record(Type.String(), Type.String(), {
    default: {},
    description: "Tags added to every instance the dispatcher creates (name: value).",
  }),
  tagKeyPrefix: Str(
    "DispatchCloud",
    "Prefix of the dispatcher's own tag names (<prefix>InstanceSetID ...).",
    {
      pattern: "^[A-Za-z0-9_.:-]*$",
      expected: "letters, digits and _ . : -",
    },
  ),
  instanceSetId: Str(
    "",
    "Marks the instances this dispatcher owns (tag <prefix>InstanceSetID); empty = clusterId.",
    {
      pattern: "^[A-Za-z0-9_.:-]*$",
      expected: "letters, digits and _ . : -",
    },
  ),
});

/** A registry host as image references name it: `host`, or `host:port` (`docker.io` for Docker Hub). */
export const REGISTRY_HOST = "^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?$";

const RegistryCredentials = Type.Object(
  {
    username: Str("", "User name to log in to the registry with."),
    password: Secret("The password or access token for username."),
  },
  { additionalProperties: false, default: {} },
);

const Workers = Section("Users' own machines as workers (docs/workers.md).", {
  longPoll: Duration(
    "2s",
    "How long a worker's check-in waits for a message (a bundle to run, one to kill) before it answers with none; the worker checks in again at once.",
    { positive: true },
  ),
  checkinTimeout: Duration(
    "1m",
    "A worker that has not checked in for this long is lost: its bundles go back to the queue (each once, counting an attempt as a lost instance's do).",
    { positive: true },
  ),
  deliveryTimeout: Duration(
    "1m",
    "A bundle given to a worker that the worker's check-ins do not report (as started or running) within this goes back to the queue.",
    { positive: true },
  ),
});

const Containers = Section("Container images (docs/images.md).", {
  registries: Type.Record(Type.String({ pattern: REGISTRY_HOST }), RegistryCredentials, {
    additionalProperties: false,
    default: {},
    description:
      "Credentials for private registries, by registry host as image references name it (127.0.0.1:5000, docker.io, 123.dkr.ecr.us-east-1.amazonaws.com). The dispatcher puts only the entry of a bundle's own image's registry into that bundle's start document, for its pull; images of registries not listed are pulled anonymously.",
    keyExpected: "a registry host, e.g. registry.example.org or 127.0.0.1:5000",
  }),
  pullRetryTimeout: Duration(
    "2m",
    "How long crunch-run retries a pull whose registry cannot be reached or answers 5xx (or 429), with backoff, before it gives the bundle back to the queue (crunchrun.image_unavailable).",
    { positive: true },
  ),
  unavailableImageRequeues: Int(
    30,
    "How many times a bundle may be given back because its image's registry was unavailable without that using up one of its attempts (its maxAttempts grows by one each time); past this they count like any other requeue.",
    0,
    1000,
  ),
});

const Gpu = Type.Object(
  {
    stack: OneOf(["cuda", "rocm"] as const, "GPU software stack."),
    driverVersion: Type.String({
      description: "Driver version (CUDA: the CUDA version the driver supports), compared as a version.",
      pattern: "^[0-9]+(\\.[0-9]+)*$",
      expected: 'a version such as "12.4" (digits and dots; quote it in YAML so 11.10 is not read as 11.1)',
    }),
    hardwareTarget: Type.String({
      description: 'CUDA compute capability (e.g. "8.0") or ROCm gfx target (e.g. "gfx90a").',
      minLength: 1,
      expected: 'a non-empty string such as "8.0" or "gfx90a" (quote numbers in YAML)',
    }),
    deviceCount: Int(undefined, "GPUs per instance.", 1),
    vram: Size("Memory of each GPU."),
  },
  {
    additionalProperties: false,
    description: "GPUs of this type (omit for none).",
    example: { stack: "cuda", driverVersion: "12.4", hardwareTarget: "8.0", deviceCount: 1, vram: "16GiB" },
  },
);

const InstanceType = Type.Object(
  {
    providerType: Str("", "The cloud's name for this type (e.g. m5.large); empty = the entry's name."),
    vcpus: Int(undefined, "Virtual CPUs.", 1),
    ram: Size("Memory."),
    includedScratch: Size("Local scratch disk that comes with the type.", 0),
    addedScratch: Size("Extra scratch disk attached at create time.", 0),
    price: Num(undefined, "Price in dollars per hour (also the maximum bid for preemptible instances).", 0),
    preemptible: Bool(false, "A preemptible (spot) instance."),
    gpu: Type.Optional(Gpu),
    tags: Type.Array(Type.String({ pattern: TAG_PATTERN }), {
      default: [],
      maxItems: MAX_TAGS,
      description:
        "Tags of this type: a bundle naming a tag (resources.tag) runs only on types and users' workers that have it.",
    }),
  },
  // The default lets Value.Default fill each entry of the instanceTypes record.
  { additionalProperties: false, default: {} },
);

export const INSTANCE_TYPE_NAME = "^[A-Za-z0-9][A-Za-z0-9._-]*$";

export const ConfigSchema = Type.Object(
  {
    clusterId: Str("local", "Cluster id: prefix of every bundle and user uuid.", {
      pattern: "^[a-z0-9]{5}$",
      expected: "exactly 5 characters a-z, 0-9",
    }),
    dataDir: Str(
      "./data",
      "Directory where `serve` keeps its state (admin token, PGlite database by default).",
      {
        pattern: "^.+$",
        expected: "a non-empty path",
      },
    ),
    database: Database,
    restServer: RestServer,
    quotas: Quotas,
    cas: Cas,
    management: Management,
    logging: Logging,
    dispatcher: Dispatcher,
    cloud: Cloud,
    containers: Containers,
    workers: Workers,
    instanceTypes: Type.Record(Type.String({ pattern: INSTANCE_TYPE_NAME }), InstanceType, {
      additionalProperties: false,
      minProperties: 1,
      description: "Instance types bundles may run on, by name. Replaces the default list as a whole.",
      default: { "local.small": { vcpus: 2, ram: "2GiB", includedScratch: "10GiB", price: 0 } },
      keyExpected: "letters, digits and . _ -, starting with a letter or digit",
    }),
  },
  { additionalProperties: false },
);

type DeepReadonly<T> = T extends (infer U)[]
  ? readonly DeepReadonly<U>[]
  : T extends object
    ? { readonly [K in keyof T]: DeepReadonly<T[K]> }
    : T;

/** The decoded, validated, frozen config: durations in milliseconds, sizes in bytes, secrets as references. */
export type Config = DeepReadonly<StaticDecode<typeof ConfigSchema>>;
export type InstanceTypeConfig = Config["instanceTypes"][string];
export type GpuConfig = NonNullable<InstanceTypeConfig["gpu"]>;
