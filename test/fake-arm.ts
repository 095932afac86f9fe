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
 * Every ARM request needs `api-version` (400 MissingApiVersionParameter) and a bearer token the token endpoint
 * issued (401 AuthenticationFailed / InvalidAuthenticationToken). Request bodies are checked as the driver's rules
 * need (one NIC with a dynamic private IP in a known subnet; a VM with a size, a managed or gallery image, a Linux
 * osProfile with SSH keys only, existing NICs not used by another VM). Errors are ARM's JSON. Faults (`faults`,
 * mutable at any time) apply in order: slowMs, next, throttleRate, serverErrorRate, then the VM-create ones.
 *
 * As in Azure: a VM create that fails after being accepted leaves the VM (Failed), its NIC and its OS disk behind;
 * deleting a VM deletes its OS disk and NICs only when the VM asked for `deleteOption: "Delete"` on them; a NIC or
 * disk in use by a VM cannot be deleted. Resource names are unique across the fake's resource groups.
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
  /**
   * Existing resource groups (default ["dc-rg"]); each holds the virtual networks and subnets of `subnets`. Images:
   * any id is accepted if it looks like a managed image or gallery image version id.
   */
  resourceGroups?: string[];
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
}

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
}

/** Every request the fake answered. */
export interface FakeArmCall {
  method: string;
  path: string;
  apiVersion: string | null;
  status: number;
  code: string | null;
}

const DEFAULT_SUBSCRIPTION = "00000000-0000-0000-0000-000000000001";
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
  /** Settles once the create has finished one way or the other (a delete waits for it). */
  settled: Promise<void>;
  /** The running delete, once one was asked for. */
  deleting: Promise<void> | null;
  local: Instance | null;
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
    return this.recordDisk(name, this.resourceGroups[0] ?? "dc-rg", this.location, { ...tags }, null);
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
    this.calls.push({ method, path: url.pathname, apiVersion, status, code });
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
    tags: Record<string, string>,
    vmId: string | null,
  ): FakeDisk {
    const disk: FakeDisk = { name, id: this.resourceId(rg, `${COMPUTE}/disks`, name), tags, vmId };
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
    return {
      name: disk.name,
      id: disk.id,
      type: `${COMPUTE}/disks`,
      location: meta?.location ?? this.location,
      tags: { ...disk.tags },
      ...(disk.vmId === null ? {} : { managedBy: disk.vmId }),
      sku: { name: "Premium_LRS", tier: "Premium" },
      properties: {
        osType: "Linux",
        hyperVGeneration: "V2",
        creationData: {
          createOption: "FromImage",
          ...(vm === undefined ? {} : { imageReference: { id: vm.imageId } }),
        },
        diskSizeGB: 30,
        diskIOPSReadWrite: 120,
        diskMBpsReadWrite: 25,
        encryption: { type: "EncryptionAtRestWithPlatformKey" },
        networkAccessPolicy: "AllowAll",
        publicNetworkAccess: "Enabled",
        timeCreated: (meta?.created ?? new Date()).toISOString(),
        provisioningState: "Succeeded",
        diskState: disk.vmId === null ? "Unattached" : "Attached",
        diskSizeBytes: 30 * 2 ** 30,
        uniqueId: randomUUID(),
        tier: "P4",
      },
    };
  }

  // ---- virtual machines ----

  private getVm(rg: string, name: string): FakeVm {
    const vm = this.find(this.vms, this.vmMeta, rg, name);
    if (vm === undefined) throw this.notFound(rg, `${COMPUTE}/virtualMachines`, name);
    return vm;
  }

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
    if (existing !== undefined) {
      if (existing.provisioningState === "Deleting") {
        throw new ArmError(409, "OperationNotAllowed", `The virtual machine '${name}' is being deleted.`);
      }
      // A second PUT updates the tags only here (a retried create gets the VM back).
      existing.tags = checkTags(body["tags"]);
      return { status: 200, body: this.vmJson(existing) };
    }
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
        "The fake ARM takes managed images and Shared Image Gallery versions by id (no marketplace images).",
      );
    }
    if (!MANAGED_IMAGE.test(imageId) && !GALLERY_IMAGE_VERSION.test(imageId)) {
      throw invalidParameter(
        "storageProfile.imageReference.id",
        "It must be /subscriptions/.../providers/Microsoft.Compute/images/<name> or .../galleries/<g>/images/<i>/versions/<v>.",
      );
    }
    const osDisk = objAt(storage, "osDisk", "storageProfile.osDisk");
    const osDiskName = strAt(osDisk, "name", "storageProfile.osDisk.name") ?? `${name}-osdisk`;
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
    if (this.disks.has(osDiskName.toLowerCase())) {
      throw new ArmError(
        409,
        "Conflict",
        `A disk named '${osDiskName}' exists already.`,
        "storageProfile.osDisk.name",
      );
    }

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
      if (nic.vmId !== null) {
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

    // The create-specific faults.
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
    let asyncError: { code: string; message: string } | null = null;
    if (sizeError !== undefined) {
      asyncError = {
        code: sizeError,
        message:
          sizeError === "AllocationFailed"
            ? `Allocation failed. We do not have sufficient capacity for the requested VM size ${size} in this region. Read more about improving likelihood of allocation success at http://aka.ms/allocation-guidance`
            : `fake ARM: ${sizeError} for VM size ${size}. Read more about improving likelihood of allocation success at http://aka.ms/allocation-guidance`,
      };
    } else if (this.faults.failAfterAccept !== null && this.faults.failAfterAccept.count > 0) {
      const f = this.faults.failAfterAccept;
      asyncError = { code: f.code, message: `fake ARM: the accepted create failed with ${f.code}.` };
      f.count--;
      if (f.count <= 0) this.faults.failAfterAccept = null;
    }

    const vm: FakeVm = {
      name,
      id: this.resourceId(rg, `${COMPUTE}/virtualMachines`, name),
      size,
      tags,
      location,
      provisioningState: "Creating",
      nicIds: nics.map((n) => n.id),
      osDiskName,
      customData: Buffer.from(customDataB64, "base64").toString("utf8"),
      adminUsername,
      publicKeys,
      priority,
      evictionPolicy,
      maxPrice,
      imageId,
      body,
    };
    for (const nic of nics) nic.vmId = vm.id;
    this.vms.set(name.toLowerCase(), vm);
    const op = this.newOp(COMPUTE);
    const meta: VmMeta = {
      resourceGroup: rg,
      location,
      created: new Date(),
      vmUuid: randomUUID(),
      computerName,
      nicDelete,
      diskDelete: diskDeleteOption?.toLowerCase() === "delete",
      storageAccountType,
      settled: Promise.resolve(),
      deleting: null,
      local: null,
    };
    this.vmMeta.set(name.toLowerCase(), meta);
    const created = this.vmJson(vm);
    const finish = (error: { code: string; message: string } | null) => {
      this.recordDisk(osDiskName, rg, location, { ...vm.tags }, vm.id);
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
    if (asyncError !== null) {
      finish(asyncError);
    } else if (this.localVms === undefined) {
      finish(null);
    } else {
      const settled = (async () => {
        try {
          const local = await this.startLocalVm(vm);
          meta.local = local;
          const ip = local.address.replace(/:\d+$/, "");
          const primary = nics[0];
          if (primary !== undefined) primary.privateIp = ip;
          finish(null);
        } catch (err) {
          finish({
            code: "OSProvisioningInternalError",
            message: `fake ARM: the local VM behind ${name} failed to start: ${(err as Error).message}`,
          });
        }
      })();
      meta.settled = settled;
      this.track(settled);
    }
    return { status: 201, body: created, headers: this.lroHeaders(op, apiVersion, true) };
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
        const disk = this.disks.get(vm.osDiskName.toLowerCase());
        if (disk !== undefined && disk.vmId === vm.id) {
          if (meta.diskDelete) {
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
          dataDisks: [],
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
