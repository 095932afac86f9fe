/**
 * The fake Azure Resource Manager endpoint (test/fake-arm.ts) through the real `@azure/identity`,
 * `@azure/arm-compute` and `@azure/arm-network` clients over HTTPS: the token flow, api-versions, NIC and VM
 * creates as long-running operations, images that must exist, data disks, untagged implicit disks, a second PUT as
 * a full create-or-update, tag updates, nextLink paging, deletes and deleteOption, every fault (lost answers and
 * busy NICs included), and one VM backed by a local sshd VM (reachable by the NIC's private IP with the osProfile
 * key, customData run, gone after stop()).
 */
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { request } from "node:https";
import { tmpdir } from "node:os";
import path from "node:path";
import { ComputeManagementClient, type VirtualMachine } from "@azure/arm-compute";
import { NetworkManagementClient } from "@azure/arm-network";
import { ClientSecretCredential } from "@azure/identity";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { generateKeyPair } from "../lib/ssh-keys.ts";
import { FakeArm } from "./fake-arm.ts";
import { connect, processesUnder, requireOpenSsh, run, waitFor } from "./local-driver-helpers.ts";

const SUB = "00000000-0000-0000-0000-000000000001";
const TENANT = "00000000-0000-0000-0000-0000000000aa";
const RG = "dc-rg";
const ADDRESS_PREFIX = "127.0.13.";
const POLL = { updateIntervalInMs: 50 };
const KEY = generateKeyPair("fake-arm-test");

interface Clients {
  credential: ClientSecretCredential;
  compute: ComputeManagementClient;
  network: NetworkManagementClient;
}

function credentialFor(fake: FakeArm, clientId = "dc-client", secret = "dc-secret"): ClientSecretCredential {
  return new ClientSecretCredential(TENANT, clientId, secret, {
    authorityHost: fake.url,
    disableInstanceDiscovery: true,
    tlsOptions: { ca: readFileSync(fake.caFile, "utf8") },
    retryOptions: { maxRetries: 0 },
  });
}

function clientsFor(fake: FakeArm): Clients {
  const credential = credentialFor(fake);
  const common = {
    endpoint: fake.url,
    tlsOptions: { ca: readFileSync(fake.caFile, "utf8") },
    retryOptions: { maxRetries: 0 },
  };
  return {
    credential,
    compute: new ComputeManagementClient(credential, SUB, {
      ...common,
      credentials: { scopes: ["https://management.azure.com/.default"] },
    }),
    network: new NetworkManagementClient(credential, SUB, {
      ...common,
      credentialScopes: ["https://management.azure.com/.default"],
    }),
  };
}

const subnetId = `/subscriptions/${SUB}/resourceGroups/${RG}/providers/Microsoft.Network/virtualNetworks/dc-vnet/subnets/default`;
const imageId = `/subscriptions/${SUB}/resourceGroups/images-rg/providers/Microsoft.Compute/images/dc-image-1`;
const galleryImage = `/subscriptions/${SUB}/resourceGroups/img/providers/Microsoft.Compute/galleries/g1/images/dc`;
const IMAGES = [imageId, `${galleryImage}/versions/1.0.0`];
const nicId = (name: string) =>
  `/subscriptions/${SUB}/resourceGroups/${RG}/providers/Microsoft.Network/networkInterfaces/${name}`;

async function createNic(
  c: Clients,
  name: string,
  tags: Record<string, string> = { DispatchCloudInstanceSetID: "zzzzz" },
) {
  return c.network.networkInterfaces.beginCreateOrUpdateAndWait(
    RG,
    name,
    {
      location: "westus2",
      tags,
      ipConfigurations: [
        { name: "ipconfig1", subnet: { id: subnetId }, privateIPAllocationMethod: "Dynamic" },
      ],
    },
    POLL,
  );
}

/** A VM as the azure driver asks for one. */
function vmParams(nic: string, over: Partial<VirtualMachine> = {}, user = "dcvm"): VirtualMachine {
  return {
    location: "westus2",
    tags: { DispatchCloudInstanceSetID: "zzzzz", "dispatch-cloud-instance-type": "small" },
    hardwareProfile: { vmSize: "Standard_D2s_v3" },
    storageProfile: {
      imageReference: { id: imageId },
      osDisk: {
        createOption: "FromImage",
        deleteOption: "Delete",
        managedDisk: { storageAccountType: "Premium_LRS" },
      },
    },
    osProfile: {
      computerName: "compute-1",
      adminUsername: user,
      customData: Buffer.from("#!/bin/sh\necho hello\n").toString("base64"),
      linuxConfiguration: {
        disablePasswordAuthentication: true,
        ssh: { publicKeys: [{ path: `/home/${user}/.ssh/authorized_keys`, keyData: KEY.publicKey }] },
      },
    },
    networkProfile: { networkInterfaces: [{ id: nicId(nic), primary: true, deleteOption: "Delete" }] },
    ...over,
  };
}

/** Awaits `p` expecting a RestError with `code` (and `status`); returns it. */
async function armError(p: Promise<unknown>, code: string, status?: number) {
  let caught: unknown;
  try {
    await p;
  } catch (err) {
    caught = err;
  }
  expect(caught, `expected ${code}`).toBeInstanceOf(Error);
  const err = caught as Error & {
    code?: string;
    statusCode?: number;
    details?: { error?: { target?: string } };
  };
  expect(err.code).toBe(code);
  if (status !== undefined) expect(err.statusCode).toBe(status);
  return err;
}

/**
 * Awaits `p` expecting a long-running operation that was accepted and then failed with `code`: core-lro throws a
 * plain Error "The long-running operation has failed. <code>. <message>".
 */
async function lroFailure(p: Promise<unknown>, code: string): Promise<Error> {
  let caught: unknown;
  try {
    await p;
  } catch (err) {
    caught = err;
  }
  expect(caught, `expected ${code}`).toBeInstanceOf(Error);
  const err = caught as Error;
  expect(/^The long-running operation has failed\. (\w+)\./.exec(err.message)?.[1]).toBe(code);
  return err;
}

/** A raw HTTPS request to the fake (for what the SDK never sends). */
function raw(
  fake: FakeArm,
  method: string,
  pathAndQuery: string,
  opts: { token?: string; body?: string } = {},
): Promise<{ status: number; headers: Record<string, string | string[] | undefined>; json: unknown }> {
  return new Promise((resolve, reject) => {
    const req = request(
      `${fake.url}${pathAndQuery}`,
      {
        method,
        ca: readFileSync(fake.caFile),
        headers: {
          ...(opts.token === undefined ? {} : { authorization: `Bearer ${opts.token}` }),
          ...(opts.body === undefined ? {} : { "content-type": "application/json" }),
        },
      },
      (res) => {
        const chunks: Buffer[] = [];
        res.on("data", (d: Buffer) => chunks.push(d));
        res.on("end", () => {
          const text = Buffer.concat(chunks).toString("utf8");
          resolve({
            status: res.statusCode ?? 0,
            headers: res.headers,
            json: text === "" ? null : JSON.parse(text),
          });
        });
      },
    );
    req.on("error", reject);
    req.end(opts.body);
  });
}

async function collect<T>(it: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const x of it) out.push(x);
  return out;
}

function resetFaults(fake: FakeArm): void {
  Object.assign(fake.faults, {
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
  });
}

describe("fake ARM: identity and request checks", () => {
  let fake: FakeArm;

  beforeAll(async () => {
    fake = await new FakeArm().start();
  });
  afterAll(async () => {
    await fake?.stop();
  });

  it("issues tokens to a known client over the client-credentials flow and refuses a wrong secret or client", async () => {
    const token = await credentialFor(fake).getToken("https://management.azure.com/.default");
    expect(token.token).toMatch(/^fake-arm\./);
    expect(token.expiresOnTimestamp).toBeGreaterThan(Date.now() + 3000_000);
    const paths = fake.calls.map((c) => `${c.method} ${c.path} ${c.status}`);
    expect(paths).toEqual([
      `GET /${TENANT}/v2.0/.well-known/openid-configuration 200`,
      `POST /${TENANT}/oauth2/v2.0/token 200`,
    ]);

    await expect(
      credentialFor(fake, "dc-client", "wrong").getToken("https://management.azure.com/.default"),
    ).rejects.toThrow(/invalid_client|AADSTS7000215/);
    await expect(
      credentialFor(fake, "nobody", "dc-secret").getToken("https://management.azure.com/.default"),
    ).rejects.toThrow(/invalid_client|AADSTS700016/);
    const refused = fake.calls.filter((c) => c.path.endsWith("/token") && c.status !== 200);
    expect(refused.map((c) => [c.status, c.code])).toEqual([
      [401, "invalid_client"],
      [401, "invalid_client"],
    ]);
  });

  it("refuses ARM requests without a token, with an unknown one, or without api-version", async () => {
    const vmPath = `/subscriptions/${SUB}/resourceGroups/${RG}/providers/Microsoft.Compute/virtualMachines`;
    const none = await raw(fake, "GET", `${vmPath}?api-version=2026-03-01`);
    expect(none.status).toBe(401);
    expect(none.json).toMatchObject({ error: { code: "AuthenticationFailed" } });
    expect(String(none.headers["www-authenticate"])).toMatch(/^Bearer /);
    const bogus = await raw(fake, "GET", `${vmPath}?api-version=2026-03-01`, { token: "not-issued" });
    expect(bogus.json).toMatchObject({ error: { code: "InvalidAuthenticationToken" } });

    const { token } = await credentialFor(fake).getToken("https://management.azure.com/.default");
    const noVersion = await raw(fake, "GET", vmPath, { token });
    expect(noVersion.status).toBe(400);
    expect(noVersion.json).toMatchObject({ error: { code: "MissingApiVersionParameter" } });
    const ok = await raw(fake, "GET", `${vmPath}?api-version=2026-03-01`, { token });
    expect(ok).toMatchObject({ status: 200, json: { value: [] } });
    const otherRg = await raw(fake, "GET", `${vmPath.replace(RG, "nope-rg")}?api-version=2026-03-01`, {
      token,
    });
    expect(otherRg.json).toMatchObject({ error: { code: "ResourceGroupNotFound" } });
    const otherSub = await raw(
      fake,
      "GET",
      `${vmPath.replace(SUB, "11111111-0000-0000-0000-000000000000")}?api-version=1`,
      {
        token,
      },
    );
    expect(otherSub.json).toMatchObject({ error: { code: "SubscriptionNotFound" } });
    const badJson = await raw(fake, "PUT", `${vmPath}/vm-x?api-version=2026-03-01`, { token, body: "{" });
    expect(badJson.json).toMatchObject({ error: { code: "InvalidRequestContent" } });
    expect(fake.calls.at(-1)).toMatchObject({
      method: "PUT",
      apiVersion: "2026-03-01",
      status: 400,
      code: "InvalidRequestContent",
    });
  });
});

describe("fake ARM through the real SDK: resources", () => {
  let fake: FakeArm;
  let c: Clients;

  beforeAll(async () => {
    fake = await new FakeArm({ pageSize: 100, images: IMAGES }).start();
    c = clientsFor(fake);
  });
  afterAll(async () => {
    await fake?.stop();
  });
  afterEach(() => resetFaults(fake));

  it("creates a NIC then a VM as long-running operations; the OS disk appears, without the VM's tags", async () => {
    const nic = await createNic(c, "vm-a-nic");
    expect(nic.provisioningState).toBe("Succeeded");
    expect(nic.ipConfigurations?.[0]?.privateIPAddress).toMatch(/^10\.0\.\d+\.\d+$/);
    expect(nic.ipConfigurations?.[0]?.subnet?.id).toBe(subnetId);
    expect(nic.tags).toEqual({ DispatchCloudInstanceSetID: "zzzzz" });
    const nicCalls = fake.calls.filter(
      (x) => x.path.includes("networkInterfaces") || x.path.includes("Microsoft.Network/locations"),
    );
    expect(nicCalls.map((x) => `${x.method} ${x.status}`)).toEqual(["PUT 201", "GET 200", "GET 200"]);

    const spot = vmParams("vm-a-nic", {
      priority: "Spot",
      evictionPolicy: "Delete",
      billingProfile: { maxPrice: -1 },
    });
    const vm = await c.compute.virtualMachines.createOrUpdate(RG, "vm-a", spot, POLL);
    expect(vm.provisioningState).toBe("Succeeded");
    expect(vm.tags).toEqual(spot.tags);
    expect(vm.priority).toBe("Spot");
    expect(vm.evictionPolicy).toBe("Delete");
    expect(vm.billingProfile?.maxPrice).toBe(-1);
    expect(vm.osProfile?.adminUsername).toBe("dcvm");
    expect(vm.networkProfile?.networkInterfaces?.[0]?.id).toBe(nicId("vm-a-nic"));

    const put = fake.calls.findIndex((x) => x.method === "PUT" && x.path.endsWith("/virtualMachines/vm-a"));
    expect(fake.calls[put]?.status).toBe(201);
    expect(
      fake.calls
        .slice(put + 1)
        .some((x) => /Microsoft.Compute\/locations\/westus2\/operations\//.test(x.path)),
    ).toBe(true);

    const fv = fake.vms.get("vm-a")!;
    expect(fv).toMatchObject({
      provisioningState: "Succeeded",
      size: "Standard_D2s_v3",
      customData: "#!/bin/sh\necho hello\n",
      publicKeys: [KEY.publicKey.trim()],
      priority: "Spot",
      evictionPolicy: "Delete",
      maxPrice: -1,
      imageId,
      osDiskName: "vm-a-osdisk",
    });
    expect(fake.nics.get("vm-a-nic")!.vmId).toBe(fv.id);
    // Azure does not copy a VM's tags to the OS disk it makes.
    expect(fake.disks.get("vm-a-osdisk")).toMatchObject({ tags: {}, vmId: fv.id, createOption: "FromImage" });
    const disk = await c.compute.disks.get(RG, "vm-a-osdisk");
    expect(disk.managedBy).toBe(fv.id);
    expect(disk.tags).toEqual({});

    // A NIC in use by a VM can take no other VM and cannot be deleted; nor can the VM's disk.
    await armError(
      c.compute.virtualMachines.createOrUpdate(RG, "vm-b", vmParams("vm-a-nic"), POLL),
      "NicInUse",
      400,
    );
    await armError(c.network.networkInterfaces.beginDeleteAndWait(RG, "vm-a-nic", POLL), "NicInUse", 400);
    await armError(c.compute.disks.delete(RG, "vm-a-osdisk", POLL), "OperationNotAllowed", 409);
  });

  it("checks NIC and VM bodies, naming the bad field", async () => {
    const badNic = (ipConfigurations: unknown[]) =>
      c.network.networkInterfaces.beginCreateOrUpdateAndWait(
        RG,
        "bad-nic",
        { location: "westus2", ipConfigurations: ipConfigurations as never },
        POLL,
      );
    await armError(badNic([]), "InvalidRequestFormat", 400);
    await armError(
      badNic([{ name: "c", subnet: { id: `${subnetId}x` }, privateIPAllocationMethod: "Dynamic" }]),
      "InvalidResourceReference",
    );
    const stat = await armError(
      badNic([
        {
          name: "c",
          subnet: { id: subnetId },
          privateIPAllocationMethod: "Static",
          privateIPAddress: "10.0.0.9",
        },
      ]),
      "InvalidParameter",
    );
    expect(stat.message).toMatch(/privateIPAllocationMethod/);
    await armError(
      c.network.networkInterfaces.beginCreateOrUpdateAndWait(
        RG,
        "bad-nic",
        {
          location: "eastus",
          ipConfigurations: [{ name: "c", subnet: { id: subnetId }, privateIPAllocationMethod: "Dynamic" }],
        },
        POLL,
      ),
      "LocationNotAvailableForResourceType",
    );
    expect(fake.nics.has("bad-nic")).toBe(false);

    await createNic(c, "vm-c-nic");
    const cases: [Partial<VirtualMachine>, string, string][] = [
      [{ hardwareProfile: {} }, "InvalidParameter", "hardwareProfile.vmSize"],
      [
        {
          storageProfile: {
            imageReference: { publisher: "Canonical", offer: "x", sku: "y", version: "latest" },
          },
        },
        "InvalidParameter",
        "storageProfile.imageReference.id",
      ],
      [
        { storageProfile: { imageReference: { id: "/images/nope" } } },
        "InvalidParameter",
        "storageProfile.imageReference.id",
      ],
      [
        { networkProfile: { networkInterfaces: [{ id: nicId("no-such-nic") }] } },
        "InvalidResourceReference",
        "networkInterfaces/no-such-nic",
      ],
      [{ priority: "Regular", evictionPolicy: "Delete" }, "InvalidParameter", "evictionPolicy"],
      [{ billingProfile: { maxPrice: -1 } }, "InvalidParameter", "billingProfile.maxPrice"],
    ];
    for (const [over, code, target] of cases) {
      const err = await armError(
        c.compute.virtualMachines.createOrUpdate(RG, "vm-c", vmParams("vm-c-nic", over), POLL),
        code,
        400,
      );
      expect(err.message, target).toContain(target);
    }
    const os = vmParams("vm-c-nic").osProfile!;
    const osCases: [Partial<typeof os>, string][] = [
      [{ customData: "not base64!" }, "osProfile.customData"],
      [{ adminUsername: "root" }, "osProfile.adminUsername"],
      [{ linuxConfiguration: { disablePasswordAuthentication: false } }, "disablePasswordAuthentication"],
      [
        {
          linuxConfiguration: {
            disablePasswordAuthentication: true,
            ssh: { publicKeys: [{ path: "/root/.ssh/authorized_keys", keyData: KEY.publicKey }] },
          },
        },
        "publicKeys[0].path",
      ],
      [
        {
          linuxConfiguration: {
            disablePasswordAuthentication: true,
            ssh: { publicKeys: [{ path: "/home/dcvm/.ssh/authorized_keys", keyData: "ssh-rsa AAAA" }] },
          },
        },
        "publicKeys[0].keyData",
      ],
      [{ adminPassword: "hunter2hunter2!" }, "osProfile.adminPassword"],
    ];
    for (const [over, target] of osCases) {
      const err = await armError(
        c.compute.virtualMachines.createOrUpdate(
          RG,
          "vm-c",
          vmParams("vm-c-nic", { osProfile: { ...os, ...over } }),
          POLL,
        ),
        "InvalidParameter",
        400,
      );
      expect(err.message, target).toContain(target);
    }
    await armError(
      c.compute.virtualMachines.createOrUpdate(RG, "vm_c", vmParams("vm-c-nic"), POLL),
      "InvalidResourceName",
    );
    expect(fake.vms.size).toBe(fake.vms.has("vm-a") ? 1 : 0);
    expect(fake.nics.get("vm-c-nic")!.vmId).toBeNull();
    const gallery = `/subscriptions/${SUB}/resourceGroups/img/providers/Microsoft.Compute/galleries/g1/images/dc/versions/1.0.0`;
    const vm = await c.compute.virtualMachines.createOrUpdate(
      RG,
      "vm-c",
      vmParams("vm-c-nic", {
        storageProfile: {
          imageReference: { id: gallery },
          osDisk: { createOption: "FromImage", name: "vm-c-root" },
        },
      }),
      POLL,
    );
    expect(vm.storageProfile?.imageReference?.id).toBe(gallery);
    expect(fake.disks.has("vm-c-root")).toBe(true);
  });

  it("updates VM tags with PATCH (the whole map), as virtualMachines.update sends", async () => {
    await createNic(c, "vm-t-nic");
    await c.compute.virtualMachines.createOrUpdate(RG, "vm-t", vmParams("vm-t-nic"), POLL);
    const updated = await c.compute.virtualMachines.update(RG, "vm-t", { tags: { only: "this" } }, POLL);
    expect(updated.tags).toEqual({ only: "this" });
    expect(fake.vms.get("vm-t")!.tags).toEqual({ only: "this" });
    expect(fake.calls.some((x) => x.method === "PATCH" && x.path.endsWith("/vm-t") && x.status === 200)).toBe(
      true,
    );
    expect((await c.compute.virtualMachines.get(RG, "vm-t")).tags).toEqual({ only: "this" });
    await armError(
      c.compute.virtualMachines.update(RG, "no-such-vm", { tags: {} }, POLL),
      "ResourceNotFound",
      404,
    );
  });

  it("lists NICs, VMs and disks by resource group, with nextLink paging past 100", async () => {
    for (let i = 0; i < 250; i++)
      fake.addDanglingNic(`page-nic-${String(i).padStart(3, "0")}`, { page: "yes" });
    fake.addDanglingDisk("page-disk-1", { page: "yes" });
    const before = fake.calls.length;
    const nics = await collect(c.network.networkInterfaces.list(RG));
    const pages = fake.calls.slice(before).filter((x) => x.path.endsWith("/networkInterfaces"));
    expect(pages.length).toBe(Math.ceil(nics.length / 100));
    expect(pages.length).toBeGreaterThanOrEqual(3);
    const names = nics.map((n) => n.name ?? "");
    expect(new Set(names).size).toBe(names.length);
    expect(names.filter((n) => n.startsWith("page-nic-")).length).toBe(250);
    expect(nics.find((n) => n.name === "page-nic-007")?.tags).toEqual({ page: "yes" });

    const vms = await collect(c.compute.virtualMachines.list(RG));
    expect(vms.map((v) => v.name).sort()).toEqual([...fake.vms.values()].map((v) => v.name).sort());
    const disks = await collect(c.compute.disks.listByResourceGroup(RG));
    expect(disks.find((d) => d.name === "page-disk-1")).toMatchObject({
      tags: { page: "yes" },
      diskState: "Unattached",
    });
    await armError(
      collect(c.compute.virtualMachines.list(RG, { filter: "tagName eq 'x'" })),
      "InvalidParameter",
      400,
    );
    for (let i = 0; i < 250; i++)
      await c.network.networkInterfaces.beginDeleteAndWait(
        RG,
        `page-nic-${String(i).padStart(3, "0")}`,
        POLL,
      );
    expect([...fake.nics.keys()].some((k) => k.startsWith("page-nic-"))).toBe(false);
  });

  it("deletes a VM with its disk and NIC when deleteOption is Delete, and leaves them otherwise", async () => {
    await createNic(c, "vm-d-nic");
    await c.compute.virtualMachines.createOrUpdate(RG, "vm-d", vmParams("vm-d-nic"), POLL);
    await c.compute.virtualMachines.delete(RG, "vm-d", POLL);
    expect(fake.vms.has("vm-d")).toBe(false);
    expect(fake.disks.has("vm-d-osdisk")).toBe(false);
    expect(fake.nics.has("vm-d-nic")).toBe(false);
    await armError(c.compute.virtualMachines.get(RG, "vm-d"), "ResourceNotFound", 404);
    const del = fake.calls.filter((x) => x.method === "DELETE" && x.path.endsWith("/vm-d"));
    expect(del.map((x) => x.status)).toEqual([202]);

    await createNic(c, "vm-e-nic");
    const keep = vmParams("vm-e-nic", {
      storageProfile: {
        imageReference: { id: imageId },
        osDisk: { createOption: "FromImage", deleteOption: "Detach" },
      },
      networkProfile: { networkInterfaces: [{ id: nicId("vm-e-nic"), primary: true }] },
    });
    await c.compute.virtualMachines.createOrUpdate(RG, "vm-e", keep, POLL);
    await c.compute.virtualMachines.delete(RG, "vm-e", POLL);
    expect(fake.vms.has("vm-e")).toBe(false);
    expect(fake.disks.get("vm-e-osdisk")).toMatchObject({ vmId: null, tags: {} });
    expect(fake.nics.get("vm-e-nic")).toMatchObject({ vmId: null });
    // Dangling now: they can go.
    await c.compute.disks.delete(RG, "vm-e-osdisk", POLL);
    await c.network.networkInterfaces.beginDeleteAndWait(RG, "vm-e-nic", POLL);
    expect(fake.disks.has("vm-e-osdisk")).toBe(false);
    expect(fake.nics.has("vm-e-nic")).toBe(false);
    // Deleting what is not there answers 204.
    await c.compute.virtualMachines.delete(RG, "vm-e", POLL);
    await c.network.networkInterfaces.beginDeleteAndWait(RG, "vm-e-nic", POLL);
    expect(fake.calls.slice(-2).map((x) => x.status)).toEqual([204, 204]);
  });

  it("takes only the api-versions a resource type knows: NoRegisteredProviderFound or InvalidApiVersionParameter", async () => {
    const { token } = await c.credential.getToken("https://management.azure.com/.default");
    const rg = `/subscriptions/${SUB}/resourceGroups/${RG}/providers`;
    const old = await raw(fake, "GET", `${rg}/Microsoft.Compute/virtualMachines?api-version=2019-01-01`, {
      token,
    });
    expect(old.status).toBe(400);
    expect(old.json).toMatchObject({ error: { code: "NoRegisteredProviderFound" } });
    const message = (old.json as { error: { message: string } }).error.message;
    expect(message).toMatch(
      /API version '2019-01-01' for type 'virtualMachines'\. The supported api-versions are '.*2026-03-01/,
    );
    // A version of another resource type is no better.
    const nic = await raw(fake, "GET", `${rg}/Microsoft.Network/networkInterfaces?api-version=2026-03-01`, {
      token,
    });
    expect(nic.json).toMatchObject({ error: { code: "NoRegisteredProviderFound" } });
    const disks = await raw(fake, "GET", `${rg}/Microsoft.Compute/disks?api-version=2026-03-01`, { token });
    expect(disks.json).toMatchObject({ error: { code: "NoRegisteredProviderFound" } });
    const bad = await raw(fake, "GET", `${rg}/Microsoft.Compute/virtualMachines?api-version=latest`, {
      token,
    });
    expect(bad.json).toMatchObject({ error: { code: "InvalidApiVersionParameter" } });
    const ok = await raw(fake, "GET", `${rg}/Microsoft.Compute/disks?api-version=2025-01-02`, { token });
    expect(ok.status).toBe(200);
    // What the SDKs send is accepted (the whole suite runs on it); these are the versions they pin.
    const sent = (re: RegExp) =>
      new Set(fake.calls.filter((x) => re.test(x.path) && x.status < 400).map((x) => x.apiVersion));
    await collect(c.compute.virtualMachines.list(RG));
    await collect(c.compute.disks.listByResourceGroup(RG));
    await collect(c.network.networkInterfaces.list(RG));
    expect(sent(/\/virtualMachines$/)).toEqual(new Set(["2026-03-01"]));
    expect(sent(/\/disks$/)).toEqual(new Set(["2025-01-02"]));
    expect(sent(/\/networkInterfaces$/)).toEqual(new Set(["2025-05-01"]));
  });

  it("makes VMs of existing images only: 404 NotFound or GalleryImageNotFound; a gallery image definition id is its latest version", async () => {
    await createNic(c, "vm-i-nic");
    const withImage = (id: string) =>
      vmParams("vm-i-nic", {
        storageProfile: {
          imageReference: { id },
          osDisk: { createOption: "FromImage", deleteOption: "Delete" },
        },
      });
    const missing = await armError(
      c.compute.virtualMachines.createOrUpdate(
        RG,
        "vm-i",
        withImage(imageId.replace("dc-image-1", "nope")),
        POLL,
      ),
      "NotFound",
      404,
    );
    expect(missing.message).toMatch(/The Image '.*\/images\/nope' cannot be found in 'westus2' region/);
    await armError(
      c.compute.virtualMachines.createOrUpdate(RG, "vm-i", withImage(`${galleryImage}/versions/9.9.9`), POLL),
      "GalleryImageNotFound",
      404,
    );
    await armError(
      c.compute.virtualMachines.createOrUpdate(
        RG,
        "vm-i",
        withImage(galleryImage.replace("/dc", "/other")),
        POLL,
      ),
      "GalleryImageNotFound",
      404,
    );
    // Azure's "latest" is the definition id without /versions; a version literally named "latest" does not exist.
    await armError(
      c.compute.virtualMachines.createOrUpdate(
        RG,
        "vm-i",
        withImage(`${galleryImage}/versions/latest`),
        POLL,
      ),
      "GalleryImageNotFound",
      404,
    );
    expect(fake.vms.has("vm-i")).toBe(false);
    const vm = await c.compute.virtualMachines.createOrUpdate(RG, "vm-i", withImage(galleryImage), POLL);
    expect(vm.provisioningState).toBe("Succeeded");
    expect(fake.vms.get("vm-i")?.imageId).toBe(galleryImage);
    await c.compute.virtualMachines.delete(RG, "vm-i", POLL);
  });

  it("makes empty data disks with the VM: untagged, listed, attached; deleted or detached by deleteOption (default Detach)", async () => {
    await createNic(c, "vm-dd-nic");
    const params = vmParams("vm-dd-nic", {
      storageProfile: {
        imageReference: { id: imageId },
        osDisk: { createOption: "FromImage", deleteOption: "Delete" },
        dataDisks: [
          { lun: 0, name: "vm-dd-scratch", createOption: "Empty", diskSizeGB: 101, deleteOption: "Delete" },
          { lun: 1, name: "vm-dd-keep", createOption: "Empty", diskSizeGB: 8 },
        ],
      },
    });
    const vm = await c.compute.virtualMachines.createOrUpdate(RG, "vm-dd", params, POLL);
    expect(vm.storageProfile?.dataDisks?.map((d) => [d.lun, d.name, d.diskSizeGB, d.deleteOption])).toEqual([
      [0, "vm-dd-scratch", 101, "Delete"],
      [1, "vm-dd-keep", 8, "Detach"],
    ]);
    const id = fake.vms.get("vm-dd")!.id;
    expect(fake.disks.get("vm-dd-scratch")).toMatchObject({
      createOption: "Empty",
      sizeGb: 101,
      tags: {},
      vmId: id,
    });
    const listed = await collect(c.compute.disks.listByResourceGroup(RG));
    expect(listed.find((d) => d.name === "vm-dd-scratch")).toMatchObject({
      managedBy: id,
      diskState: "Attached",
      diskSizeGB: 101,
      creationData: { createOption: "Empty" },
    });
    await armError(c.compute.disks.delete(RG, "vm-dd-scratch", POLL), "OperationNotAllowed", 409);
    // Bad data disks, naming the field.
    for (const [disk, target] of [
      [{ lun: 0, createOption: "Empty" }, "dataDisks[0].diskSizeGB"],
      [{ lun: 64, createOption: "Empty", diskSizeGB: 1 }, "dataDisks[0].lun"],
      [{ lun: 0, createOption: "Attach", diskSizeGB: 1 }, "dataDisks[0].createOption"],
    ] as const) {
      await createNic(c, "vm-dx-nic");
      const err = await armError(
        c.compute.virtualMachines.createOrUpdate(
          RG,
          "vm-dx",
          vmParams("vm-dx-nic", {
            storageProfile: { imageReference: { id: imageId }, dataDisks: [disk as never] },
          }),
          POLL,
        ),
        "InvalidParameter",
        400,
      );
      expect(err.message).toContain(target);
    }
    await c.compute.virtualMachines.delete(RG, "vm-dd", POLL);
    expect(fake.disks.has("vm-dd-scratch")).toBe(false);
    expect(fake.disks.has("vm-dd-osdisk")).toBe(false);
    expect(fake.disks.get("vm-dd-keep")).toMatchObject({ vmId: null });
    await c.compute.disks.delete(RG, "vm-dd-keep", POLL);
  });

  it("a second PUT of a VM is a full create-or-update: tags replaced, a data disk added; immutable changes are 409 PropertyChangeNotAllowed", async () => {
    await createNic(c, "vm-u-nic");
    const first = vmParams("vm-u-nic", { tags: { a: "1", b: "2" } });
    await c.compute.virtualMachines.createOrUpdate(RG, "vm-u", first, POLL);
    const before = fake.calls.length;
    const again = await c.compute.virtualMachines.createOrUpdate(
      RG,
      "vm-u",
      {
        ...first,
        tags: { c: "3" },
        storageProfile: {
          ...first.storageProfile,
          dataDisks: [{ lun: 0, createOption: "Empty", diskSizeGB: 4, deleteOption: "Delete" }],
        },
      },
      POLL,
    );
    expect(fake.calls.slice(before).find((x) => x.method === "PUT")?.status).toBe(200);
    expect(again.tags).toEqual({ c: "3" });
    expect(fake.vms.get("vm-u")!.tags).toEqual({ c: "3" });
    const added = fake.vms.get("vm-u")!.dataDisks;
    expect(added).toHaveLength(1);
    expect(fake.disks.get(added[0]!.name.toLowerCase())).toMatchObject({
      sizeGb: 4,
      vmId: fake.vms.get("vm-u")!.id,
    });
    // The same NIC, its own: no NicInUse. Immutable properties:
    const os = first.osProfile!;
    for (const [over, target] of [
      [
        { osProfile: { ...os, customData: Buffer.from("#!/bin/sh\necho other\n").toString("base64") } },
        "osProfile.customData",
      ],
      [{ osProfile: { ...os, computerName: "compute-2" } }, "osProfile.computerName"],
      [
        {
          storageProfile: {
            ...first.storageProfile,
            imageReference: { id: `${galleryImage}/versions/1.0.0` },
          },
        },
        "storageProfile.imageReference",
      ],
      [{ priority: "Spot", evictionPolicy: "Delete" }, "priority"],
    ] as const) {
      const err = await armError(
        c.compute.virtualMachines.createOrUpdate(
          RG,
          "vm-u",
          { ...first, ...(over as Partial<VirtualMachine>) },
          POLL,
        ),
        "PropertyChangeNotAllowed",
        409,
      );
      expect(err.message).toBe(`Changing property '${target}' is not allowed.`);
    }
    expect(fake.vms.get("vm-u")!.customData).toBe("#!/bin/sh\necho hello\n");
    await c.compute.virtualMachines.delete(RG, "vm-u", POLL);
    expect([...fake.disks.keys()].some((k) => k.startsWith("vm-u"))).toBe(false);

    // A PUT of a VM whose create failed provisions it again (and fails again while its size still cannot be had).
    await createNic(c, "vm-r-nic");
    fake.faults.sizeErrors.set("Standard_D2s_v3", "AllocationFailed");
    await lroFailure(
      c.compute.virtualMachines.createOrUpdate(RG, "vm-r", vmParams("vm-r-nic"), POLL),
      "AllocationFailed",
    );
    await lroFailure(
      c.compute.virtualMachines.createOrUpdate(RG, "vm-r", vmParams("vm-r-nic"), POLL),
      "AllocationFailed",
    );
    fake.faults.sizeErrors.clear();
    const retried = await c.compute.virtualMachines.createOrUpdate(RG, "vm-r", vmParams("vm-r-nic"), POLL);
    expect(retried.provisioningState).toBe("Succeeded");
    expect([...fake.disks.keys()].filter((k) => k.startsWith("vm-r"))).toEqual(["vm-r-osdisk"]);
    await c.compute.virtualMachines.delete(RG, "vm-r", POLL);
  });

  describe("faults", () => {
    it("next: a one-shot error on the matching method and path, with Retry-After when given", async () => {
      fake.faults.next.push({
        method: "PUT",
        path: /\/networkInterfaces\/f-nic$/,
        status: 429,
        code: "TooManyRequests",
        retryAfter: 7,
      });
      const err = await armError(createNic(c, "f-nic"), "TooManyRequests", 429);
      expect(
        (
          err as Error & { response?: { headers: { get(n: string): string | undefined } } }
        ).response?.headers.get("retry-after"),
      ).toBe("7");
      expect(fake.faults.next).toEqual([]);
      await createNic(c, "f-nic");
      expect(fake.nics.has("f-nic")).toBe(true);
    });

    it("throttleRate 1: every ARM request is 429 with Retry-After retryAfterSeconds; the token endpoint is spared", async () => {
      fake.faults.throttleRate = 1;
      fake.faults.retryAfterSeconds = 3;
      const err = await armError(c.compute.virtualMachines.get(RG, "vm-a"), "TooManyRequests", 429);
      expect(
        (
          err as Error & { response?: { headers: { get(n: string): string | undefined } } }
        ).response?.headers.get("retry-after"),
      ).toBe("3");
      expect(fake.calls.at(-1)).toMatchObject({ status: 429, code: "TooManyRequests" });
      const before = fake.calls.length;
      await credentialFor(fake).getToken("https://management.azure.com/.default");
      expect(fake.calls.slice(before).every((x) => x.status === 200)).toBe(true);
    });

    it("throttleRate 0.5: some requests are throttled and some are not", async () => {
      fake.faults.throttleRate = 0.5;
      const results = await Promise.allSettled(
        Array.from({ length: 40 }, () => c.compute.virtualMachines.get(RG, "vm-a")),
      );
      expect(results.some((r) => r.status === "fulfilled")).toBe(true);
      expect(
        results.some(
          (r) => r.status === "rejected" && (r.reason as { code?: string }).code === "TooManyRequests",
        ),
      ).toBe(true);
    });

    it("serverErrorRate 1: every ARM request is 500 InternalServerError", async () => {
      fake.faults.serverErrorRate = 1;
      await armError(collect(c.network.networkInterfaces.list(RG)), "InternalServerError", 500);
      await armError(c.compute.virtualMachines.get(RG, "vm-a"), "InternalServerError", 500);
    });

    it("applies one-shots before throttling, and throttling before server errors", async () => {
      fake.faults.throttleRate = 1;
      fake.faults.serverErrorRate = 1;
      fake.faults.next.push({ method: "*", path: /./, status: 409, code: "Conflict" });
      await armError(c.compute.virtualMachines.get(RG, "vm-a"), "Conflict", 409);
      await armError(c.compute.virtualMachines.get(RG, "vm-a"), "TooManyRequests", 429);
    });

    it("slowMs: answers wait; a client that gives up first gets nothing", async () => {
      fake.faults.slowMs = 400;
      const ac = new AbortController();
      const p = c.compute.virtualMachines.get(RG, "vm-a", { abortSignal: ac.signal });
      setTimeout(() => ac.abort(), 50);
      await expect(p).rejects.toThrow(/abort/i);
      fake.faults.slowMs = 0;
      expect((await c.compute.virtualMachines.get(RG, "vm-a")).name).toBe("vm-a");
    });

    it("maxVms: creates beyond it are 409 OperationNotAllowed with Azure's quota message", async () => {
      fake.faults.maxVms = [...fake.vms.values()].filter((v) => v.provisioningState === "Succeeded").length;
      await createNic(c, "q-nic");
      const err = await armError(
        c.compute.virtualMachines.createOrUpdate(RG, "vm-q", vmParams("q-nic"), POLL),
        "OperationNotAllowed",
        409,
      );
      expect(err.message).toMatch(/exceeding approved .* quota/);
      expect(fake.vms.has("vm-q")).toBe(false);
      expect(fake.nics.get("q-nic")!.vmId).toBeNull();
      fake.faults.maxVms = 0;
      await c.compute.virtualMachines.createOrUpdate(RG, "vm-q", vmParams("q-nic"), POLL);
      expect(fake.vms.get("vm-q")!.provisioningState).toBe("Succeeded");
    });

    it("sizeErrors: SkuNotAvailable at once (409); allocation failures after acceptance, leaving VM, NIC and disk", async () => {
      fake.faults.sizeErrors.set("Standard_D2s_v3", "SkuNotAvailable");
      await createNic(c, "s-nic");
      await armError(
        c.compute.virtualMachines.createOrUpdate(RG, "vm-s", vmParams("s-nic"), POLL),
        "SkuNotAvailable",
        409,
      );
      expect(fake.vms.has("vm-s")).toBe(false);
      for (const code of ["AllocationFailed", "ZonalAllocationFailed", "OverconstrainedAllocationRequest"]) {
        fake.faults.sizeErrors.set("Standard_D2s_v3", code);
        const name = `vm-${code.toLowerCase().slice(0, 8)}`;
        await createNic(c, `${name}-nic`);
        await lroFailure(
          c.compute.virtualMachines.createOrUpdate(RG, name, vmParams(`${name}-nic`), POLL),
          code,
        );
        const put = fake.calls.find((x) => x.method === "PUT" && x.path.endsWith(`/${name}`));
        expect(put?.status).toBe(201);
        expect(fake.vms.get(name)?.provisioningState).toBe("Failed");
        expect(fake.nics.get(`${name}-nic`)?.vmId).toBe(fake.vms.get(name)?.id);
        expect(fake.disks.get(`${name}-osdisk`)).toMatchObject({ tags: {}, vmId: fake.vms.get(name)?.id });
        // Deleting the failed VM takes its disk and NIC (deleteOption Delete).
        await c.compute.virtualMachines.delete(RG, name, POLL);
        expect([fake.vms.has(name), fake.disks.has(`${name}-osdisk`), fake.nics.has(`${name}-nic`)]).toEqual([
          false,
          false,
          false,
        ]);
      }
      fake.faults.sizeErrors.set("Standard_D2s_v3", "AllocationFailed");
      const other = await c.compute.virtualMachines.createOrUpdate(
        RG,
        "vm-s",
        vmParams("s-nic", { hardwareProfile: { vmSize: "Standard_D4s_v3" } }),
        POLL,
      );
      expect(other.provisioningState).toBe("Succeeded");
    });

    it("failAfterAccept: the next N creates are accepted and then fail with the code", async () => {
      fake.faults.failAfterAccept = { code: "InternalServerError", count: 2 };
      for (const name of ["vm-f1", "vm-f2", "vm-f3"]) await createNic(c, `${name}-nic`);
      await lroFailure(
        c.compute.virtualMachines.createOrUpdate(RG, "vm-f1", vmParams("vm-f1-nic"), POLL),
        "InternalServerError",
      );
      await lroFailure(
        c.compute.virtualMachines.createOrUpdate(RG, "vm-f2", vmParams("vm-f2-nic"), POLL),
        "InternalServerError",
      );
      expect(fake.faults.failAfterAccept).toBeNull();
      const ok = await c.compute.virtualMachines.createOrUpdate(RG, "vm-f3", vmParams("vm-f3-nic"), POLL);
      expect(ok.provisioningState).toBe("Succeeded");
      expect(fake.vms.get("vm-f1")?.provisioningState).toBe("Failed");
      expect(fake.disks.has("vm-f2-osdisk")).toBe(true);
    });

    it("lostAnswers drop: the work is done, the connection closes without an answer", async () => {
      await createNic(c, "la-nic");
      fake.faults.lostAnswers.push({ method: "PUT", path: /\/virtualMachines\/vm-la$/, mode: "drop" });
      let caught: unknown;
      try {
        await c.compute.virtualMachines.createOrUpdate(RG, "vm-la", vmParams("la-nic"), POLL);
      } catch (err) {
        caught = err;
      }
      expect((caught as { statusCode?: number }).statusCode).toBeUndefined();
      expect(fake.faults.lostAnswers).toEqual([]);
      expect(fake.calls.find((x) => x.method === "PUT" && x.path.endsWith("/vm-la"))).toMatchObject({
        status: 201,
        lost: "drop",
      });
      // The VM exists all the same, and the next requests are answered.
      expect((await c.compute.virtualMachines.get(RG, "vm-la")).provisioningState).toBe("Succeeded");
      await c.compute.virtualMachines.delete(RG, "vm-la", POLL);
    });

    it("lostAnswers hold: no answer until the client gives up; the work is done", async () => {
      await createNic(c, "lh-nic");
      fake.faults.lostAnswers.push({ method: "DELETE", path: /\/networkInterfaces\/lh-nic$/, mode: "hold" });
      const ac = new AbortController();
      const deleting = c.network.networkInterfaces.beginDeleteAndWait(RG, "lh-nic", {
        ...POLL,
        abortSignal: ac.signal,
      });
      await waitFor("the held DELETE", () =>
        fake.calls.some((x) => x.lost === "hold" && x.path.endsWith("/lh-nic")),
      );
      expect(fake.nics.has("lh-nic")).toBe(false);
      ac.abort();
      await expect(deleting).rejects.toThrow(/abort/i);
    });

    it("lostAnswerRate 1: PUT, PATCH and DELETE answers are lost, GETs are answered", async () => {
      fake.faults.lostAnswerRate = 1;
      const before = fake.calls.length;
      // The rejection is caught at once: a dropped answer rejects while waitFor polls.
      const creating = createNic(c, "lr-nic").then(
        () => null,
        (e: unknown) => e,
      );
      await waitFor("the PUT done, its answer lost", () =>
        fake.calls.slice(before).some((x) => x.lost !== undefined),
      );
      fake.releaseLostAnswers(); // (a held one: the client here has no request timeout)
      expect(await creating).toBeInstanceOf(Error);
      expect(fake.nics.has("lr-nic")).toBe(true);
      expect((await c.network.networkInterfaces.get(RG, "lr-nic")).name).toBe("lr-nic");
      fake.faults.lostAnswerRate = 0;
      await c.network.networkInterfaces.beginDeleteAndWait(RG, "lr-nic", POLL);
    });

    it("anotherOperationRate 1: NIC PUTs and DELETEs are 429 RetryableErrorDueToAnotherOperation for that NIC; VMs are not", async () => {
      await createNic(c, "ao-nic");
      fake.faults.anotherOperationRate = 1;
      fake.faults.retryAfterSeconds = 4;
      const err = await armError(
        c.network.networkInterfaces.beginDeleteAndWait(RG, "ao-nic", POLL),
        "RetryableErrorDueToAnotherOperation",
        429,
      );
      expect(err.message).toMatch(
        /is updating resource .*\/networkInterfaces\/ao-nic\. The call can be retried in 4 seconds\./,
      );
      expect(
        (
          err as Error & { response?: { headers: { get(n: string): string | undefined } } }
        ).response?.headers.get("retry-after"),
      ).toBe("4");
      await armError(createNic(c, "ao-nic-2"), "RetryableErrorDueToAnotherOperation", 429);
      await c.compute.virtualMachines.createOrUpdate(RG, "vm-ao", vmParams("ao-nic"), POLL);
      expect(fake.vms.has("vm-ao")).toBe(true);
      fake.faults.anotherOperationRate = 0;
      await c.compute.virtualMachines.delete(RG, "vm-ao", POLL);
    });

    it("a 429 on the operation status poll reaches the caller", async () => {
      await createNic(c, "p-nic");
      fake.faults.next.push({
        method: "GET",
        path: /\/operations\//,
        status: 429,
        code: "TooManyRequests",
        retryAfter: 2,
      });
      await armError(
        c.compute.virtualMachines.createOrUpdate(RG, "vm-p", vmParams("p-nic"), POLL),
        "TooManyRequests",
        429,
      );
      expect(fake.vms.get("vm-p")?.provisioningState).toBe("Succeeded");
    });
  });
});

describe("fake ARM: Retry-After on long-running operations", () => {
  it("sends lroRetryAfter on accepted operations", async () => {
    const fake = await new FakeArm({ lroRetryAfter: 0 }).start();
    try {
      const c = clientsFor(fake);
      const { token } = await c.credential.getToken("https://management.azure.com/.default");
      const res = await raw(
        fake,
        "PUT",
        `/subscriptions/${SUB}/resourceGroups/${RG}/providers/Microsoft.Network/networkInterfaces/r-nic?api-version=2025-05-01`,
        {
          token,
          body: JSON.stringify({
            location: "westus2",
            properties: {
              ipConfigurations: [
                { name: "c", properties: { subnet: { id: subnetId }, privateIPAllocationMethod: "Dynamic" } },
              ],
            },
          }),
        },
      );
      expect(res.status).toBe(201);
      expect(res.headers["retry-after"]).toBe("0");
      expect(String(res.headers["azure-asyncoperation"])).toMatch(
        new RegExp(
          `^${fake.url}/subscriptions/${SUB}/providers/Microsoft.Network/locations/westus2/operations/.+api-version=2025-05-01$`,
        ),
      );
      // DELETE: 202 with both headers; the Location URL answers 200 once the operation is done.
      const del = await raw(
        fake,
        "DELETE",
        `/subscriptions/${SUB}/resourceGroups/${RG}/providers/Microsoft.Network/networkInterfaces/r-nic?api-version=2025-05-01`,
        { token },
      );
      expect(del.status).toBe(202);
      const location = new URL(String(del.headers["location"]));
      expect(location.searchParams.get("monitor")).toBe("true");
      const done = await raw(fake, "GET", `${location.pathname}${location.search}`, { token });
      expect(done.status).toBe(200);
      const status = new URL(String(del.headers["azure-asyncoperation"]));
      const op = await raw(fake, "GET", `${status.pathname}${status.search}`, { token });
      expect(op.json).toMatchObject({ status: "Succeeded" });
      expect(fake.nics.has("r-nic")).toBe(false);
    } finally {
      await fake.stop();
    }
  });
});

describe("fake ARM VMs backed by local sshd VMs", () => {
  let fake: FakeArm;
  let c: Clients;
  let stateDir: string;
  let user: string;

  beforeAll(async () => {
    user = requireOpenSsh();
    stateDir = mkdtempSync(path.join(tmpdir(), "fake-arm-vms-"));
    fake = await new FakeArm({
      localVms: { stateDir, user, addressPrefix: ADDRESS_PREFIX },
      images: IMAGES,
    }).start();
    c = clientsFor(fake);
  }, 60_000);
  afterAll(async () => {
    await fake?.stop();
    if (stateDir !== undefined) rmSync(stateDir, { recursive: true, force: true });
  }, 60_000);

  it("runs customData on a VM reachable by its NIC's private IP with the osProfile key; stop() leaves no process", async () => {
    const nic = await createNic(c, "vm-l-nic");
    expect(nic.ipConfigurations?.[0]?.privateIPAddress).toBeUndefined();
    const customData = [
      "#!/bin/sh",
      'echo "custom data ran as $(id -un)" > "$DISPATCH_VM_ROOT/tmp/custom-data-ran"',
    ].join("\n");
    const params = vmParams(
      "vm-l-nic",
      {
        osProfile: {
          ...vmParams("x", {}, user).osProfile,
          customData: Buffer.from(customData).toString("base64"),
        },
      },
      user,
    );
    await armError(
      c.compute.virtualMachines.createOrUpdate(RG, "vm-l", vmParams("vm-l-nic", {}, "someoneelse"), POLL),
      "InvalidParameter",
      400,
    );
    const poller = c.compute.virtualMachines.createOrUpdate(RG, "vm-l", params, POLL);
    const vm = await poller;
    expect(vm.provisioningState).toBe("Succeeded");
    const ip = (await c.network.networkInterfaces.get(RG, "vm-l-nic")).ipConfigurations?.[0]
      ?.privateIPAddress;
    expect(ip?.startsWith(ADDRESS_PREFIX)).toBe(true);
    expect(fake.nics.get("vm-l-nic")!.privateIp).toBe(ip);

    const ssh = await connect(ip!, user, KEY.privateKey);
    try {
      let ran = "";
      await waitFor(
        "the customData to run",
        async () => {
          ran = (await run(ssh, 'cat "$DISPATCH_VM_ROOT/tmp/custom-data-ran" 2>/dev/null')).stdout;
          return ran !== "";
        },
        20_000,
      );
      expect(ran.trim()).toBe(`custom data ran as ${user}`);
    } finally {
      ssh.end();
    }
    expect(processesUnder(stateDir).length).toBeGreaterThan(0);

    // A second VM, deleted through the API: its sshd goes.
    await createNic(c, "vm-m-nic");
    await c.compute.virtualMachines.createOrUpdate(RG, "vm-m", vmParams("vm-m-nic", {}, user), POLL);
    const ip2 = fake.nics.get("vm-m-nic")!.privateIp!;
    expect(ip2).not.toBe(ip);
    await c.compute.virtualMachines.delete(RG, "vm-m", POLL);
    await expect(connect(ip2, user, KEY.privateKey)).rejects.toThrow();
    expect(fake.nics.has("vm-m-nic")).toBe(false);

    await fake.stop();
    expect(processesUnder(stateDir)).toEqual([]);
  }, 90_000);
});
