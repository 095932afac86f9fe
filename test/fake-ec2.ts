/**
 * A fake EC2 endpoint speaking the EC2 Query API (form-encoded POST in, XML out) well enough for the real
 * `@aws-sdk/client-ec2` to run RunInstances, DescribeInstances, CreateTags, DeleteTags, TerminateInstances,
 * DescribeKeyPairs, ImportKeyPair and DescribeSpotPriceHistory against it. It checks each request's parameters
 * as EC2 does (and a little more strictly where the dispatcher's driver has rules to keep: one network interface
 * without a public IP, one instance per request), answers errors in EC2's error XML with EC2's HTTP status, and
 * has injectable faults (`faults`, mutable at any time, `resetFaults()` to clear): slow answers, one-shot errors,
 * throttling, 500s; for RunInstances errors per subnet, subnets out of addresses (each of EC2's ways of saying so),
 * types at capacity or not offered in a zone, spot configurations EC2 does not support, an image that does not
 * exist, an instance limit (optionally still counting recently terminated instances), a spot instance count and a
 * vCPU limit; answers lost after the work was done (the connection dropped, or held until the client gives up);
 * and EC2's eventual consistency (a new instance missing from DescribeInstances, CreateTags/DeleteTags and
 * TerminateInstances answering InvalidInstanceID.NotFound for a while after its launch). A RunInstances without
 * a subnet launches in the default VPC's default subnet, and a repeated ClientToken gets the first launch back.
 *
 * With `localVms`, each instance is backed by a local-driver VM (openssh mode: its own sshd on its own
 * 127.0.0.x:22, which is the instance's private IP) whose init command is the decoded UserData (preceded, with
 * `imds`, by a line writing the instance's IMDS endpoint into `$DISPATCH_VM_ROOT/etc/dispatch-cloud/`) and whose
 * authorized key is the public key of the imported key pair named by KeyName.
 *
 * Signatures are not verified: any credentials do, but a request must carry a SigV4 Authorization header.
 */
import { createHash, createPublicKey, randomBytes, randomUUID } from "node:crypto";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import type { Instance, InstanceSet } from "../cloud-drivers/types.ts";
import { systemClock } from "../lib/clock.ts";
import { type BackingVmOptions, openBackingVms, startBackingVm } from "./fake-cloud-vms.ts";
import {
  itemSet,
  leaf,
  listParam,
  node,
  type QueryParams,
  responseDocument,
  structListParam,
  structParam,
  tagSet,
  errorDocument as xmlError,
} from "./fake-ec2-xml.ts";
import type { FakeImds } from "./fake-imds.ts";

export interface FakeEc2Options {
  region?: string; // default "us-east-1"
  subnets?: string[]; // known subnet ids; default ["subnet-0a", "subnet-0b", "subnet-0c"]
  /**
   * Back each instance with a local-driver VM (openssh mode: its own sshd on 127.0.0.x:22 = its
   * PrivateIpAddress). `addressPrefix` (default the local driver's "127.0.0.") keeps test files' VMs apart.
   */
  localVms?: BackingVmOptions;
  /** When set (with localVms), each VM gets its imds-endpoint file pointing at imds.endpointFor(instanceId). */
  imds?: FakeImds;
  /** Spot price history returned by DescribeSpotPriceHistory. */
  spotPrices?: { instanceType: string; availabilityZone: string; price: number; timestamp: Date }[];
  /** How long a terminated instance stays listed (state terminated); default 2000 ms. */
  terminatedLingerMs?: number;
  /**
   * Where a RunInstances without a subnet launches: the default VPC's default subnet (one of `subnets`; default the
   * first). null: the account has no default VPC, and such a request is refused (VPCIdNotSpecified).
   */
  defaultSubnet?: string | null;
}

/** How an answer is lost: `drop` closes the connection without one; `late` holds it until the client gives up. */
export type LostAnswerMode = "drop" | "late";

/** How EC2 says a subnet has no free address left (it says it in each of these ways). */
export type SubnetFullStyle =
  /** 400 InsufficientFreeAddressesInSubnet "There are not enough free addresses in subnet '...' ..." */
  | "InsufficientFreeAddressesInSubnet"
  /** 400 InvalidParameterValue "Not enough free addresses in subnet ..." */
  | "not-enough"
  /** 400 InvalidParameterValue "There aren't sufficient free Ipv4 addresses or prefixes" (no subnet named) */
  | "ipv4";

export interface Ec2Faults {
  throttleRate: number; // 0..1: fraction of ALL requests answered 503 RequestLimitExceeded
  serverErrorRate: number; // 0..1: fraction answered 500 InternalError
  slowMs: number; // delay before every answer
  maxInstances: number; // 0 = none; RunInstances beyond it (pending+running) -> InstanceLimitExceeded
  vcpuLimit: number; // 0 = none; beyond it -> VcpuLimitExceeded
  typesAtCapacity: Set<string>; // RunInstances of these types -> InsufficientInstanceCapacity
  subnetErrors: Map<string, string>; // subnet id -> error code every RunInstances in it gets
  /** One-shot errors: the next request of `action` (or any action when "*") fails with `code`/`status`. */
  next: { action: string; code: string; status?: number; message?: string }[];

  /** Subnets with no free address left, and how EC2 says so. */
  fullSubnets: Map<string, SubnetFullStyle>;
  /** Instance type -> subnets whose availability zone does not offer it: Unsupported, naming the type. */
  typesNotInZone: Map<string, Set<string>>;
  /** Spot requests of these types: Unsupported "The requested configuration is currently not supported". */
  unsupportedSpotTypes: Set<string>;
  /** 0 = none; spot instances (pending and running) beyond it -> MaxSpotInstanceCountExceeded. */
  maxSpotInstances: number;
  /** Images that do not exist: RunInstances -> InvalidAMIID.NotFound. */
  missingImages: Set<string>;

  /**
   * Lost answers: this fraction of the successful requests of `lostAnswerActions` is carried out, and then its
   * answer is lost (`lostAnswerMode`).
   */
  lostAnswerRate: number;
  lostAnswerActions: Set<string>; // default RunInstances only
  lostAnswerMode: LostAnswerMode;
  /** One-shot lost answers: the next successful request of `action` (or any, "*") is done and its answer lost. */
  loseNext: { action: string; mode?: LostAnswerMode }[];

  /** Eventual consistency: for this long after its launch, DescribeInstances neither lists nor knows an instance. */
  listDelayMs: number;
  /** For this long after its launch, CreateTags and DeleteTags on an instance answer InvalidInstanceID.NotFound. */
  tagNotFoundMs: number;
  /** For this long after its launch, TerminateInstances answers InvalidInstanceID.NotFound and leaves it running. */
  terminateNotFoundMs: number;
  /** For this long after their termination, instances still count toward maxInstances (as EC2's limit does). */
  terminatedCountMs: number;
}

/** Every fault off. */
export function noFaults(): Ec2Faults {
  return {
    throttleRate: 0,
    serverErrorRate: 0,
    slowMs: 0,
    maxInstances: 0,
    vcpuLimit: 0,
    typesAtCapacity: new Set(),
    subnetErrors: new Map(),
    next: [],
    fullSubnets: new Map(),
    typesNotInZone: new Map(),
    unsupportedSpotTypes: new Set(),
    maxSpotInstances: 0,
    missingImages: new Set(),
    lostAnswerRate: 0,
    lostAnswerActions: new Set(["RunInstances"]),
    lostAnswerMode: "drop",
    loseNext: [],
    listDelayMs: 0,
    tagNotFoundMs: 0,
    terminateNotFoundMs: 0,
    terminatedCountMs: 0,
  };
}

export interface FakeInstance {
  id: string;
  type: string;
  state: "pending" | "running" | "shutting-down" | "terminated";
  subnetId: string;
  privateIp: string;
  tags: Record<string, string>;
  keyName: string | null;
  userData: string; // decoded
  imageId: string;
  launchTime: Date;
  spot: { maxPrice: string | null; interruptionBehavior: string | null; type: string | null } | null;
  /** The RunInstances request's parameters as received (flattened query keys -> values), for assertions. */
  params: Record<string, string>;
  volumeTags: Record<string, string>;
}

export type FakeInstanceState = FakeInstance["state"];

/** One point of DescribeSpotPriceHistory's data. */
export type FakeSpotPrice = NonNullable<FakeEc2Options["spotPrices"]>[number];

/** EC2's instance state codes. */
export const INSTANCE_STATE_CODES: Record<FakeInstanceState, number> = {
  pending: 0,
  running: 16,
  "shutting-down": 32,
  terminated: 48,
};

const API_VERSION = "2016-11-15";
const OWNER_ID = "123456789012";
const VPC_ID = "vpc-0fa4e0000000000a1";
const DEFAULT_SUBNETS = ["subnet-0a", "subnet-0b", "subnet-0c"];
const MAX_BODY_BYTES = 1 << 20;
const MAX_USER_DATA_BYTES = 16 * 1024;
const MAX_TAGS_PER_RESOURCE = 50;
const TAGGABLE_AT_LAUNCH = new Set([
  "instance",
  "volume",
  "network-interface",
  "spot-instances-request",
  "elastic-gpu",
]);
const VOLUME_TYPES = new Set(["standard", "io1", "io2", "gp2", "gp3", "sc1", "st1"]);

const STATUS_500 = new Set([
  "InternalError",
  "InternalFailure",
  "InsufficientInstanceCapacity",
  "InsufficientAddressCapacity",
  "InsufficientCapacity",
  "InsufficientHostCapacity",
  "InsufficientReservedInstanceCapacity",
]);
const STATUS_503 = new Set(["RequestLimitExceeded", "ServiceUnavailable", "Unavailable"]);

/** The HTTP status EC2 answers an error code with: 500/503 for server errors, 400 for the rest. */
export function ec2ErrorStatus(code: string): number {
  if (STATUS_500.has(code)) return 500;
  if (STATUS_503.has(code)) return 503;
  if (code === "AuthFailure") return 401;
  if (code === "DryRunOperation") return 412;
  return 400;
}

/** vCPUs of an instance type by its size (nano..large 2, xlarge 4, Nxlarge 4N, metal 96), as on EC2's common families. */
export function vcpusOf(instanceType: string): number {
  const size = instanceType.split(".")[1] ?? "";
  if (size === "xlarge") return 4;
  const m = /^(\d+)xlarge$/.exec(size);
  if (m !== null) return 4 * Number(m[1]);
  if (size === "metal") return 96;
  return 2;
}

/**
 * The fingerprint EC2 gives an imported public key (an OpenSSH `authorized_keys` line): for RSA, the MD5 of the
 * key's DER (SubjectPublicKeyInfo) encoding as colon-separated hex; for ed25519, the base64 SHA-256 of the
 * key blob (what `ssh-keygen -l` prints, with padding and without the `SHA256:` label).
 */
export function ec2ImportedKeyFingerprint(publicKeyLine: string): string {
  return parsePublicKey(publicKeyLine).fingerprint;
}

/** EC2's answer to a launch in a subnet with no free address left, in the given style. */
function subnetFullError(style: SubnetFullStyle, subnetId: string): Ec2Error {
  switch (style) {
    case "InsufficientFreeAddressesInSubnet":
      return new Ec2Error(
        "InsufficientFreeAddressesInSubnet",
        `There are not enough free addresses in subnet '${subnetId}' to satisfy the requested number of instances.`,
      );
    case "not-enough":
      return new Ec2Error("InvalidParameterValue", `Not enough free addresses in subnet ${subnetId}.`);
    case "ipv4":
      return new Ec2Error("InvalidParameterValue", "There aren't sufficient free Ipv4 addresses or prefixes");
  }
}

class Ec2Error extends Error {
  constructor(
    readonly code: string,
    message: string,
    readonly status = ec2ErrorStatus(code),
  ) {
    super(message);
  }
}

interface InstanceExtra {
  seq: number;
  /** Date.now() at launch (0 for records added by tests: long propagated). */
  launchedAt: number;
  reservationId: string;
  networkInterfaceId: string;
  securityGroups: string[];
  clientToken: string | null;
  terminatedAt: number | null;
  stateReason: { code: string; message: string } | null;
  volumes: { device: string; volumeId: string; deleteOnTermination: boolean }[];
  metadataOptions: QueryParams;
  iamProfileArn: string | null;
  spotRequestId: string | null;
}

interface KeyMeta {
  id: string;
  type: "rsa" | "ed25519";
  created: Date;
}

type Handler = (params: QueryParams) => string | Promise<string>;

function hexId(prefix: string): string {
  return `${prefix}-${randomBytes(9).toString("hex").slice(0, 17)}`;
}

function required(p: QueryParams, key: string, what = key): string {
  const v = p[key];
  if (v === undefined || v === "") {
    throw new Ec2Error("MissingParameter", `The request must contain the parameter ${what}`);
  }
  return v;
}

function invalidValue(key: string, value: string, why = ""): Ec2Error {
  return new Ec2Error(
    "InvalidParameterValue",
    `Value (${value}) for parameter ${key} is invalid.${why === "" ? "" : ` ${why}`}`,
  );
}

function oneOf(p: QueryParams, key: string, allowed: readonly string[], path = key): string | undefined {
  const v = p[key];
  if (v === undefined) return undefined;
  if (!allowed.includes(v)) throw invalidValue(path, v, `Allowed: ${allowed.join(", ")}.`);
  return v;
}

function isBase64(s: string): boolean {
  return s.length % 4 === 0 && /^[A-Za-z0-9+/]*={0,2}$/.test(s);
}

function checkTag(key: string, value: string, path: string): void {
  if (key.length === 0 || key.length > 128)
    throw invalidValue(`${path}.Key`, key, "Tag keys have 1 to 128 characters.");
  if (value.length > 256)
    throw invalidValue(`${path}.Value`, value, "Tag values have at most 256 characters.");
  if (key.toLowerCase().startsWith("aws:")) {
    throw invalidValue(`${path}.Key`, key, "Tag keys starting with 'aws:' are reserved.");
  }
}

/** `Tag.N.Key`/`Tag.N.Value` members under `prefix` (Value missing -> ""), checked. */
function tagsParam(p: QueryParams, prefix: string, pathPrefix = prefix): Record<string, string> {
  const tags: Record<string, string> = {};
  for (const { index, params } of structListParam(p, prefix)) {
    const path = `${pathPrefix}.${index}`;
    const key = required(params, "Key", `${path}.Key`);
    const value = params["Value"] ?? "";
    checkTag(key, value, path);
    tags[key] = value;
  }
  return tags;
}

/** EC2 filter values: `*` any run of characters, `?` one character, backslash escapes. */
function wildcard(pattern: string): RegExp {
  let re = "";
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i]!;
    if (c === "\\" && i + 1 < pattern.length) re += pattern[++i]!.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
    else if (c === "*") re += ".*";
    else if (c === "?") re += ".";
    else re += c.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  }
  return new RegExp(`^${re}$`, "s");
}

interface Filter {
  name: string;
  values: RegExp[];
}

function filtersParam(p: QueryParams): Filter[] {
  return structListParam(p, "Filter").map(({ index, params }) => {
    const name = required(params, "Name", `Filter.${index}.Name`);
    const values = listParam(params, "Value");
    if (values.length === 0) {
      throw new Ec2Error(
        "InvalidParameterValue",
        `The filter '${name}' (Filter.${index}) needs at least one Value`,
      );
    }
    return { name, values: values.map(wildcard) };
  });
}

function anyMatch(values: RegExp[], s: string | null | undefined): boolean {
  return s !== null && s !== undefined && values.some((re) => re.test(s));
}

function pageToken(payload: object): string {
  return Buffer.from(JSON.stringify(payload)).toString("base64url");
}

function readPageToken<T>(token: string | undefined, check: (v: unknown) => v is T): T | undefined {
  if (token === undefined) return undefined;
  try {
    const v: unknown = JSON.parse(Buffer.from(token, "base64url").toString("utf8"));
    if (check(v)) return v;
  } catch {
    // Answered below.
  }
  throw new Ec2Error("InvalidPaginationToken", `The pagination token '${token}' is not valid or has expired`);
}

function maxResultsParam(p: QueryParams, min: number, max: number): number | undefined {
  const raw = p["MaxResults"];
  if (raw === undefined) return undefined;
  const n = Number(raw);
  if (!/^\d+$/.test(raw) || n < min || n > max) {
    throw invalidValue("MaxResults", raw, `It must be a whole number from ${min} to ${max}.`);
  }
  return n;
}

function dateParam(p: QueryParams, key: string): Date | undefined {
  const raw = p[key];
  if (raw === undefined) return undefined;
  const d = new Date(raw);
  if (!/^\d{4}-\d\d-\d\d(T[\d:.]+(Z|[+-]\d\d:?\d\d)?)?$/.test(raw) || Number.isNaN(d.getTime())) {
    throw invalidValue(key, raw, "It must be an ISO 8601 date and time.");
  }
  return d;
}

function filterKey(p: QueryParams): string {
  const entries = Object.entries(p)
    .filter(
      ([k]) =>
        k.startsWith("Filter.") || k.startsWith("InstanceType.") || k.startsWith("ProductDescription."),
    )
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  return createHash("sha256").update(JSON.stringify(entries)).digest("base64url").slice(0, 16);
}

interface ParsedKey {
  type: "rsa" | "ed25519";
  fingerprint: string;
  line: string;
}

function keyFormatError(why: string): Ec2Error {
  return new Ec2Error("InvalidKey.Format", `Key is not in valid OpenSSH public key format: ${why}`);
}

/** Parses an OpenSSH public key line (rsa or ed25519 only, as EC2) and computes EC2's imported-key fingerprint. */
function parsePublicKey(line: string): ParsedKey {
  const parts = line.trim().split(/\s+/);
  const [type, b64] = parts;
  if (type === undefined || b64 === undefined || !isBase64(b64))
    throw keyFormatError("expected '<type> <base64>'");
  const blob = Buffer.from(b64, "base64");
  let at = 0;
  const next = (): Buffer => {
    if (at + 4 > blob.length) throw keyFormatError("truncated key blob");
    const len = blob.readUInt32BE(at);
    if (at + 4 + len > blob.length) throw keyFormatError("truncated key blob");
    const out = blob.subarray(at + 4, at + 4 + len);
    at += 4 + len;
    return out;
  };
  if (next().toString("latin1") !== type) throw keyFormatError("the key blob's type differs from the line's");
  if (type === "ssh-ed25519") {
    if (next().length !== 32 || at !== blob.length) throw keyFormatError("an ed25519 key is 32 bytes");
    return {
      type: "ed25519",
      fingerprint: createHash("sha256").update(blob).digest("base64"),
      line: line.trim(),
    };
  }
  if (type !== "ssh-rsa") throw keyFormatError(`${type} keys are not supported (rsa and ed25519 are)`);
  const unsigned = (b: Buffer): Buffer => {
    let i = 0;
    while (i < b.length - 1 && b[i] === 0) i++;
    return b.subarray(i);
  };
  const e = unsigned(next());
  const n = unsigned(next());
  if (at !== blob.length) throw keyFormatError("trailing bytes after the RSA key");
  const bits = n.length * 8 - Math.clz32(n[0] ?? 0) + 24;
  if (bits < 1024 || bits > 16384) throw keyFormatError(`an RSA key of ${bits} bits`);
  let der: Buffer;
  try {
    der = createPublicKey({
      key: { kty: "RSA", n: n.toString("base64url"), e: e.toString("base64url") },
      format: "jwk",
    }).export({ type: "spki", format: "der" });
  } catch (err) {
    throw keyFormatError((err as Error).message);
  }
  const md5 = createHash("md5").update(der).digest("hex");
  return { type: "rsa", fingerprint: md5.match(/../g)!.join(":"), line: line.trim() };
}

export class FakeEc2 {
  readonly faults: Ec2Faults = noFaults();
  readonly instances = new Map<string, FakeInstance>();
  readonly keyPairs = new Map<string, { name: string; fingerprint: string; publicKey: string }>();
  /**
   * Every request: action, params, HTTP status and error code (null when it succeeded), and how its answer was
   * lost (null: it was sent).
   */
  readonly calls: {
    action: string;
    params: Record<string, string>;
    status: number;
    code: string | null;
    lost: LostAnswerMode | null;
  }[] = [];
  /** Launches, and terminations as TerminateInstances starts them (shutting-down), in order. */
  readonly history: { at: number; instanceId: string; event: "launched" | "terminating" }[] = [];

  private readonly region: string;
  private readonly subnets: string[];
  private readonly defaultSubnet: string | null;
  private readonly lingerMs: number;
  private readonly spotPrices: FakeSpotPrice[];
  private readonly imds: FakeImds | undefined;
  private readonly localVms: FakeEc2Options["localVms"];
  private readonly extras = new Map<string, InstanceExtra>();
  private readonly keyMeta = new Map<string, KeyMeta>();
  private readonly clientTokens = new Map<string, { instanceId: string; requestKey: string }>();
  private readonly ipCounters = new Map<string, number>();
  /** Instance id -> its local VM (a promise while the VM starts). */
  private readonly vms = new Map<string, Promise<Instance>>();
  private readonly background = new Set<Promise<void>>();
  private readonly handlers: Record<string, Handler>;
  private vmSet: InstanceSet | undefined;
  private server: Server | undefined;
  private baseUrl = "";
  private seq = 0;
  private stopping = false;
  /** Aborted by stop(): ends slowMs waits. */
  private readonly stopped = new AbortController();

  constructor(opts: FakeEc2Options = {}) {
    this.region = opts.region ?? "us-east-1";
    this.subnets = [...(opts.subnets ?? DEFAULT_SUBNETS)];
    this.defaultSubnet = opts.defaultSubnet === undefined ? (this.subnets[0] ?? null) : opts.defaultSubnet;
    if (this.defaultSubnet !== null && !this.subnets.includes(this.defaultSubnet)) {
      throw new Error(`FakeEc2: the default subnet ${this.defaultSubnet} is not one of the subnets`);
    }
    this.lingerMs = opts.terminatedLingerMs ?? 2000;
    this.spotPrices = opts.spotPrices ?? [];
    this.imds = opts.imds;
    this.localVms = opts.localVms;
    if (this.imds !== undefined && this.localVms === undefined) {
      throw new Error("FakeEc2: the imds option needs localVms (the endpoint file is written on the VM)");
    }
    this.handlers = {
      RunInstances: (p) => this.runInstances(p),
      DescribeInstances: (p) => this.describeInstances(p),
      CreateTags: (p) => this.createTags(p),
      DeleteTags: (p) => this.deleteTags(p),
      TerminateInstances: (p) => this.terminateInstances(p),
      ImportKeyPair: (p) => this.importKeyPair(p),
      DescribeKeyPairs: (p) => this.describeKeyPairs(p),
      DescribeSpotPriceHistory: (p) => this.describeSpotPriceHistory(p),
    };
  }

  /** Listens on 127.0.0.1 and a free port; with localVms, checks first that local sshd VMs can run here. */
  async start(): Promise<this> {
    if (this.localVms !== undefined) {
      this.vmSet = await openBackingVms(this.localVms, "fake-ec2");
    }
    const server = createServer((req, res) => void this.handle(req, res));
    await new Promise<void>((ok, fail) => {
      server.once("error", fail);
      server.listen(0, "127.0.0.1", () => ok());
    });
    this.server = server;
    this.baseUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    return this;
  }

  /** The endpoint for the SDK: http://127.0.0.1:PORT. */
  get url(): string {
    if (this.baseUrl === "") throw new Error("FakeEc2: not started");
    return this.baseUrl;
  }

  /** Stops listening and destroys every backing local VM (waiting for those still starting). */
  async stop(): Promise<void> {
    this.stopping = true;
    this.stopped.abort();
    const s = this.server;
    this.server = undefined;
    if (s !== undefined) {
      s.closeAllConnections();
      await new Promise<void>((ok) => s.close(() => ok()));
    }
    await Promise.allSettled([...this.background]);
    await Promise.allSettled(
      [...this.vms.entries()].map(async ([id, vm]) => {
        await (await vm).destroy();
        this.markTerminated(id, "Client.UserInitiatedShutdown", "the fake EC2 endpoint stopped");
      }),
    );
    this.vms.clear();
    await this.vmSet?.stop();
  }

  /** Switches every fault off. */
  resetFaults(): void {
    Object.assign(this.faults, noFaults());
  }

  /** Adds n plain instances (records only, no VM) with these tags, e.g. for pagination tests. */
  addInstances(n: number, init: Partial<FakeInstance>): FakeInstance[] {
    const out: FakeInstance[] = [];
    for (let i = 0; i < n; i++) {
      const subnetId = init.subnetId ?? this.subnets[0] ?? "subnet-0a";
      const inst: FakeInstance = {
        id: n === 1 && init.id !== undefined ? init.id : hexId("i"),
        type: init.type ?? "t3.small",
        state: init.state ?? "running",
        subnetId,
        privateIp: init.privateIp ?? this.nextPrivateIp(subnetId),
        tags: { ...init.tags },
        keyName: init.keyName ?? null,
        userData: init.userData ?? "",
        imageId: init.imageId ?? "ami-0fa4e000000000001",
        launchTime: init.launchTime ?? new Date(),
        spot: init.spot === undefined || init.spot === null ? null : { ...init.spot },
        params: { ...init.params },
        volumeTags: { ...init.volumeTags },
      };
      this.record(inst, { securityGroups: [], clientToken: null });
      if (inst.state === "terminated") this.extras.get(inst.id)!.terminatedAt = Date.now();
      out.push(inst);
    }
    return out;
  }

  /** Spot interruption: the instance's IMDS answers with a notice (needs imds); state unchanged. */
  interrupt(instanceId: string): void {
    if (this.imds === undefined)
      throw new Error("FakeEc2.interrupt: this fake was made without the imds option");
    if (!this.instances.has(instanceId)) throw new Error(`FakeEc2.interrupt: no instance ${instanceId}`);
    this.imds.interrupt(instanceId);
  }

  // ---- HTTP ----

  private async handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const requestId = randomUUID();
    const params: QueryParams = {};
    let status = 200;
    let code: string | null = null;
    let lost: LostAnswerMode | null = null;
    let xml: string;
    try {
      const body = await readBody(req);
      for (const [k, v] of new URL(req.url ?? "/", "http://fake").searchParams) params[k] = v;
      for (const [k, v] of new URLSearchParams(body)) params[k] = v;
      xml = await this.process(req, params, requestId);
      lost = this.lostAnswer(params["Action"] ?? "");
    } catch (err) {
      const e =
        err instanceof Ec2Error
          ? err
          : new Ec2Error("InternalError", `fake EC2: ${err instanceof Error ? err.message : String(err)}`);
      status = e.status;
      code = e.code;
      xml = xmlError(e.code, e.message, requestId);
    }
    this.calls.push({ action: params["Action"] ?? "", params, status, code, lost });
    if (lost === "drop") {
      // Done, and the connection closes without an answer (the client sees a reset or "socket hang up").
      req.socket.destroy();
      return;
    }
    if (lost === "late") {
      // Done, and the answer is held until the client has given up on it (its timeout closes the connection).
      await new Promise<void>((ok) => {
        if (res.destroyed || req.socket.destroyed) ok();
        else res.once("close", () => ok());
      });
      return;
    }
    if (res.destroyed) return;
    res.statusCode = status;
    res.setHeader("Content-Type", "text/xml;charset=UTF-8");
    res.setHeader("x-amzn-RequestId", requestId);
    res.end(xml);
  }

  private async process(req: IncomingMessage, params: QueryParams, requestId: string): Promise<string> {
    const auth = req.headers.authorization;
    if (typeof auth !== "string" || !auth.startsWith("AWS4-HMAC-SHA256")) {
      throw new Ec2Error("AuthFailure", "AWS was not able to validate the provided access credentials");
    }
    const action = params["Action"] ?? "";
    await this.applyFaults(action);
    if (action === "") throw new Ec2Error("MissingAction", "The request must contain the parameter Action");
    const handler = this.handlers[action];
    if (handler === undefined) {
      throw new Ec2Error(
        "InvalidAction",
        `The action ${action} is not valid for this web service (fake EC2)`,
      );
    }
    const version = required(params, "Version");
    if (version !== API_VERSION) {
      throw new Ec2Error(
        "NoSuchVersion",
        `An unknown API version was requested: ${version} (fake EC2 speaks ${API_VERSION})`,
      );
    }
    return responseDocument(action, requestId, await handler(params));
  }

  /** Whether the answer to a successful request of `action` is lost, and how (one-shots first, then the rate). */
  private lostAnswer(action: string): LostAnswerMode | null {
    const f = this.faults;
    const i = f.loseNext.findIndex((n) => n.action === action || n.action === "*");
    if (i >= 0) {
      const [n] = f.loseNext.splice(i, 1);
      return n?.mode ?? f.lostAnswerMode;
    }
    if (f.lostAnswerRate > 0 && f.lostAnswerActions.has(action) && Math.random() < f.lostAnswerRate) {
      return f.lostAnswerMode;
    }
    return null;
  }

  /** slowMs, then the one-shot errors, then throttling, then server errors. */
  private async applyFaults(action: string): Promise<void> {
    const f = this.faults;
    if (f.slowMs > 0) {
      try {
        await systemClock.sleep(f.slowMs, this.stopped.signal);
      } catch {
        throw new Ec2Error("Unavailable", "The fake EC2 endpoint is stopping");
      }
    }
    const i = f.next.findIndex((n) => n.action === action || n.action === "*");
    if (i >= 0) {
      const [n] = f.next.splice(i, 1);
      if (n !== undefined) {
        throw new Ec2Error(
          n.code,
          n.message ?? `fake EC2: injected ${n.code}`,
          n.status ?? ec2ErrorStatus(n.code),
        );
      }
    }
    if (f.throttleRate > 0 && Math.random() < f.throttleRate) {
      throw new Ec2Error("RequestLimitExceeded", "Request limit exceeded (fake EC2 throttling).");
    }
    if (f.serverErrorRate > 0 && Math.random() < f.serverErrorRate) {
      throw new Ec2Error("InternalError", "An internal error has occurred (fake EC2).");
    }
  }

  private dryRun(p: QueryParams): void {
    if (p["DryRun"] === "true") {
      throw new Ec2Error("DryRunOperation", "Request would have succeeded, but DryRun flag is set.");
    }
  }

  // ---- instances ----

  private record(inst: FakeInstance, more: Partial<InstanceExtra>): InstanceExtra {
    const extra: InstanceExtra = {
      seq: ++this.seq,
      launchedAt: 0,
      reservationId: hexId("r"),
      networkInterfaceId: hexId("eni"),
      securityGroups: [],
      clientToken: null,
      terminatedAt: null,
      stateReason: null,
      volumes: [{ device: "/dev/xvda", volumeId: hexId("vol"), deleteOnTermination: true }],
      metadataOptions: {},
      iamProfileArn: null,
      spotRequestId: inst.spot === null ? null : hexId("sir"),
      ...more,
    };
    this.instances.set(inst.id, inst);
    this.extras.set(inst.id, extra);
    return extra;
  }

  private extraOf(inst: FakeInstance): InstanceExtra {
    let extra = this.extras.get(inst.id);
    if (extra === undefined) extra = this.record(inst, {}); // Put into `instances` by a test directly.
    return extra;
  }

  /** Whether the instance was launched less than `ms` ago (EC2 may not know it everywhere yet). */
  private young(inst: FakeInstance, ms: number): boolean {
    return ms > 0 && Date.now() - this.extraOf(inst).launchedAt < ms;
  }

  /** Whether the instance counts toward maxInstances: pending or running, or recently terminated. */
  private countsTowardLimit(inst: FakeInstance): boolean {
    if (inst.state === "pending" || inst.state === "running") return true;
    const ms = this.faults.terminatedCountMs;
    if (ms <= 0) return false;
    if (inst.state === "shutting-down") return true;
    const at = this.extraOf(inst).terminatedAt;
    return at !== null && Date.now() - at < ms;
  }

  /** Whether EC2 still shows the instance (a terminated one for terminatedLingerMs). */
  private visible(inst: FakeInstance): boolean {
    if (inst.state !== "terminated") return true;
    const at = this.extraOf(inst).terminatedAt;
    return at === null || Date.now() - at < this.lingerMs;
  }

  private markTerminated(id: string, code: string, message: string): void {
    const inst = this.instances.get(id);
    if (inst === undefined || inst.state === "terminated") return;
    inst.state = "terminated";
    const extra = this.extraOf(inst);
    extra.terminatedAt = Date.now();
    extra.stateReason = { code, message };
  }

  private availabilityZone(subnetId: string): string {
    const i = Math.max(0, this.subnets.indexOf(subnetId));
    return `${this.region}${"abcdef"[i % 6]}`;
  }

  private nextPrivateIp(subnetId: string): string {
    const i = Math.max(0, this.subnets.indexOf(subnetId)) % 256;
    let n = this.ipCounters.get(subnetId) ?? 3;
    do n++;
    while ((n & 255) < 4 || (n & 255) === 255);
    this.ipCounters.set(subnetId, n);
    return `10.${i}.${(n >> 8) & 255}.${n & 255}`;
  }

  /**
   * The instance ids of `InstanceId.N`; every one must be known (and still shown). `unknownYet` instances are
   * answered as EC2 answers one it does not know (yet).
   */
  private knownInstances(
    ids: string[],
    path = "InstanceId",
    unknownYet: (inst: FakeInstance) => boolean = () => false,
  ): FakeInstance[] {
    const malformed = ids.filter(
      (id) => !/^i-[0-9a-f]{8}(?:[0-9a-f]{9})?$/.test(id) && !this.instances.has(id),
    );
    if (malformed.length > 0) {
      throw new Ec2Error(
        "InvalidInstanceID.Malformed",
        `Invalid id: '${malformed[0]}' (${path}; expecting 'i-...')`,
      );
    }
    const missing: string[] = [];
    const found: FakeInstance[] = [];
    for (const id of ids) {
      const inst = this.instances.get(id);
      if (inst === undefined || !this.visible(inst) || unknownYet(inst)) missing.push(id);
      else found.push(inst);
    }
    if (missing.length > 0) {
      throw new Ec2Error(
        "InvalidInstanceID.NotFound",
        `The instance ID${missing.length > 1 ? "s" : ""} '${missing.join(", ")}' do${missing.length > 1 ? "" : "es"} not exist`,
      );
    }
    return found;
  }

  private async runInstances(p: QueryParams): Promise<string> {
    const imageId = required(p, "ImageId");
    if (!/^ami-[0-9a-z]+$/.test(imageId)) {
      throw new Ec2Error("InvalidAMIID.Malformed", `Invalid id: '${imageId}' (ImageId; expecting 'ami-...')`);
    }
    const type = required(p, "InstanceType");
    if (!/^[a-z][a-z0-9-]*\.[a-z0-9-]+$/.test(type)) {
      throw invalidValue("InstanceType", type, "It is not an instance type name such as m5.large.");
    }
    const minCount = required(p, "MinCount");
    const maxCount = required(p, "MaxCount");
    for (const [key, v] of [
      ["MinCount", minCount],
      ["MaxCount", maxCount],
    ] as const) {
      if (v !== "1")
        throw invalidValue(key, v, "The fake EC2 launches exactly one instance per request (1).");
    }

    // The network: exactly one interface, in a known subnet, without a public IP.
    for (const top of ["SubnetId", "SecurityGroupId.1", "SecurityGroup.1", "PrivateIpAddress"]) {
      if (p[top] !== undefined && Object.keys(p).some((k) => k.startsWith("NetworkInterface."))) {
        throw new Ec2Error(
          "InvalidParameterCombination",
          `Network interfaces and an instance-level ${top.replace(/\.1$/, "")} may not be specified on the same request`,
        );
      }
    }
    const interfaces = structListParam(p, "NetworkInterface");
    if (interfaces.length === 0) {
      throw new Ec2Error(
        "MissingParameter",
        "The request must contain the parameter NetworkInterface.1 (the fake EC2 wants one network interface: " +
          "DeviceIndex 0, SubnetId, AssociatePublicIpAddress false)",
      );
    }
    if (interfaces.length > 1 || interfaces[0]!.index !== 1) {
      throw new Ec2Error(
        "InvalidParameterValue",
        "The fake EC2 takes exactly one network interface, NetworkInterface.1",
      );
    }
    const ni = interfaces[0]!.params;
    const deviceIndex = required(ni, "DeviceIndex", "NetworkInterface.1.DeviceIndex");
    if (deviceIndex !== "0")
      throw invalidValue("NetworkInterface.1.DeviceIndex", deviceIndex, "The primary interface is 0.");
    // No subnet: the default VPC's default subnet, as EC2 does (if the account has a default VPC).
    const askedSubnet = ni["SubnetId"];
    if (askedSubnet === undefined && this.defaultSubnet === null) {
      throw new Ec2Error(
        "VPCIdNotSpecified",
        "No default VPC for this user. GroupName is only supported for EC2-Classic and default VPC.",
      );
    }
    const subnetId = askedSubnet ?? this.defaultSubnet ?? "";
    if (ni["AssociatePublicIpAddress"] !== "false") {
      throw invalidValue(
        "NetworkInterface.1.AssociatePublicIpAddress",
        ni["AssociatePublicIpAddress"] ?? "(missing)",
        "Instances get no public IP here: it must be false.",
      );
    }
    const securityGroups = listParam(ni, "SecurityGroupId");
    for (const g of securityGroups) {
      if (!/^sg-[0-9a-z]+$/.test(g)) {
        throw new Ec2Error(
          "InvalidGroupId.Malformed",
          `Invalid id: '${g}' (NetworkInterface.1.SecurityGroupId; expecting 'sg-...')`,
        );
      }
    }
    if (!/^subnet-[0-9a-z]+$/.test(subnetId)) {
      throw new Ec2Error("InvalidSubnetID.Malformed", `Invalid id: '${subnetId}' (expecting 'subnet-...')`);
    }
    if (!this.subnets.includes(subnetId)) {
      throw new Ec2Error("InvalidSubnetID.NotFound", `The subnet ID '${subnetId}' does not exist`);
    }

    if (this.faults.missingImages.has(imageId)) {
      throw new Ec2Error("InvalidAMIID.NotFound", `The image id '[${imageId}]' does not exist`);
    }

    // Key pair and user data.
    const keyName = p["KeyName"];
    const key = keyName === undefined ? undefined : this.keyPairs.get(keyName);
    if (keyName !== undefined && key === undefined) {
      throw new Ec2Error("InvalidKeyPair.NotFound", `The key pair '${keyName}' does not exist`);
    }
    if (this.localVms !== undefined && key === undefined) {
      throw new Ec2Error(
        "MissingParameter",
        "The request must contain the parameter KeyName (the fake EC2's local VMs authorize the key pair's public key)",
      );
    }
    const userDataB64 = p["UserData"] ?? "";
    if (!isBase64(userDataB64))
      throw new Ec2Error("InvalidParameterValue", "Invalid BASE64 encoding of user data (UserData)");
    const userDataBytes = Buffer.from(userDataB64, "base64");
    if (userDataBytes.length > MAX_USER_DATA_BYTES) {
      throw new Ec2Error(
        "InvalidParameterValue",
        `User data is limited to ${MAX_USER_DATA_BYTES} bytes (got ${userDataBytes.length}) (UserData)`,
      );
    }

    oneOf(p, "InstanceInitiatedShutdownBehavior", ["stop", "terminate"]);
    const metadataOptions = structParam(p, "MetadataOptions");
    oneOf(metadataOptions, "HttpTokens", ["optional", "required"], "MetadataOptions.HttpTokens");
    oneOf(metadataOptions, "HttpEndpoint", ["enabled", "disabled"], "MetadataOptions.HttpEndpoint");
    oneOf(
      metadataOptions,
      "InstanceMetadataTags",
      ["enabled", "disabled"],
      "MetadataOptions.InstanceMetadataTags",
    );
    const hopLimit = metadataOptions["HttpPutResponseHopLimit"];
    if (
      hopLimit !== undefined &&
      !(/^\d+$/.test(hopLimit) && Number(hopLimit) >= 1 && Number(hopLimit) <= 64)
    ) {
      throw invalidValue("MetadataOptions.HttpPutResponseHopLimit", hopLimit, "It must be from 1 to 64.");
    }

    // Spot.
    const market = structParam(p, "InstanceMarketOptions");
    let spot: FakeInstance["spot"] = null;
    if (Object.keys(market).length > 0) {
      const marketType = required(market, "MarketType", "InstanceMarketOptions.MarketType");
      if (marketType !== "spot") {
        throw invalidValue(
          "InstanceMarketOptions.MarketType",
          marketType,
          "The fake EC2 supports spot only.",
        );
      }
      const so = structParam(market, "SpotOptions");
      const spotType = oneOf(
        so,
        "SpotInstanceType",
        ["one-time", "persistent"],
        "InstanceMarketOptions.SpotOptions.SpotInstanceType",
      );
      const behaviour = oneOf(
        so,
        "InstanceInterruptionBehavior",
        ["hibernate", "stop", "terminate"],
        "InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior",
      );
      if (behaviour !== undefined && behaviour !== "terminate" && spotType !== "persistent") {
        throw new Ec2Error(
          "InvalidParameterCombination",
          `InstanceInterruptionBehavior ${behaviour} needs SpotInstanceType persistent`,
        );
      }
      const maxPrice = so["MaxPrice"];
      if (maxPrice !== undefined && !(/^\d+(\.\d+)?$/.test(maxPrice) && Number(maxPrice) > 0)) {
        throw invalidValue(
          "InstanceMarketOptions.SpotOptions.MaxPrice",
          maxPrice,
          "It must be a positive price.",
        );
      }
      spot = { maxPrice: maxPrice ?? null, interruptionBehavior: behaviour ?? null, type: spotType ?? null };
    }

    // Block devices.
    const volumes: InstanceExtra["volumes"] = [
      { device: "/dev/xvda", volumeId: hexId("vol"), deleteOnTermination: true },
    ];
    for (const { index, params: bdm } of structListParam(p, "BlockDeviceMapping")) {
      const path = `BlockDeviceMapping.${index}`;
      const device = required(bdm, "DeviceName", `${path}.DeviceName`);
      const size = bdm["Ebs.VolumeSize"];
      if (size !== undefined && !(/^\d+$/.test(size) && Number(size) >= 1 && Number(size) <= 16384)) {
        throw invalidValue(`${path}.Ebs.VolumeSize`, size, "It must be from 1 to 16384 (GiB).");
      }
      oneOf(bdm, "Ebs.VolumeType", [...VOLUME_TYPES], `${path}.Ebs.VolumeType`);
      const del = oneOf(bdm, "Ebs.DeleteOnTermination", ["true", "false"], `${path}.Ebs.DeleteOnTermination`);
      if (Object.keys(bdm).some((k) => k.startsWith("Ebs."))) {
        volumes.push({ device, volumeId: hexId("vol"), deleteOnTermination: del !== "false" });
      }
    }

    // Tags at launch.
    const tags: Record<string, string> = {};
    const volumeTags: Record<string, string> = {};
    for (const { index, params: spec } of structListParam(p, "TagSpecification")) {
      const path = `TagSpecification.${index}`;
      const resourceType = required(spec, "ResourceType", `${path}.ResourceType`);
      if (!TAGGABLE_AT_LAUNCH.has(resourceType)) {
        throw invalidValue(
          `${path}.ResourceType`,
          resourceType,
          `Taggable at launch: ${[...TAGGABLE_AT_LAUNCH].join(", ")}.`,
        );
      }
      const specTags = tagsParam(spec, "Tag", `${path}.Tag`);
      if (Object.keys(specTags).length > MAX_TAGS_PER_RESOURCE) {
        throw new Ec2Error("TagLimitExceeded", `${path}: at most ${MAX_TAGS_PER_RESOURCE} tags per resource`);
      }
      if (resourceType === "instance") Object.assign(tags, specTags);
      if (resourceType === "volume") Object.assign(volumeTags, specTags);
    }

    const profileName = p["IamInstanceProfile.Name"];
    const profileArn = p["IamInstanceProfile.Arn"];
    if (profileName !== undefined && profileArn !== undefined) {
      throw new Ec2Error(
        "InvalidParameterCombination",
        "IamInstanceProfile takes a Name or an Arn, not both",
      );
    }
    if (profileArn !== undefined && !/^arn:aws[a-z-]*:iam::\d{12}:instance-profile\/.+$/.test(profileArn)) {
      throw invalidValue("IamInstanceProfile.Arn", profileArn, "It is not an instance profile ARN.");
    }
    this.dryRun(p);

    // A retry with the same ClientToken gets the first launch back.
    const clientToken = p["ClientToken"] ?? null;
    const requestKey = JSON.stringify(
      Object.entries(p)
        .filter(([k]) => k !== "ClientToken")
        .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)),
    );
    if (clientToken !== null) {
      const earlier = this.clientTokens.get(clientToken);
      if (earlier !== undefined) {
        if (earlier.requestKey !== requestKey) {
          throw new Ec2Error(
            "IdempotentParameterMismatch",
            `ClientToken '${clientToken}' was used before with different parameters`,
          );
        }
        const inst = this.instances.get(earlier.instanceId);
        if (inst !== undefined) {
          // The first launch's answer, once its instance has its address (its VM may still be starting).
          await this.vms.get(inst.id)?.catch(() => undefined);
          return this.reservationXml([inst]);
        }
      }
    }

    // Capacity and limits.
    const subnetError = this.faults.subnetErrors.get(subnetId);
    if (subnetError !== undefined) {
      throw new Ec2Error(
        subnetError,
        `fake EC2: ${subnetError} in subnet ${subnetId} (${this.availabilityZone(subnetId)})`,
      );
    }
    const full = this.faults.fullSubnets.get(subnetId);
    if (full !== undefined) throw subnetFullError(full, subnetId);
    const az = this.availabilityZone(subnetId);
    if (this.faults.typesNotInZone.get(type)?.has(subnetId) === true) {
      const elsewhere = this.subnets
        .filter((sn) => !this.faults.typesNotInZone.get(type)?.has(sn))
        .map((sn) => this.availabilityZone(sn));
      throw new Ec2Error(
        "Unsupported",
        `Your requested instance type (${type}) is not supported in your requested Availability Zone (${az}). ` +
          `Please retry your request by not specifying an Availability Zone or choosing ${elsewhere.join(", ")}.`,
      );
    }
    if (spot !== null && this.faults.unsupportedSpotTypes.has(type)) {
      throw new Ec2Error(
        "Unsupported",
        "The requested configuration is currently not supported. Please check the documentation for supported configurations.",
      );
    }
    if (this.faults.typesAtCapacity.has(type)) {
      throw new Ec2Error(
        "InsufficientInstanceCapacity",
        `Not enough ${type} capacity in ${az} for this request (fake EC2).`,
      );
    }
    const all = [...this.instances.values()];
    const live = all.filter((i) => i.state === "pending" || i.state === "running");
    const counted = all.filter((i) => this.countsTowardLimit(i));
    const max = this.faults.maxInstances;
    if (max > 0 && counted.length + 1 > max) {
      const gone = counted.length - live.length;
      throw new Ec2Error(
        "InstanceLimitExceeded",
        `This request would exceed the instance limit of ${max} (${live.length} pending or running` +
          `${gone > 0 ? `, ${gone} recently terminated` : ""}) (fake EC2).`,
      );
    }
    const maxSpot = this.faults.maxSpotInstances;
    if (spot !== null && maxSpot > 0 && live.filter((i) => i.spot !== null).length + 1 > maxSpot) {
      throw new Ec2Error("MaxSpotInstanceCountExceeded", "Max spot instance count exceeded");
    }
    const vcpuLimit = this.faults.vcpuLimit;
    const used = live.reduce((sum, i) => sum + vcpusOf(i.type), 0);
    if (vcpuLimit > 0 && used + vcpusOf(type) > vcpuLimit) {
      throw new Ec2Error(
        "VcpuLimitExceeded",
        `This request needs ${vcpusOf(type)} vCPUs; ${used} of the limit of ${vcpuLimit} are in use (fake EC2).`,
      );
    }
    if (spot?.maxPrice !== undefined && spot.maxPrice !== null) {
      const latest = this.spotPrices
        .filter((sp) => sp.instanceType === type && sp.availabilityZone === az)
        .sort((a, b) => b.timestamp.getTime() - a.timestamp.getTime())[0];
      if (latest !== undefined && latest.price > Number(spot.maxPrice)) {
        throw new Ec2Error(
          "SpotMaxPriceTooLow",
          `Your maximum price (${spot.maxPrice}) is below the current spot price (${latest.price}) of ${type} in ${az}`,
        );
      }
    }
    if (this.stopping) throw new Ec2Error("Unavailable", "The fake EC2 endpoint is stopping");

    const inst: FakeInstance = {
      id: hexId("i"),
      type,
      state: "pending",
      subnetId,
      privateIp: this.localVms === undefined ? this.nextPrivateIp(subnetId) : "",
      tags,
      keyName: keyName ?? null,
      userData: userDataBytes.toString("utf8"),
      imageId,
      launchTime: new Date(Math.floor(Date.now() / 1000) * 1000),
      spot,
      params: { ...p },
      volumeTags,
    };
    this.record(inst, {
      launchedAt: Date.now(),
      securityGroups,
      clientToken,
      volumes,
      metadataOptions,
      iamProfileArn:
        profileArn ??
        (profileName === undefined ? null : `arn:aws:iam::${OWNER_ID}:instance-profile/${profileName}`),
    });
    if (clientToken !== null) this.clientTokens.set(clientToken, { instanceId: inst.id, requestKey });
    this.history.push({ at: Date.now(), instanceId: inst.id, event: "launched" });

    if (this.localVms !== undefined && key !== undefined) {
      const vm = this.startVm(inst, key.publicKey);
      this.vms.set(inst.id, vm);
      try {
        const address = (await vm).address;
        inst.privateIp = address.replace(/:\d+$/, "");
      } catch (err) {
        this.vms.delete(inst.id);
        this.markTerminated(inst.id, "Server.InternalError", "the instance's local VM failed to start");
        throw new Ec2Error(
          "InternalError",
          `fake EC2: the local VM behind ${inst.id} failed to start: ${(err as Error).message}`,
        );
      }
    }
    const xml = this.reservationXml([inst]);
    if (inst.state === "pending") inst.state = "running";
    return xml;
  }

  private startVm(inst: FakeInstance, publicKey: string): Promise<Instance> {
    const set = this.vmSet;
    if (set === undefined) return Promise.reject(new Error("FakeEc2: localVms needs start() first"));
    return startBackingVm(set, {
      providerType: inst.type,
      vcpus: vcpusOf(inst.type),
      preemptible: inst.spot !== null,
      imageId: inst.imageId,
      tags: { FakeEc2InstanceId: inst.id },
      init: inst.userData,
      publicKey,
      ...(this.imds === undefined ? {} : { imdsEndpoint: this.imds.endpointFor(inst.id) }),
    });
  }

  private instanceXml(inst: FakeInstance): string {
    const extra = this.extraOf(inst);
    const ip = inst.privateIp;
    const groups = itemSet(
      "groupSet",
      extra.securityGroups.map((g) => leaf("groupId", g) + leaf("groupName", g)),
    );
    const mo = extra.metadataOptions;
    return [
      leaf("instanceId", inst.id),
      leaf("imageId", inst.imageId),
      node("instanceState", leaf("code", INSTANCE_STATE_CODES[inst.state]), leaf("name", inst.state)),
      leaf("privateDnsName", ip === "" ? "" : `ip-${ip.replaceAll(".", "-")}.ec2.internal`),
      leaf("dnsName", ""),
      leaf("reason", extra.stateReason === null ? "" : `${extra.stateReason.message}`),
      leaf("keyName", inst.keyName),
      leaf("amiLaunchIndex", 0),
      "<productCodes/>",
      leaf("instanceType", inst.type),
      leaf("launchTime", inst.launchTime),
      node(
        "placement",
        leaf("availabilityZone", this.availabilityZone(inst.subnetId)),
        leaf("groupName", ""),
        leaf("tenancy", "default"),
      ),
      node("monitoring", leaf("state", "disabled")),
      leaf("subnetId", inst.subnetId),
      leaf("vpcId", VPC_ID),
      ip === "" ? "" : leaf("privateIpAddress", ip),
      leaf("sourceDestCheck", true),
      groups,
      extra.stateReason === null
        ? ""
        : node(
            "stateReason",
            leaf("code", extra.stateReason.code),
            leaf("message", extra.stateReason.message),
          ),
      leaf("architecture", "x86_64"),
      leaf("rootDeviceType", "ebs"),
      leaf("rootDeviceName", "/dev/xvda"),
      itemSet(
        "blockDeviceMapping",
        extra.volumes.map((v) =>
          [
            leaf("deviceName", v.device),
            node(
              "ebs",
              leaf("volumeId", v.volumeId),
              leaf("status", inst.state === "terminated" ? "detached" : "attached"),
              leaf("attachTime", inst.launchTime),
              leaf("deleteOnTermination", v.deleteOnTermination),
            ),
          ].join(""),
        ),
      ),
      leaf("virtualizationType", "hvm"),
      leaf("clientToken", extra.clientToken ?? ""),
      Object.keys(inst.tags).length === 0 ? "" : tagSet(inst.tags),
      leaf("hypervisor", "xen"),
      inst.state === "terminated"
        ? "<networkInterfaceSet/>"
        : itemSet("networkInterfaceSet", [
            [
              leaf("networkInterfaceId", extra.networkInterfaceId),
              leaf("subnetId", inst.subnetId),
              leaf("vpcId", VPC_ID),
              leaf("ownerId", OWNER_ID),
              leaf("status", "in-use"),
              ip === "" ? "" : leaf("privateIpAddress", ip),
              groups,
              node(
                "attachment",
                leaf("deviceIndex", 0),
                leaf("status", "attached"),
                leaf("deleteOnTermination", true),
              ),
            ].join(""),
          ]),
      leaf("ebsOptimized", false),
      inst.spot === null
        ? ""
        : leaf("instanceLifecycle", "spot") + leaf("spotInstanceRequestId", extra.spotRequestId),
      extra.iamProfileArn === null
        ? ""
        : node("iamInstanceProfile", leaf("arn", extra.iamProfileArn), leaf("id", "AIPAFAKEEC2PROFILE0001")),
      node(
        "metadataOptions",
        leaf("state", inst.state === "pending" ? "pending" : "applied"),
        leaf("httpTokens", mo["HttpTokens"] ?? "optional"),
        leaf("httpPutResponseHopLimit", mo["HttpPutResponseHopLimit"] ?? "1"),
        leaf("httpEndpoint", mo["HttpEndpoint"] ?? "enabled"),
      ),
    ].join("");
  }

  /** RunInstances' answer (one reservation) or one DescribeInstances reservation per instance. */
  private reservationXml(insts: FakeInstance[]): string {
    const inst = insts[0];
    const extra = inst === undefined ? undefined : this.extraOf(inst);
    return [
      leaf("reservationId", extra?.reservationId),
      leaf("ownerId", OWNER_ID),
      itemSet(
        "groupSet",
        (extra?.securityGroups ?? []).map((g) => leaf("groupId", g) + leaf("groupName", g)),
      ),
      itemSet(
        "instancesSet",
        insts.map((i) => this.instanceXml(i)),
      ),
    ].join("");
  }

  private describeInstances(p: QueryParams): string {
    const ids = listParam(p, "InstanceId");
    const maxResults = maxResultsParam(p, 5, 1000);
    if (ids.length > 0 && maxResults !== undefined) {
      throw new Ec2Error(
        "InvalidParameterCombination",
        "InstanceId and MaxResults may not be specified on the same request",
      );
    }
    const filters = filtersParam(p);
    const predicates = filters.map((f) => this.instanceFilter(f));
    const key = filterKey(p);
    const token = readPageToken(
      p["NextToken"],
      (v): v is { after: number; key: string } =>
        typeof v === "object" &&
        v !== null &&
        typeof (v as { after?: unknown }).after === "number" &&
        (v as { key?: unknown }).key === key,
    );
    const listDelay = this.faults.listDelayMs;
    const unknownYet = (inst: FakeInstance) => this.young(inst, listDelay);
    const candidates =
      ids.length > 0 ? this.knownInstances(ids, "InstanceId", unknownYet) : [...this.instances.values()];
    this.dryRun(p);
    const after = token?.after ?? 0;
    const page: FakeInstance[] = [];
    let more = false;
    for (const inst of candidates) {
      if (!this.visible(inst) || unknownYet(inst) || this.extraOf(inst).seq <= after) continue;
      if (!predicates.every((match) => match(inst))) continue;
      if (maxResults !== undefined && page.length === maxResults) {
        more = true;
        break;
      }
      page.push(inst);
    }
    const last = page[page.length - 1];
    return (
      itemSet(
        "reservationSet",
        page.map((inst) => this.reservationXml([inst])),
      ) +
      (more && last !== undefined ? leaf("nextToken", pageToken({ after: this.extraOf(last).seq, key })) : "")
    );
  }

  private instanceFilter({ name, values }: Filter): (inst: FakeInstance) => boolean {
    if (name.startsWith("tag:")) {
      const tagKey = name.slice(4);
      return (inst) => anyMatch(values, inst.tags[tagKey]);
    }
    switch (name) {
      case "tag-key":
        return (inst) => Object.keys(inst.tags).some((k) => anyMatch(values, k));
      case "tag-value":
        return (inst) => Object.values(inst.tags).some((v) => anyMatch(values, v));
      case "instance-state-name":
        return (inst) => anyMatch(values, inst.state);
      case "instance-state-code":
        return (inst) => anyMatch(values, String(INSTANCE_STATE_CODES[inst.state]));
      case "instance-id":
        return (inst) => anyMatch(values, inst.id);
      case "instance-type":
        return (inst) => anyMatch(values, inst.type);
      case "subnet-id":
        return (inst) => anyMatch(values, inst.subnetId);
      case "availability-zone":
        return (inst) => anyMatch(values, this.availabilityZone(inst.subnetId));
      case "private-ip-address":
        return (inst) => anyMatch(values, inst.privateIp);
      case "key-name":
        return (inst) => anyMatch(values, inst.keyName);
      case "image-id":
        return (inst) => anyMatch(values, inst.imageId);
      case "instance-lifecycle":
        return (inst) => anyMatch(values, inst.spot === null ? null : "spot");
      default:
        throw new Ec2Error("InvalidParameterValue", `The filter '${name}' is invalid (fake EC2)`);
    }
  }

  /** ResourceId.N: instances only here; every one must exist. */
  private taggedResources(p: QueryParams): FakeInstance[] {
    const ids = listParam(p, "ResourceId");
    if (ids.length === 0)
      throw new Ec2Error("MissingParameter", "The request must contain the parameter ResourceId.1");
    for (const id of ids) {
      if (!id.startsWith("i-"))
        throw new Ec2Error("InvalidID", `The ID '${id}' is not valid (the fake EC2 tags instances only)`);
    }
    return this.knownInstances(ids, "ResourceId", (inst) => this.young(inst, this.faults.tagNotFoundMs));
  }

  private createTags(p: QueryParams): string {
    const insts = this.taggedResources(p);
    if (structListParam(p, "Tag").length === 0) {
      throw new Ec2Error("MissingParameter", "The request must contain the parameter Tag.1.Key");
    }
    const tags = tagsParam(p, "Tag");
    for (const inst of insts) {
      const keys = new Set([...Object.keys(inst.tags), ...Object.keys(tags)]);
      if (keys.size > MAX_TAGS_PER_RESOURCE) {
        throw new Ec2Error(
          "TagLimitExceeded",
          `Instance ${inst.id} would have more than ${MAX_TAGS_PER_RESOURCE} tags`,
        );
      }
    }
    this.dryRun(p);
    for (const inst of insts) Object.assign(inst.tags, tags);
    return leaf("return", true);
  }

  private deleteTags(p: QueryParams): string {
    const insts = this.taggedResources(p);
    const members = structListParam(p, "Tag").map(({ index, params }) => ({
      key: required(params, "Key", `Tag.${index}.Key`),
      value: params["Value"],
    }));
    this.dryRun(p);
    for (const inst of insts) {
      if (members.length === 0) {
        // No Tag at all: every tag goes.
        for (const k of Object.keys(inst.tags)) delete inst.tags[k];
        continue;
      }
      for (const { key, value } of members) {
        if (value === undefined || inst.tags[key] === value) delete inst.tags[key];
      }
    }
    return leaf("return", true);
  }

  private terminateInstances(p: QueryParams): string {
    const ids = listParam(p, "InstanceId");
    if (ids.length === 0)
      throw new Ec2Error("MissingParameter", "The request must contain the parameter InstanceId.1");
    const insts = this.knownInstances(ids, "InstanceId", (inst) =>
      this.young(inst, this.faults.terminateNotFoundMs),
    );
    this.dryRun(p);
    const items: string[] = [];
    const finish: (() => void)[] = [];
    for (const inst of insts) {
      const previous = inst.state;
      if (previous === "pending" || previous === "running") {
        inst.state = "shutting-down";
        this.history.push({ at: Date.now(), instanceId: inst.id, event: "terminating" });
        const vm = this.vms.get(inst.id);
        if (vm !== undefined) {
          const done = (async () => {
            try {
              await (await vm).destroy();
            } catch {
              // It failed to start, or is gone already: terminated either way.
            }
            this.vms.delete(inst.id);
            this.markTerminated(inst.id, "Client.UserInitiatedShutdown", "User initiated shutdown");
          })();
          this.background.add(done);
          void done.finally(() => this.background.delete(done));
        } else {
          finish.push(() =>
            this.markTerminated(inst.id, "Client.UserInitiatedShutdown", "User initiated shutdown"),
          );
        }
      }
      const state = (s: FakeInstanceState) => leaf("code", INSTANCE_STATE_CODES[s]) + leaf("name", s);
      items.push(
        leaf("instanceId", inst.id) +
          node("currentState", state(inst.state)) +
          node("previousState", state(previous)),
      );
    }
    const xml = itemSet("instancesSet", items);
    for (const f of finish) f();
    return xml;
  }

  // ---- key pairs ----

  private metaOf(name: string, publicKey: string): KeyMeta {
    let meta = this.keyMeta.get(name);
    if (meta === undefined) {
      meta = {
        id: hexId("key"),
        type: publicKey.startsWith("ssh-ed25519") ? "ed25519" : "rsa",
        created: new Date(),
      };
      this.keyMeta.set(name, meta);
    }
    return meta;
  }

  private importKeyPair(p: QueryParams): string {
    const name = required(p, "KeyName");
    if (name.length > 255 || !/^[\x20-\x7e]+$/.test(name)) {
      throw invalidValue("KeyName", name, "Key names have 1 to 255 printable ASCII characters.");
    }
    const material = required(p, "PublicKeyMaterial");
    if (!isBase64(material)) throw keyFormatError("PublicKeyMaterial is not base64");
    const parsed = parsePublicKey(Buffer.from(material, "base64").toString("utf8"));
    if (this.keyPairs.has(name)) {
      throw new Ec2Error("InvalidKeyPair.Duplicate", `The key pair '${name}' already exists`);
    }
    this.dryRun(p);
    this.keyPairs.set(name, { name, fingerprint: parsed.fingerprint, publicKey: parsed.line });
    const meta: KeyMeta = { id: hexId("key"), type: parsed.type, created: new Date() };
    this.keyMeta.set(name, meta);
    return leaf("keyFingerprint", parsed.fingerprint) + leaf("keyName", name) + leaf("keyPairId", meta.id);
  }

  private describeKeyPairs(p: QueryParams): string {
    const names = listParam(p, "KeyName");
    const ids = listParam(p, "KeyPairId");
    const filters = filtersParam(p);
    const all = [...this.keyPairs.values()].map((k) => ({ ...k, meta: this.metaOf(k.name, k.publicKey) }));
    for (const n of names) {
      if (!this.keyPairs.has(n))
        throw new Ec2Error("InvalidKeyPair.NotFound", `The key pair '${n}' does not exist`);
    }
    for (const id of ids) {
      if (!all.some((k) => k.meta.id === id)) {
        throw new Ec2Error("InvalidKeyPair.NotFound", `The key pair ID '${id}' does not exist`);
      }
    }
    const predicates = filters.map(({ name, values }): ((k: (typeof all)[number]) => boolean) => {
      switch (name) {
        case "fingerprint":
          return (k) => anyMatch(values, k.fingerprint);
        case "key-name":
          return (k) => anyMatch(values, k.name);
        case "key-pair-id":
          return (k) => anyMatch(values, k.meta.id);
        case "key-type":
          return (k) => anyMatch(values, k.meta.type);
        default:
          throw new Ec2Error("InvalidParameterValue", `The filter '${name}' is invalid (fake EC2)`);
      }
    });
    this.dryRun(p);
    const includePublicKey = p["IncludePublicKey"] === "true";
    const selected = all.filter(
      (k) =>
        (names.length === 0 || names.includes(k.name)) &&
        (ids.length === 0 || ids.includes(k.meta.id)) &&
        predicates.every((match) => match(k)),
    );
    return itemSet(
      "keySet",
      selected.map((k) =>
        [
          leaf("keyPairId", k.meta.id),
          leaf("keyType", k.meta.type),
          leaf("keyName", k.name),
          leaf("keyFingerprint", k.fingerprint),
          leaf("createTime", k.meta.created),
          includePublicKey ? leaf("publicKey", k.publicKey) : "",
        ].join(""),
      ),
    );
  }

  // ---- spot prices ----

  private describeSpotPriceHistory(p: QueryParams): string {
    const types = listParam(p, "InstanceType");
    const products = listParam(p, "ProductDescription");
    const zone = p["AvailabilityZone"];
    const start = dateParam(p, "StartTime");
    const end = dateParam(p, "EndTime");
    if (start !== undefined && end !== undefined && start > end) {
      throw new Ec2Error("InvalidParameterValue", "StartTime must not be later than EndTime");
    }
    const maxResults = maxResultsParam(p, 1, 1000) ?? 1000;
    const filters = filtersParam(p);
    const key = filterKey(p);
    const token = readPageToken(
      p["NextToken"],
      (v): v is { offset: number; key: string } =>
        typeof v === "object" &&
        v !== null &&
        typeof (v as { offset?: unknown }).offset === "number" &&
        (v as { key?: unknown }).key === key,
    );
    const product = "Linux/UNIX";
    const predicates = filters.map(({ name, values }): ((sp: FakeSpotPrice) => boolean) => {
      switch (name) {
        case "instance-type":
          return (sp) => anyMatch(values, sp.instanceType);
        case "availability-zone":
          return (sp) => anyMatch(values, sp.availabilityZone);
        case "product-description":
          return () => anyMatch(values, product);
        default:
          throw new Ec2Error("InvalidParameterValue", `The filter '${name}' is invalid (fake EC2)`);
      }
    });
    this.dryRun(p);
    if (products.length > 0 && !products.some((d) => d === product || d === `${product} (Amazon VPC)`)) {
      return itemSet("spotPriceHistorySet", []);
    }
    const matching = this.spotPrices.filter(
      (sp) =>
        (types.length === 0 || types.includes(sp.instanceType)) &&
        (zone === undefined || sp.availabilityZone === zone) &&
        (end === undefined || sp.timestamp <= end) &&
        predicates.every((match) => match(sp)),
    );
    // In the window, plus, per type and zone, the price in effect at StartTime.
    const inWindow = matching.filter((sp) => {
      if (start === undefined || sp.timestamp >= start) return true;
      return !matching.some(
        (other) =>
          other !== sp &&
          other.instanceType === sp.instanceType &&
          other.availabilityZone === sp.availabilityZone &&
          other.timestamp < start &&
          other.timestamp > sp.timestamp,
      );
    });
    inWindow.sort((a, b) => b.timestamp.getTime() - a.timestamp.getTime());
    const offset = token?.offset ?? 0;
    const page = inWindow.slice(offset, offset + maxResults);
    const more = offset + maxResults < inWindow.length;
    return (
      leaf("nextToken", more ? pageToken({ offset: offset + maxResults, key }) : undefined) +
      itemSet(
        "spotPriceHistorySet",
        page.map((sp) =>
          [
            leaf("instanceType", sp.instanceType),
            leaf("productDescription", product),
            leaf("spotPrice", sp.price.toFixed(6)),
            leaf("timestamp", sp.timestamp),
            leaf("availabilityZone", sp.availabilityZone),
          ].join(""),
        ),
      )
    );
  }
}

function readBody(req: IncomingMessage): Promise<string> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    req.on("data", (d: Buffer) => {
      size += d.length;
      if (size > MAX_BODY_BYTES) {
        reject(
          new Ec2Error("InvalidParameterValue", `The request body is larger than ${MAX_BODY_BYTES} bytes`),
        );
        req.resume();
        return;
      }
      chunks.push(d);
    });
    req.on("end", () => resolve(Buffer.concat(chunks).toString("utf8")));
    req.on("error", reject);
  });
}
