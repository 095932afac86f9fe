import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { pathToFileURL } from "node:url";
import { afterAll, describe, expect, it } from "vitest";
import { DispatchCloudError } from "../../lib/errors.ts";
import { AZURE_DEFAULTS, isImageId, parseAzureParameters } from "./params.ts";

const SUB = "00000000-0000-0000-0000-000000000001";
const TENANT = "00000000-0000-0000-0000-0000000000aa";
const CLIENT = "11111111-2222-3333-4444-555555555555";
const SECRET = "Qx8~verySecretClientValue.abc";
const BASE = {
  subscriptionId: SUB,
  resourceGroup: "dc-rg",
  location: "westus2",
  network: "dc-vnet",
  subnet: "default",
};

const dir = mkdtempSync(path.join(tmpdir(), "azure-params-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function file(name: string, content: string): string {
  const f = path.join(dir, name);
  writeFileSync(f, content, { mode: 0o600 });
  return f;
}

function errorOf(params: unknown, env: Record<string, string | undefined> = {}): DispatchCloudError {
  try {
    parseAzureParameters(params, env);
  } catch (err) {
    if (err instanceof DispatchCloudError) return err;
    throw err;
  }
  throw new Error("expected an error");
}

describe("azure driver parameters", () => {
  it("needs a subscription, resource group, location and subnet, and fills in the defaults", () => {
    const p = parseAzureParameters(BASE, {});
    expect(p).toEqual({
      subscriptionId: SUB,
      cloudEnvironment: "AzurePublicCloud",
      endpoint: "https://management.azure.com",
      authorityHost: "https://login.microsoftonline.com",
      tokenScope: "https://management.azure.com/.default",
      tlsCa: undefined,
      resourceGroup: "dc-rg",
      location: "westus2",
      network: "dc-vnet",
      networkResourceGroup: "dc-rg",
      subnet: "default",
      subnetId: `/subscriptions/${SUB}/resourceGroups/dc-rg/providers/Microsoft.Network/virtualNetworks/dc-vnet/subnets/default`,
      image: "",
      adminUsername: "crunch",
      storageAccountType: "StandardSSD_LRS",
      deleteDanglingResourcesAfterMs: 20_000,
      pollIntervalMs: 2000,
      requestTimeoutMs: 30_000,
    });
    // No service principal: DefaultAzureCredential.
    expect(p.servicePrincipal).toBeUndefined();
    expect(AZURE_DEFAULTS.adminUsername).toBe(p.adminUsername);
  });

  it("takes every parameter; the service principal is resolved but never enumerable", () => {
    const ca = file("ca.pem", "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n");
    const secretFile = pathToFileURL(file("secret", `${SECRET}\n`)).href;
    const image = `/subscriptions/${SUB}/resourceGroups/img/providers/Microsoft.Compute/galleries/g1/images/debian/versions/1.0.0`;
    const p = parseAzureParameters(
      {
        ...BASE,
        tenantId: "env:AZ_TENANT",
        clientId: CLIENT,
        clientSecret: secretFile,
        endpoint: "https://127.0.0.1:8443/",
        authorityHost: "https://127.0.0.1:8443",
        tlsCaFile: ca,
        location: "WestUS2",
        networkResourceGroup: "net-rg",
        image,
        adminUsername: "dcvm",
        storageAccountType: "Premium_LRS",
        deleteDanglingResourcesAfter: "1m",
        pollInterval: "100ms",
        requestTimeout: "5s",
      },
      { AZ_TENANT: TENANT },
    );
    expect(p.endpoint).toBe("https://127.0.0.1:8443");
    expect(p.authorityHost).toBe("https://127.0.0.1:8443");
    expect(p.tokenScope).toBe("https://127.0.0.1:8443/.default");
    expect(p.tlsCa).toContain("BEGIN CERTIFICATE");
    expect(p.location).toBe("westus2");
    expect(p.subnetId).toBe(
      `/subscriptions/${SUB}/resourceGroups/net-rg/providers/Microsoft.Network/virtualNetworks/dc-vnet/subnets/default`,
    );
    expect(p.image).toBe(image);
    expect(p.adminUsername).toBe("dcvm");
    expect(p.storageAccountType).toBe("Premium_LRS");
    expect(p.deleteDanglingResourcesAfterMs).toBe(60_000);
    expect(p.pollIntervalMs).toBe(100);
    expect(p.requestTimeoutMs).toBe(5000);
    expect(p.servicePrincipal).toEqual({ tenantId: TENANT, clientId: CLIENT, clientSecret: SECRET });
    expect(JSON.stringify(p)).not.toContain(SECRET);
    expect(Object.keys(p)).not.toContain("servicePrincipal");
  });

  it("picks the endpoints of the cloud environment", () => {
    const gov = parseAzureParameters({ ...BASE, cloudEnvironment: "AzureUSGovernment" }, {});
    expect(gov.endpoint).toBe("https://management.usgovcloudapi.net");
    expect(gov.authorityHost).toBe("https://login.microsoftonline.us");
    const china = parseAzureParameters({ ...BASE, cloudEnvironment: "AzureChinaCloud" }, {});
    expect(china.endpoint).toBe("https://management.chinacloudapi.cn");
    expect(china.tokenScope).toBe("https://management.chinacloudapi.cn/.default");
  });

  it("accepts a full subnet id instead of network + subnet", () => {
    const id = `/subscriptions/${SUB}/resourceGroups/other/providers/Microsoft.Network/virtualNetworks/v/subnets/s`;
    const p = parseAzureParameters(
      { subscriptionId: SUB, resourceGroup: "rg", location: "eastus", subnet: id },
      {},
    );
    expect(p.subnetId).toBe(id);
    expect(p.network).toBeUndefined();
    expect(
      errorOf({ subscriptionId: SUB, resourceGroup: "rg", location: "eastus", subnet: id, network: "v" })
        .path,
    ).toBe("cloud.driverParameters.network");
  });

  it.each([
    [undefined, "subscriptionId", "is required"],
    [{ ...BASE, subscriptionId: undefined }, "subscriptionId", "is required"],
    [{ ...BASE, subscriptionId: "my-sub" }, "subscriptionId", "GUID"],
    [{ ...BASE, resourceGroup: undefined }, "resourceGroup", "is required"],
    [{ ...BASE, resourceGroup: "bad/rg" }, "resourceGroup", "resource group name"],
    [{ ...BASE, resourceGroup: "ends." }, "resourceGroup", "not ending"],
    [{ ...BASE, location: undefined }, "location", "is required"],
    [{ ...BASE, location: "West US 2" }, "location", "no spaces"],
    [{ ...BASE, subnet: undefined }, "subnet", "is required"],
    [{ ...BASE, network: undefined }, "network", "is required with a subnet name"],
    [{ ...BASE, subnet: "/subscriptions/x" }, "subnet", "subnet id"],
    [{ ...BASE, network: "bad net" }, "network", "virtual network name"],
    [{ ...BASE, networkResourceGroup: 3 }, "networkResourceGroup", "resource group name"],
    [{ ...BASE, cloudEnvironment: "AzureGermany" }, "cloudEnvironment", "AzurePublicCloud"],
    [{ ...BASE, endpoint: "http://127.0.0.1:1" }, "endpoint", "https://"],
    [{ ...BASE, authorityHost: "login" }, "authorityHost", "https://"],
    [{ ...BASE, endpoint: "https://u:p@h" }, "endpoint", "user name"],
    [{ ...BASE, tlsCaFile: "relative.pem" }, "tlsCaFile", "absolute path"],
    [{ ...BASE, tlsCaFile: "/nonexistent/ca.pem" }, "tlsCaFile", "ENOENT"],
    [{ ...BASE, image: "debian-12" }, "image", "managed image id"],
    [{ ...BASE, adminUsername: "root" }, "adminUsername", "refuses"],
    [{ ...BASE, adminUsername: "admin" }, "adminUsername", "refuses"],
    [{ ...BASE, adminUsername: "Bad User" }, "adminUsername", "Linux user name"],
    [{ ...BASE, storageAccountType: "UltraSSD_LRS" }, "storageAccountType", "Standard_LRS"],
    [{ ...BASE, pollInterval: "0" }, "pollInterval", "longer than 0"],
    [{ ...BASE, requestTimeout: 30 }, "requestTimeout", "unit"],
    [{ ...BASE, deleteDanglingResourcesAfter: "soon" }, "deleteDanglingResourcesAfter", "duration"],
    [{ ...BASE, region: "westus2" }, "region", "not a parameter"],
    [{ ...BASE, clientId: CLIENT }, "tenantId", "is required with clientId"],
    [{ ...BASE, tenantId: TENANT, clientId: CLIENT }, "clientSecret", "is required with"],
    [{ ...BASE, tenantId: TENANT, clientId: "my app", clientSecret: "x" }, "clientId", "GUID"],
    [{ ...BASE, tenantId: "not a tenant", clientId: CLIENT, clientSecret: "x" }, "tenantId", "tenant id"],
    [
      { ...BASE, tenantId: TENANT, clientId: CLIENT, clientSecret: "env:AZ_SECRET" },
      "clientSecret",
      "AZ_SECRET",
    ],
    [
      { ...BASE, tenantId: TENANT, clientId: CLIENT, clientSecret: "file:relative" },
      "clientSecret",
      "file:///",
    ],
    [{ ...BASE, tenantId: TENANT, clientId: CLIENT, clientSecret: "" }, "clientSecret", "non-empty"],
  ])("refuses %j at %s", (params, key, text) => {
    const err = errorOf(params);
    expect(err.code).toBe("cloud.invalid_parameters");
    expect(err.path).toBe(`cloud.driverParameters.${key}`);
    expect(err.message).toContain(text);
  });

  it("never quotes a secret in a message", () => {
    const err = errorOf({ ...BASE, tenantId: TENANT, clientId: "bad id", clientSecret: SECRET });
    expect(err.message).not.toContain(SECRET);
    const missing = errorOf({
      ...BASE,
      tenantId: TENANT,
      clientId: CLIENT,
      clientSecret: "file:///nonexistent/s",
    });
    expect(missing.message).toContain("/nonexistent/s");
    expect(errorOf({ ...BASE, tlsCaFile: file("empty.pem", "not pem") }).message).toContain("no PEM");
  });

  it("knows image ids", () => {
    expect(
      isImageId(`/subscriptions/${SUB}/resourceGroups/r/providers/Microsoft.Compute/images/debian`),
    ).toBe(true);
    expect(
      isImageId(
        `/subscriptions/${SUB}/resourceGroups/r/providers/Microsoft.Compute/galleries/g/images/i/versions/1.2.3`,
      ),
    ).toBe(true);
    // The latest version: the image definition id; not a version named "latest" (Azure takes that literally).
    const definition = `/subscriptions/${SUB}/resourceGroups/r/providers/Microsoft.Compute/galleries/g/images/i`;
    expect(isImageId(definition)).toBe(true);
    expect(isImageId(`${definition}/versions/latest`)).toBe(false);
    expect(isImageId(`${definition}/versions/LATEST`)).toBe(false);
    expect(isImageId("https://example.blob.core.windows.net/vhds/debian.vhd")).toBe(false);
    expect(isImageId("Debian:debian-12:12:latest")).toBe(false);
  });
});
