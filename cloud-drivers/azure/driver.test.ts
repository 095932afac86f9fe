/**
 * The azure driver through the real @azure/arm-compute, @azure/arm-network and @azure/identity clients, over
 * HTTPS, against the fake Resource Manager endpoint (test/fake-arm.ts): long-running operations, paging, ARM
 * error answers, the client-credentials token flow, answers lost after the work was done (also across a restart:
 * a fresh driver on the same fake), resources busy with another operation, missing images, untagged disks.
 */
import { spawnSync } from "node:child_process";
import { chmod, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { Writable } from "node:stream";
import { fileURLToPath } from "node:url";
import { Registry } from "prom-client";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { type Clock, systemClock } from "../../lib/clock.ts";
import type { DispatchCloudError } from "../../lib/errors.ts";
import { createLogger } from "../../lib/logger.ts";
import { FakeArm, type FakeArmOptions } from "../../test/fake-arm.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import { expectSshBackedInstance, requireOpenSsh, waitFor } from "../../test/local-driver-helpers.ts";
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "../errors.ts";
import type { InstanceSet, InstanceType, Tags } from "../types.ts";
import {
  azureDriver,
  azureQuotaGroup,
  BUSY_TRIES,
  instanceSetMarker,
  namedForSet,
  newVmName,
  ownerVmName,
  resourceNames,
  STATUS_POLL_TRIES,
} from "./driver.ts";

const SUB = "00000000-0000-0000-0000-000000000001";
const TENANT = "00000000-0000-0000-0000-0000000000aa";
const CLIENT = "dc-client";
const SECRET = "dc-secret-Qx8~notInAnyLog";
const IMAGE = `/subscriptions/${SUB}/resourceGroups/images/providers/Microsoft.Compute/images/debian-12`;
const GALLERY_IMAGE = `/subscriptions/${SUB}/resourceGroups/images/providers/Microsoft.Compute/galleries/g/images/debian/versions/1.0.0`;
const KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIN3Co0CR4DHa3WeHCvk3/67EpjpMqOLKYR/dTJsN5tD8 dispatcher";
const OWN = { DispatchCloudInstanceSetID: "zzzzz" };
const INIT = "#!/bin/sh\necho hello > /tmp/x\n";
const GiB = 2 ** 30;

function type(over: Partial<InstanceType> = {}): InstanceType {
  return {
    name: "d2s",
    providerType: "Standard_D2s_v3",
    vcpus: 2,
    ram: 8 * GiB,
    includedScratch: 16 * GiB,
    addedScratch: 0,
    scratch: 16 * GiB,
    price: 0.096,
    preemptible: false,
    gpu: null,
    ...over,
  };
}

function capturedLogger() {
  const lines: string[] = [];
  const destination = new Writable({
    write(chunk, _enc, done) {
      lines.push(String(chunk));
      done();
    },
  });
  return { logger: createLogger({ level: "debug", format: "json", destination }), lines };
}

async function errorOf(p: Promise<unknown>): Promise<Error> {
  try {
    await p;
  } catch (err) {
    return err as Error;
  }
  throw new Error("expected the call to fail");
}

describe("azure names and quota groups", () => {
  it("names VMs dc-<instance set marker>-<12 base32> and their resources after them", () => {
    const marker = instanceSetMarker("zzzzz");
    expect(marker).toMatch(/^[a-z2-7]{6}$/);
    expect(instanceSetMarker("zzzzz")).toBe(marker);
    expect(instanceSetMarker("zzzzy")).not.toBe(marker);
    const name = newVmName(marker);
    expect(name).toMatch(new RegExp(`^dc-${marker}-[a-z2-7]{12}$`));
    expect(newVmName(marker)).not.toBe(name);
    for (const r of Object.values(resourceNames(name))) expect(namedForSet(r, marker)).toBe(true);
    expect(namedForSet(resourceNames(name).osDisk, instanceSetMarker("zzzzy"))).toBe(false);
    expect(namedForSet(name, marker)).toBe(false);
    expect(resourceNames("dc-x")).toEqual({
      nic: "dc-x-nic",
      osDisk: "dc-x-osdisk",
      scratchDisk: "dc-x-scratch",
    });
    expect(ownerVmName("dc-x-nic")).toBe("dc-x");
    expect(ownerVmName("dc-x-osdisk")).toBe("dc-x");
    expect(ownerVmName("other")).toBeUndefined();
  });

  it.each([
    ["Standard_D2s_v3", "dsv3"],
    ["Standard_D64s_v3", "dsv3"],
    ["Standard_D2_v3", "dv3"],
    ["Standard_E4ads_v5", "eadsv5"],
    ["Standard_E4-2s_v3", "esv3"],
    ["Standard_NC24ads_A100_v4", "ncadsa100v4"],
    ["Standard_DS2_v2", "dsv2"],
    ["Standard_F8", "f"],
    ["Standard_HB120rs_v3", "hbrsv3"],
    ["Basic_A1", "a"],
  ])("%s -> %s (and -spot when preemptible)", (size, group) => {
    expect(azureQuotaGroup({ providerType: size, preemptible: false })).toBe(group);
    expect(azureQuotaGroup({ providerType: size, preemptible: true })).toBe(`${group}-spot`);
  });
});

describe("azure driver against the fake ARM endpoint", () => {
  let fake: FakeArm;
  let sets: InstanceSet[];
  let log: ReturnType<typeof capturedLogger>;

  async function startFake(opts: FakeArmOptions = {}): Promise<void> {
    fake = await new FakeArm({
      clients: { [CLIENT]: SECRET },
      images: [IMAGE, GALLERY_IMAGE],
      ...opts,
    }).start();
  }

  beforeEach(async () => {
    sets = [];
    log = capturedLogger();
    await startFake();
  });

  afterEach(async () => {
    for (const s of sets) await s.stop();
    await fake.stop();
    // No secret reached a log line, whatever the test did.
    expect(log.lines.join("")).not.toContain(SECRET);
  });

  async function openSet(
    extra: Record<string, unknown> = {},
    clock: Clock = systemClock,
  ): Promise<InstanceSet> {
    const set = await azureDriver.instanceSet(
      {
        subscriptionId: SUB,
        tenantId: TENANT,
        clientId: CLIENT,
        clientSecret: SECRET,
        endpoint: fake.url,
        authorityHost: fake.url,
        tlsCaFile: fake.caFile,
        resourceGroup: "dc-rg",
        location: "westus2",
        network: "dc-vnet",
        subnet: "default",
        pollInterval: "50ms",
        ...extra,
      },
      "zzzzz",
      { ...OWN },
      { logger: log.logger, clock, registry: new Registry() },
    );
    sets.push(set);
    return set;
  }

  const armCalls = (method: string, re: RegExp) =>
    fake.calls.filter((c) => c.method === method && re.test(c.path));
  const NIC_PATH = /\/networkInterfaces\/[^/]+$/;
  const VM_PATH = /\/virtualMachines\/[^/]+$/;
  const COMPUTE_OPERATION = /\/Microsoft\.Compute\/locations\/[^/]+\/operations\//;

  /** Nothing of a create is left in the fake. */
  function expectNothingLeft(): void {
    expect([...fake.vms.keys()]).toEqual([]);
    expect([...fake.nics.keys()]).toEqual([]);
    expect([...fake.disks.keys()]).toEqual([]);
  }

  describe("create", () => {
    it("creates the NIC, then the VM with the dispatcher's parameters; the address is the NIC's private IP", async () => {
      const set = await openSet();
      const tags: Tags = { ...OWN, DispatchCloudInstanceType: "d2s", Owner: "ops" };
      const inst = await set.create(type(), IMAGE, tags, INIT, KEY);

      expect(inst.id).toMatch(new RegExp(`^dc-${instanceSetMarker("zzzzz")}-[a-z2-7]{12}$`));
      expect(inst.remoteUser).toBe("crunch");
      expect(inst.providerType).toBe("Standard_D2s_v3");
      expect(inst.tags).toEqual(tags);
      const nicPut = fake.calls.findIndex((c) => c.method === "PUT" && NIC_PATH.test(c.path));
      const vmPut = fake.calls.findIndex((c) => c.method === "PUT" && VM_PATH.test(c.path));
      expect(nicPut).toBeGreaterThanOrEqual(0);
      expect(vmPut).toBeGreaterThan(nicPut);
      // Every ARM call names an api-version; the token came from the client-credentials flow.
      expect(
        fake.calls.filter((c) => c.path.includes("/subscriptions/")).every((c) => c.apiVersion !== null),
      ).toBe(true);
      expect(fake.calls.some((c) => c.method === "POST" && c.path === `/${TENANT}/oauth2/v2.0/token`)).toBe(
        true,
      );

      const nic = fake.nics.get(`${inst.id}-nic`)!;
      expect(nic.tags).toEqual(tags);
      expect(nic.subnetId).toMatch(/\/virtualNetworks\/dc-vnet\/subnets\/default$/);
      expect(inst.address).toBe(nic.privateIp);
      expect(inst.address).toMatch(/^\d+\.\d+\.\d+\.\d+$/);

      const vm = fake.vms.get(inst.id)!;
      expect(vm.size).toBe("Standard_D2s_v3");
      expect(vm.imageId).toBe(IMAGE);
      expect(vm.tags).toEqual(tags);
      expect(vm.customData).toBe(INIT);
      expect(vm.adminUsername).toBe("crunch");
      expect(vm.publicKeys).toEqual([KEY]);
      expect(vm.priority).toBeNull();
      expect(vm.nicIds).toEqual([nic.id]);
      expect(vm.osDiskName).toBe(`${inst.id}-osdisk`);
      const body = vm.body as { properties: Record<string, Record<string, unknown>> };
      expect(body.properties["osProfile"]).toMatchObject({
        computerName: inst.id,
        linuxConfiguration: {
          disablePasswordAuthentication: true,
          ssh: { publicKeys: [{ path: "/home/crunch/.ssh/authorized_keys", keyData: KEY }] },
        },
      });
      expect(body.properties["storageProfile"]).toMatchObject({
        imageReference: { id: IMAGE },
        osDisk: {
          name: `${inst.id}-osdisk`,
          createOption: "FromImage",
          deleteOption: "Delete",
          managedDisk: { storageAccountType: "StandardSSD_LRS" },
        },
      });
      expect(body.properties["storageProfile"]?.["dataDisks"]).toBeUndefined();
      expect(body.properties["networkProfile"]).toEqual({
        networkInterfaces: [{ id: nic.id, properties: { primary: true, deleteOption: "Delete" } }],
      });
    });

    it("spot types: priority Spot, evictionPolicy Delete, maxPrice -1", async () => {
      const set = await openSet();
      const inst = await set.create(type({ preemptible: true }), IMAGE, { ...OWN }, INIT, KEY);
      const vm = fake.vms.get(inst.id)!;
      expect(vm.priority).toBe("Spot");
      expect(vm.evictionPolicy).toBe("Delete");
      expect(vm.maxPrice).toBe(-1);
      expect((vm.body as { properties: Record<string, unknown> }).properties).toMatchObject({
        priority: "Spot",
        evictionPolicy: "Delete",
        billingProfile: { maxPrice: -1 },
      });
    });

    it("added scratch is an empty data disk of whole GiB, deleted with the VM", async () => {
      const set = await openSet({ storageAccountType: "Premium_LRS" });
      const inst = await set.create(
        type({ addedScratch: 100 * GiB + 1 }),
        GALLERY_IMAGE,
        { ...OWN },
        INIT,
        KEY,
      );
      const body = fake.vms.get(inst.id)!.body as { properties: { storageProfile: Record<string, unknown> } };
      expect(body.properties.storageProfile["dataDisks"]).toEqual([
        {
          lun: 0,
          name: `${inst.id}-scratch`,
          createOption: "Empty",
          diskSizeGB: 101,
          deleteOption: "Delete",
          managedDisk: { storageAccountType: "Premium_LRS" },
        },
      ]);
      expect(fake.vms.get(inst.id)!.imageId).toBe(GALLERY_IMAGE);
      // Made with the VM, attached at LUN 0, untagged (as Azure makes it); deleted with it.
      expect(fake.disks.get(`${inst.id}-scratch`)).toMatchObject({
        createOption: "Empty",
        sizeGb: 101,
        storageAccountType: "Premium_LRS",
        tags: {},
        vmId: fake.vms.get(inst.id)!.id,
      });
      expect(fake.vms.get(inst.id)!.dataDisks).toEqual([{ lun: 0, name: `${inst.id}-scratch` }]);
      await inst.destroy();
      expectNothingLeft();
    });

    it("uses the image parameter when cloud.imageId is empty, and refuses to create without an image", async () => {
      const withDefault = await openSet({ image: GALLERY_IMAGE, adminUsername: "dcvm" });
      const inst = await withDefault.create(type(), "", { ...OWN }, INIT, KEY);
      expect(fake.vms.get(inst.id)!.imageId).toBe(GALLERY_IMAGE);
      expect(fake.vms.get(inst.id)!.adminUsername).toBe("dcvm");

      const set = await openSet();
      const before = fake.calls.length;
      const none = (await errorOf(set.create(type(), "", { ...OWN }, INIT, KEY))) as DispatchCloudError;
      expect(none.code).toBe("cloud.invalid_parameters");
      expect(none.path).toBe("cloud.imageId");
      const bad = (await errorOf(
        set.create(type(), "debian-12", { ...OWN }, INIT, KEY),
      )) as DispatchCloudError;
      expect(bad.code).toBe("cloud.invalid_parameters");
      expect(bad.message).toContain("managed image id");
      expect(fake.calls.length).toBe(before);
    });
  });

  describe("images", () => {
    it("an image that does not exist: a CloudError that says so (not capacity); the NIC is deleted", async () => {
      const set = await openSet();
      for (const missing of [
        IMAGE.replace("debian-12", "debian-13"),
        GALLERY_IMAGE.replace("1.0.0", "9.9.9"),
      ]) {
        const err = (await errorOf(set.create(type(), missing, { ...OWN }, INIT, KEY))) as DispatchCloudError;
        expect(err).toBeInstanceOf(CloudError);
        expect(err.code).toBe("cloud.error");
        expect(err.message).toContain("the image does not exist in this region, or cannot be read");
        expect(err.message).toContain(missing);
      }
      expect(armCalls("DELETE", VM_PATH)).toHaveLength(0);
      expectNothingLeft();
    });

    it("a gallery image definition id (Azure's form for its latest version) is used as it is", async () => {
      const set = await openSet();
      const latest = GALLERY_IMAGE.replace(/\/versions\/[^/]+$/, "");
      const inst = await set.create(type(), latest, { ...OWN }, INIT, KEY);
      expect(fake.vms.get(inst.id)!.imageId).toBe(latest);
      const bad = (await errorOf(
        set.create(type(), `${latest}/versions/latest`, { ...OWN }, INIT, KEY),
      )) as DispatchCloudError;
      expect(bad.code).toBe("cloud.invalid_parameters");
      expect(bad.message).toContain("without /versions/...: its latest version");
    });
  });

  describe("failed creates leave nothing behind", () => {
    it("a VM create refused at once (SkuNotAvailable, 409): capacity for the type; the NIC is deleted", async () => {
      const set = await openSet();
      fake.faults.sizeErrors.set("Standard_D2s_v3", "SkuNotAvailable");
      const err = (await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY))) as CapacityError;
      expect(err).toBeInstanceOf(CapacityError);
      expect(err.scope).toBe("instanceType");
      expect(err.instanceType).toBe("d2s");
      expect(err.message).toContain("SkuNotAvailable");
      expect(armCalls("PUT", NIC_PATH)).toHaveLength(1);
      expect(armCalls("DELETE", NIC_PATH)).toHaveLength(1);
      // Nothing was accepted, so there is no VM to delete.
      expect(armCalls("DELETE", VM_PATH)).toHaveLength(0);
      expectNothingLeft();
    });

    it.each(["AllocationFailed", "ZonalAllocationFailed", "OverconstrainedAllocationRequest"])(
      "a VM create that fails after being accepted (%s): capacity for the type; VM, NIC and OS disk deleted",
      async (code) => {
        const set = await openSet();
        fake.faults.sizeErrors.set("Standard_D2s_v3", code);
        const err = (await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY))) as CapacityError;
        expect(err).toBeInstanceOf(CapacityError);
        expect(err.scope).toBe("instanceType");
        expect(err.message).toContain(`${code} (operation failed)`);
        expect(armCalls("DELETE", VM_PATH)).toHaveLength(1);
        expect(armCalls("DELETE", NIC_PATH)).toHaveLength(1);
        expect(armCalls("DELETE", /\/disks\/[^/]+-osdisk$/)).toHaveLength(1);
        expectNothingLeft();
        // Other sizes still work.
        fake.faults.sizeErrors.clear();
        await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
        expect(fake.vms.size).toBe(1);
      },
    );

    it("an accepted create that fails with InternalServerError: CloudError, all cleaned up", async () => {
      const set = await openSet();
      fake.faults.failAfterAccept = { code: "InternalServerError", count: 1 };
      const err = await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toContain("InternalServerError");
      expectNothingLeft();
    });

    it("a failed create whose cleanup is throttled: its VM is never listed, and the next list deletes what it left", async () => {
      const set = await openSet();
      fake.faults.sizeErrors.set("Standard_D2s_v3", "AllocationFailed");
      fake.faults.next.push({
        method: "DELETE",
        path: VM_PATH,
        status: 429,
        code: "TooManyRequests",
        retryAfter: 1,
      });
      const err = await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CapacityError);
      // The VM whose allocation failed is still there, and would never boot.
      expect([...fake.vms.values()].map((v) => v.provisioningState)).toEqual(["Failed"]);
      expect(log.lines.join("")).toContain("trying again later");
      expect(await set.instances({})).toEqual([]);
      expectNothingLeft();
      expect(armCalls("DELETE", VM_PATH).map((c) => c.status)).toEqual([429, 202]);
    });

    it("the regional cores quota: CloudQuotaError; the NIC is deleted", async () => {
      const set = await openSet();
      fake.faults.maxVms = 1;
      await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      const err = await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CloudQuotaError);
      expect(err.message).toContain("OperationNotAllowed");
      expect(fake.vms.size).toBe(1);
      expect(fake.nics.size).toBe(1);
    });

    it("a family cores quota: capacity for the quota group", async () => {
      const set = await openSet();
      fake.faults.next.push({
        method: "PUT",
        path: VM_PATH,
        status: 409,
        code: "OperationNotAllowed",
        message:
          "Operation could not be completed as it results in exceeding approved standardDSv3Family Cores quota. Additional details - Current Limit: 10",
      });
      const err = (await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY))) as CapacityError;
      expect(err).toBeInstanceOf(CapacityError);
      expect(err.scope).toBe("quotaGroup");
      expect(err.quotaGroup).toBe("dsv3");
      expectNothingLeft();
    });

    it("a NIC create that fails: nothing is created, the error is classified", async () => {
      const set = await openSet();
      fake.faults.next.push({ method: "PUT", path: NIC_PATH, status: 500, code: "InternalServerError" });
      const err = await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CloudError);
      expect(armCalls("PUT", VM_PATH)).toHaveLength(0);
      expectNothingLeft();
    });
  });

  describe("a VM create whose answer is lost: the VM is found, then used or deleted, never hidden", () => {
    it("a VM create whose answer is lost after the VM was made: the driver finds the VM and returns it; one VM, listed", async () => {
      const set = await openSet();
      fake.faults.lostAnswers.push({ method: "PUT", path: VM_PATH, mode: "drop" });
      const inst = await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      expect(armCalls("PUT", VM_PATH).map((c) => c.lost)).toEqual(["drop"]);
      expect([...fake.vms.keys()]).toEqual([inst.id]);
      expect(fake.vms.get(inst.id)!.provisioningState).toBe("Succeeded");
      expect(inst.address).toBe(fake.nics.get(`${inst.id}-nic`)!.privateIp);
      expect((await set.instances({ ...OWN })).map((i) => i.id)).toEqual([inst.id]);
      // Nothing of it is taken for a leftover: no delete of any kind.
      expect(fake.calls.filter((c) => c.method === "DELETE")).toEqual([]);
      await inst.destroy();
      expectNothingLeft();
    });

    it("an answer held past requestTimeout: the same (the driver gives up on the PUT, then finds the VM)", async () => {
      const set = await openSet({ requestTimeout: "2s" });
      fake.faults.lostAnswers.push({ method: "PUT", path: VM_PATH, mode: "hold" });
      const inst = await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      expect(armCalls("PUT", VM_PATH).map((c) => c.lost)).toEqual(["hold"]);
      expect([...fake.vms.keys()]).toEqual([inst.id]);
      expect(log.lines.join("")).toContain("azure VM create got no answer; looking for the VM");
      expect((await set.instances({ ...OWN })).map((i) => i.id)).toEqual([inst.id]);
    });

    it("a lost answer, and the VM then fails to provision: VM, NIC and disks deleted; a CloudError", async () => {
      const set = await openSet();
      fake.faults.sizeErrors.set("Standard_D2s_v3", "AllocationFailed");
      fake.faults.lostAnswers.push({ method: "PUT", path: VM_PATH, mode: "drop" });
      const err = await errorOf(set.create(type({ addedScratch: GiB }), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toMatch(/the create got no answer, and the VM it made then failed to provision/);
      expect(armCalls("DELETE", VM_PATH)).toHaveLength(1);
      expectNothingLeft();
      expect(await set.instances({})).toEqual([]);
    });

    it("a 500 to the PUT, and no VM: only the NIC is deleted", async () => {
      const set = await openSet();
      fake.faults.next.push({ method: "PUT", path: VM_PATH, status: 500, code: "InternalServerError" });
      const err = await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CloudError);
      expect(armCalls("GET", VM_PATH).map((c) => c.status)).toEqual([404]);
      expect(armCalls("DELETE", VM_PATH)).toHaveLength(0);
      expectNothingLeft();
    });

    it("a lost answer and a VM that cannot be read: nothing deleted; the VM is listed for the pool to adopt", async () => {
      const clock = new FakeClock(Date.now());
      const set = await openSet({ deleteDanglingResourcesAfter: "1s" }, clock);
      fake.faults.lostAnswers.push({ method: "PUT", path: VM_PATH, mode: "drop" });
      for (let i = 0; i < STATUS_POLL_TRIES; i++)
        fake.faults.next.push({ method: "GET", path: VM_PATH, status: 500, code: "InternalServerError" });
      const creating = errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      for (let i = 1; i < STATUS_POLL_TRIES; i++) {
        await waitFor("the driver waiting to GET the VM again", () => clock.pending > 0);
        await clock.advance(50);
      }
      expect(await creating).toBeInstanceOf(CloudError);
      expect(fake.calls.filter((c) => c.method === "DELETE")).toEqual([]);
      const [vm] = [...fake.vms.values()];
      await clock.advance(5000); // past deleteDanglingResourcesAfter: its NIC is not dangling, it is the VM's
      expect((await set.instances({ ...OWN })).map((i) => i.id)).toEqual([vm!.name]);
      expect(fake.nics.size).toBe(1);
      expect(fake.calls.filter((c) => c.method === "DELETE")).toEqual([]);
    });

    it("a lost answer and a GET that does not see the VM yet: the NIC is in use, so the VM is left to the pool", async () => {
      const set = await openSet();
      fake.faults.lostAnswers.push({ method: "PUT", path: VM_PATH, mode: "drop" });
      fake.faults.next.push({ method: "GET", path: VM_PATH, status: 404, code: "ResourceNotFound" });
      const err = await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CloudError);
      expect(armCalls("DELETE", NIC_PATH).map((c) => c.code)).toEqual(["NicInUse"]);
      expect(log.lines.join("")).toContain("its VM exists; left to the pool");
      const [vm] = [...fake.vms.values()];
      expect((await set.instances({ ...OWN })).map((i) => i.id)).toEqual([vm!.name]);
      // Not a leftover: later lists delete nothing.
      await set.instances({});
      expect(armCalls("DELETE", NIC_PATH)).toHaveLength(1);
    });

    it("after a restart (a fresh driver on the same cloud), the VM of a create whose answer never came is listed", async () => {
      const before = await openSet();
      fake.faults.lostAnswers.push({ method: "PUT", path: VM_PATH, mode: "hold" });
      // The old process waits for an answer that does not come (and is then gone: its create never returns).
      const stale = errorOf(before.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      await waitFor("the VM PUT done, its answer held", () => fake.calls.some((c) => c.lost === "hold"));
      const [vm] = [...fake.vms.values()];
      const clock = new FakeClock(Date.now());
      const after = await openSet({ deleteDanglingResourcesAfter: "1s" }, clock);
      await clock.advance(5000);
      const listed = await after.instances({ ...OWN });
      expect(listed.map((i) => i.id)).toEqual([vm!.name]);
      expect(listed[0]!.address).toBe(fake.nics.get(`${vm!.name}-nic`)!.privateIp);
      await clock.advance(5000);
      await after.instances({ ...OWN });
      expect(fake.nics.size).toBe(1); // the listed VM's NIC is no dangling NIC
      // The pool of the new process uses it, or destroys it; here: destroys it. Nothing is left.
      await listed[0]!.destroy();
      expectNothingLeft();
      fake.releaseLostAnswers();
      expect(await stale).toBeInstanceOf(CloudError);
      expectNothingLeft();
    });
  });

  describe("a resource busy with another operation (RetryableErrorDueToAnotherOperation) is not a rate limit", () => {
    const busy = (method: string, path: RegExp) => ({
      method,
      path,
      status: 429,
      code: "RetryableErrorDueToAnotherOperation",
      message:
        "Operation PutNetworkInterfaceOperation (x) is updating resource y. The call can be retried in 0 seconds.",
      retryAfter: 0,
    });

    it("a NIC delete is sent again after Retry-After and succeeds", async () => {
      const set = await openSet();
      const inst = await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      fake.faults.next.push(busy("DELETE", NIC_PATH));
      await inst.destroy();
      expect(armCalls("DELETE", NIC_PATH).map((c) => c.status)).toEqual([429, 204]);
      expectNothingLeft();
    });

    it("a NIC create and a VM create are sent again; the create succeeds", async () => {
      const set = await openSet();
      fake.faults.next.push(busy("PUT", NIC_PATH), busy("PUT", VM_PATH));
      const inst = await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      expect(armCalls("PUT", NIC_PATH).map((c) => c.status)).toEqual([429, 201]);
      expect(armCalls("PUT", VM_PATH).map((c) => c.status)).toEqual([429, 201]);
      expect(fake.vms.has(inst.id)).toBe(true);
      expect(log.lines.join("")).toContain("another operation holds the resource; sending the call again");
    });

    it(`still busy after ${BUSY_TRIES} sends: a CloudError for that call, not a pool-wide rate limit`, async () => {
      const set = await openSet();
      for (let i = 0; i < BUSY_TRIES; i++) fake.faults.next.push(busy("PUT", NIC_PATH));
      const err = await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CloudError);
      expect(err).not.toBeInstanceOf(CloudRateLimitError);
      expect(err.message).toContain("RetryableErrorDueToAnotherOperation");
      expect(armCalls("PUT", NIC_PATH)).toHaveLength(BUSY_TRIES);
      expectNothingLeft();
    });
  });

  describe("error mapping through the SDK", () => {
    it("429 with Retry-After: rate limit until now + Retry-After, and the SDK did not retry", async () => {
      const clock = new FakeClock(Date.UTC(2026, 2, 1));
      const set = await openSet({}, clock);
      await set.instances({}); // token and first GC out of the way
      const before = fake.calls.length;
      fake.faults.next.push({
        method: "GET",
        path: /\/virtualMachines$/,
        status: 429,
        code: "TooManyRequests",
        retryAfter: 7,
      });
      const err = (await errorOf(set.instances({}))) as CloudRateLimitError;
      expect(err).toBeInstanceOf(CloudRateLimitError);
      expect(err.earliestRetry).toBe(clock.now() + 7000);
      expect(fake.calls.length - before).toBe(1);
    });

    it("429 without Retry-After: 20 s", async () => {
      const clock = new FakeClock(Date.UTC(2026, 2, 1));
      const set = await openSet({}, clock);
      fake.faults.next.push({ method: "PUT", path: NIC_PATH, status: 429, code: "TooManyRequests" });
      const err = (await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY))) as CloudRateLimitError;
      expect(err).toBeInstanceOf(CloudRateLimitError);
      expect(err.earliestRetry).toBe(clock.now() + 20_000);
      expectNothingLeft();
    });

    it("throttling of every call (throttleRate 1): each call fails once, with the fake's Retry-After", async () => {
      const clock = new FakeClock(Date.UTC(2026, 2, 1));
      const set = await openSet({}, clock);
      await set.instances({});
      fake.faults.throttleRate = 1;
      fake.faults.retryAfterSeconds = 3;
      const before = fake.calls.length;
      const err = (await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY))) as CloudRateLimitError;
      expect(err).toBeInstanceOf(CloudRateLimitError);
      expect(err.earliestRetry).toBe(clock.now() + 3000);
      // One refused PUT; no retries by the SDK (its throttling retry is off too).
      expect(fake.calls.slice(before).filter((c) => c.method === "PUT")).toHaveLength(1);
    });

    it("a throttled status poll of the NIC create is a rate limit too", async () => {
      const clock = new FakeClock(Date.UTC(2026, 2, 1));
      const set = await openSet({}, clock);
      fake.faults.next.push({
        method: "GET",
        path: /\/operations\//,
        status: 429,
        code: "TooManyRequests",
        retryAfter: 2,
      });
      const err = (await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY))) as CloudRateLimitError;
      expect(err).toBeInstanceOf(CloudRateLimitError);
      expect(err.earliestRetry).toBe(clock.now() + 2000);
      // The NIC was created; the next list (past the rate limit) deletes it.
      expect(fake.nics.size).toBe(1);
      expect(armCalls("DELETE", NIC_PATH)).toHaveLength(0);
      await set.instances({});
      expectNothingLeft();
    });

    it("a throttled status poll of an accepted VM create: polling resumes after Retry-After, without a second PUT; the VM is not listed until its create returns", async () => {
      const set = await openSet();
      fake.faults.next.push({
        method: "GET",
        path: COMPUTE_OPERATION,
        status: 429,
        code: "TooManyRequests",
        retryAfter: 1,
      });
      const started = Date.now();
      const creating = set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      await waitFor("the throttled status poll", () =>
        armCalls("GET", COMPUTE_OPERATION).some((c) => c.status === 429),
      );
      // The VM exists and has succeeded, but its create has not returned: the pool must not get it from a list.
      expect([...fake.vms.values()].map((v) => v.provisioningState)).toEqual(["Succeeded"]);
      expect(await set.instances({})).toEqual([]);
      const inst = await creating;
      expect(Date.now() - started).toBeGreaterThanOrEqual(1000);
      expect(armCalls("PUT", VM_PATH)).toHaveLength(1);
      expect(armCalls("GET", COMPUTE_OPERATION).map((c) => c.status)).toEqual([429, 200]);
      expect(log.lines.join("")).toContain("status poll failed; polling again");
      expect((await set.instances({})).map((i) => i.id)).toEqual([inst.id]);
    });

    it(`status polls of an accepted VM create failing ${STATUS_POLL_TRIES} times in a row: the create fails and is cleaned up`, async () => {
      const set = await openSet();
      for (let i = 0; i < STATUS_POLL_TRIES; i++)
        fake.faults.next.push({
          method: "GET",
          path: COMPUTE_OPERATION,
          status: 500,
          code: "InternalServerError",
        });
      const err = await errorOf(set.create(type(), IMAGE, { ...OWN }, INIT, KEY));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toContain("InternalServerError");
      // The failed polls of the create, then (the cleanup) the delete's.
      const statuses = armCalls("GET", COMPUTE_OPERATION).map((c) => c.status);
      expect(statuses.slice(0, STATUS_POLL_TRIES + 1)).toEqual([...Array(STATUS_POLL_TRIES).fill(500), 200]);
      expect(armCalls("PUT", VM_PATH)).toHaveLength(1);
      expectNothingLeft();
    });

    it("500s, 403s and 404s are CloudErrors named after the operation", async () => {
      const set = await openSet();
      fake.faults.next.push({
        method: "GET",
        path: /\/virtualMachines$/,
        status: 500,
        code: "InternalServerError",
      });
      const e500 = await errorOf(set.instances({}));
      expect(e500).toBeInstanceOf(CloudError);
      expect(e500.message).toMatch(/^azure list VMs: InternalServerError/);
      fake.faults.next.push({
        method: "GET",
        path: /\/networkInterfaces$/,
        status: 403,
        code: "AuthorizationFailed",
      });
      expect(await errorOf(set.instances({}))).toBeInstanceOf(CloudError);
      const missing = await openSet({ resourceGroup: "no-such-rg" });
      const e404 = await errorOf(missing.instances({}));
      expect(e404).toBeInstanceOf(CloudError);
    });

    it("a wrong client secret: CloudError, and the secret is in no message", async () => {
      const set = await openSet({ clientSecret: "wrong-secret-value" });
      const err = await errorOf(set.instances({}));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).not.toContain("wrong-secret-value");
      expect(fake.calls.filter((c) => c.path.includes("/subscriptions/"))).toHaveLength(0);
    });

    it("a call ARM does not answer within requestTimeout is a CloudError", async () => {
      const set = await openSet({ requestTimeout: "300ms" });
      await set.instances({});
      fake.faults.slowMs = 2000;
      const err = await errorOf(set.instances({}));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toContain("no answer within 300 ms");
      fake.faults.slowMs = 0;
    });
  });

  describe("instances", () => {
    it("lists the resource group page by page, keeps tag matches, joins addresses from one NIC list", async () => {
      await fake.stop();
      await startFake({ pageSize: 2 });
      const set = await openSet();
      const mine: string[] = [];
      for (let i = 0; i < 3; i++) {
        mine.push((await set.create(type(), IMAGE, { ...OWN, N: String(i) }, INIT, KEY)).id);
      }
      const other = await set.create(type(), IMAGE, { DispatchCloudInstanceSetID: "other" }, INIT, KEY);
      const deleting = await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      fake.vms.get(deleting.id)!.provisioningState = "Deleting";

      const before = fake.calls.length;
      const listed = await set.instances({ ...OWN });
      expect(listed.map((i) => i.id).sort()).toEqual([...mine].sort());
      for (const inst of listed) {
        expect(inst.address).toBe(fake.nics.get(`${inst.id}-nic`)!.privateIp);
        expect(inst.remoteUser).toBe("crunch");
        expect(inst.providerType).toBe("Standard_D2s_v3");
      }
      expect(listed.find((i) => i.id === mine[1])!.tags).toEqual({ ...OWN, N: "1" });
      const calls = fake.calls.slice(before);
      // 5 VMs at 2 a page: 3 pages; NICs the same; no GET per VM or NIC.
      expect(calls.filter((c) => c.method === "GET" && /\/virtualMachines$/.test(c.path))).toHaveLength(3);
      expect(calls.filter((c) => c.method === "GET" && /\/networkInterfaces$/.test(c.path))).toHaveLength(3);
      expect(
        calls.filter((c) => c.method === "GET" && (VM_PATH.test(c.path) || NIC_PATH.test(c.path))),
      ).toHaveLength(0);
      expect((await set.instances({ ...OWN, N: "2" })).map((i) => i.id)).toEqual([mine[2]]);
      expect((await set.instances({})).map((i) => i.id)).toContain(other.id);
    });

    it("setTags replaces the VM's tag map", async () => {
      const set = await openSet();
      const inst = await set.create(type(), IMAGE, { ...OWN, A: "1", B: "2" }, INIT, KEY);
      await inst.setTags({ ...OWN, A: "3", C: "4" });
      expect(fake.vms.get(inst.id)!.tags).toEqual({ ...OWN, A: "3", C: "4" });
      expect(inst.tags).toEqual({ ...OWN, A: "3", C: "4" });
      expect(armCalls("PATCH", VM_PATH)).toHaveLength(1);
      expect((await set.instances({ ...OWN }))[0]!.tags).toEqual({ ...OWN, A: "3", C: "4" });
    });

    it("destroy deletes the VM, its NIC and its disks; destroying again is fine", async () => {
      const set = await openSet();
      const inst = await set.create(type({ addedScratch: GiB }), IMAGE, { ...OWN }, INIT, KEY);
      const keep = await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      await inst.destroy();
      expect([...fake.vms.keys()]).toEqual([keep.id]);
      expect([...fake.nics.keys()]).toEqual([`${keep.id}-nic`]);
      expect([...fake.disks.keys()]).toEqual([`${keep.id}-osdisk`]);
      await inst.destroy();
      expect((await set.instances({})).map((i) => i.id)).toEqual([keep.id]);
    });

    it("collects dangling NICs and disks of this instance set once older than deleteDanglingResourcesAfter", async () => {
      const clock = new FakeClock(Date.now());
      const set = await openSet({ deleteDanglingResourcesAfter: "10m" }, clock);
      const live = await set.create(type(), IMAGE, { ...OWN }, INIT, KEY);
      fake.addDanglingNic("dc-aaaaaaaaaaaa-nic", { ...OWN });
      fake.addDanglingDisk("dc-aaaaaaaaaaaa-osdisk", {}); // untagged, like Azure's implicit OS disks
      fake.addDanglingDisk("dc-bbbbbbbbbbbb-osdisk", { ...OWN });
      fake.addDanglingNic("dc-cccccccccccc-nic", { DispatchCloudInstanceSetID: "other" });
      fake.addDanglingDisk("dc-cccccccccccc-osdisk", { DispatchCloudInstanceSetID: "other" });
      fake.addDanglingNic("unrelated-nic", {});
      // Left without their NIC (untagged, as Azure makes them): known as ours by the name alone.
      const orphan = resourceNames(newVmName(instanceSetMarker("zzzzz")));
      fake.addDanglingDisk(orphan.osDisk, {});
      fake.addDanglingDisk(orphan.scratchDisk, {});
      const others = resourceNames(newVmName(instanceSetMarker("other")));
      fake.addDanglingDisk(others.osDisk, {});

      // Young: first seen now (NICs) or created just now (disks).
      await set.instances({});
      expect(fake.nics.size).toBe(4);
      expect(fake.disks.size).toBe(7);

      // (The disks' age comes from their timeCreated, set by the fake's real clock a moment after `clock` began.)
      await clock.advance(11 * 60_000);
      await set.instances({});
      expect([...fake.nics.keys()].sort()).toEqual(
        [`${live.id}-nic`, "dc-cccccccccccc-nic", "unrelated-nic"].sort(),
      );
      expect([...fake.disks.keys()].sort()).toEqual(
        [`${live.id}-osdisk`, "dc-cccccccccccc-osdisk", others.osDisk].sort(),
      );
      expect(fake.vms.has(live.id)).toBe(true);
      // At most once per deleteDanglingResourcesAfter: the next list does not even list disks.
      fake.addDanglingNic("dc-dddddddddddd-nic", { ...OWN });
      const before = fake.calls.length;
      await set.instances({});
      expect(fake.calls.slice(before).some((c) => c.path.endsWith("/disks"))).toBe(false);
      expect(fake.nics.has("dc-dddddddddddd-nic")).toBe(true);
    });

    it("a failed dangling-resource deletion is logged and does not fail the list", async () => {
      const clock = new FakeClock(Date.now());
      const set = await openSet({ deleteDanglingResourcesAfter: "0s" }, clock);
      fake.addDanglingNic("dc-eeeeeeeeeeee-nic", { ...OWN });
      fake.faults.next.push({ method: "DELETE", path: NIC_PATH, status: 500, code: "InternalServerError" });
      await clock.advance(1000);
      expect(await set.instances({})).toEqual([]);
      expect(fake.nics.has("dc-eeeeeeeeeeee-nic")).toBe(true);
      expect(log.lines.join("")).toContain("cannot delete a dangling azure resource");
      await clock.advance(1000);
      await set.instances({});
      expect(fake.nics.has("dc-eeeeeeeeeeee-nic")).toBe(false);
    });
  });
});

describe("the azure driver's registration", () => {
  it("loads the Azure SDK only when an azure instance set opens", () => {
    // A fresh process: which @azure modules (ESM or CommonJS) were loaded before and after the azure set opened?
    const hooks = encodeURIComponent(
      'let port; export function initialize(d) { port = d.port; } export async function resolve(s, c, next) { const r = await next(s, c); if (r.url.includes("/node_modules/@azure/")) port.postMessage(r.url); return r; }',
    );
    const script = `
      import { createRequire, register } from "node:module";
      import { MessageChannel } from "node:worker_threads";
      const { port1, port2 } = new MessageChannel();
      const seen = [];
      port1.on("message", (u) => seen.push(u));
      port1.unref();
      register("data:text/javascript,${hooks}", { data: { port: port2 }, transferList: [port2] });
      const require = createRequire(process.cwd() + "/");
      const settle = () => new Promise((r) => setTimeout(r, 200));
      const loaded = async () => { await settle(); return seen.length > 0 || Object.keys(require.cache).some((k) => k.includes("/@azure/")); };
      const { createDefaultRegistry } = await import(process.cwd() + "/cloud-drivers/registry.ts");
      const { createLogger } = await import(process.cwd() + "/lib/logger.ts");
      const drivers = createDefaultRegistry();
      await drivers.get("local").instanceSet({ stateDir: process.argv[1] }, "x", {}, deps());
      const before = await loaded();
      const set = await drivers.get("azure").instanceSet({ subscriptionId: "${SUB}", resourceGroup: "rg", location: "westus2", network: "v", subnet: "s" }, "x", {}, deps());
      console.log(JSON.stringify({ before, after: await loaded() }));
      await set.stop();
      function deps() {
        return { logger: createLogger({ level: "silent", format: "json" }), clock: { now: () => 0, sleep: async () => {} }, registry: undefined };
      }
    `;
    const out = spawnSync(
      process.execPath,
      ["--import", "tsx", "--no-warnings", "--input-type=module", "-e", script, tmpdir()],
      { cwd: repoRoot, encoding: "utf8", timeout: 60_000 },
    );
    expect(out.stderr).toBe("");
    expect(JSON.parse(out.stdout.trim())).toEqual({ before: false, after: true });
  });
});

const repoRoot = fileURLToPath(new URL("../..", import.meta.url));

describe("azure driver with sshd-backed VMs", () => {
  let dir: string | undefined;
  let fake: FakeArm | undefined;
  let set: InstanceSet | undefined;

  afterEach(async () => {
    await set?.stop();
    await fake?.stop();
    if (dir !== undefined) await rm(dir, { recursive: true, force: true });
  });

  it("the VM's private IP runs its own sshd, which admits the dispatcher's key as adminUsername", async () => {
    const user = requireOpenSsh();
    dir = await mkdtemp(path.join(tmpdir(), "azure-driver-vms-"));
    await chmod(dir, 0o711); // The VMs' login user reaches its root under it.
    fake = await new FakeArm({
      localVms: { stateDir: path.join(dir, "vms"), user, addressPrefix: "127.0.14." },
      images: [IMAGE],
    }).start();
    set = await azureDriver.instanceSet(
      {
        subscriptionId: SUB,
        tenantId: TENANT,
        clientId: "dc-client",
        clientSecret: "dc-secret",
        endpoint: fake.url,
        authorityHost: fake.url,
        tlsCaFile: fake.caFile,
        resourceGroup: "dc-rg",
        location: "westus2",
        network: "dc-vnet",
        subnet: "default",
        adminUsername: user,
        pollInterval: "100ms",
      },
      "zzzzz",
      { ...OWN },
      {
        logger: createLogger({ level: "silent", format: "json" }),
        clock: systemClock,
        registry: new Registry(),
      },
    );
    const vms = set;
    const inst = await expectSshBackedInstance(
      vms,
      (init, publicKey) => vms.create(type(), IMAGE, { ...OWN }, init, publicKey),
      { address: /^127\.0\.14\.\d+$/, listFilter: { ...OWN }, user, what: "customData" },
    );
    await inst.destroy();
    expect(fake.vms.size).toBe(0);
    expect(fake.nics.size).toBe(0);
    expect(fake.disks.size).toBe(0);
  });
});
