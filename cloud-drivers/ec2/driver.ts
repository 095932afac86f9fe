/**
 * The `ec2` cloud: instances are EC2 instances, created and found through @aws-sdk/client-ec2 with the SDK's
 * own retries off (the pool owns retry policy). Every EC2 error goes through classifyEc2Error (errors.ts).
 * The registry imports this module lazily, so processes that do not use EC2 never load the SDK.
 * Over 700 lines because each call (run, describe with paging, terminate, tags, spot and capacity answers)
 * maps EC2's shapes to the driver interface here, with what EC2's eventual consistency and lost answers need
 * (an idempotent RunInstances, tag retries); errors and parameters are their own modules.
 */
import { createHash, createPublicKey, randomBytes } from "node:crypto";
import {
  type _InstanceType,
  type BlockDeviceMapping,
  CreateTagsCommand,
  DeleteTagsCommand,
  DescribeInstancesCommand,
  DescribeKeyPairsCommand,
  DescribeSpotPriceHistoryCommand,
  EC2Client,
  type EC2ClientConfig,
  type Instance as Ec2ApiInstance,
  ImportKeyPairCommand,
  RunInstancesCommand,
  type RunInstancesCommandInput,
  type RunInstancesCommandOutput,
  type Tag,
  TerminateInstancesCommand,
} from "@aws-sdk/client-ec2";
import type { Clock } from "../../lib/clock.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { Logger } from "../../lib/logger.ts";
import { CapacityError, CloudError } from "../errors.ts";
import {
  type CloudDriver,
  type Instance,
  type InstanceSet,
  type InstanceType,
  type PricePoint,
  TAG,
  type Tags,
} from "../types.ts";
import { classifyEc2Error, ec2ErrorInfo, isLostAnswer, isSubnetSpecific, ThrottleBackoff } from "./errors.ts";
import { type Ec2Parameters, parseEc2Parameters } from "./params.ts";

/** States listed by instances(): shutting-down and terminated instances are gone for the dispatcher. */
export const LISTED_STATES = ["pending", "running", "stopping", "stopped"] as const;
/** The device name of the added-scratch EBS volume. */
export const SCRATCH_DEVICE = "/dev/xvdt";
/** Prefix of the key pair name the driver imports (then the first 32 hex digits of the key's SHA-256). */
export const KEY_NAME_PREFIX = "dispatch-cloud-";
const GiB = 2 ** 30;
const HOURS_PER_MONTH = 30 * 24;
/** After a failed spot price refresh, try again after this long (or the update interval, if shorter). */
const PRICE_RETRY_MS = 60_000;
/** RunInstances sends per subnet: a request whose answer was lost is sent once more, with the same ClientToken. */
export const RUN_ATTEMPTS = 2;
/**
 * EC2's eventual consistency: an instance launched less than this long ago may be unknown to CreateTags and
 * DeleteTags for a while; those are sent again after each of TAG_RETRY_DELAYS_MS.
 */
export const TAG_RETRY_WINDOW_MS = 5 * 60_000;
export const TAG_RETRY_DELAYS_MS = [1000, 2000, 4000] as const;
/** Fixed input of the ClientToken hash (a version, so a new scheme never collides with an old one). */
const CLIENT_TOKEN_PREFIX = "dispatch-cloud ec2 RunInstances ClientToken v1";

/**
 * The RunInstances ClientToken of a create: a one-way hash of the instance secret (and the subnet tried, so each
 * subnet's launch is its own request), 64 ASCII characters as EC2 allows. A send repeated after a lost answer
 * carries the same token and gets the first launch back instead of a second instance; the token reveals nothing
 * of the secret.
 */
export function ec2ClientToken(secret: string, subnetId: string | undefined): string {
  return createHash("sha256")
    .update(`${CLIENT_TOKEN_PREFIX}\0${secret}\0${subnetId ?? "(default subnet)"}`)
    .digest("hex");
}

/** The instance secret among a create's tags (`<prefix>InstanceSecret`), if there is exactly one. */
function instanceSecretOf(tags: Tags): string | undefined {
  const found = Object.entries(tags).filter(([k, v]) => k.endsWith(TAG.instanceSecret) && v !== "");
  return found.length === 1 ? found[0]![1] : undefined;
}

export const ec2Driver: CloudDriver = {
  async instanceSet(params, instanceSetId, _sharedTags, deps) {
    const p = parseEc2Parameters(params);
    const log = deps.logger.child({ component: "ec2-driver", instanceSetId });
    return new Ec2InstanceSet(p, deps.clock, log);
  },
};

/** An SSH public key as EC2 sees it: its authorized_keys line and the fingerprints EC2 may show for it. */
export interface Ec2PublicKey {
  type: "ssh-rsa" | "ssh-ed25519";
  /** `type base64` (no comment): what ImportKeyPair gets. */
  line: string;
  /** The fingerprints to look for (DescribeKeyPairs filter values), EC2's own form first. */
  fingerprints: string[];
  /** The name to import it under. */
  keyName: string;
}

/**
 * Parses an authorized_keys line and computes EC2's fingerprints of it. EC2 fingerprints an imported key
 * as: RSA, the MD5 of the public key's DER (SubjectPublicKeyInfo) in colon-separated hex; ED25519, the
 * base64 SHA-256 of the SSH key blob (with padding; the unpadded OpenSSH form is asked for too). For RSA,
 * the MD5 of the SSH blob (RFC 4716's form, used by some EC2-compatible clouds) is asked for as well.
 */
export function ec2PublicKey(publicKey: string): Ec2PublicKey {
  const fields = publicKey.trim().split(/\s+/);
  const type = fields[0];
  const blob = Buffer.from(fields[1] ?? "", "base64");
  if (type !== "ssh-rsa" && type !== "ssh-ed25519") {
    throw new DispatchCloudError(
      "ssh.invalid_key",
      `ec2 driver: EC2 imports only ssh-rsa and ssh-ed25519 public keys; the dispatcher's key is ${JSON.stringify(type ?? "")}`,
      { path: "dispatcher.privateKey" },
    );
  }
  const parts = sshFields(blob);
  if (parts === undefined || parts[0]?.toString() !== type) {
    throw new DispatchCloudError(
      "ssh.invalid_key",
      "ec2 driver: the dispatcher's public key cannot be parsed",
      {
        path: "dispatcher.privateKey",
      },
    );
  }
  const colonHex = (digest: Buffer) => digest.toString("hex").replace(/(..)(?!$)/g, "$1:");
  let fingerprints: string[];
  if (type === "ssh-rsa") {
    const [, e, n] = parts;
    if (e === undefined || n === undefined) {
      throw new DispatchCloudError(
        "ssh.invalid_key",
        "ec2 driver: the dispatcher's RSA public key is truncated",
        {
          path: "dispatcher.privateKey",
        },
      );
    }
    const der = createPublicKey({
      key: { kty: "RSA", e: unsigned(e).toString("base64url"), n: unsigned(n).toString("base64url") },
      format: "jwk",
    }).export({ type: "spki", format: "der" });
    fingerprints = [
      colonHex(createHash("md5").update(der).digest()),
      colonHex(createHash("md5").update(blob).digest()),
    ];
  } else {
    const sha = createHash("sha256").update(blob).digest("base64");
    fingerprints = [sha, sha.replace(/=+$/, "")];
  }
  return {
    type,
    line: `${type} ${blob.toString("base64")}`,
    fingerprints,
    keyName: KEY_NAME_PREFIX + createHash("sha256").update(blob).digest("hex").slice(0, 32),
  };
}

/** The length-prefixed fields of an SSH wire-format blob, or undefined if it is malformed. */
function sshFields(blob: Buffer): Buffer[] | undefined {
  const out: Buffer[] = [];
  let at = 0;
  while (at < blob.length) {
    if (at + 4 > blob.length) return undefined;
    const len = blob.readUInt32BE(at);
    if (at + 4 + len > blob.length) return undefined;
    out.push(blob.subarray(at + 4, at + 4 + len));
    at += 4 + len;
  }
  return out;
}

/** An SSH mpint without its sign byte(s). */
function unsigned(mpint: Buffer): Buffer {
  let i = 0;
  while (i < mpint.length - 1 && mpint[i] === 0) i++;
  return mpint.subarray(i);
}

/** The EC2 quota group rule: longest configured prefix, else the alphabetic prefix; "-spot" when preemptible. */
export function ec2QuotaGroup(
  type: Pick<InstanceType, "providerType" | "preemptible">,
  groups: Readonly<Record<string, string>>,
): string {
  const lower = type.providerType.toLowerCase();
  let best: string | undefined;
  for (const prefix of Object.keys(groups)) {
    if (lower.startsWith(prefix) && (best === undefined || prefix.length > best.length)) best = prefix;
  }
  const group = best !== undefined ? (groups[best] ?? best) : (/^[a-z]+/.exec(lower)?.[0] ?? lower);
  return type.preemptible ? `${group}-spot` : group;
}

/** Sorted by time, one point per time (the last wins), consecutive equal prices merged. */
export function normalizePrices(points: readonly PricePoint[]): PricePoint[] {
  const byTime = new Map<number, number>();
  for (const p of points) byTime.set(p.startTime, p.price);
  const sorted = [...byTime.entries()].sort((a, b) => a[0] - b[0]);
  const out: PricePoint[] = [];
  for (const [startTime, price] of sorted) {
    if (out.at(-1)?.price !== price) out.push({ startTime, price });
  }
  return out;
}

interface SpotPrices {
  points: PricePoint[];
  /** No refresh before this time (clock ms). */
  nextRefresh: number;
}

class Ec2InstanceSet implements InstanceSet {
  readonly client: EC2Client;
  private readonly backoff = new ThrottleBackoff();
  /** Key pair names by key line: one lookup/import per key, shared by concurrent creates. */
  private readonly keyNames = new Map<string, Promise<string>>();
  private subnetCursor = 0;
  /** Spot price history by `<instance type> <availability zone>`, shared by every instance. */
  private readonly spotPrices = new Map<string, SpotPrices>();
  private readonly secrets: string[];
  /** Aborted by stop(): ends the waits between tag retries. */
  readonly stopped = new AbortController();
  /** ClientTokens of the creates in flight: their instances are left out of lists until the create returns. */
  private readonly launching = new Set<string>();

  constructor(
    readonly p: Ec2Parameters,
    readonly clock: Clock,
    readonly log: Logger,
  ) {
    const config: EC2ClientConfig = {
      region: p.region,
      maxAttempts: 1,
      requestHandler: {
        requestTimeout: p.requestTimeoutMs,
        connectionTimeout: p.requestTimeoutMs,
        throwOnRequestTimeout: true,
      },
    };
    if (p.endpoint !== undefined) config.endpoint = p.endpoint;
    if (p.credentials !== undefined) {
      config.credentials = {
        accessKeyId: p.credentials.accessKeyId,
        secretAccessKey: p.credentials.secretAccessKey,
      };
    }
    this.client = new EC2Client(config);
    this.secrets = p.credentials === undefined ? [] : [p.credentials.secretAccessKey];
  }

  /** One EC2 call: success resets the throttle backoff; failure is classified once. */
  async call<T>(
    operation: string,
    send: () => Promise<T>,
    type?: InstanceType,
    raw?: (err: unknown) => boolean,
  ): Promise<T> {
    try {
      const out = await send();
      this.backoff.reset();
      return out;
    } catch (err) {
      if (raw?.(err)) throw err;
      throw this.classify(operation, err, type);
    }
  }

  classify(operation: string, err: unknown, type?: InstanceType): Error {
    return classifyEc2Error(err, {
      operation,
      now: this.clock.now(),
      backoff: this.backoff,
      ...(type === undefined
        ? {}
        : {
            instanceType: { name: type.name, providerType: type.providerType },
            quotaGroup: this.quotaGroup(type),
          }),
      secrets: this.secrets,
      timeoutMs: this.p.requestTimeoutMs,
    });
  }

  quotaGroup(type: InstanceType): string {
    return ec2QuotaGroup(type, this.p.instanceTypeQuotaGroups);
  }

  async stop(): Promise<void> {
    this.stopped.abort();
    this.client.destroy();
  }

  async create(
    type: InstanceType,
    imageId: string,
    tags: Tags,
    initCommand: string,
    publicKey: string,
  ): Promise<Instance> {
    const keyName = publicKey.trim() === "" ? undefined : await this.keyName(publicKey);
    const tagList = toTagList(tags);
    const input: RunInstancesCommandInput = {
      MinCount: 1,
      MaxCount: 1,
      ImageId: imageId,
      InstanceType: type.providerType as _InstanceType,
      UserData: Buffer.from(initCommand).toString("base64"),
      InstanceInitiatedShutdownBehavior: "terminate",
      MetadataOptions: { HttpTokens: "required", HttpEndpoint: "enabled" },
    };
    // The tags go on the instance and its volumes at launch (EC2 refuses a tag specification without tags).
    if (tagList.length > 0) {
      input.TagSpecifications = [
        { ResourceType: "instance", Tags: tagList },
        { ResourceType: "volume", Tags: tagList },
      ];
    }
    if (keyName !== undefined) input.KeyName = keyName;
    if (this.p.iamInstanceProfile !== undefined) input.IamInstanceProfile = this.p.iamInstanceProfile;
    if (type.addedScratch > 0) {
      const mapping: BlockDeviceMapping = {
        DeviceName: SCRATCH_DEVICE,
        Ebs: {
          VolumeSize: Math.ceil(type.addedScratch / GiB),
          VolumeType: this.p.ebsVolumeType,
          DeleteOnTermination: true,
        },
      };
      input.BlockDeviceMappings = [mapping];
    }
    if (type.preemptible) {
      input.InstanceMarketOptions = {
        MarketType: "spot",
        SpotOptions: {
          InstanceInterruptionBehavior: "terminate",
          SpotInstanceType: "one-time",
          MaxPrice: String(type.price),
        },
      };
    }
    // Without a secret among the tags (not the pool's creates), a token of this create alone.
    const tokenSeed = instanceSecretOf(tags) ?? randomBytes(20).toString("hex");
    const subnets: (string | undefined)[] = this.p.subnetIds.length > 0 ? this.p.subnetIds : [undefined];
    const tokens = subnets.map((subnetId) => ec2ClientToken(tokenSeed, subnetId));
    for (const t of tokens) this.launching.add(t);
    try {
      return await this.launch(input, type, tags, subnets, tokens);
    } finally {
      for (const t of tokens) this.launching.delete(t);
    }
  }

  /**
   * RunInstances in each subnet in turn (from the next one round-robin) until one launches the instance or fails
   * for a reason that is not the subnet's.
   */
  private async launch(
    input: RunInstancesCommandInput,
    type: InstanceType,
    tags: Tags,
    subnets: readonly (string | undefined)[],
    tokens: readonly string[],
  ): Promise<Instance> {
    const start = this.subnetCursor++ % subnets.length;
    /** An instance-type capacity error from any subnet: another type may still launch (in that subnet). */
    let typeCapacity: Error | undefined;
    let lastError: Error | undefined;
    for (let i = 0; i < subnets.length; i++) {
      const at = (start + i) % subnets.length;
      const subnetId = subnets[at];
      input.NetworkInterfaces = [
        {
          DeviceIndex: 0,
          AssociatePublicIpAddress: false,
          DeleteOnTermination: true,
          ...(subnetId === undefined ? {} : { SubnetId: subnetId }),
          ...(this.p.securityGroupIds.length === 0 ? {} : { Groups: [...this.p.securityGroupIds] }),
        },
      ];
      input.ClientToken = tokens[at];
      let out: RunInstancesCommandOutput;
      try {
        out = await this.runInstances(input, type, subnetId);
      } catch (err) {
        const classified = this.classify("RunInstances", err, type);
        if (!isSubnetSpecific(err)) throw classified;
        lastError = classified;
        if (classified instanceof CapacityError && classified.scope === "instanceType") {
          typeCapacity = classified;
        }
        if (i < subnets.length - 1) {
          this.log.warn(
            { subnetId, code: ec2ErrorInfo(err).code, instanceType: type.name },
            "ec2 RunInstances failed in a subnet; trying the next",
          );
        }
        continue;
      }
      const inst = out.Instances?.[0];
      if (inst?.InstanceId === undefined) {
        throw new CloudError("ec2 RunInstances: the answer names no instance");
      }
      this.log.info(
        { instanceId: inst.InstanceId, instanceType: type.name, subnetId },
        "ec2 instance created",
      );
      return new Ec2Instance(this, inst, tags);
    }
    // Every subnet failed for a reason of its own: a type at capacity somewhere lets the pool try another type;
    // otherwise the last subnet's error counts (out of addresses everywhere: capacity for every type).
    throw typeCapacity ?? lastError ?? new CloudError("ec2 RunInstances: no subnet to try");
  }

  /**
   * One RunInstances in one subnet. A send that got no answer at all (timeout, dropped connection) may have
   * launched the instance: it is sent once more with the same ClientToken, which gets that launch back rather than
   * a second instance. Errors are EC2's or the SDK's, unclassified.
   */
  private async runInstances(
    input: RunInstancesCommandInput,
    type: InstanceType,
    subnetId: string | undefined,
  ): Promise<RunInstancesCommandOutput> {
    for (let attempt = 1; ; attempt++) {
      try {
        const out = await this.client.send(new RunInstancesCommand(input));
        this.backoff.reset();
        if (attempt > 1) {
          this.log.info(
            { instanceId: out.Instances?.[0]?.InstanceId, instanceType: type.name, subnetId, attempt },
            "ec2 RunInstances answered after a lost answer (same ClientToken: one launch)",
          );
        }
        return out;
      } catch (err) {
        if (attempt >= RUN_ATTEMPTS || !isLostAnswer(err)) throw err;
        this.log.warn(
          {
            instanceType: type.name,
            subnetId,
            error: this.classify("RunInstances", err, type).message,
          },
          "ec2 RunInstances got no answer; sending it again with the same ClientToken",
        );
      }
    }
  }

  /** The key pair holding `publicKey`: found by fingerprint, else imported once. */
  private keyName(publicKey: string): Promise<string> {
    const key = ec2PublicKey(publicKey);
    let name = this.keyNames.get(key.line);
    if (name === undefined) {
      name = this.findOrImportKey(key);
      this.keyNames.set(key.line, name);
      // A failed lookup is not cached: the next create tries again.
      name.catch(() => {
        if (this.keyNames.get(key.line) === name) this.keyNames.delete(key.line);
      });
    }
    return name;
  }

  private async findOrImportKey(key: Ec2PublicKey): Promise<string> {
    const found = await this.call("DescribeKeyPairs", () =>
      this.client.send(
        new DescribeKeyPairsCommand({ Filters: [{ Name: "fingerprint", Values: key.fingerprints }] }),
      ),
    );
    const existing = found.KeyPairs?.find((k) => k.KeyName !== undefined)?.KeyName;
    if (existing !== undefined) {
      this.log.info({ keyName: existing }, "ec2 key pair found by fingerprint");
      return existing;
    }
    try {
      await this.call(
        "ImportKeyPair",
        () =>
          this.client.send(
            new ImportKeyPairCommand({ KeyName: key.keyName, PublicKeyMaterial: Buffer.from(key.line) }),
          ),
        undefined,
        (err) => ec2ErrorInfo(err).code === "InvalidKeyPair.Duplicate",
      );
      this.log.info({ keyName: key.keyName }, "ec2 key pair imported");
    } catch (err) {
      if (ec2ErrorInfo(err).code !== "InvalidKeyPair.Duplicate") throw err;
      // Imported meanwhile (another dispatcher): the name is derived from the key, so it is this key.
      this.log.info({ keyName: key.keyName }, "ec2 key pair already imported");
    }
    return key.keyName;
  }

  async instances(filter: Tags): Promise<Instance[]> {
    const Filters = [
      // EC2 filter values are patterns (* and ? are wildcards): escape them to match the value itself.
      ...Object.entries(filter).map(([k, v]) => ({
        Name: `tag:${k}`,
        Values: [v.replace(/[\\*?]/g, "\\$&")],
      })),
      { Name: "instance-state-name", Values: [...LISTED_STATES] },
    ];
    const result: Ec2Instance[] = [];
    let NextToken: string | undefined;
    do {
      const page = await this.call("DescribeInstances", () =>
        this.client.send(
          new DescribeInstancesCommand({
            Filters,
            MaxResults: 1000,
            ...(NextToken === undefined ? {} : { NextToken }),
          }),
        ),
      );
      for (const reservation of page.Reservations ?? []) {
        for (const inst of reservation.Instances ?? []) {
          const state = inst.State?.Name;
          if (inst.InstanceId === undefined || state === "shutting-down" || state === "terminated") continue;
          // Launched by a create still in flight (its answer lost, being asked again): the create may yet fail,
          // and the pool would then shut down an instance it had already handed bundles. Listed once it returns.
          if (inst.ClientToken !== undefined && this.launching.has(inst.ClientToken)) continue;
          result.push(new Ec2Instance(this, inst, fromTagList(inst.Tags)));
        }
      }
      NextToken = page.NextToken === "" ? undefined : page.NextToken;
    } while (NextToken !== undefined);
    await this.refreshSpotPrices(result);
    return result;
  }

  /** The spot price history of (type, zone), normalised; empty until fetched. */
  spotPriceHistory(providerType: string, zone: string): readonly PricePoint[] {
    return this.spotPrices.get(`${providerType} ${zone}`)?.points ?? [];
  }

  /**
   * Fetches the spot price history of each (type, zone) of the listed spot instances whose history is older
   * than spotPriceUpdateInterval: from the earliest launch among them (and at least 3 intervals back), so a
   * point in force at every launch is known. Failures are logged; the old history stays.
   */
  private async refreshSpotPrices(instances: readonly Ec2Instance[]): Promise<void> {
    const now = this.clock.now();
    const interval = this.p.spotPriceUpdateIntervalMs;
    const due = new Map<string, { providerType: string; zone: string; since: number }>();
    for (const inst of instances) {
      if (!inst.spot || inst.zone === undefined) continue;
      const key = `${inst.providerType} ${inst.zone}`;
      if ((this.spotPrices.get(key)?.nextRefresh ?? Number.NEGATIVE_INFINITY) > now) continue;
      const since = Math.min(inst.launchTime, now - 3 * interval);
      const d = due.get(key);
      if (d === undefined) due.set(key, { providerType: inst.providerType, zone: inst.zone, since });
      else d.since = Math.min(d.since, since);
    }
    for (const [key, { providerType, zone, since }] of due) {
      const old = this.spotPrices.get(key)?.points ?? [];
      try {
        const points: PricePoint[] = [];
        let NextToken: string | undefined;
        do {
          const page = await this.call("DescribeSpotPriceHistory", () =>
            this.client.send(
              new DescribeSpotPriceHistoryCommand({
                InstanceTypes: [providerType as _InstanceType],
                AvailabilityZone: zone,
                ProductDescriptions: ["Linux/UNIX"],
                StartTime: new Date(since),
                MaxResults: 1000,
                ...(NextToken === undefined ? {} : { NextToken }),
              }),
            ),
          );
          for (const sp of page.SpotPriceHistory ?? []) {
            const price = Number(sp.SpotPrice);
            if (sp.Timestamp === undefined || !Number.isFinite(price)) continue;
            if (sp.InstanceType !== undefined && sp.InstanceType !== providerType) continue;
            if (sp.AvailabilityZone !== undefined && sp.AvailabilityZone !== zone) continue;
            points.push({ startTime: sp.Timestamp.getTime(), price });
          }
          NextToken = page.NextToken === "" ? undefined : page.NextToken;
        } while (NextToken !== undefined);
        // Keep the point in force at `since` and everything after it: older points matter to no instance.
        const all = normalizePrices([...old, ...points]);
        const first = Math.max(
          0,
          all.findLastIndex((pt) => pt.startTime <= since),
        );
        this.spotPrices.set(key, { points: all.slice(first), nextRefresh: now + interval });
      } catch (err) {
        this.log.warn({ err, instanceType: providerType, zone }, "cannot refresh the ec2 spot price history");
        this.spotPrices.set(key, { points: old, nextRefresh: now + Math.min(interval, PRICE_RETRY_MS) });
      }
    }
  }

  /** Dollars per hour of the added-scratch volume of `type`. */
  ebsHourly(type: InstanceType): number {
    return type.addedScratch > 0
      ? (this.p.ebsPrice * Math.ceil(type.addedScratch / GiB)) / HOURS_PER_MONTH
      : 0;
  }
}

class Ec2Instance implements Instance {
  readonly id: string;
  readonly address: string;
  readonly remoteUser: string;
  readonly providerType: string;
  readonly spot: boolean;
  readonly zone: string | undefined;
  /** Milliseconds since the epoch (the launch time EC2 reports, or now). */
  readonly launchTime: number;
  private currentTags: Tags;

  constructor(
    private readonly set: Ec2InstanceSet,
    inst: Ec2ApiInstance,
    tags: Tags,
  ) {
    this.id = inst.InstanceId ?? "";
    this.address = inst.PrivateIpAddress ?? "";
    this.remoteUser = set.p.adminUsername;
    this.providerType = inst.InstanceType ?? "";
    this.spot = inst.InstanceLifecycle === "spot";
    this.zone = inst.Placement?.AvailabilityZone;
    this.launchTime = inst.LaunchTime?.getTime() ?? set.clock.now();
    this.currentTags = { ...tags };
  }

  get tags(): Tags {
    return this.currentTags;
  }

  /** Replaces the tag map: CreateTags for new or changed pairs, DeleteTags for keys no longer there. */
  async setTags(tags: Tags): Promise<void> {
    const old = this.currentTags;
    const changed = Object.entries(tags).filter(([k, v]) => old[k] !== v || !Object.hasOwn(old, k));
    // aws:* tags belong to AWS; they can be neither written nor deleted.
    const removed = Object.keys(old).filter((k) => !Object.hasOwn(tags, k) && !k.startsWith("aws:"));
    const { client } = this.set;
    if (changed.length > 0) {
      await this.tagCall("CreateTags", () =>
        client.send(
          new CreateTagsCommand({
            Resources: [this.id],
            Tags: changed.map(([Key, Value]) => ({ Key, Value })),
          }),
        ),
      );
      this.currentTags = { ...old, ...Object.fromEntries(changed) };
    }
    if (removed.length > 0) {
      await this.tagCall("DeleteTags", () =>
        client.send(new DeleteTagsCommand({ Resources: [this.id], Tags: removed.map((Key) => ({ Key })) })),
      );
    }
    const kept = Object.entries(old).filter(([k]) => k.startsWith("aws:") && !Object.hasOwn(tags, k));
    this.currentTags = { ...Object.fromEntries(kept), ...tags };
  }

  /**
   * CreateTags or DeleteTags (both idempotent). While the instance is new (TAG_RETRY_WINDOW_MS after its launch),
   * InvalidInstanceID.NotFound is EC2 not knowing it everywhere yet: the call is sent again after each of
   * TAG_RETRY_DELAYS_MS. Then, or for any other error, it fails (classified); the tags this instance remembers
   * stay as they were, so the next setTags sends the change again.
   */
  private async tagCall<T>(operation: string, send: () => Promise<T>): Promise<T> {
    const { set } = this;
    for (let attempt = 0; ; attempt++) {
      try {
        return await set.call(operation, send, undefined, (err) => isNotFound(err));
      } catch (err) {
        const delay = TAG_RETRY_DELAYS_MS[attempt];
        const young = set.clock.now() - this.launchTime < TAG_RETRY_WINDOW_MS;
        if (!isNotFound(err)) throw err;
        if (delay === undefined || !young || set.stopped.signal.aborted) throw set.classify(operation, err);
        set.log.info(
          { instanceId: this.id, operation, retryInMs: delay },
          "ec2 does not know the new instance yet (eventual consistency); tagging it again shortly",
        );
        try {
          await set.clock.sleep(delay, set.stopped.signal);
        } catch {
          throw set.classify(operation, err);
        }
      }
    }
  }

  /**
   * TerminateInstances (idempotent: an instance already shutting down or terminated is fine). An instance EC2
   * does not know (InvalidInstanceID.NotFound) is NOT taken as gone: EC2's eventual consistency means one
   * launched moments ago may be unknown to this call and still run. It fails as a CloudError; the pool destroys
   * the instance again while the cloud still lists it, and forgets it once a list no longer shows it.
   */
  async destroy(): Promise<void> {
    await this.set.call("TerminateInstances", () =>
      this.set.client.send(new TerminateInstancesCommand({ InstanceIds: [this.id] })),
    );
  }

  /**
   * What the instance costs per hour over time. Spot: the spot price history of its type and zone (the point
   * in force at launch, then every change), plus the added-scratch volume at ebsPrice; until that history is
   * known, and for on-demand instances, the configured price from launch (taken as the whole hourly price).
   */
  priceHistory(type: InstanceType): PricePoint[] {
    const configured = [{ startTime: this.launchTime, price: type.price }];
    if (!this.spot || this.zone === undefined) return configured;
    const history = this.set.spotPriceHistory(this.providerType, this.zone);
    const ebs = this.set.ebsHourly(type);
    const out: PricePoint[] = [];
    for (const p of history) {
      if (p.startTime <= this.launchTime) {
        out.length = 0;
        out.push({ startTime: this.launchTime, price: p.price + ebs });
      } else {
        out.push({ startTime: p.startTime, price: p.price + ebs });
      }
    }
    if (out.length === 0) return configured;
    // No known price at launch: the configured price (the most it can cost) until the first known one.
    if (out[0]!.startTime > this.launchTime) out.unshift({ startTime: this.launchTime, price: type.price });
    return out;
  }
}

function isNotFound(err: unknown): boolean {
  return ec2ErrorInfo(err).code === "InvalidInstanceID.NotFound";
}

function toTagList(tags: Tags): Tag[] {
  return Object.entries(tags).map(([Key, Value]) => ({ Key, Value }));
}

function fromTagList(list: readonly Tag[] | undefined): Tags {
  const tags: Tags = {};
  for (const t of list ?? []) if (t.Key !== undefined) tags[t.Key] = t.Value ?? "";
  return tags;
}
