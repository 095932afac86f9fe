/**
 * The `azure` cloud: instances are Azure VMs, each with its own NIC, created and found through
 * @azure/arm-compute and @azure/arm-network (authenticated by @azure/identity) with the SDK's own retries off
 * (the pool owns retry policy, except that a call refused because another operation holds its one resource is
 * sent again here). Every Azure error goes through classifyAzureError (errors.ts). The registry imports this module
 * lazily, so processes that do not use Azure never load the SDK.
 * Over 500 lines because a VM is several Azure resources (VM, NIC, disks, tags) created, found (also after a create
 * whose answer was lost), collected when dangling and destroyed together; the error classification and the
 * parameter schema are their own modules.
 */
import { createHash, randomBytes } from "node:crypto";
import type { Disk, VirtualMachine } from "@azure/arm-compute";
import { ComputeManagementClient, restorePoller } from "@azure/arm-compute";
import type { NetworkInterface } from "@azure/arm-network";
import { NetworkManagementClient } from "@azure/arm-network";
import { ClientSecretCredential, DefaultAzureCredential, type TokenCredential } from "@azure/identity";
import type { Clock } from "../../lib/clock.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import type { Logger } from "../../lib/logger.ts";
import { CloudError, CloudRateLimitError } from "../errors.ts";
import {
  type CloudDriver,
  type Instance,
  type InstanceSet,
  type InstanceType,
  TAG,
  type Tags,
} from "../types.ts";
import {
  armErrorCode,
  azureErrorInfo,
  busyRetryAfterMs,
  classifyAzureError,
  isNotFound,
  isResourceBusy,
  outcomeUnknown,
} from "./errors.ts";
import { type AzureParameters, IMAGE_FORMAT, isImageId, parseAzureParameters } from "./params.ts";

/** VMs in this provisioning state are gone for the dispatcher. */
export const SKIPPED_STATES = ["Deleting"] as const;
/** Name of the NIC's only IP configuration. */
export const IP_CONFIGURATION = "ip1";
/** LUN of the added-scratch data disk. */
export const SCRATCH_LUN = 0;
const GiB = 2 ** 30;
/** Reads of a new VM's NIC for its private IP before the create counts as failed. */
const ADDRESS_TRIES = 5;
/**
 * Status polls of an accepted VM create that may fail in a row (throttled, 5xx, no answer) before the create
 * counts as failed. A failed poll says nothing about the operation, so polling resumes from the saved state.
 */
export const STATUS_POLL_TRIES = 6;
/**
 * Sends of one call refused because another operation holds its resource (RetryableErrorDueToAnotherOperation),
 * each after the answer's Retry-After, before the call fails (as a CloudError: it is no rate limit).
 */
export const BUSY_TRIES = 5;
/** The longest wait the driver takes before polling or sending again. */
const MAX_WAIT_MS = 60_000;

export const azureDriver: CloudDriver = {
  async instanceSet(params, instanceSetId, sharedTags, deps) {
    const p = parseAzureParameters(params);
    const log = deps.logger.child({ component: "azure-driver", instanceSetId });
    // The tag that marks this instance set's resources: how dangling NICs and disks are recognised.
    const ownTag = Object.entries(sharedTags).find(
      ([k, v]) => k.endsWith(TAG.instanceSetId) && v === instanceSetId,
    );
    if (ownTag === undefined) {
      log.warn("no instance set ID tag among the shared tags: dangling NICs and disks will not be collected");
    }
    return new AzureInstanceSet(p, deps.clock, log, ownTag, instanceSetMarker(instanceSetId));
  },
};

const BASE32 = "abcdefghijklmnopqrstuvwxyz234567";

/**
 * 6 base32 characters of the SHA-256 of the instance set ID. Every VM name (and so every NIC and disk name) carries
 * it: Azure copies no tags to the disks a VM makes, so a disk left behind is known as this instance set's by its
 * name even when its NIC is gone.
 */
export function instanceSetMarker(instanceSetId: string): string {
  const hash = createHash("sha256").update(instanceSetId).digest();
  let out = "";
  for (const b of hash.subarray(0, 6)) out += BASE32[b & 31];
  return out;
}

/**
 * `dc-<marker>-` and 12 random base32 characters (lowercase letters and 2-7): a valid VM, computer and resource
 * name.
 */
export function newVmName(marker: string): string {
  let out = `dc-${marker}-`;
  for (const b of randomBytes(12)) out += BASE32[b & 31];
  return out;
}

/** Whether a NIC or disk name is one resourceNames gives a VM of the instance set with this marker. */
export function namedForSet(resourceName: string, marker: string): boolean {
  return new RegExp(`^dc-${marker}-[a-z2-7]{12}-(?:nic|osdisk|scratch)$`).test(resourceName);
}

/** The names of the resources that belong to VM `name`. */
export function resourceNames(name: string): { nic: string; osDisk: string; scratchDisk: string } {
  return { nic: `${name}-nic`, osDisk: `${name}-osdisk`, scratchDisk: `${name}-scratch` };
}

/** The VM name a NIC or disk named by resourceNames belongs to, or undefined. */
export function ownerVmName(resourceName: string): string | undefined {
  const m = /^(.+)-(?:nic|osdisk|scratch)$/.exec(resourceName);
  return m?.[1];
}

/**
 * The quota group of a VM size: Azure counts cores per VM family ("standardDSv3Family" for Standard_D2s_v3 ...
 * Standard_D64s_v3). Made from the size name: the series letters, the additive features, the accelerator and
 * the version, lowercase: Standard_D2s_v3 -> dsv3, Standard_E4ads_v5 -> eadsv5, Standard_NC24ads_A100_v4 ->
 * ncadsa100v4, Standard_F8 -> f; "-spot" for preemptible types (spot VMs count against the regional
 * low-priority cores quota instead).
 */
export function azureQuotaGroup(type: Pick<InstanceType, "providerType" | "preemptible">): string {
  const size = type.providerType.toLowerCase().replace(/^(standard|basic)_/, "");
  const m = /^([a-z]+)\d+(?:-\d+)?([a-z]*)(?:_([a-z]+\d+))?(?:_(v\d+))?$/.exec(size);
  const group = m === null ? size.replace(/[^a-z0-9]/g, "") : `${m[1]}${m[2]}${m[3] ?? ""}${m[4] ?? ""}`;
  return type.preemptible ? `${group}-spot` : group;
}

/** The VM body create sends (exported for the tests and the docs). */
export function vmBody(
  p: AzureParameters,
  name: string,
  nicId: string,
  type: InstanceType,
  imageId: string,
  tags: Tags,
  initCommand: string,
  publicKey: string,
): VirtualMachine {
  const names = resourceNames(name);
  const vm: VirtualMachine = {
    location: p.location,
    tags: { ...tags },
    hardwareProfile: { vmSize: type.providerType },
    storageProfile: {
      imageReference: { id: imageId },
      osDisk: {
        name: names.osDisk,
        createOption: "FromImage",
        deleteOption: "Delete",
        caching: "ReadWrite",
        managedDisk: { storageAccountType: p.storageAccountType },
      },
      ...(type.addedScratch > 0
        ? {
            dataDisks: [
              {
                lun: SCRATCH_LUN,
                name: names.scratchDisk,
                createOption: "Empty",
                diskSizeGB: Math.ceil(type.addedScratch / GiB),
                deleteOption: "Delete",
                managedDisk: { storageAccountType: p.storageAccountType },
              },
            ],
          }
        : {}),
    },
    osProfile: {
      computerName: name,
      adminUsername: p.adminUsername,
      customData: Buffer.from(initCommand).toString("base64"),
      linuxConfiguration: {
        disablePasswordAuthentication: true,
        ...(publicKey.trim() === ""
          ? {}
          : {
              ssh: {
                publicKeys: [
                  { path: `/home/${p.adminUsername}/.ssh/authorized_keys`, keyData: publicKey.trim() },
                ],
              },
            }),
      },
    },
    networkProfile: { networkInterfaces: [{ id: nicId, primary: true, deleteOption: "Delete" }] },
  };
  if (type.preemptible) {
    vm.priority = "Spot";
    vm.evictionPolicy = "Delete";
    vm.billingProfile = { maxPrice: -1 };
  }
  return vm;
}

interface Seen {
  /** Clock ms when this process first saw the resource without a VM. */
  firstSeen: number;
}

class AzureInstanceSet implements InstanceSet {
  readonly compute: ComputeManagementClient;
  readonly network: NetworkManagementClient;
  private readonly secrets: string[];
  /** Names of VMs whose create is under way in this process: their NIC and disks are not dangling. */
  private readonly creating = new Set<string>();
  /**
   * Failed creates of this process whose cleanup has not finished, by VM name -> whether their VM is to be deleted.
   * Those VMs are never listed (a VM whose allocation failed would only hold bundles until timeoutBooting); each
   * list past the collection interval tries their cleanup again. A create whose VM was never known to exist (false)
   * hides nothing: should its VM turn up (its NIC is "in use"), it is left to the pool like any listed VM.
   */
  private readonly leftovers = new Map<string, boolean>();
  /** Dangling candidates by lower-cased resource id: when first seen. */
  private readonly seen = new Map<string, Seen>();
  private lastGc = Number.NEGATIVE_INFINITY;
  private gcRunning: Promise<void> | undefined;

  constructor(
    readonly p: AzureParameters,
    readonly clock: Clock,
    readonly log: Logger,
    readonly ownTag: [string, string] | undefined,
    /** In every resource name of this instance set (instanceSetMarker). */
    readonly marker: string,
  ) {
    const tlsOptions = p.tlsCa === undefined ? {} : { tlsOptions: { ca: p.tlsCa } };
    const retryOptions = { maxRetries: 0 };
    const sp = p.servicePrincipal;
    const credential: TokenCredential =
      sp === undefined
        ? new DefaultAzureCredential({ authorityHost: p.authorityHost, retryOptions, ...tlsOptions })
        : new ClientSecretCredential(sp.tenantId, sp.clientId, sp.clientSecret, {
            authorityHost: p.authorityHost,
            disableInstanceDiscovery: true,
            retryOptions,
            ...tlsOptions,
          });
    this.secrets = sp === undefined ? [] : [sp.clientSecret];
    this.compute = new ComputeManagementClient(credential, p.subscriptionId, {
      endpoint: p.endpoint,
      credentials: { scopes: [p.tokenScope] },
      retryOptions,
      ...tlsOptions,
    });
    this.network = new NetworkManagementClient(credential, p.subscriptionId, {
      endpoint: p.endpoint,
      $host: p.endpoint,
      credentialScopes: [p.tokenScope],
      retryOptions,
      ...tlsOptions,
    });
    // Each HTTP request (not each long-running operation) gets requestTimeout.
    const timeout = p.requestTimeoutMs;
    for (const pipeline of [this.compute.pipeline, this.network.pipeline]) {
      pipeline.addPolicy({
        name: "dispatchCloudRequestTimeout",
        sendRequest(request, next) {
          if (!(request.timeout > 0)) request.timeout = timeout;
          return next(request);
        },
      });
    }
  }

  /** One Azure call: failures are classified once. */
  async call<T>(operation: string, send: () => Promise<T>, type?: InstanceType): Promise<T> {
    try {
      return await send();
    } catch (err) {
      throw this.classify(operation, err, type);
    }
  }

  classify(operation: string, err: unknown, type?: InstanceType): Error {
    if (err instanceof DispatchCloudError) return err;
    return classifyAzureError(err, {
      operation,
      now: this.clock.now(),
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

  get lro() {
    return { updateIntervalInMs: this.p.pollIntervalMs };
  }

  quotaGroup(type: InstanceType): string {
    return azureQuotaGroup(type);
  }

  async stop(): Promise<void> {
    await this.gcRunning;
  }

  async create(
    type: InstanceType,
    imageId: string,
    tags: Tags,
    initCommand: string,
    publicKey: string,
  ): Promise<Instance> {
    const image = imageId !== "" ? imageId : this.p.image;
    if (image === "") {
      throw new DispatchCloudError(
        "cloud.invalid_parameters",
        "azure driver: no image: set cloud.imageId or cloud.driverParameters.image",
        { path: "cloud.imageId" },
      );
    }
    if (!isImageId(image)) {
      throw new DispatchCloudError(
        "cloud.invalid_parameters",
        `azure driver: cloud.imageId must be ${IMAGE_FORMAT}`,
        { path: imageId !== "" ? "cloud.imageId" : "cloud.driverParameters.image" },
      );
    }
    const name = newVmName(this.marker);
    const names = resourceNames(name);
    const { resourceGroup } = this.p;
    this.creating.add(name);
    try {
      // 1. The NIC, tagged like the instance (so a dangling one is found by the instance set ID tag).
      let nic: NetworkInterface;
      try {
        nic = await this.call(`create NIC ${names.nic}`, () =>
          this.sendAgainWhileBusy(`create NIC ${names.nic}`, () =>
            this.network.networkInterfaces.beginCreateOrUpdateAndWait(
              resourceGroup,
              names.nic,
              {
                location: this.p.location,
                tags: { ...tags },
                ipConfigurations: [
                  {
                    name: IP_CONFIGURATION,
                    subnet: { id: this.p.subnetId },
                    privateIPAllocationMethod: "Dynamic",
                  },
                ],
              },
              this.lro,
            ),
          ),
        );
      } catch (err) {
        // A refused PUT leaves nothing; an accepted one that failed (or got no answer) may leave the NIC. When
        // throttled, its deletion waits for the next collection.
        if (err instanceof CloudRateLimitError) this.leftovers.set(name, false);
        else await this.cleanUp(name, false);
        throw err;
      }
      const nicId = nic.id;
      if (nicId === undefined) {
        await this.cleanUp(name, false);
        throw new CloudError(`azure create NIC ${names.nic}: the answer has no id`);
      }

      // 2. The VM.
      await this.createVm(name, vmBody(this.p, name, nicId, type, image, tags, initCommand, publicKey), type);

      // 3. Its address: the NIC's private IP, assigned by now. An instance without one could never be reached
      // (the pool would wait timeoutBooting for it), so a few tries, then the create fails and is cleaned up.
      let address: string | undefined;
      for (let attempt = 1; address === undefined; attempt++) {
        try {
          const current = await this.call(`get NIC ${names.nic}`, () =>
            this.network.networkInterfaces.get(resourceGroup, names.nic),
          );
          address = privateIp(current);
          if (address === undefined) throw new CloudError(`azure get NIC ${names.nic}: it has no private IP`);
        } catch (err) {
          if (attempt >= ADDRESS_TRIES) {
            this.log.warn({ err, vm: name }, "cannot read the new VM's private IP; deleting it");
            await this.cleanUp(name, true);
            throw err;
          }
          const wait =
            err instanceof CloudRateLimitError ? err.earliestRetry - this.clock.now() : this.p.pollIntervalMs;
          await this.clock.sleep(Math.min(Math.max(wait, 0), 60_000));
        }
      }
      this.log.info({ vm: name, instanceType: type.name, address }, "azure VM created");
      return new AzureInstance(this, name, address, type.providerType, tags);
    } finally {
      this.creating.delete(name);
    }
  }

  /**
   * The VM PUT, and the wait for its operation. When it fails, what it left is deleted and the classified error
   * thrown, except after a PUT that got no answer (timed out, connection lost, 5xx): that PUT may have been done, so
   * the VM is looked for (settleLostCreate) and, if it exists and provisions, the create goes on with it.
   */
  private async createVm(name: string, body: VirtualMachine, type: InstanceType): Promise<void> {
    let accepted = false;
    try {
      // (Wrapped: a poller is a thenable, which an async function would await whole.)
      const { poller } = await this.sendAgainWhileBusy(`create VM ${name}`, async () => {
        const sent = this.compute.virtualMachines.createOrUpdate(this.p.resourceGroup, name, body, this.lro);
        await sent.submitted();
        return { poller: sent };
      });
      accepted = true;
      await this.untilCreated(name, poller, await poller.serialize(), type);
    } catch (err) {
      const error = this.classify(`create VM ${name}`, err, type);
      const code = (error as DispatchCloudError).code;
      if (!accepted && outcomeUnknown(err, this.clock.now())) {
        this.log.warn(
          { vm: name, instanceType: type.name, code, err: error },
          "azure VM create got no answer; looking for the VM",
        );
        const found = await this.settleLostCreate(name, type);
        if (found === "succeeded") {
          this.log.info({ vm: name }, "the VM of the unanswered create exists and has provisioned; using it");
          return;
        }
        if (found === "failed") {
          await this.cleanUp(name, true);
          throw new CloudError(
            `azure create VM ${name}: the create got no answer, and the VM it made then failed to provision`,
            { cause: err },
          );
        }
        // absent: nothing but the NIC to delete. unknown: nothing is deleted; if the VM exists it is listed (the
        // pool adopts it), if not its NIC dangles until the collection deletes it.
        if (found === "absent") await this.cleanUp(name, false);
        throw error;
      }
      this.log.warn(
        { vm: name, instanceType: type.name, code, accepted },
        "azure VM create failed; deleting what it left",
      );
      await this.cleanUp(name, accepted);
      throw error;
    }
  }

  /**
   * After a VM PUT that got no answer: GETs the VM until it has provisioned ("succeeded"), failed or is being
   * deleted ("failed"), or is not there ("absent"); "unknown" after STATUS_POLL_TRIES failed GETs in a row.
   */
  private async settleLostCreate(
    name: string,
    type: InstanceType,
  ): Promise<"succeeded" | "failed" | "absent" | "unknown"> {
    for (let failures = 0; ; ) {
      let state: string;
      try {
        const vm = await this.compute.virtualMachines.get(this.p.resourceGroup, name);
        state = vm.provisioningState ?? "";
        failures = 0;
      } catch (err) {
        if (isNotFound(err)) return "absent";
        failures++;
        const error = this.classify(`get VM ${name}`, err, type);
        if (failures >= STATUS_POLL_TRIES) {
          this.log.warn(
            { vm: name, err: error },
            "cannot find out whether the unanswered create made its VM",
          );
          return "unknown";
        }
        await this.wait(error);
        continue;
      }
      if (state === "Succeeded") return "succeeded";
      if (state === "Failed" || state === "Canceled" || state === "Deleting") return "failed";
      await this.clock.sleep(this.p.pollIntervalMs);
    }
  }

  /** Sleeps until a rate limit's earliestRetry, else pollInterval (at most MAX_WAIT_MS). */
  private async wait(error: Error): Promise<void> {
    const ms =
      error instanceof CloudRateLimitError ? error.earliestRetry - this.clock.now() : this.p.pollIntervalMs;
    await this.clock.sleep(Math.min(Math.max(ms, 0), MAX_WAIT_MS));
  }

  /**
   * One call on one resource, sent again while ARM answers that another operation holds that resource
   * (RetryableErrorDueToAnotherOperation: a lock on it, not a rate limit), after the answer's Retry-After (else
   * pollInterval), at most BUSY_TRIES times in all; then the error stands.
   */
  async sendAgainWhileBusy<T>(operation: string, send: () => Promise<T>): Promise<T> {
    for (let attempt = 1; ; attempt++) {
      try {
        return await send();
      } catch (err) {
        if (!isResourceBusy(err) || attempt >= BUSY_TRIES) throw err;
        const ms = busyRetryAfterMs(err, this.clock.now()) ?? this.p.pollIntervalMs;
        this.log.info(
          { operation, attempt, waitMs: ms },
          "azure: another operation holds the resource; sending the call again",
        );
        await this.clock.sleep(Math.min(Math.max(ms, 0), MAX_WAIT_MS));
      }
    }
  }

  /**
   * Waits for an accepted VM create. A status poll that fails (throttled, 5xx, no answer) is not the operation
   * failing: core-lro keeps such a failure as the poller's outcome, so polling goes on with a poller restored
   * from the state saved after the PUT, after Retry-After (or pollInterval), up to STATUS_POLL_TRIES in a row.
   * An operation whose status says Failed ends the wait at once.
   */
  private async untilCreated(
    name: string,
    first: ReturnType<ComputeManagementClient["virtualMachines"]["createOrUpdate"]>,
    state: string,
    type: InstanceType,
  ): Promise<void> {
    let poller = first;
    for (let attempt = 1; ; attempt++) {
      try {
        await poller.pollUntilDone();
        return;
      } catch (err) {
        if (attempt >= STATUS_POLL_TRIES || azureErrorInfo(err, this.clock.now()).operationFailed) throw err;
        const error = this.classify(`poll the create of VM ${name}`, err, type);
        this.log.info({ vm: name, attempt, err: error }, "azure VM create status poll failed; polling again");
        await this.wait(error);
        poller = restorePoller(this.compute, state, this.compute.virtualMachines.createOrUpdate, this.lro);
      }
    }
  }

  /**
   * After a failed create: the VM (when it is known to exist), then the NIC and disks, each ignoring NotFound.
   * Failures are logged, not thrown: the create is kept among the leftovers, tried again at the next collection. A
   * NIC "in use" when no VM was known to exist means the VM exists after all (a PUT that got no answer was done):
   * it is left to the pool, which lists it like any other.
   */
  private async cleanUp(name: string, deleteVm: boolean): Promise<void> {
    const names = resourceNames(name);
    try {
      if (deleteVm) await this.deleteVm(name);
      await Promise.all([
        this.deleteNic(names.nic),
        ...(deleteVm ? [this.deleteDisk(names.osDisk), this.deleteDisk(names.scratchDisk)] : []),
      ]);
      this.leftovers.delete(name);
    } catch (err) {
      if (!deleteVm && armErrorCode(err) === "NicInUse") {
        this.leftovers.delete(name);
        this.log.warn(
          { vm: name },
          "the NIC of a failed azure create is in use: its VM exists; left to the pool",
        );
        return;
      }
      this.leftovers.set(name, deleteVm);
      this.log.warn({ err, vm: name }, "cannot delete what a failed azure create left; trying again later");
    }
  }

  async deleteVm(name: string): Promise<void> {
    await this.ignoringNotFound(`delete VM ${name}`, () =>
      this.compute.virtualMachines.delete(this.p.resourceGroup, name, this.lro).pollUntilDone(),
    );
  }

  async deleteNic(name: string): Promise<void> {
    await this.ignoringNotFound(`delete NIC ${name}`, () =>
      this.network.networkInterfaces.beginDeleteAndWait(this.p.resourceGroup, name, this.lro),
    );
  }

  async deleteDisk(name: string): Promise<void> {
    await this.ignoringNotFound(`delete disk ${name}`, () =>
      this.compute.disks.delete(this.p.resourceGroup, name, this.lro).pollUntilDone(),
    );
  }

  /** A delete: NotFound is success; a busy resource is waited for (sendAgainWhileBusy). */
  private async ignoringNotFound(operation: string, send: () => Promise<unknown>): Promise<void> {
    try {
      await this.sendAgainWhileBusy(operation, send);
    } catch (err) {
      if (isNotFound(err)) return;
      throw this.classify(operation, err);
    }
  }

  /**
   * Every VM of the resource group (ARM has no server-side tag filter for VMs), those whose tags include
   * `filter` kept, except those whose create is under way in this process; addresses from one NIC listing.
   * Garbage-collects dangling NICs and disks on the way.
   */
  async instances(filter: Tags): Promise<Instance[]> {
    const { resourceGroup } = this.p;
    const vms: VirtualMachine[] = [];
    const nics: NetworkInterface[] = [];
    await this.call("list VMs", async () => {
      for await (const vm of this.compute.virtualMachines.list(resourceGroup)) vms.push(vm);
    });
    await this.call("list NICs", async () => {
      for await (const nic of this.network.networkInterfaces.list(resourceGroup)) nics.push(nic);
    });
    const ipByNic = new Map<string, string>();
    for (const nic of nics) {
      const ip = privateIp(nic);
      if (nic.id !== undefined && ip !== undefined) ipByNic.set(nic.id.toLowerCase(), ip);
    }
    const result: AzureInstance[] = [];
    for (const vm of vms) {
      if (vm.name === undefined) continue;
      // A create of this process still under way returns its VM, or deletes it if it fails: listing it now would
      // hand the pool an instance that may vanish under its bundles.
      if (this.creating.has(vm.name) || this.leftovers.get(vm.name) === true) continue;
      if ((SKIPPED_STATES as readonly string[]).includes(vm.provisioningState ?? "")) continue;
      const tags = vm.tags ?? {};
      if (!Object.entries(filter).every(([k, v]) => tags[k] === v)) continue;
      const refs = vm.networkProfile?.networkInterfaces ?? [];
      const primary = refs.find((r) => r.primary === true) ?? refs[0];
      const address = primary?.id === undefined ? "" : (ipByNic.get(primary.id.toLowerCase()) ?? "");
      result.push(new AzureInstance(this, vm.name, address, vm.hardwareProfile?.vmSize ?? "", { ...tags }));
    }
    const now = this.clock.now();
    if (this.gcRunning === undefined && now - this.lastGc >= this.gcInterval()) {
      this.lastGc = now;
      this.gcRunning = this.housekeeping(vms, nics).finally(() => {
        this.gcRunning = undefined;
      });
      await this.gcRunning;
    }
    return result;
  }

  private gcInterval(): number {
    return Math.max(this.p.deleteDanglingResourcesAfterMs, 1000);
  }

  /** What failed creates left (tried again), then dangling NICs and disks of this instance set. */
  private async housekeeping(
    vms: readonly VirtualMachine[],
    nics: readonly NetworkInterface[],
  ): Promise<void> {
    for (const [name, vmAccepted] of [...this.leftovers]) await this.cleanUp(name, vmAccepted);
    if (this.ownTag !== undefined) await this.collectGarbage(vms, nics);
  }

  /**
   * Deletes NICs attached to no (existing) VM and disks managed by no VM, that carry this instance set's ID tag
   * (or, for disks, are named after a VM whose NIC does) and are older than deleteDanglingResourcesAfter.
   * Nothing that belongs to a VM of the list or to a create under way is touched. Failures are logged.
   */
  private async collectGarbage(
    vms: readonly VirtualMachine[],
    nics: readonly NetworkInterface[],
  ): Promise<void> {
    const [tagKey, tagValue] = this.ownTag ?? ["", ""];
    const now = this.clock.now();
    const after = this.p.deleteDanglingResourcesAfterMs;
    const vmNames = new Set(vms.map((vm) => vm.name?.toLowerCase()).filter((n) => n !== undefined));
    const vmIds = new Set(vms.map((vm) => vm.id?.toLowerCase()).filter((n) => n !== undefined));
    const busy = (resourceName: string) => {
      const owner = ownerVmName(resourceName)?.toLowerCase();
      return owner !== undefined && (vmNames.has(owner) || this.creating.has(owner));
    };
    const candidates = new Set<string>();
    const marker = this.marker;
    const old = (id: string, created: Date | undefined): boolean => {
      candidates.add(id);
      let seen = this.seen.get(id);
      if (seen === undefined) {
        seen = { firstSeen: now };
        this.seen.set(id, seen);
      }
      const since =
        created !== undefined && !Number.isNaN(created.getTime()) ? created.getTime() : seen.firstSeen;
      return now - since >= after;
    };

    const deletions: { kind: "NIC" | "disk"; name: string }[] = [];
    const ourVmNames = new Set<string>();
    for (const nic of nics) {
      if (nic.name === undefined || nic.id === undefined) continue;
      if (nic.tags?.[tagKey] !== tagValue) continue;
      const owner = ownerVmName(nic.name);
      if (owner !== undefined) ourVmNames.add(owner.toLowerCase());
      const vmId = nic.virtualMachine?.id?.toLowerCase();
      if (vmId !== undefined && vmIds.has(vmId)) continue;
      if (busy(nic.name)) continue;
      if (old(nic.id.toLowerCase(), undefined)) deletions.push({ kind: "NIC", name: nic.name });
    }

    const disks: Disk[] = [];
    try {
      await this.call("list disks", async () => {
        for await (const disk of this.compute.disks.listByResourceGroup(this.p.resourceGroup))
          disks.push(disk);
      });
    } catch (err) {
      this.log.warn({ err }, "cannot list azure disks to collect dangling ones");
    }
    for (const disk of disks) {
      if (disk.name === undefined || disk.id === undefined) continue;
      const owner = ownerVmName(disk.name)?.toLowerCase();
      const ours =
        disk.tags?.[tagKey] === tagValue ||
        (owner !== undefined && ourVmNames.has(owner)) ||
        namedForSet(disk.name, marker);
      if (!ours) continue;
      if ((disk.managedBy ?? "") !== "" || disk.diskState === "Attached" || disk.diskState === "Reserved")
        continue;
      if (busy(disk.name)) continue;
      if (old(disk.id.toLowerCase(), disk.timeCreated)) deletions.push({ kind: "disk", name: disk.name });
    }

    // Forget what is no longer a candidate (gone, or attached again).
    for (const id of this.seen.keys()) if (!candidates.has(id)) this.seen.delete(id);

    await Promise.all(
      deletions.map(async ({ kind, name }) => {
        try {
          if (kind === "NIC") await this.deleteNic(name);
          else await this.deleteDisk(name);
          this.log.info({ kind, name }, "deleted a dangling azure resource");
        } catch (err) {
          this.log.warn({ err, kind, name }, "cannot delete a dangling azure resource");
        }
      }),
    );
  }
}

function privateIp(nic: NetworkInterface): string | undefined {
  const configs = nic.ipConfigurations ?? [];
  const config = configs.find((c) => c.primary === true) ?? configs[0];
  const ip = config?.privateIPAddress;
  return ip === undefined || ip === "" ? undefined : ip;
}

class AzureInstance implements Instance {
  readonly remoteUser: string;
  private currentTags: Tags;

  constructor(
    private readonly set: AzureInstanceSet,
    readonly id: string,
    readonly address: string,
    readonly providerType: string,
    tags: Tags,
  ) {
    this.remoteUser = set.p.adminUsername;
    this.currentTags = { ...tags };
  }

  get tags(): Tags {
    return this.currentTags;
  }

  /** Replaces the VM's tag map (one PATCH with the full map; the NIC keeps its create-time tags). */
  async setTags(tags: Tags): Promise<void> {
    await this.set.call(`update tags of VM ${this.id}`, () =>
      this.set.sendAgainWhileBusy(`update tags of VM ${this.id}`, () =>
        this.set.compute.virtualMachines
          .update(this.set.p.resourceGroup, this.id, { tags: { ...tags } }, this.set.lro)
          .pollUntilDone(),
      ),
    );
    this.currentTags = { ...tags };
  }

  /** Deletes the VM, then its NIC and disks; any of them already gone is fine. */
  async destroy(): Promise<void> {
    const names = resourceNames(this.id);
    await this.set.deleteVm(this.id);
    await Promise.all([
      this.set.deleteNic(names.nic),
      this.set.deleteDisk(names.osDisk),
      this.set.deleteDisk(names.scratchDisk),
    ]);
  }
}
