/**
 * A fake Azure Resource Manager endpoint, over HTTPS with a self-signed certificate made at start, speaking enough
 * ARM for the real `@azure/arm-compute` and `@azure/arm-network` clients and `@azure/identity`'s
 * ClientSecretCredential (authorityHost = the fake's url, disableInstanceDiscovery, tlsOptions.ca = caFile):
 *
 * - the identity platform: `/{tenant}/v2.0/.well-known/openid-configuration` and `/{tenant}/oauth2/v2.0/token`
 *   (client credentials; a wrong client or secret is 401 invalid_client);
 * - network interfaces (PUT and DELETE as long-running operations, GET, PATCH tags, list with nextLink), virtual
 *   machines (PUT, PATCH and DELETE as long-running operations, GET, list with nextLink), managed disks (GET,
 *   DELETE as a long-running operation, list with nextLink), subnets (GET), and the operation status endpoints
 *   that the `Azure-AsyncOperation` and `Location` headers point to.
 *
 * Every ARM request needs a bearer token the token endpoint issued (401 AuthenticationFailed /
 * InvalidAuthenticationToken) and an `api-version` the resource type knows (400 MissingApiVersionParameter,
 * InvalidApiVersionParameter for a malformed one, NoRegisteredProviderFound listing the supported versions for an
 * unknown one; API_VERSIONS holds a subset of Azure's lists that includes what the pinned SDKs send). Request
 * bodies are checked as the driver's rules need (one NIC with a dynamic private IP in a known subnet; a VM with a
 * size, an existing managed image or gallery image version (or gallery image definition: its latest version), a
 * Linux osProfile with SSH keys only, existing NICs not used by another VM, empty data disks). An unknown image is
 * 404 NotFound (managed image) or GalleryImageNotFound. Errors are ARM's JSON. Faults (`faults`, mutable at any
 * time) apply in order: slowMs, next, throttleRate, serverErrorRate, anotherOperationRate, then the VM-create
 * ones; lostAnswers and lostAnswerRate apply after the work was done.
 *
 * As in Azure: a PUT of an existing VM is a full create-or-update (tags replaced, data disks added or detached;
 * a change of an immutable property such as osProfile or the image is 409 PropertyChangeNotAllowed); a VM create
 * that fails after being accepted leaves the VM (Failed), its NIC and its disks behind; the OS disk and the data
 * disks a VM creates carry no tags (the VM's are not copied); deleting a VM deletes its OS disk, data disks and
 * NICs only when the VM asked for `deleteOption: "Delete"` on each (Azure's default is Detach); a NIC or disk in
 * use by a VM cannot be deleted. Resource names are unique across the fake's resource groups.
 *
 * With `localVms`, each VM is backed by a local-driver VM (openssh: its own sshd on 127.0.x.y:22, which becomes the
 * NIC's private IP) whose init script is the decoded customData and whose authorized key is the osProfile's key.
 * With `imds` too (an Azure-flavour test/fake-imds.ts), the init script first writes the VM's metadata endpoint
 * into `$DISPATCH_VM_ROOT/etc/dispatch-cloud/imds-endpoint`, and `interrupt(vm)` schedules its eviction there.
 */
import { randomBytes, randomUUID } from "node:crypto";
import { rmSync } from "node:fs";
import type { IncomingMessage, ServerResponse } from "node:http";
import { createServer, type Server } from "node:https";
import type { AddressInfo } from "node:net";
import type { Instance, InstanceSet } from "../cloud-drivers/types.ts";
import { systemClock } from "../lib/clock.ts";
import {
  AadError,
  ArmError,
  arrAt,
  invalidParameter,
  isBase64,
  isSshPublicKey,
  type Json,
  jsonBody,
  makeSelfSignedCert,
  missingParameter,
  normalizeLocation,
  objAt,
  readBody,
  type SelfSignedCert,
  strAt,
} from "./fake-arm-http.ts";
import { type BackingVmOptions, openBackingVms, startBackingVm } from "./fake-cloud-vms.ts";
import type { FakeImds } from "./fake-imds.ts";

export interface FakeArmOptions {
  subscriptionId?: string; // default "00000000-0000-0000-0000-000000000001"
  tenantId?: string; // default "00000000-0000-0000-0000-0000000000aa"
  /** client id -> secret accepted by the token endpoint; default { "dc-client": "dc-secret" }. */
  clients?: Record<string, string>;
  /** Existing resource groups (default ["dc-rg"]); each holds the virtual networks and subnets of `subnets`. */
  resourceGroups?: string[];
  /**
   * The images that exist (more with addImage): managed image ids (`.../providers/Microsoft.Compute/images/<name>`)
   * and gallery image version ids (`.../galleries/<g>/images/<i>/versions/<v>`, which also makes the image
   * definition id `.../galleries/<g>/images/<i>` usable: its latest version). Default: [FAKE_ARM_IMAGE].
   */
  images?: string[];
  /** "vnet/subnet" names in every resource group; default ["dc-vnet/default"]. */
  subnets?: string[];
  location?: string; // default "westus2"
  /**
   * Back each VM with a local-driver VM (openssh; its sshd address becomes the NIC's private IP), running the
   * decoded customData as its init script and the osProfile SSH public key as its authorized key.
   */
  localVms?: BackingVmOptions;
  /** With localVms: each VM's metadata service (Scheduled Events) is imds.endpointFor(<VM name>). */
  imds?: FakeImds;
  /** Seconds sent in Retry-After on LRO answers (default: none, so the client's updateIntervalInMs rules). */
  lroRetryAfter?: number;
  /** Items per list page before a nextLink; default 100. */
  pageSize?: number;
}

export interface ArmFaults {
  throttleRate: number; // 0..1 of ALL ARM requests -> 429 with Retry-After: retryAfterSeconds
  retryAfterSeconds: number; // default 1
  serverErrorRate: number; // 0..1 -> 500 InternalServerError
  slowMs: number;
  /**
   * VM creates beyond this many VMs -> 409 OperationNotAllowed "...exceeding approved ... quota..." (the cores
   * quota shape Azure uses); 0 = none.
   */
  maxVms: number;
  /**
   * VM sizes (e.g. "Standard_D2s_v3") whose creates fail: code is one of SkuNotAvailable (409 sync),
   * AllocationFailed / ZonalAllocationFailed / OverconstrainedAllocationRequest (accepted, then the LRO fails).
   */
  sizeErrors: Map<string, string>;
  /** Accepted LROs (VM create) that then fail with this code (InternalServerError etc.), for the next N creates. */
  failAfterAccept: { code: string; count: number } | null;
  /** One-shot errors: the next request matching method + path regex fails with status/code. */
  next: {
    method: string;
    path: RegExp;
    status: number;
    code: string;
    message?: string;
    retryAfter?: number;
  }[];
  /**
   * 0..1 of NIC PUTs and DELETEs refused with 429 RetryableErrorDueToAnotherOperation (another operation holds that
   * one NIC; Retry-After: retryAfterSeconds): a lock on one resource, not the subscription's rate limit.
   */
  anotherOperationRate: number;
  /**
   * 0..1 of the successful PUT, PATCH and DELETE requests to ARM resources whose answer is lost after the work was
   * done: half of them dropped (the connection closed without an answer), half held (no answer until the client
   * gives up and closes the connection, or the fake stops).
   */
  lostAnswerRate: number;
  /** One-shots: the next successful request matching method + path regex is done, then its answer is lost. */
  lostAnswers: { method: string; path: RegExp; mode: LostAnswerMode }[];
}

/** How an answer is lost: "drop" closes the connection at once, "hold" never answers (until the client gives up). */
export type LostAnswerMode = "drop" | "hold";

export interface FakeVm {
  name: string;
  id: string;
  size: string;
  tags: Record<string, string>;
  location: string;
  provisioningState: "Creating" | "Succeeded" | "Failed" | "Deleting";
  nicIds: string[];
  osDiskName: string;
  customData: string /* decoded */;
  adminUsername: string;
  publicKeys: string[];
  priority: string | null;
  evictionPolicy: string | null;
  maxPrice: number | null;
  imageId: string;
  /** Its data disks by LUN (names of disks in `disks`). */
  dataDisks: { lun: number; name: string }[];
  body: unknown /* the PUT body as sent */;
}

export interface FakeNic {
  name: string;
  id: string;
  tags: Record<string, string>;
  privateIp: string | null;
  subnetId: string;
  vmId: string | null;
}

export interface FakeDisk {
  name: string;
  id: string;
  tags: Record<string, string>;
  vmId: string | null;
  /** FromImage: an OS disk; Empty: a data disk. */
  createOption: "FromImage" | "Empty";
  sizeGb: number;
  storageAccountType: string;
}

/** Every request the fake answered. */
export interface FakeArmCall {
  method: string;
  path: string;
  apiVersion: string | null;
  status: number;
  code: string | null;
  /** Set when the answer was lost after the work was done (faults.lostAnswers, lostAnswerRate). */
  lost?: LostAnswerMode;
}

const DEFAULT_SUBSCRIPTION = "00000000-0000-0000-0000-000000000001";
const NETWORK_API_VERSIONS = [
  "2022-07-01",
  "2022-09-01",
  "2022-11-01",
  "2023-02-01",
  "2023-04-01",
  "2023-05-01",
  "2023-06-01",
  "2023-09-01",
  "2023-11-01",
  "2024-01-01",
  "2024-03-01",
  "2024-05-01",
  "2024-07-01",
  "2024-10-01",
  "2025-01-01",
  "2025-03-01",
  "2025-05-01",
] as const;
const DEFAULT_TENANT = "00000000-0000-0000-0000-0000000000aa";
const ASYNC_FAILURE_CODES = new Set([
  "AllocationFailed",
  "ZonalAllocationFailed",
  "OverconstrainedAllocationRequest",
]);
const TOKEN_LIFETIME_S = 3599;
const MAX_TAGS = 50;
const MAX_CUSTOM_DATA_CHARS = 87380;
const RESERVED_ADMIN_NAMES = new Set([
  "administrator",
  "admin",
  "user",
  "user1",
  "test",
  "test1",
  "root",
  "guest",
  "sys",
  "support",
]);
const COMPUTE = "Microsoft.Compute";
const NETWORK = "Microsoft.Network";

type OpStatus = "InProgress" | "Succeeded" | "Failed" | "Canceled";

interface Operation {
  id: string;
  provider: string;
  status: OpStatus;
  error: { code: string; message: string } | null;
  startTime: Date;
  endTime: Date | null;
}

interface ResourceMeta {
  resourceGroup: string;
  location: string;
  created: Date;
}

interface NicMeta extends ResourceMeta {
  ipConfigName: string;
  acceleratedNetworking: boolean;
  mac: string;
}

interface VmMeta extends ResourceMeta {
  vmUuid: string;
  computerName: string;
  nicDelete: Map<string, boolean>; // lower-cased NIC id -> deleteOption Delete
  diskDelete: boolean;
  storageAccountType: string;
  /** The data disks asked for, by LUN (created with the VM, or when a PUT adds them). */
  dataDiskSpecs: Map<number, DataDiskSpec>;
  /** Settles once the create has finished one way or the other (a delete waits for it). */
  settled: Promise<void>;
  /** The running delete, once one was asked for. */
  deleting: Promise<void> | null;
  local: Instance | null;
}

interface DataDiskSpec {
  lun: number;
  name: string;
  sizeGb: number;
  deleteOption: "Delete" | "Detach";
  storageAccountType: string;
  caching: string;
}

/** A VM PUT body, checked: what a create makes or an update compares. */
interface VmSpec {
  location: string;
  tags: Record<string, string>;
  size: string;
  imageId: string;
  osDiskName: string;
  diskDelete: boolean;
  storageAccountType: string;
  dataDisks: DataDiskSpec[];
  computerName: string;
  adminUsername: string;
  customData: string /* decoded */;
  publicKeys: string[];
  nics: FakeNic[];
  nicDelete: Map<string, boolean>;
  priority: string | null;
  evictionPolicy: string | null;
  maxPrice: number | null;
}

interface Route {
  sub: string;
  rg: string | null;
  provider: string;
  type: string; // lower-cased, e.g. "virtualmachines", "locations"
  rest: string[]; // segments after the type
}

function uuidNoDashes(): string {
  return randomUUID().replaceAll("-", "");
}

function isResourceName(name: string, max: number): boolean {
  return name.length <= max && /^[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$/.test(name);
}

function checkTags(v: unknown, target = "tags"): Record<string, string> {
  if (v === undefined || v === null) return {};
  if (typeof v !== "object" || Array.isArray(v)) throw invalidParameter(target, "Tags are a JSON object.");
  const entries = Object.entries(v as Json);
  if (entries.length > MAX_TAGS) {
    throw new ArmError(
      400,
      "InvalidTagCount",
      `At most ${MAX_TAGS} tags per resource (got ${entries.length}).`,
      target,
    );
  }
  const out: Record<string, string> = {};
  for (const [k, val] of entries) {
    if (typeof val !== "string") throw invalidParameter(`${target}.${k}`, "Tag values are strings.");
    if (k.length === 0 || k.length > 512) {
      throw new ArmError(
        400,
        "InvalidTagNameLength",
        `The tag name '${k}' has more than 512 characters.`,
        target,
      );
    }
    if (/[<>%&\\?/]/.test(k)) {
      throw new ArmError(
        400,
        "InvalidTagNameCharacters",
        `The tag names '${k}' have reserved characters '<,>,%,&,\\,?,/' or control characters.`,
        target,
      );
    }
    if (val.length > 256) {
      throw new ArmError(
        400,
        "InvalidTagValueLength",
        `The value of tag '${k}' has more than 256 characters.`,
        target,
      );
    }
    out[k] = val;
  }
  return out;
}

const MANAGED_IMAGE =
  /^\/subscriptions\/[^/]+\/resourceGroups\/[^/]+\/providers\/Microsoft\.Compute\/images\/[^/]+$/i;
const GALLERY_IMAGE_VERSION =
  /^\/subscriptions\/[^/]+\/resourceGroups\/[^/]+\/providers\/Microsoft\.Compute\/galleries\/[^/]+\/images\/[^/]+\/versions\/[^/]+$/i;
/** A gallery image definition id: Azure's documented way to ask for its latest version (no `/versions/...`). */
const GALLERY_IMAGE =
  /^\/subscriptions\/[^/]+\/resourceGroups\/[^/]+\/providers\/Microsoft\.Compute\/galleries\/[^/]+\/images\/[^/]+$/i;

/** The image the fake knows by default (test/azure-config.ts uses it). */
export const FAKE_ARM_IMAGE = `/subscriptions/${DEFAULT_SUBSCRIPTION}/resourceGroups/dc-rg/providers/Microsoft.Compute/images/dc-image`;

/**
 * The api-versions each resource type accepts: a subset of what Azure lists for it, including those the pinned
 * SDKs send (@azure/arm-compute 24: virtualMachines 2026-03-01, disks 2025-01-02; @azure/arm-network 36:
 * 2025-05-01). The operation status endpoints of a provider take any of its versions.
 */
export const API_VERSIONS: Readonly<Record<string, readonly string[]>> = {
  "Microsoft.Compute/virtualMachines": [
    "2021-03-01",
    "2021-07-01",
    "2021-11-01",
    "2022-03-01",
    "2022-08-01",
    "2022-11-01",
    "2023-03-01",
    "2023-07-01",
    "2023-09-01",
    "2024-03-01",
    "2024-07-01",
    "2024-11-01",
    "2025-04-01",
    "2026-03-01",
  ],
  "Microsoft.Compute/disks": [
    "2021-04-01",
    "2021-08-01",
    "2021-12-01",
    "2022-03-02",
    "2022-07-02",
    "2023-01-02",
    "2023-04-02",
    "2023-10-02",
    "2024-03-02",
    "2025-01-02",
  ],
  "Microsoft.Network/networkInterfaces": NETWORK_API_VERSIONS,
  "Microsoft.Network/virtualNetworks/subnets": NETWORK_API_VERSIONS,
};

export class FakeArm {
  readonly faults: ArmFaults = {
    throttleRate: 0,
    retryAfterSeconds: 1,
    serverErrorRate: 0,
    slowMs: 0,
    maxVms: 0,
    sizeErrors: new Map(),
    failAfterAccept: null,
    next: [],
    anotherOperationRate: 0,
    lostAnswerRate: 0,
    lostAnswers: [],
  };
  /** By lower-cased name. */
  readonly vms = new Map<string, FakeVm>();
  readonly nics = new Map<string, FakeNic>();
  readonly disks = new Map<string, FakeDisk>();
  /** Every request: method, path (no query), api-version, status, error code (null on success). */
  readonly calls: FakeArmCall[] = [];

  private readonly subscriptionId: string;
  private readonly tenantId: string;
  private readonly clients: Record<string, string>;
  private readonly resourceGroups: string[];
  /** Lower-cased image ids. */
  private readonly images = new Set<string>();
  private readonly subnets: string[];
  private readonly location: string;
  private readonly localVms: FakeArmOptions["localVms"];
  private readonly imds: FakeImds | undefined;
  private readonly lroRetryAfter: number | undefined;
  private readonly pageSize: number;
  private readonly tokens = new Map<string, number>(); // access token -> expiry (ms)
  private readonly ops = new Map<string, Operation>();
  private readonly nicMeta = new Map<string, NicMeta>();
  private readonly vmMeta = new Map<string, VmMeta>();
  private readonly diskMeta = new Map<string, ResourceMeta>();
  private readonly background = new Set<Promise<void>>();
  /** Ends of the answers being held (lost "hold"): each closes its connection. */
  private readonly held = new Set<() => void>();
  private vmSet: InstanceSet | undefined;
  private server: Server | undefined;
  private tls: SelfSignedCert | undefined;
  private baseUrl = "";
  private ipCounter = 3;
  private stopping = false;
  private readonly stopped = new AbortController();

  constructor(opts: FakeArmOptions = {}) {
    this.subscriptionId = opts.subscriptionId ?? DEFAULT_SUBSCRIPTION;
    this.tenantId = opts.tenantId ?? DEFAULT_TENANT;
    this.clients = { ...(opts.clients ?? { "dc-client": "dc-secret" }) };
    this.resourceGroups = [...(opts.resourceGroups ?? ["dc-rg"])];
    for (const image of opts.images ?? [FAKE_ARM_IMAGE]) this.addImage(image);
    this.subnets = [...(opts.subnets ?? ["dc-vnet/default"])];
    this.location = opts.location ?? "westus2";
    this.localVms = opts.localVms;
    this.imds = opts.imds;
    if (this.imds !== undefined && (this.localVms === undefined || this.imds.cloud !== "azure")) {
      throw new Error("FakeArm: the imds option needs localVms and an Azure-flavour FakeImds");
    }
    this.lroRetryAfter = opts.lroRetryAfter;
    this.pageSize = opts.pageSize ?? 100;
    if (!Number.isInteger(this.pageSize) || this.pageSize < 1)
      throw new Error("FakeArm: pageSize must be >= 1");
    for (const s of this.subnets) {
      if (!/^[^/]+\/[^/]+$/.test(s)) throw new Error(`FakeArm: subnets are "vnet/subnet" names; got ${s}`);
    }
  }

  /** HTTPS on 127.0.0.1 and a free port with a fresh self-signed certificate; with localVms, starts that set. */
  async start(): Promise<this> {
    if (this.localVms !== undefined) {
      this.vmSet = await openBackingVms(this.localVms, "fake-arm");
    }
    this.tls = makeSelfSignedCert();
    const server = createServer(
      { key: this.tls.key, cert: this.tls.cert },
      (req, res) => void this.handle(req, res),
    );
    await new Promise<void>((ok, fail) => {
      server.once("error", fail);
      server.listen(0, "127.0.0.1", () => ok());
    });
    this.server = server;
    this.baseUrl = `https://127.0.0.1:${(server.address() as AddressInfo).port}`;
    return this;
  }

  /** https://127.0.0.1:PORT: the ARM endpoint and the authority host. */
  get url(): string {
    if (this.baseUrl === "") throw new Error("FakeArm: not started");
    return this.baseUrl;
  }

  /** The PEM file of the fake's certificate, to trust (tlsCaFile). */
  get caFile(): string {
    if (this.tls === undefined) throw new Error("FakeArm: not started");
    return this.tls.certFile;
  }

  /** Spot eviction: VM `name`'s Scheduled Events list a Preempt event (needs imds); the VM stays as it is. */
  interrupt(name: string): void {
    if (this.imds === undefined)
      throw new Error("FakeArm.interrupt: this fake was made without the imds option");
    if (!this.vms.has(name.toLowerCase())) throw new Error(`FakeArm.interrupt: no VM ${name}`);
    this.imds.interrupt(name);
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
      [...this.vmMeta.values()].map(async (meta) => {
        await meta.settled;
        const local = meta.local;
        meta.local = null;
        await local?.destroy();
      }),
    );
    await this.vmSet?.stop();
    this.vmSet = undefined;
    if (this.tls !== undefined) rmSync(this.tls.dir, { recursive: true, force: true });
  }

  /** Ends every held answer (lost "hold") now: their connections close without an answer. */
  releaseLostAnswers(): void {
    for (const done of [...this.held]) done();
  }

  /** Makes an image exist: a managed image id or a gallery image version id. */
  addImage(id: string): void {
    if (!MANAGED_IMAGE.test(id) && !GALLERY_IMAGE_VERSION.test(id)) {
      throw new Error(`FakeArm.addImage: not a managed image or gallery image version id: ${id}`);
    }
    this.images.add(id.toLowerCase());
  }

  /** Leaves a dangling NIC as a failed or interrupted create would (tagged as given). */
  addDanglingNic(name: string, tags: Record<string, string>): FakeNic {
    const rg = this.resourceGroups[0] ?? "dc-rg";
    const [vnet, subnet] = (this.subnets[0] ?? "dc-vnet/default").split("/");
    return this.recordNic(name, rg, this.location, {
      tags: { ...tags },
      subnetId: this.subnetId(rg, vnet ?? "dc-vnet", subnet ?? "default"),
      ipConfigName: "ipconfig1",
      acceleratedNetworking: false,
    });
  }

  /** Leaves a dangling OS disk as a failed or interrupted create would (tagged as given). */
  addDanglingDisk(name: string, tags: Record<string, string>): FakeDisk {
    return this.recordDisk(name, this.resourceGroups[0] ?? "dc-rg", this.location, {
      tags: { ...tags },
      vmId: null,
      createOption: "FromImage",
      sizeGb: 30,
      storageAccountType: "Premium_LRS",
    });
  }

  // ---- HTTP ----

  private async handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const url = new URL(req.url ?? "/", "https://fake-arm");
    const method = (req.method ?? "GET").toUpperCase();
    const apiVersion = url.searchParams.get("api-version");
    let status = 200;
    let code: string | null = null;
    let body: unknown;
    const headers: Record<string, string> = {};
    try {
      const text = await readBody(req);
      const answer = await this.process(method, url, text, req.headers.authorization);
      status = answer.status;
      body = answer.body;
      Object.assign(headers, answer.headers ?? {});
    } catch (err) {
      if (err instanceof AadError) {
        status = err.status;
        code = err.error;
        body = err.body();
      } else {
        const e =
          err instanceof ArmError
            ? err
            : new ArmError(
                500,
                "InternalServerError",
                `fake ARM: ${err instanceof Error ? err.message : String(err)}`,
              );
        status = e.status;
        code = e.code;
        body = e.body();
        if (e.retryAfter !== undefined) headers["Retry-After"] = String(e.retryAfter);
        if (status === 401) {
          headers["WWW-Authenticate"] =
            `Bearer authorization_uri="${this.baseUrl}/${this.tenantId}", error="invalid_token", ` +
            `error_description="${e.code}"`;
        }
      }
    }
    const lost = this.loseAnswer(method, url.pathname, status);
    this.calls.push({
      method,
      path: url.pathname,
      apiVersion,
      status,
      code,
      ...(lost === null ? {} : { lost }),
    });
    if (lost !== null) {
      await this.withhold(res, lost);
      return;
    }
    if (res.destroyed) return;
    res.statusCode = status;
    res.setHeader("x-ms-request-id", randomUUID());
    res.setHeader("x-ms-correlation-request-id", randomUUID());
    for (const [k, v] of Object.entries(headers)) res.setHeader(k, v);
    if (body === undefined) {
      res.end();
      return;
    }
    res.setHeader("Content-Type", "application/json; charset=utf-8");
    res.end(JSON.stringify(body));
  }

  /** Whether the answer to this (done) request is lost, and how: a one-shot, or lostAnswerRate. */
  private loseAnswer(method: string, path: string, status: number): LostAnswerMode | null {
    if (status >= 400 || !path.toLowerCase().startsWith("/subscriptions/")) return null;
    const f = this.faults;
    const i = f.lostAnswers.findIndex(
      (l) => (l.method === "*" || l.method.toUpperCase() === method) && l.path.test(path),
    );
    if (i >= 0) {
      const [l] = f.lostAnswers.splice(i, 1);
      return l?.mode ?? "drop";
    }
    if (
      ["PUT", "PATCH", "DELETE"].includes(method) &&
      f.lostAnswerRate > 0 &&
      Math.random() < f.lostAnswerRate
    ) {
      return Math.random() < 0.5 ? "drop" : "hold";
    }
    return null;
  }

  /** Loses an answer: closes the connection now (drop), or once the client has given up or the fake stops (hold). */
  private async withhold(res: ServerResponse, mode: LostAnswerMode): Promise<void> {
    if (mode === "hold" && !res.destroyed) {
      await new Promise<void>((resolve) => {
        const done = () => {
          this.held.delete(done);
          resolve();
        };
        this.held.add(done);
        res.once("close", done);
        this.stopped.signal.addEventListener("abort", done, { once: true });
      });
    }
    res.socket?.destroy();
    res.destroy();
  }

  private async process(
    method: string,
    url: URL,
    text: string,
    authorization: string | undefined,
  ): Promise<{ status: number; body?: unknown; headers?: Record<string, string> }> {
    const f = this.faults;
    if (f.slowMs > 0) {
      try {
        await systemClock.sleep(f.slowMs, this.stopped.signal);
      } catch {
        throw new ArmError(503, "ServiceUnavailable", "The fake ARM endpoint is stopping.");
      }
    }
    const i = f.next.findIndex(
      (n) => (n.method === "*" || n.method.toUpperCase() === method) && n.path.test(url.pathname),
    );
    if (i >= 0) {
      const [n] = f.next.splice(i, 1);
      if (n !== undefined) {
        throw new ArmError(
          n.status,
          n.code,
          n.message ?? `fake ARM: injected ${n.code}`,
          undefined,
          n.retryAfter,
        );
      }
    }

    const segments = url.pathname
      .split("/")
      .filter((s) => s !== "")
      .map(decodeURIComponent);
    const first = segments[0]?.toLowerCase();
    if (first !== "subscriptions") return this.identity(method, segments, text);

    this.authenticate(authorization);
    const apiVersion = url.searchParams.get("api-version");
    if (apiVersion === null || apiVersion === "") {
      throw new ArmError(
        400,
        "MissingApiVersionParameter",
        "The api-version query parameter (?api-version=) is required for all requests.",
      );
    }
    if (f.throttleRate > 0 && Math.random() < f.throttleRate) {
      throw new ArmError(
        429,
        "TooManyRequests",
        "The request is being throttled as the limit has been reached for operation type (fake ARM).",
        undefined,
        f.retryAfterSeconds,
      );
    }
    if (f.serverErrorRate > 0 && Math.random() < f.serverErrorRate) {
      throw new ArmError(500, "InternalServerError", "An internal server error occurred (fake ARM).");
    }
    const nic = /\/providers\/Microsoft\.Network\/networkInterfaces\/[^/]+$/i.exec(url.pathname);
    if (
      nic !== null &&
      (method === "PUT" || method === "DELETE") &&
      f.anotherOperationRate > 0 &&
      Math.random() < f.anotherOperationRate
    ) {
      const seconds = f.retryAfterSeconds;
      throw new ArmError(
        429,
        "RetryableErrorDueToAnotherOperation",
        `Operation ${method === "PUT" ? "PutNetworkInterfaceOperation" : "DeleteNetworkInterfaceOperation"} (${randomUUID()}) is updating resource ${decodeURIComponent(url.pathname)}. The call can be retried in ${seconds} seconds.`,
        undefined,
        seconds,
      );
    }
    if (this.stopping) throw new ArmError(503, "ServiceUnavailable", "The fake ARM endpoint is stopping.");
    return this.arm(method, url, segments, text, apiVersion);
  }

  // ---- identity platform ----

  private identity(
    method: string,
    segments: string[],
    text: string,
  ): { status: number; body?: unknown; headers?: Record<string, string> } {
    const [tenant, ...rest] = segments;
    const path = rest.join("/").toLowerCase();
    const known = path === "v2.0/.well-known/openid-configuration" || path === "oauth2/v2.0/token";
    if (tenant === undefined || !known) {
      throw new AadError(
        404,
        "invalid_request",
        90002,
        `The fake identity endpoint has no /${segments.join("/")}.`,
      );
    }
    if (tenant.toLowerCase() !== this.tenantId.toLowerCase()) {
      throw new AadError(
        400,
        "invalid_tenant",
        90002,
        `Tenant '${tenant}' not found. Check to make sure you have the correct tenant ID.`,
      );
    }
    const base = `${this.baseUrl}/${this.tenantId}`;
    if (path === "v2.0/.well-known/openid-configuration") {
      if (method !== "GET")
        throw new AadError(405, "invalid_request", 900561, "The endpoint only accepts GET.");
      return {
        status: 200,
        body: {
          token_endpoint: `${base}/oauth2/v2.0/token`,
          token_endpoint_auth_methods_supported: [
            "client_secret_post",
            "private_key_jwt",
            "client_secret_basic",
          ],
          jwks_uri: `${base}/discovery/v2.0/keys`,
          response_modes_supported: ["query", "fragment", "form_post"],
          subject_types_supported: ["pairwise"],
          id_token_signing_alg_values_supported: ["RS256"],
          response_types_supported: ["code", "id_token", "code id_token", "id_token token"],
          scopes_supported: ["openid", "profile", "email", "offline_access"],
          issuer: `${base}/v2.0`,
          request_uri_parameter_supported: false,
          userinfo_endpoint: `${base}/oidc/userinfo`,
          authorization_endpoint: `${base}/oauth2/v2.0/authorize`,
          device_authorization_endpoint: `${base}/oauth2/v2.0/devicecode`,
          http_logout_supported: true,
          frontchannel_logout_supported: true,
          end_session_endpoint: `${base}/oauth2/v2.0/logout`,
          claims_supported: ["sub", "iss", "aud", "exp", "iat", "nonce", "tid"],
          tenant_region_scope: "NA",
          cloud_instance_name: "fake-arm",
        },
      };
    }
    if (method !== "POST")
      throw new AadError(405, "invalid_request", 900561, "The endpoint only accepts POST.");
    const form = new URLSearchParams(text);
    const grant = form.get("grant_type");
    if (grant !== "client_credentials") {
      throw new AadError(
        400,
        "unsupported_grant_type",
        70003,
        `The fake supports client_credentials only (got ${grant}).`,
      );
    }
    const clientId = form.get("client_id") ?? "";
    const secret = form.get("client_secret");
    if (clientId === "")
      throw new AadError(400, "invalid_request", 900144, "The request body must contain client_id.");
    if (!Object.hasOwn(this.clients, clientId)) {
      throw new AadError(
        401,
        "invalid_client",
        700016,
        `Application with identifier '${clientId}' was not found in the directory '${this.tenantId}'.`,
      );
    }
    if (secret === null || secret !== this.clients[clientId]) {
      throw new AadError(
        401,
        "invalid_client",
        7000215,
        `Invalid client secret provided. Ensure the secret being sent in the request is the client secret value, not the client secret ID, for a secret added to app '${clientId}'.`,
      );
    }
    const scope = form.get("scope") ?? "";
    if (!scope.split(" ").some((s) => s.endsWith("/.default"))) {
      throw new AadError(
        400,
        "invalid_scope",
        1002012,
        `The provided value for scope ${scope} is not valid. Client credential flows must have a scope value with /.default suffixed to the resource identifier.`,
      );
    }
    const token = `fake-arm.${randomBytes(24).toString("base64url")}`;
    this.tokens.set(token, Date.now() + TOKEN_LIFETIME_S * 1000);
    return {
      status: 200,
      body: {
        token_type: "Bearer",
        expires_in: TOKEN_LIFETIME_S,
        ext_expires_in: TOKEN_LIFETIME_S,
        access_token: token,
      },
      headers: { "Cache-Control": "no-store, no-cache", Pragma: "no-cache" },
    };
  }

  private authenticate(authorization: string | undefined): void {
    if (authorization === undefined || authorization === "") {
      throw new ArmError(
        401,
        "AuthenticationFailed",
        "Authentication failed. The 'Authorization' header is missing.",
      );
    }
    const m = /^Bearer (.+)$/i.exec(authorization);
    if (m === null) {
      throw new ArmError(
        401,
        "AuthenticationFailed",
        "Authentication failed. The 'Authorization' header is provided in an invalid format.",
      );
    }
    const expires = this.tokens.get(m[1] ?? "");
    if (expires === undefined) {
      throw new ArmError(401, "InvalidAuthenticationToken", "The access token is invalid.");
    }
    if (expires < Date.now()) {
      throw new ArmError(
        401,
        "ExpiredAuthenticationToken",
        "The access token expiry UTC time is earlier than current UTC time.",
      );
    }
  }

  // ---- ARM routing ----

  private route(segments: string[]): Route {
    const lower = segments.map((s) => s.toLowerCase());
    const sub = segments[1] ?? "";
    if (sub.toLowerCase() !== this.subscriptionId.toLowerCase()) {
      throw new ArmError(404, "SubscriptionNotFound", `The subscription '${sub}' could not be found.`);
    }
    let at = 2;
    let rg: string | null = null;
    if (lower[at] === "resourcegroups") {
      const name = segments[at + 1] ?? "";
      const found = this.resourceGroups.find((g) => g.toLowerCase() === name.toLowerCase());
      if (found === undefined) {
        throw new ArmError(404, "ResourceGroupNotFound", `Resource group '${name}' could not be found.`);
      }
      rg = found;
      at += 2;
    }
    if (lower[at] !== "providers" || segments[at + 1] === undefined || segments[at + 2] === undefined) {
      throw new ArmError(404, "NotFound", `The fake ARM has no /${segments.join("/")}.`);
    }
    return {
      sub,
      rg,
      provider: lower[at + 1] ?? "",
      type: lower[at + 2] ?? "",
      rest: segments.slice(at + 3),
    };
  }

  private async arm(
    method: string,
    url: URL,
    segments: string[],
    text: string,
    apiVersion: string,
  ): Promise<{ status: number; body?: unknown; headers?: Record<string, string> }> {
    const r = this.route(segments);
    const key = `${r.provider}/${r.type}`;
    const name = r.rest[0];
    const unsupported = () =>
      new ArmError(405, "MethodNotAllowed", `The fake ARM does not support ${method} on ${url.pathname}.`);
    this.checkApiVersion(r, apiVersion);
    if (r.rg === null) {
      if (r.type === "locations" && r.rest[1]?.toLowerCase() === "operations" && r.rest[2] !== undefined) {
        if (method !== "GET") throw unsupported();
        return this.operationStatus(r.rest[2], url.searchParams.get("monitor") === "true");
      }
      throw new ArmError(404, "NotFound", `The fake ARM has no ${url.pathname}.`);
    }
    const rg = r.rg;
    const typeErr = () =>
      new ArmError(
        400,
        "InvalidResourceType",
        `The resource type '${r.type}' could not be found in the namespace '${r.provider}' (fake ARM).`,
      );
    switch (key) {
      case "microsoft.network/networkinterfaces":
        if (r.rest.length > 1) throw typeErr();
        if (name === undefined) {
          if (method !== "GET") throw unsupported();
          return this.list(url, apiVersion, this.nics, rg, (n) => this.nicJson(n));
        }
        if (method === "GET") return { status: 200, body: this.nicJson(this.getNic(rg, name)) };
        if (method === "PUT") return this.putNic(rg, name, jsonBody(text), apiVersion);
        if (method === "PATCH") return this.patchNic(rg, name, jsonBody(text));
        if (method === "DELETE") return this.deleteNic(rg, name, apiVersion);
        throw unsupported();
      case "microsoft.compute/virtualmachines":
        if (r.rest.length > 1) throw typeErr();
        if (name === undefined) {
          if (method !== "GET") throw unsupported();
          const filter = url.searchParams.get("$filter");
          if (filter !== null) {
            throw invalidParameter(
              "$filter",
              "The fake ARM lists virtual machines without filters (Azure filters them by scale set only).",
            );
          }
          return this.list(url, apiVersion, this.vms, rg, (v) => this.vmJson(v));
        }
        if (method === "GET") return { status: 200, body: this.vmJson(this.getVm(rg, name)) };
        if (method === "PUT") return this.putVm(rg, name, jsonBody(text), apiVersion);
        if (method === "PATCH") return this.patchVm(rg, name, jsonBody(text), apiVersion);
        if (method === "DELETE") return this.deleteVm(rg, name, apiVersion);
        throw unsupported();
      case "microsoft.compute/disks":
        if (r.rest.length > 1) throw typeErr();
        if (name === undefined) {
          if (method !== "GET") throw unsupported();
          return this.list(url, apiVersion, this.disks, rg, (d) => this.diskJson(d));
        }
        if (method === "GET") return { status: 200, body: this.diskJson(this.getDisk(rg, name)) };
        if (method === "DELETE") return this.deleteDisk(rg, name, apiVersion);
        throw unsupported();
      case "microsoft.network/virtualnetworks": {
        const [vnet, sub, subnet, ...more] = r.rest;
        if (
          vnet === undefined ||
          sub?.toLowerCase() !== "subnets" ||
          subnet === undefined ||
          more.length > 0
        ) {
          throw unsupported();
        }
        if (method !== "GET") throw unsupported();
        const found = this.subnets.find((s) => s.toLowerCase() === `${vnet}/${subnet}`.toLowerCase());
        if (found === undefined) {
          throw new ArmError(404, "NotFound", `Resource ${this.subnetId(rg, vnet, subnet)} not found.`);
        }
        const [v, s] = found.split("/");
        return { status: 200, body: this.subnetJson(rg, v ?? vnet, s ?? subnet) };
      }
      default:
        throw typeErr();
    }
  }

  /**
   * ARM's api-version rules: a malformed version is InvalidApiVersionParameter, one the resource type does not
   * know is NoRegisteredProviderFound naming the versions it knows (both 400). Types the fake does not serve are
   * left to the routing's own errors.
   */
  private checkApiVersion(r: Route, apiVersion: string): void {
    const provider =
      r.provider === "microsoft.compute" ? COMPUTE : r.provider === "microsoft.network" ? NETWORK : "";
    let type: string | undefined;
    let versions: readonly string[] | undefined;
    if (r.type === "locations") {
      type = "locations/operations";
      const prefix = `${provider}/`;
      versions = [
        ...new Set(
          Object.entries(API_VERSIONS)
            .filter(([k]) => provider !== "" && k.startsWith(prefix))
            .flatMap(([, v]) => v),
        ),
      ].sort();
    } else {
      const known = Object.keys(API_VERSIONS).find((k) => {
        const [p, t, sub] = k.split("/");
        return (
          p?.toLowerCase() === r.provider &&
          t?.toLowerCase() === r.type &&
          (sub === undefined || r.rest[1]?.toLowerCase() === sub.toLowerCase())
        );
      });
      if (known !== undefined) {
        type = known.slice(provider.length + 1);
        versions = API_VERSIONS[known];
      }
    }
    if (type === undefined || versions === undefined || versions.length === 0) return;
    const list = [...versions].reverse().join(", ");
    if (!/^\d{4}-\d{2}-\d{2}(-preview)?$/.test(apiVersion)) {
      throw new ArmError(
        400,
        "InvalidApiVersionParameter",
        `The api-version '${apiVersion}' is invalid. The supported versions are '${list}'.`,
      );
    }
    if (!versions.includes(apiVersion)) {
      throw new ArmError(
        400,
        "NoRegisteredProviderFound",
        `No registered resource provider found for location '${this.location}' and API version '${apiVersion}' for type '${type}'. The supported api-versions are '${list}'. The supported locations are '${this.location}'.`,
      );
    }
  }

  // ---- long-running operations ----

  private newOp(provider: string): Operation {
    const op: Operation = {
      id: randomUUID(),
      provider,
      status: "InProgress",
      error: null,
      startTime: new Date(),
      endTime: null,
    };
    this.ops.set(op.id, op);
    return op;
  }

  private finishOp(op: Operation, error: { code: string; message: string } | null): void {
    if (op.status !== "InProgress") return;
    op.status = error === null ? "Succeeded" : "Failed";
    op.error = error;
    op.endTime = new Date();
  }

  /** The Azure-AsyncOperation (and Location) headers of an accepted operation. */
  private lroHeaders(op: Operation, apiVersion: string, withLocation: boolean): Record<string, string> {
    const base = `${this.baseUrl}/subscriptions/${this.subscriptionId}/providers/${op.provider}/locations/${this.location}/operations/${op.id}`;
    const headers: Record<string, string> = {
      "Azure-AsyncOperation": `${base}?p=${uuidNoDashes()}&api-version=${apiVersion}`,
    };
    if (withLocation)
      headers["Location"] = `${base}?p=${uuidNoDashes()}&monitor=true&api-version=${apiVersion}`;
    if (this.lroRetryAfter !== undefined) headers["Retry-After"] = String(this.lroRetryAfter);
    return headers;
  }

  private operationStatus(
    id: string,
    monitor: boolean,
  ): { status: number; body?: unknown; headers?: Record<string, string> } {
    const op = this.ops.get(id);
    if (op === undefined) throw new ArmError(404, "NotFound", `The operation '${id}' was not found.`);
    const retry: Record<string, string> =
      op.status === "InProgress" && this.lroRetryAfter !== undefined
        ? { "Retry-After": String(this.lroRetryAfter) }
        : {};
    if (monitor) {
      // The Location header's URL: 202 while running, 200 once done, the error once failed.
      if (op.status === "InProgress") return { status: 202, headers: retry };
      if (op.error !== null) throw new ArmError(400, op.error.code, op.error.message);
      return { status: 200 };
    }
    return {
      status: 200,
      headers: retry,
      body: {
        name: op.id,
        status: op.status,
        startTime: op.startTime.toISOString(),
        ...(op.endTime === null ? {} : { endTime: op.endTime.toISOString() }),
        ...(op.error === null ? {} : { error: op.error }),
      },
    };
  }

  private track(p: Promise<void>): void {
    this.background.add(p);
    void p.finally(() => this.background.delete(p));
  }

  // ---- lists ----

  private list<T extends { name: string }>(
    url: URL,
    apiVersion: string,
    items: Map<string, T>,
    rg: string,
    json: (item: T) => unknown,
  ): { status: number; body: unknown } {
    const metaOf = (key: string): ResourceMeta | undefined =>
      this.vmMeta.get(key) ?? this.nicMeta.get(key) ?? this.diskMeta.get(key);
    const token = url.searchParams.get("$skiptoken");
    let after = "";
    if (token !== null) {
      try {
        after = String(
          (JSON.parse(Buffer.from(token, "base64url").toString("utf8")) as { after: unknown }).after,
        );
      } catch {
        throw invalidParameter("$skiptoken", "It is not a token this endpoint gave.");
      }
    }
    const keys = [...items.keys()].filter((k) => metaOf(k)?.resourceGroup === rg && k > after).sort();
    const page = keys.slice(0, this.pageSize);
    const last = page[page.length - 1];
    const body: Json = { value: page.map((k) => json(items.get(k)!)) };
    if (keys.length > page.length && last !== undefined) {
      const skip = Buffer.from(JSON.stringify({ after: last })).toString("base64url");
      body["nextLink"] =
        `${this.baseUrl}${url.pathname}?api-version=${encodeURIComponent(apiVersion)}&%24skiptoken=${skip}`;
    }
    return { status: 200, body };
  }

  // ---- network interfaces ----

  private subnetId(rg: string, vnet: string, subnet: string): string {
    return `/subscriptions/${this.subscriptionId}/resourceGroups/${rg}/providers/${NETWORK}/virtualNetworks/${vnet}/subnets/${subnet}`;
  }

  private resourceId(rg: string, type: string, name: string): string {
    return `/subscriptions/${this.subscriptionId}/resourceGroups/${rg}/providers/${type}/${name}`;
  }

  /** The canonical id of a known subnet, or undefined. */
  private knownSubnet(id: string): string | undefined {
    for (const rg of this.resourceGroups) {
      for (const s of this.subnets) {
        const [vnet, subnet] = s.split("/");
        const known = this.subnetId(rg, vnet ?? "", subnet ?? "");
        if (known.toLowerCase() === id.toLowerCase()) return known;
      }
    }
    return undefined;
  }

  private subnetJson(rg: string, vnet: string, subnet: string): Json {
    const id = this.subnetId(rg, vnet, subnet);
    return {
      name: subnet,
      id,
      etag: `W/"${randomUUID()}"`,
      type: `${NETWORK}/virtualNetworks/subnets`,
      properties: {
        provisioningState: "Succeeded",
        addressPrefix: "10.0.0.0/16",
        ipConfigurations: [...this.nics.values()]
          .filter((n) => n.subnetId.toLowerCase() === id.toLowerCase())
          .map((n) => ({
            id: `${n.id}/ipConfigurations/${this.nicMeta.get(n.name.toLowerCase())?.ipConfigName}`,
          })),
        privateEndpointNetworkPolicies: "Disabled",
        privateLinkServiceNetworkPolicies: "Enabled",
      },
    };
  }

  private checkLocation(body: Json, target = "location"): string {
    const loc = strAt(body, "location", target);
    if (loc === undefined || loc === "") {
      throw new ArmError(
        400,
        "LocationRequired",
        "The location property is required for this definition.",
        target,
      );
    }
    if (normalizeLocation(loc) !== normalizeLocation(this.location)) {
      throw new ArmError(
        400,
        "LocationNotAvailableForResourceType",
        `The provided location '${loc}' is not available for this resource type. The fake ARM's location is '${this.location}'.`,
        target,
      );
    }
    return this.location;
  }

  private nextPrivateIp(): string {
    let n = this.ipCounter;
    do n++;
    while ((n & 255) < 4 || (n & 255) === 255);
    this.ipCounter = n;
    return `10.0.${(n >> 8) & 255}.${n & 255}`;
  }

  private recordNic(
    name: string,
    rg: string,
    location: string,
    init: {
      tags: Record<string, string>;
      subnetId: string;
      ipConfigName: string;
      acceleratedNetworking: boolean;
    },
  ): FakeNic {
    const nic: FakeNic = {
      name,
      id: this.resourceId(rg, `${NETWORK}/networkInterfaces`, name),
      tags: init.tags,
      privateIp: this.localVms === undefined ? this.nextPrivateIp() : null,
      subnetId: init.subnetId,
      vmId: null,
    };
    this.nics.set(name.toLowerCase(), nic);
    this.nicMeta.set(name.toLowerCase(), {
      resourceGroup: rg,
      location,
      created: new Date(),
      ipConfigName: init.ipConfigName,
      acceleratedNetworking: init.acceleratedNetworking,
      mac: randomBytes(6).toString("hex").toUpperCase().match(/../g)!.join("-"),
    });
    return nic;
  }

  private notFound(rg: string, type: string, name: string): ArmError {
    return new ArmError(
      404,
      "ResourceNotFound",
      `The Resource '${type}/${name}' under resource group '${rg}' was not found. For more details please go to https://aka.ms/ARMResourceNotFoundFix`,
    );
  }

  /** The resource `name` of `items` when it is in resource group `rg`. */
  private find<T>(
    items: Map<string, T>,
    metas: Map<string, ResourceMeta>,
    rg: string,
    name: string,
  ): T | undefined {
    const key = name.toLowerCase();
    return metas.get(key)?.resourceGroup === rg ? items.get(key) : undefined;
  }

  private getNic(rg: string, name: string): FakeNic {
    const nic = this.find(this.nics, this.nicMeta, rg, name);
    if (nic === undefined) throw this.notFound(rg, `${NETWORK}/networkInterfaces`, name);
    return nic;
  }

  private nameConflict(rg: string, name: string, metas: Map<string, ResourceMeta>): void {
    const other = metas.get(name.toLowerCase());
    if (other !== undefined && other.resourceGroup !== rg) {
      throw new ArmError(
        409,
        "Conflict",
        `The fake ARM keeps names unique across resource groups: '${name}' exists in '${other.resourceGroup}'.`,
      );
    }
  }

  private putNic(rg: string, name: string, body: Json, apiVersion: string) {
    if (!isResourceName(name, 80)) {
      throw new ArmError(
        400,
        "InvalidResourceName",
        `Resource name ${name} is invalid. The name can be up to 80 characters long. It must begin with a word character, and it must end with a word character or with '_'. The name may contain word characters or '.', '-', '_'.`,
      );
    }
    this.nameConflict(rg, name, this.nicMeta);
    const location = this.checkLocation(body);
    const tags = checkTags(body["tags"]);
    const props = objAt(body, "properties", "properties");
    const configs = arrAt(props, "ipConfigurations", "properties.ipConfigurations");
    if (configs === undefined || configs.length === 0) {
      throw new ArmError(
        400,
        "InvalidRequestFormat",
        "Cannot parse the request: a network interface needs at least one IP configuration (properties.ipConfigurations).",
        "properties.ipConfigurations",
      );
    }
    if (configs.length > 1) {
      throw invalidParameter(
        "properties.ipConfigurations",
        "The fake ARM takes exactly one IP configuration.",
      );
    }
    const cfg = configs[0];
    if (typeof cfg !== "object" || cfg === null || Array.isArray(cfg)) {
      throw invalidParameter("properties.ipConfigurations[0]", "It must be an object.");
    }
    const ipConfigName = strAt(cfg as Json, "name", "properties.ipConfigurations[0].name");
    if (ipConfigName === undefined || ipConfigName === "") {
      throw missingParameter("properties.ipConfigurations[0].name");
    }
    const cfgProps = objAt(cfg as Json, "properties", "properties.ipConfigurations[0].properties");
    const subnet = objAt(cfgProps, "subnet", "properties.ipConfigurations[0].properties.subnet");
    const subnetRef = strAt(subnet, "id", "properties.ipConfigurations[0].properties.subnet.id");
    if (subnetRef === undefined)
      throw missingParameter("properties.ipConfigurations[0].properties.subnet.id");
    const subnetId = this.knownSubnet(subnetRef);
    if (subnetId === undefined) {
      throw new ArmError(
        400,
        "InvalidResourceReference",
        `Resource ${subnetRef} referenced by resource ${this.resourceId(rg, `${NETWORK}/networkInterfaces`, name)} was not found. Please make sure that the referenced resource exists, and that both resources are in the same region.`,
        "properties.ipConfigurations[0].properties.subnet.id",
      );
    }
    const method = strAt(
      cfgProps,
      "privateIPAllocationMethod",
      "properties.ipConfigurations[0].properties.privateIPAllocationMethod",
    );
    if (method?.toLowerCase() !== "dynamic") {
      throw invalidParameter(
        "properties.ipConfigurations[0].properties.privateIPAllocationMethod",
        `The fake ARM allocates private IPs dynamically only: it must be "Dynamic" (got ${JSON.stringify(method ?? null)}).`,
      );
    }
    for (const k of ["publicIPAddress", "privateIPAddress"]) {
      if (cfgProps?.[k] !== undefined && cfgProps[k] !== null) {
        throw invalidParameter(
          `properties.ipConfigurations[0].properties.${k}`,
          "The fake ARM's NICs have a dynamic private IP and no public IP.",
        );
      }
    }
    const accelerated = props?.["enableAcceleratedNetworking"];
    if (accelerated !== undefined && typeof accelerated !== "boolean") {
      throw invalidParameter("properties.enableAcceleratedNetworking", "It must be a boolean.");
    }
    const existing = this.nics.get(name.toLowerCase());
    if (existing !== undefined) {
      existing.tags = tags;
      return { status: 200, body: this.nicJson(existing) };
    }
    const nic = this.recordNic(name, rg, location, {
      tags,
      subnetId,
      ipConfigName,
      acceleratedNetworking: accelerated === true,
    });
    const op = this.newOp(NETWORK);
    this.finishOp(op, null);
    return { status: 201, body: this.nicJson(nic), headers: this.lroHeaders(op, apiVersion, false) };
  }

  private patchNic(rg: string, name: string, body: Json) {
    const nic = this.getNic(rg, name);
    for (const k of Object.keys(body)) {
      if (k !== "tags") throw invalidParameter(k, "The fake ARM patches network interface tags only.");
    }
    nic.tags = checkTags(body["tags"]);
    return { status: 200, body: this.nicJson(nic) };
  }

  private deleteNic(rg: string, name: string, apiVersion: string) {
    const nic = this.find(this.nics, this.nicMeta, rg, name);
    if (nic === undefined) return { status: 204 };
    if (nic.vmId !== null) {
      throw new ArmError(
        400,
        "NicInUse",
        `Network Interface ${nic.id} is used by existing resource ${nic.vmId}. In order to delete the network interface, it must be dissociated from the resource. To learn more, see aka.ms/deletenic.`,
      );
    }
    this.nics.delete(name.toLowerCase());
    this.nicMeta.delete(name.toLowerCase());
    const op = this.newOp(NETWORK);
    this.finishOp(op, null);
    return { status: 202, headers: this.lroHeaders(op, apiVersion, true) };
  }

  private nicJson(nic: FakeNic): Json {
    const meta = this.nicMeta.get(nic.name.toLowerCase());
    const cfgName = meta?.ipConfigName ?? "ipconfig1";
    return {
      name: nic.name,
      id: nic.id,
      etag: `W/"${randomUUID()}"`,
      type: `${NETWORK}/networkInterfaces`,
      location: meta?.location ?? this.location,
      tags: { ...nic.tags },
      kind: "Regular",
      properties: {
        provisioningState: "Succeeded",
        resourceGuid: randomUUID(),
        ipConfigurations: [
          {
            name: cfgName,
            id: `${nic.id}/ipConfigurations/${cfgName}`,
            etag: `W/"${randomUUID()}"`,
            type: `${NETWORK}/networkInterfaces/ipConfigurations`,
            properties: {
              provisioningState: "Succeeded",
              ...(nic.privateIp === null ? {} : { privateIPAddress: nic.privateIp }),
              privateIPAllocationMethod: "Dynamic",
              subnet: { id: nic.subnetId },
              primary: true,
              privateIPAddressVersion: "IPv4",
            },
          },
        ],
        dnsSettings: { dnsServers: [], appliedDnsServers: [] },
        ...(nic.vmId === null
          ? {}
          : { macAddress: meta?.mac, primary: true, virtualMachine: { id: nic.vmId } }),
        enableAcceleratedNetworking: meta?.acceleratedNetworking ?? false,
        vnetEncryptionSupported: false,
        enableIPForwarding: false,
        disableTcpStateTracking: false,
        hostedWorkloads: [],
        tapConfigurations: [],
        nicType: "Standard",
        allowPort25Out: false,
        auxiliaryMode: "None",
        auxiliarySku: "None",
      },
    };
  }

  // ---- disks ----

  private recordDisk(
    name: string,
    rg: string,
    location: string,
    init: Omit<FakeDisk, "name" | "id">,
  ): FakeDisk {
    const disk: FakeDisk = { name, id: this.resourceId(rg, `${COMPUTE}/disks`, name), ...init };
    this.disks.set(name.toLowerCase(), disk);
    this.diskMeta.set(name.toLowerCase(), { resourceGroup: rg, location, created: new Date() });
    return disk;
  }

  private getDisk(rg: string, name: string): FakeDisk {
    const disk = this.find(this.disks, this.diskMeta, rg, name);
    if (disk === undefined) throw this.notFound(rg, `${COMPUTE}/disks`, name);
    return disk;
  }

  private deleteDisk(rg: string, name: string, apiVersion: string) {
    const disk = this.find(this.disks, this.diskMeta, rg, name);
    if (disk === undefined) return { status: 204 };
    if (disk.vmId !== null) {
      throw new ArmError(409, "OperationNotAllowed", `Disk ${disk.name} is attached to VM ${disk.vmId}.`);
    }
    this.disks.delete(name.toLowerCase());
    this.diskMeta.delete(name.toLowerCase());
    const op = this.newOp(COMPUTE);
    this.finishOp(op, null);
    return { status: 202, headers: this.lroHeaders(op, apiVersion, true) };
  }

  private diskJson(disk: FakeDisk): Json {
    const meta = this.diskMeta.get(disk.name.toLowerCase());
    const vm = [...this.vms.values()].find((v) => v.id === disk.vmId);
    const os = disk.createOption === "FromImage";
    const premium = disk.storageAccountType.startsWith("Premium");
    return {
      name: disk.name,
      id: disk.id,
      type: `${COMPUTE}/disks`,
      location: meta?.location ?? this.location,
      tags: { ...disk.tags },
      ...(disk.vmId === null ? {} : { managedBy: disk.vmId }),
      sku: { name: disk.storageAccountType, tier: premium ? "Premium" : "Standard" },
      properties: {
        ...(os ? { osType: "Linux", hyperVGeneration: "V2" } : {}),
        creationData: {
          createOption: disk.createOption,
          ...(os && vm !== undefined ? { imageReference: { id: vm.imageId } } : {}),
        },
        diskSizeGB: disk.sizeGb,
        diskIOPSReadWrite: 120,
        diskMBpsReadWrite: 25,
        encryption: { type: "EncryptionAtRestWithPlatformKey" },
        networkAccessPolicy: "AllowAll",
        publicNetworkAccess: "Enabled",
        timeCreated: (meta?.created ?? new Date()).toISOString(),
        provisioningState: "Succeeded",
        diskState: disk.vmId === null ? "Unattached" : "Attached",
        diskSizeBytes: disk.sizeGb * 2 ** 30,
        uniqueId: randomUUID(),
      },
    };
  }

  // ---- virtual machines ----

  private getVm(rg: string, name: string): FakeVm {
    const vm = this.find(this.vms, this.vmMeta, rg, name);
    if (vm === undefined) throw this.notFound(rg, `${COMPUTE}/virtualMachines`, name);
    return vm;
  }

  /**
   * A VM PUT: a create, or (the VM exists) a full create-or-update: the body replaces the model, so its tags replace
   * the VM's; data disks may be added (made now) or left out (detached); a change of a property Azure does not let
   * a running VM change is 409 PropertyChangeNotAllowed. A PUT of a VM whose create failed provisions it again.
   */
  private putVm(rg: string, name: string, body: Json, apiVersion: string) {
    if (!/^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,62}[A-Za-z0-9])?$/.test(name)) {
      throw new ArmError(
        400,
        "InvalidResourceName",
        `The resource name '${name}' is invalid: Linux VM names have 1 to 64 letters, digits, '.' and '-', and do not start or end with '.' or '-'.`,
      );
    }
    this.nameConflict(rg, name, this.vmMeta);
    const existing = this.vms.get(name.toLowerCase());
    if (existing?.provisioningState === "Deleting") {
      throw new ArmError(409, "OperationNotAllowed", `The virtual machine '${name}' is being deleted.`);
    }
    if (existing?.provisioningState === "Creating") {
      throw new ArmError(
        409,
        "OperationNotAllowed",
        `Operation 'PUT' is not allowed on the virtual machine '${name}' while its create is in progress (fake ARM).`,
      );
    }
    const spec = this.parseVm(rg, name, body, existing);
    if (existing !== undefined) return this.updateVm(existing, spec, body, apiVersion);

    // The create-specific faults.
    const size = spec.size;
    const sizeError = this.faults.sizeErrors.get(size);
    if (sizeError !== undefined && !ASYNC_FAILURE_CODES.has(sizeError)) {
      throw new ArmError(
        409,
        sizeError,
        sizeError === "SkuNotAvailable"
          ? `The requested VM size for resource 'Following SKUs have failed for Capacity Restrictions: ${size}' is currently not available in location '${this.location}'. Please try another size or deploy to a different location or different zone. See https://aka.ms/azureskunotavailable for details.`
          : `fake ARM: ${sizeError} for VM size ${size}`,
      );
    }
    const live = [...this.vms.values()].filter(
      (v) => v.provisioningState === "Creating" || v.provisioningState === "Succeeded",
    ).length;
    if (this.faults.maxVms > 0 && live >= this.faults.maxVms) {
      throw new ArmError(
        409,
        "OperationNotAllowed",
        `Operation could not be completed as it results in exceeding approved Total Regional Cores quota. Additional details - Deployment Model: Resource Manager, Location: ${this.location}, Current Limit: ${this.faults.maxVms * 2}, Current Usage: ${live * 2}, Additional Required: 2, (Minimum) New Limit Required: ${live * 2 + 2}. Submit a request for Quota increase at https://aka.ms/ProdportalCRP/#blade/Microsoft_Azure_Capacity/UsageAndQuota.ReactView (fake ARM: maxVms ${this.faults.maxVms}).`,
      );
    }
    let asyncError = this.sizeFailure(size);
    if (
      asyncError === null &&
      this.faults.failAfterAccept !== null &&
      this.faults.failAfterAccept.count > 0
    ) {
      const f = this.faults.failAfterAccept;
      asyncError = { code: f.code, message: `fake ARM: the accepted create failed with ${f.code}.` };
      f.count--;
      if (f.count <= 0) this.faults.failAfterAccept = null;
    }

    const vm: FakeVm = {
      name,
      id: this.resourceId(rg, `${COMPUTE}/virtualMachines`, name),
      size,
      tags: spec.tags,
      location: spec.location,
      provisioningState: "Creating",
      nicIds: spec.nics.map((n) => n.id),
      osDiskName: spec.osDiskName,
      customData: spec.customData,
      adminUsername: spec.adminUsername,
      publicKeys: spec.publicKeys,
      priority: spec.priority,
      evictionPolicy: spec.evictionPolicy,
      maxPrice: spec.maxPrice,
      imageId: spec.imageId,
      dataDisks: spec.dataDisks.map((d) => ({ lun: d.lun, name: d.name })),
      body,
    };
    for (const nic of spec.nics) nic.vmId = vm.id;
    this.vms.set(name.toLowerCase(), vm);
    const meta: VmMeta = {
      resourceGroup: rg,
      location: spec.location,
      created: new Date(),
      vmUuid: randomUUID(),
      computerName: spec.computerName,
      nicDelete: spec.nicDelete,
      diskDelete: spec.diskDelete,
      storageAccountType: spec.storageAccountType,
      dataDiskSpecs: new Map(spec.dataDisks.map((d) => [d.lun, d])),
      settled: Promise.resolve(),
      deleting: null,
      local: null,
    };
    this.vmMeta.set(name.toLowerCase(), meta);
    const created = this.vmJson(vm);
    const op = this.newOp(COMPUTE);
    this.provision(vm, meta, op, asyncError);
    return { status: 201, body: created, headers: this.lroHeaders(op, apiVersion, true) };
  }

  /** The allocation failure sizeErrors sets for `size` (an accepted create then fails with it), or null. */
  private sizeFailure(size: string): { code: string; message: string } | null {
    const sizeError = this.faults.sizeErrors.get(size);
    if (sizeError === undefined || !ASYNC_FAILURE_CODES.has(sizeError)) return null;
    return {
      code: sizeError,
      message:
        sizeError === "AllocationFailed"
          ? `Allocation failed. We do not have sufficient capacity for the requested VM size ${size} in this region. Read more about improving likelihood of allocation success at http://aka.ms/allocation-guidance`
          : `fake ARM: ${sizeError} for VM size ${size}. Read more about improving likelihood of allocation success at http://aka.ms/allocation-guidance`,
    };
  }

  /**
   * Brings an accepted VM create (or a PUT of a Failed VM) to its end: its disks made (untagged: Azure does not
   * copy the VM's tags to them), its local VM started (localVms), then Succeeded, or Failed with `asyncError`.
   */
  private provision(
    vm: FakeVm,
    meta: VmMeta,
    op: Operation,
    asyncError: { code: string; message: string } | null,
  ): void {
    vm.provisioningState = "Creating";
    const finish = (error: { code: string; message: string } | null) => {
      this.makeDisks(vm, meta);
      if (vm.provisioningState === "Deleting") {
        this.finishOp(
          op,
          error ?? {
            code: "OperationPreempted",
            message: "Operation execution has been preempted by a more recent operation.",
          },
        );
        return;
      }
      vm.provisioningState = error === null ? "Succeeded" : "Failed";
      this.finishOp(op, error);
    };
    if (asyncError !== null || this.localVms === undefined || meta.local !== null) {
      finish(asyncError);
      return;
    }
    const settled = (async () => {
      try {
        const local = await this.startLocalVm(vm);
        meta.local = local;
        const ip = local.address.replace(/:\d+$/, "");
        const primaryId = vm.nicIds[0]?.toLowerCase();
        const primary = [...this.nics.values()].find((n) => n.id.toLowerCase() === primaryId);
        if (primary !== undefined) primary.privateIp = ip;
        finish(null);
      } catch (err) {
        finish({
          code: "OSProvisioningInternalError",
          message: `fake ARM: the local VM behind ${vm.name} failed to start: ${(err as Error).message}`,
        });
      }
    })();
    meta.settled = settled;
    this.track(settled);
  }

  /** The VM's OS disk and data disks, attached to it, made if they do not exist yet. */
  private makeDisks(vm: FakeVm, meta: VmMeta): void {
    if (!this.disks.has(vm.osDiskName.toLowerCase())) {
      this.recordDisk(vm.osDiskName, meta.resourceGroup, meta.location, {
        tags: {},
        vmId: vm.id,
        createOption: "FromImage",
        sizeGb: 30,
        storageAccountType: meta.storageAccountType,
      });
    }
    for (const d of meta.dataDiskSpecs.values()) {
      if (this.disks.has(d.name.toLowerCase())) continue;
      this.recordDisk(d.name, meta.resourceGroup, meta.location, {
        tags: {},
        vmId: vm.id,
        createOption: "Empty",
        sizeGb: d.sizeGb,
        storageAccountType: d.storageAccountType,
      });
    }
  }

  /** A PUT of an existing VM: immutable properties compared, the rest applied (see putVm). */
  private updateVm(vm: FakeVm, spec: VmSpec, body: Json, apiVersion: string) {
    const meta = this.vmMeta.get(vm.name.toLowerCase());
    if (meta === undefined) throw new ArmError(500, "InternalServerError", "fake ARM: a VM without its meta");
    const same = (a: unknown, b: unknown) => JSON.stringify(a) === JSON.stringify(b);
    const changes: [string, boolean][] = [
      ["osProfile.computerName", meta.computerName === spec.computerName],
      ["osProfile.adminUsername", vm.adminUsername === spec.adminUsername],
      ["osProfile.customData", vm.customData === spec.customData],
      ["osProfile.linuxConfiguration.ssh.publicKeys", same(vm.publicKeys, spec.publicKeys)],
      ["storageProfile.imageReference", vm.imageId.toLowerCase() === spec.imageId.toLowerCase()],
      ["storageProfile.osDisk.name", vm.osDiskName.toLowerCase() === spec.osDiskName.toLowerCase()],
      ["priority", vm.priority === spec.priority],
      ["evictionPolicy", vm.evictionPolicy === spec.evictionPolicy],
      ["billingProfile.maxPrice", vm.maxPrice === spec.maxPrice],
      [
        "networkProfile.networkInterfaces",
        same(
          vm.nicIds.map((id) => id.toLowerCase()),
          spec.nics.map((n) => n.id.toLowerCase()),
        ),
      ],
    ];
    for (const d of spec.dataDisks) {
      const had = meta.dataDiskSpecs.get(d.lun);
      if (had === undefined) continue;
      changes.push([
        `storageProfile.dataDisks[lun ${d.lun}].name`,
        had.name.toLowerCase() === d.name.toLowerCase(),
      ]);
      changes.push([`storageProfile.dataDisks[lun ${d.lun}].diskSizeGB`, had.sizeGb === d.sizeGb]);
    }
    const changed = changes.find(([, ok]) => !ok);
    if (changed !== undefined) {
      throw new ArmError(
        409,
        "PropertyChangeNotAllowed",
        `Changing property '${changed[0]}' is not allowed.`,
        changed[0],
      );
    }
    vm.tags = spec.tags;
    vm.size = spec.size;
    vm.body = body;
    meta.diskDelete = spec.diskDelete;
    meta.nicDelete = spec.nicDelete;
    // Data disks left out are detached (they stay, unattached); new ones are made and attached.
    const wanted = new Map(spec.dataDisks.map((d) => [d.lun, d]));
    for (const [lun, had] of meta.dataDiskSpecs) {
      if (wanted.has(lun)) continue;
      const disk = this.disks.get(had.name.toLowerCase());
      if (disk !== undefined && disk.vmId === vm.id) disk.vmId = null;
    }
    meta.dataDiskSpecs = new Map(
      spec.dataDisks.map((d) => {
        const had = meta.dataDiskSpecs.get(d.lun);
        return [d.lun, had === undefined ? d : { ...had, deleteOption: d.deleteOption, caching: d.caching }];
      }),
    );
    vm.dataDisks = [...meta.dataDiskSpecs.values()].map((d) => ({ lun: d.lun, name: d.name }));
    const op = this.newOp(COMPUTE);
    if (vm.provisioningState === "Failed") {
      this.provision(vm, meta, op, this.sizeFailure(vm.size));
    } else {
      this.makeDisks(vm, meta);
      this.finishOp(op, null);
    }
    return { status: 200, body: this.vmJson(vm), headers: this.lroHeaders(op, apiVersion, true) };
  }

  /** An image id the VM may use: it must exist (404 NotFound or GalleryImageNotFound, as Azure answers). */
  private checkImage(imageId: string, location: string): void {
    const id = imageId.toLowerCase();
    if (MANAGED_IMAGE.test(imageId)) {
      if (this.images.has(id)) return;
      throw new ArmError(404, "NotFound", `The Image '${imageId}' cannot be found in '${location}' region.`);
    }
    const known = GALLERY_IMAGE_VERSION.test(imageId)
      ? this.images.has(id)
      : GALLERY_IMAGE.test(imageId) && [...this.images].some((i) => i.startsWith(`${id}/versions/`));
    if (known) return;
    if (GALLERY_IMAGE_VERSION.test(imageId) || GALLERY_IMAGE.test(imageId)) {
      throw new ArmError(
        404,
        "GalleryImageNotFound",
        `The gallery image ${imageId} is not available in ${location} region. Please contact image owner to replicate to this region, or change your requested region.`,
        "imageReference",
      );
    }
    throw invalidParameter(
      "storageProfile.imageReference.id",
      "It must be /subscriptions/.../providers/Microsoft.Compute/images/<name>, .../galleries/<g>/images/<i>/versions/<v> or .../galleries/<g>/images/<i> (its latest version).",
    );
  }

  /** Checks a VM PUT body; `self` is the VM it updates (its own NICs and disks are not "in use"). */
  private parseVm(rg: string, name: string, body: Json, self: FakeVm | undefined): VmSpec {
    const location = this.checkLocation(body);
    const tags = checkTags(body["tags"]);
    const props = objAt(body, "properties", "properties");
    if (props === undefined) throw missingParameter("properties");

    const hw = objAt(props, "hardwareProfile", "hardwareProfile");
    const size = strAt(hw, "vmSize", "hardwareProfile.vmSize");
    if (size === undefined) throw missingParameter("hardwareProfile.vmSize");
    if (!/^[A-Za-z0-9_]+$/.test(size))
      throw invalidParameter("hardwareProfile.vmSize", "It is not a VM size name.");

    const storage = objAt(props, "storageProfile", "storageProfile");
    const imageRef = objAt(storage, "imageReference", "storageProfile.imageReference");
    if (imageRef === undefined) throw missingParameter("storageProfile.imageReference");
    const imageId = strAt(imageRef, "id", "storageProfile.imageReference.id");
    if (imageId === undefined) {
      throw invalidParameter(
        "storageProfile.imageReference.id",
        "The fake ARM takes managed images and Azure Compute Gallery images by id (no marketplace images).",
      );
    }
    if (
      !MANAGED_IMAGE.test(imageId) &&
      !GALLERY_IMAGE_VERSION.test(imageId) &&
      !GALLERY_IMAGE.test(imageId)
    ) {
      throw invalidParameter(
        "storageProfile.imageReference.id",
        "It must be /subscriptions/.../providers/Microsoft.Compute/images/<name>, .../galleries/<g>/images/<i>/versions/<v> or .../galleries/<g>/images/<i> (its latest version).",
      );
    }
    const osDisk = objAt(storage, "osDisk", "storageProfile.osDisk");
    const osDiskName =
      strAt(osDisk, "name", "storageProfile.osDisk.name") ?? self?.osDiskName ?? `${name}-osdisk`;
    if (!isResourceName(osDiskName, 80)) throw invalidParameter("storageProfile.osDisk.name");
    const createOption = strAt(osDisk, "createOption", "storageProfile.osDisk.createOption");
    if (createOption !== undefined && createOption.toLowerCase() !== "fromimage") {
      throw invalidParameter("storageProfile.osDisk.createOption", "It must be FromImage.");
    }
    const diskDeleteOption = strAt(osDisk, "deleteOption", "storageProfile.osDisk.deleteOption");
    if (diskDeleteOption !== undefined && !["delete", "detach"].includes(diskDeleteOption.toLowerCase())) {
      throw invalidParameter("storageProfile.osDisk.deleteOption", "It must be Delete or Detach.");
    }
    const managedDisk = objAt(osDisk, "managedDisk", "storageProfile.osDisk.managedDisk");
    const storageAccountType =
      strAt(managedDisk, "storageAccountType", "storageProfile.osDisk.managedDisk.storageAccountType") ??
      "Premium_LRS";
    const diskTaken = (diskName: string, target: string) => {
      const disk = this.disks.get(diskName.toLowerCase());
      if (disk !== undefined && (self === undefined || disk.vmId !== self.id)) {
        throw new ArmError(409, "Conflict", `A disk named '${diskName}' exists already.`, target);
      }
    };
    diskTaken(osDiskName, "storageProfile.osDisk.name");
    const dataDisks = this.parseDataDisks(name, storage, osDiskName, self, diskTaken);

    const os = objAt(props, "osProfile", "osProfile");
    if (os === undefined) throw missingParameter("osProfile");
    const computerName = strAt(os, "computerName", "osProfile.computerName");
    if (computerName === undefined) throw missingParameter("osProfile.computerName");
    if (
      !/^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,62}[A-Za-z0-9])?$/.test(computerName) ||
      /^\d+$/.test(computerName)
    ) {
      throw invalidParameter(
        "osProfile.computerName",
        "Linux host names have 1 to 64 letters, digits, '.' and '-'.",
      );
    }
    const adminUsername = strAt(os, "adminUsername", "osProfile.adminUsername");
    if (adminUsername === undefined) throw missingParameter("osProfile.adminUsername");
    if (
      !/^[a-z_][a-z0-9_.-]{0,63}$/i.test(adminUsername) ||
      RESERVED_ADMIN_NAMES.has(adminUsername.toLowerCase())
    ) {
      throw invalidParameter("osProfile.adminUsername", "It is not a user name Azure allows on Linux.");
    }
    if (this.localVms !== undefined && adminUsername !== this.localVms.user) {
      throw invalidParameter(
        "osProfile.adminUsername",
        `The fake ARM's local VMs log in as '${this.localVms.user}'.`,
      );
    }
    if (os["adminPassword"] !== undefined && os["adminPassword"] !== null) {
      throw invalidParameter("osProfile.adminPassword", "The fake ARM's VMs take SSH keys only.");
    }
    const customDataB64 = strAt(os, "customData", "osProfile.customData") ?? "";
    if (!isBase64(customDataB64) || customDataB64.length > MAX_CUSTOM_DATA_CHARS) {
      throw invalidParameter(
        "osProfile.customData",
        `Custom data in OSProfile must be in Base64 encoding and with a maximum length of ${MAX_CUSTOM_DATA_CHARS} characters.`,
      );
    }
    const linux = objAt(os, "linuxConfiguration", "osProfile.linuxConfiguration");
    if (linux === undefined) throw missingParameter("osProfile.linuxConfiguration");
    if (linux["disablePasswordAuthentication"] !== true) {
      throw invalidParameter(
        "osProfile.linuxConfiguration.disablePasswordAuthentication",
        "The fake ARM's VMs take SSH keys only: it must be true.",
      );
    }
    const ssh = objAt(linux, "ssh", "osProfile.linuxConfiguration.ssh");
    const keys = arrAt(ssh, "publicKeys", "osProfile.linuxConfiguration.ssh.publicKeys") ?? [];
    if (keys.length === 0) throw missingParameter("osProfile.linuxConfiguration.ssh.publicKeys");
    const publicKeys: string[] = [];
    keys.forEach((k, i) => {
      const target = `osProfile.linuxConfiguration.ssh.publicKeys[${i}]`;
      if (typeof k !== "object" || k === null || Array.isArray(k)) throw invalidParameter(target);
      const keyPath = strAt(k as Json, "path", `${target}.path`);
      if (keyPath !== `/home/${adminUsername}/.ssh/authorized_keys`) {
        throw invalidParameter(
          `${target}.path`,
          `Destination path for SSH public keys is currently limited to its default value /home/${adminUsername}/.ssh/authorized_keys due to a known issue in Linux provisioning agent.`,
        );
      }
      const keyData = strAt(k as Json, "keyData", `${target}.keyData`);
      if (keyData === undefined || !isSshPublicKey(keyData)) {
        throw invalidParameter(
          `${target}.keyData`,
          "It is not an ssh-rsa (2048 bits or more) or ssh-ed25519 key.",
        );
      }
      publicKeys.push(keyData.trim());
    });

    const net = objAt(props, "networkProfile", "networkProfile");
    const nicRefs = arrAt(net, "networkInterfaces", "networkProfile.networkInterfaces") ?? [];
    if (nicRefs.length === 0) throw missingParameter("networkProfile.networkInterfaces");
    const nics: FakeNic[] = [];
    const nicDelete = new Map<string, boolean>();
    let primaries = 0;
    nicRefs.forEach((ref, i) => {
      const target = `networkProfile.networkInterfaces[${i}]`;
      if (typeof ref !== "object" || ref === null || Array.isArray(ref)) throw invalidParameter(target);
      const id = strAt(ref as Json, "id", `${target}.id`);
      if (id === undefined) throw missingParameter(`${target}.id`);
      const m =
        /^\/subscriptions\/([^/]+)\/resourceGroups\/([^/]+)\/providers\/Microsoft\.Network\/networkInterfaces\/([^/]+)$/i.exec(
          id,
        );
      const nic = m === null ? undefined : this.nics.get((m[3] ?? "").toLowerCase());
      if (nic === undefined || nic.id.toLowerCase() !== id.toLowerCase()) {
        throw new ArmError(
          400,
          "InvalidResourceReference",
          `Resource ${id} referenced by resource ${this.resourceId(rg, `${COMPUTE}/virtualMachines`, name)} was not found.`,
          `${target}.id`,
        );
      }
      if (nic.vmId !== null && nic.vmId !== self?.id) {
        throw new ArmError(
          400,
          "NicInUse",
          `Network Interface ${nic.id} is used by existing resource ${nic.vmId}.`,
          `${target}.id`,
        );
      }
      if (this.nicMeta.get(nic.name.toLowerCase())?.location !== location) {
        throw invalidParameter(`${target}.id`, "The NIC is in another location.");
      }
      const nicProps = objAt(ref as Json, "properties", `${target}.properties`);
      const primary = nicProps?.["primary"];
      if (primary === true || nicRefs.length === 1) primaries++;
      const del = strAt(nicProps, "deleteOption", `${target}.properties.deleteOption`);
      if (del !== undefined && !["delete", "detach"].includes(del.toLowerCase())) {
        throw invalidParameter(`${target}.properties.deleteOption`, "It must be Delete or Detach.");
      }
      nicDelete.set(nic.id.toLowerCase(), del?.toLowerCase() === "delete");
      nics.push(nic);
    });
    if (primaries !== 1) {
      throw invalidParameter(
        "networkProfile.networkInterfaces",
        "Exactly one network interface must be primary.",
      );
    }

    const priorityRaw = strAt(props, "priority", "priority");
    const priority =
      priorityRaw === undefined
        ? null
        : ["Regular", "Low", "Spot"].find((p) => p.toLowerCase() === priorityRaw.toLowerCase());
    if (priority === undefined) throw invalidParameter("priority", "It must be Regular, Low or Spot.");
    const spotLike = priority === "Spot" || priority === "Low";
    const evictionRaw = strAt(props, "evictionPolicy", "evictionPolicy");
    const evictionPolicy =
      evictionRaw === undefined
        ? null
        : ["Deallocate", "Delete"].find((p) => p.toLowerCase() === evictionRaw.toLowerCase());
    if (evictionPolicy === undefined)
      throw invalidParameter("evictionPolicy", "It must be Deallocate or Delete.");
    if (evictionPolicy !== null && !spotLike) {
      throw invalidParameter(
        "evictionPolicy",
        "Eviction policy can be set only for Spot (or Low priority) VMs.",
      );
    }
    const billing = objAt(props, "billingProfile", "billingProfile");
    const maxPriceRaw = billing?.["maxPrice"];
    let maxPrice: number | null = null;
    if (maxPriceRaw !== undefined && maxPriceRaw !== null) {
      if (typeof maxPriceRaw !== "number" || !(maxPriceRaw === -1 || maxPriceRaw > 0)) {
        throw invalidParameter("billingProfile.maxPrice", "It must be -1 or a price greater than 0.");
      }
      if (!spotLike)
        throw invalidParameter("billingProfile.maxPrice", "Max price can be set only for Spot VMs.");
      maxPrice = maxPriceRaw;
    }

    // Last: the image must exist (the body is well-formed by now).
    this.checkImage(imageId, location);

    return {
      location,
      tags,
      size,
      imageId,
      osDiskName,
      diskDelete: diskDeleteOption?.toLowerCase() === "delete",
      storageAccountType,
      dataDisks,
      computerName,
      adminUsername,
      customData: Buffer.from(customDataB64, "base64").toString("utf8"),
      publicKeys,
      nics,
      nicDelete,
      priority,
      evictionPolicy,
      maxPrice,
    };
  }

  /** `storageProfile.dataDisks`: empty managed disks on distinct LUNs (Azure's deleteOption default: Detach). */
  private parseDataDisks(
    vmName: string,
    storage: Json | undefined,
    osDiskName: string,
    self: FakeVm | undefined,
    diskTaken: (name: string, target: string) => void,
  ): DataDiskSpec[] {
    const raw = arrAt(storage, "dataDisks", "storageProfile.dataDisks") ?? [];
    const out: DataDiskSpec[] = [];
    const names = new Set([osDiskName.toLowerCase()]);
    raw.forEach((d, i) => {
      const target = `storageProfile.dataDisks[${i}]`;
      if (typeof d !== "object" || d === null || Array.isArray(d)) throw invalidParameter(target);
      const disk = d as Json;
      const lun = disk["lun"];
      if (typeof lun !== "number" || !Number.isInteger(lun) || lun < 0 || lun > 63) {
        throw invalidParameter(`${target}.lun`, "A LUN is an integer from 0 to 63.");
      }
      if (out.some((o) => o.lun === lun)) {
        throw invalidParameter(`${target}.lun`, `LUN ${lun} is used by more than one data disk.`);
      }
      const createOption = strAt(disk, "createOption", `${target}.createOption`);
      if (createOption === undefined) throw missingParameter(`${target}.createOption`);
      if (createOption.toLowerCase() !== "empty") {
        throw invalidParameter(`${target}.createOption`, "The fake ARM makes empty data disks only (Empty).");
      }
      const sizeGb = disk["diskSizeGB"];
      if (typeof sizeGb !== "number" || !Number.isInteger(sizeGb) || sizeGb < 1 || sizeGb > 32767) {
        throw invalidParameter(`${target}.diskSizeGB`, "An empty data disk needs a size of 1 to 32767 GiB.");
      }
      const del = strAt(disk, "deleteOption", `${target}.deleteOption`) ?? "Detach";
      const deleteOption = (["Delete", "Detach"] as const).find((o) => o.toLowerCase() === del.toLowerCase());
      if (deleteOption === undefined)
        throw invalidParameter(`${target}.deleteOption`, "It must be Delete or Detach.");
      const had = self?.dataDisks.find((x) => x.lun === lun)?.name;
      const name =
        strAt(disk, "name", `${target}.name`) ?? had ?? `${vmName}_disk${lun + 2}_${uuidNoDashes()}`;
      if (!isResourceName(name, 80)) throw invalidParameter(`${target}.name`);
      if (names.has(name.toLowerCase()))
        throw invalidParameter(`${target}.name`, `Disk name ${name} is used twice.`);
      names.add(name.toLowerCase());
      diskTaken(name, `${target}.name`);
      const managed = objAt(disk, "managedDisk", `${target}.managedDisk`);
      out.push({
        lun,
        name,
        sizeGb,
        deleteOption,
        storageAccountType:
          strAt(managed, "storageAccountType", `${target}.managedDisk.storageAccountType`) ?? "Premium_LRS",
        caching: strAt(disk, "caching", `${target}.caching`) ?? "None",
      });
    });
    return out;
  }

  private startLocalVm(vm: FakeVm): Promise<Instance> {
    const set = this.vmSet;
    if (set === undefined) return Promise.reject(new Error("FakeArm: localVms needs start() first"));
    return startBackingVm(set, {
      providerType: vm.size,
      vcpus: 2,
      preemptible: vm.priority === "Spot" || vm.priority === "Low",
      imageId: vm.imageId,
      tags: { FakeArmVm: vm.name },
      init: vm.customData,
      publicKey: vm.publicKeys[0] ?? "",
      ...(this.imds === undefined ? {} : { imdsEndpoint: this.imds.endpointFor(vm.name) }),
    });
  }

  private patchVm(rg: string, name: string, body: Json, apiVersion: string) {
    const vm = this.getVm(rg, name);
    for (const k of Object.keys(body)) {
      if (k !== "tags") throw invalidParameter(k, "The fake ARM updates virtual machine tags only.");
    }
    if (vm.provisioningState === "Deleting") {
      throw new ArmError(409, "OperationNotAllowed", `The virtual machine '${vm.name}' is being deleted.`);
    }
    if (body["tags"] !== undefined) vm.tags = checkTags(body["tags"]);
    const op = this.newOp(COMPUTE);
    this.finishOp(op, null);
    return { status: 200, body: this.vmJson(vm), headers: this.lroHeaders(op, apiVersion, false) };
  }

  private deleteVm(rg: string, name: string, apiVersion: string) {
    const vm = this.find(this.vms, this.vmMeta, rg, name);
    const meta = this.vmMeta.get(name.toLowerCase());
    if (vm === undefined || meta === undefined) return { status: 204 };
    const op = this.newOp(COMPUTE);
    if (meta.deleting === null) {
      vm.provisioningState = "Deleting";
      meta.deleting = (async () => {
        await meta.settled;
        const local = meta.local;
        meta.local = null;
        try {
          await local?.destroy();
        } catch {
          // Gone already.
        }
        this.vms.delete(name.toLowerCase());
        this.vmMeta.delete(name.toLowerCase());
        const disks: [string, boolean][] = [
          [vm.osDiskName, meta.diskDelete],
          ...[...meta.dataDiskSpecs.values()].map((d): [string, boolean] => [
            d.name,
            d.deleteOption === "Delete",
          ]),
        ];
        for (const [diskName, del] of disks) {
          const disk = this.disks.get(diskName.toLowerCase());
          if (disk === undefined || disk.vmId !== vm.id) continue;
          if (del) {
            this.disks.delete(disk.name.toLowerCase());
            this.diskMeta.delete(disk.name.toLowerCase());
          } else {
            disk.vmId = null;
          }
        }
        for (const nicId of vm.nicIds) {
          const nic = [...this.nics.values()].find((n) => n.id.toLowerCase() === nicId.toLowerCase());
          if (nic === undefined || nic.vmId !== vm.id) continue;
          if (meta.nicDelete.get(nicId.toLowerCase()) === true) {
            this.nics.delete(nic.name.toLowerCase());
            this.nicMeta.delete(nic.name.toLowerCase());
          } else {
            nic.vmId = null;
          }
        }
      })();
      this.track(meta.deleting);
    }
    // A second delete while the first runs gets its own operation with the same outcome.
    this.track(meta.deleting.then(() => this.finishOp(op, null)));
    return { status: 202, headers: this.lroHeaders(op, apiVersion, true) };
  }

  private vmJson(vm: FakeVm): Json {
    const meta = this.vmMeta.get(vm.name.toLowerCase());
    const sent = (vm.body as Json | undefined) ?? {};
    const props = (sent["properties"] as Json | undefined) ?? {};
    const os = (props["osProfile"] as Json | undefined) ?? {};
    const linux = (os["linuxConfiguration"] as Json | undefined) ?? {};
    const disk = this.disks.get(vm.osDiskName.toLowerCase());
    return {
      name: vm.name,
      id: vm.id,
      type: `${COMPUTE}/virtualMachines`,
      location: vm.location,
      tags: { ...vm.tags },
      properties: {
        vmId: meta?.vmUuid,
        hardwareProfile: { vmSize: vm.size },
        storageProfile: {
          imageReference: { id: vm.imageId },
          osDisk: {
            osType: "Linux",
            name: vm.osDiskName,
            createOption: "FromImage",
            caching: "ReadWrite",
            managedDisk: {
              storageAccountType: meta?.storageAccountType ?? "Premium_LRS",
              ...(disk === undefined ? {} : { id: disk.id }),
            },
            deleteOption: meta?.diskDelete === true ? "Delete" : "Detach",
            diskSizeGB: 30,
          },
          dataDisks: [...(meta?.dataDiskSpecs.values() ?? [])].map((d) => {
            const made = this.disks.get(d.name.toLowerCase());
            return {
              lun: d.lun,
              name: d.name,
              createOption: "Empty",
              caching: d.caching,
              managedDisk: {
                storageAccountType: d.storageAccountType,
                ...(made === undefined ? {} : { id: made.id }),
              },
              deleteOption: d.deleteOption,
              diskSizeGB: d.sizeGb,
              toBeDetached: false,
            };
          }),
        },
        osProfile: {
          computerName: meta?.computerName ?? vm.name,
          adminUsername: vm.adminUsername,
          linuxConfiguration: {
            disablePasswordAuthentication: true,
            ssh: {
              publicKeys: vm.publicKeys.map((keyData) => ({
                path: `/home/${vm.adminUsername}/.ssh/authorized_keys`,
                keyData,
              })),
            },
            provisionVMAgent: linux["provisionVMAgent"] ?? true,
            enableVMAgentPlatformUpdates: false,
          },
          secrets: [],
          allowExtensionOperations: true,
          requireGuestProvisionSignal: true,
        },
        networkProfile: {
          networkInterfaces: vm.nicIds.map((id, i) => ({
            id,
            properties: {
              primary: i === 0,
              deleteOption: meta?.nicDelete.get(id.toLowerCase()) === true ? "Delete" : "Detach",
            },
          })),
        },
        ...(vm.priority === null ? {} : { priority: vm.priority }),
        ...(vm.evictionPolicy === null ? {} : { evictionPolicy: vm.evictionPolicy }),
        ...(vm.maxPrice === null ? {} : { billingProfile: { maxPrice: vm.maxPrice } }),
        provisioningState: vm.provisioningState,
        timeCreated: (meta?.created ?? new Date()).toISOString(),
      },
    };
  }
}
