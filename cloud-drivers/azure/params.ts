/**
 * `cloud.driverParameters` of the azure driver: validated once when the instance set opens, defaults filled in,
 * the service principal (tenantId, clientId, clientSecret) resolved from `file://` / `env:` references and the
 * CA file read. Every error is cloud.invalid_parameters with the path of the bad key; no message quotes a secret.
 */
import { readFileSync } from "node:fs";
import path from "node:path";
import { parameterTools } from "../params.ts";

export interface AzureServicePrincipal {
  tenantId: string;
  clientId: string;
  clientSecret: string;
}

export const CLOUD_ENVIRONMENTS = {
  AzurePublicCloud: {
    endpoint: "https://management.azure.com",
    authorityHost: "https://login.microsoftonline.com",
  },
  AzureUSGovernment: {
    endpoint: "https://management.usgovcloudapi.net",
    authorityHost: "https://login.microsoftonline.us",
  },
  AzureChinaCloud: {
    endpoint: "https://management.chinacloudapi.cn",
    authorityHost: "https://login.chinacloudapi.cn",
  },
} as const;
export type CloudEnvironment = keyof typeof CLOUD_ENVIRONMENTS;

/** Managed disk types that need nothing but a size. */
export const STORAGE_ACCOUNT_TYPES = [
  "Standard_LRS",
  "StandardSSD_LRS",
  "StandardSSD_ZRS",
  "Premium_LRS",
  "Premium_ZRS",
] as const;
export type StorageAccountType = (typeof STORAGE_ACCOUNT_TYPES)[number];

export interface AzureParameters {
  subscriptionId: string;
  cloudEnvironment: CloudEnvironment;
  /** The Resource Manager URL (no trailing slash). */
  endpoint: string;
  /** The Microsoft Entra ID (login) URL (no trailing slash). */
  authorityHost: string;
  /** The token scope of Resource Manager: `<endpoint>/.default`. */
  tokenScope: string;
  /** PEM text of extra CAs to trust (Azure Stack Hub, tests), or undefined. */
  tlsCa: string | undefined;
  /**
   * The service principal, or undefined for DefaultAzureCredential (environment, workload identity, managed
   * identity, Azure CLI...). Not enumerable: logging the parameters never shows it.
   */
  readonly servicePrincipal: AzureServicePrincipal | undefined;
  resourceGroup: string;
  location: string;
  network: string | undefined;
  networkResourceGroup: string;
  subnet: string;
  /** The full resource id of the subnet NICs are created in. */
  subnetId: string;
  /** Default image id (used when cloud.imageId is empty); "" = none. */
  image: string;
  adminUsername: string;
  storageAccountType: StorageAccountType;
  deleteDanglingResourcesAfterMs: number;
  pollIntervalMs: number;
  requestTimeoutMs: number;
}

/** Defaults, as written in a config file. */
export const AZURE_DEFAULTS = {
  cloudEnvironment: "AzurePublicCloud",
  adminUsername: "crunch",
  storageAccountType: "StandardSSD_LRS",
  deleteDanglingResourcesAfter: "20s",
  pollInterval: "2s",
  requestTimeout: "30s",
} as const;

const KEYS = [
  "subscriptionId",
  "tenantId",
  "clientId",
  "clientSecret",
  "cloudEnvironment",
  "endpoint",
  "authorityHost",
  "tlsCaFile",
  "resourceGroup",
  "location",
  "network",
  "networkResourceGroup",
  "subnet",
  "image",
  "adminUsername",
  "storageAccountType",
  "deleteDanglingResourcesAfter",
  "pollInterval",
  "requestTimeout",
] as const;

/** Names Azure refuses as a Linux VM's admin user. */
const RESERVED_ADMIN_NAMES = new Set([
  "administrator",
  "admin",
  "user",
  "user1",
  "test",
  "user2",
  "test1",
  "user3",
  "admin1",
  "1",
  "123",
  "a",
  "actuser",
  "adm",
  "admin2",
  "aspnet",
  "backup",
  "console",
  "david",
  "guest",
  "john",
  "owner",
  "root",
  "server",
  "sql",
  "support",
  "support_388945a0",
  "sys",
  "test2",
  "test3",
  "user4",
  "user5",
]);

const { invalid, show, knownMap, secretValue, duration } = parameterTools("azure");
const GUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
/** Resource group names: letters, digits, _-.() up to 90, not ending with a period. */
const RESOURCE_GROUP = /^[-\w.()]{0,89}[-\w()]$/;
/** Virtual network and subnet names. */
const NETWORK_NAME = /^[A-Za-z0-9][-\w.]{0,78}\w$|^[A-Za-z0-9]$/;
const SUBNET_ID =
  /^\/subscriptions\/[^/]+\/resourceGroups\/[^/]+\/providers\/Microsoft\.Network\/virtualNetworks\/[^/]+\/subnets\/[^/]+$/i;

/** A managed image id. */
export const MANAGED_IMAGE_ID =
  /^\/subscriptions\/[^/]+\/resourceGroups\/[^/]+\/providers\/Microsoft\.Compute\/images\/[^/]+$/i;
/**
 * An Azure Compute Gallery (Shared Image Gallery) image version id, or an image definition id (no `/versions/...`),
 * which is how Azure is asked for the definition's latest version. A version literally named `latest` is not that
 * (Azure looks for a version of that name), so it is refused.
 */
export const GALLERY_IMAGE_VERSION_ID =
  /^\/subscriptions\/[^/]+\/resourceGroups\/[^/]+\/providers\/Microsoft\.Compute\/galleries\/[^/]+\/images\/[^/]+(\/versions\/(?!latest$)[^/]+)?$/i;

export const IMAGE_FORMAT =
  "a managed image id (/subscriptions/<sub>/resourceGroups/<rg>/providers/Microsoft.Compute/images/<name>) or an Azure Compute Gallery image version id (.../Microsoft.Compute/galleries/<gallery>/images/<image>/versions/<version>; without /versions/...: its latest version)";

export function isImageId(value: string): boolean {
  return MANAGED_IMAGE_ID.test(value) || GALLERY_IMAGE_VERSION_ID.test(value);
}

/**
 * Validates the azure driver's parameters. `env` is where `env:NAME` secrets are read (process.env by default).
 */
export function parseAzureParameters(
  params: unknown,
  env: Readonly<Record<string, string | undefined>> = process.env,
): AzureParameters {
  const raw = knownMap(params, KEYS, { key: "subscriptionId", hint: "is required" });

  const subscriptionId = raw["subscriptionId"];
  if (subscriptionId === undefined) throw invalid("subscriptionId", "is required (a GUID)");
  if (typeof subscriptionId !== "string" || !GUID.test(subscriptionId)) {
    throw invalid("subscriptionId", `must be a subscription id (a GUID); got ${show(subscriptionId)}`);
  }

  const cloudEnvironment = raw["cloudEnvironment"] ?? AZURE_DEFAULTS.cloudEnvironment;
  if (typeof cloudEnvironment !== "string" || !Object.hasOwn(CLOUD_ENVIRONMENTS, cloudEnvironment)) {
    throw invalid(
      "cloudEnvironment",
      `must be one of ${Object.keys(CLOUD_ENVIRONMENTS).join(", ")}; got ${show(cloudEnvironment)}`,
    );
  }
  const cloud = CLOUD_ENVIRONMENTS[cloudEnvironment as CloudEnvironment];
  const endpoint = raw["endpoint"] === undefined ? cloud.endpoint : httpsUrl("endpoint", raw["endpoint"]);
  const authorityHost =
    raw["authorityHost"] === undefined
      ? cloud.authorityHost
      : httpsUrl("authorityHost", raw["authorityHost"]);

  let tlsCa: string | undefined;
  const caFile = raw["tlsCaFile"];
  if (caFile !== undefined) {
    if (typeof caFile !== "string" || !path.isAbsolute(caFile)) {
      throw invalid("tlsCaFile", `must be the absolute path of a PEM file; got ${show(caFile)}`);
    }
    try {
      tlsCa = readFileSync(caFile, "utf8");
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code ?? "error";
      throw invalid("tlsCaFile", `cannot be read: ${caFile} (${code})`, err);
    }
    if (!tlsCa.includes("-----BEGIN CERTIFICATE-----")) {
      throw invalid("tlsCaFile", `holds no PEM certificate: ${caFile}`);
    }
  }

  const servicePrincipal = parseServicePrincipal(raw, env);

  const resourceGroup = resourceGroupName("resourceGroup", raw["resourceGroup"], true);
  const location = raw["location"];
  if (location === undefined) throw invalid("location", "is required (e.g. westus2)");
  if (typeof location !== "string" || !/^[a-z0-9]+$/i.test(location)) {
    throw invalid("location", `must be a region name such as westus2 (no spaces); got ${show(location)}`);
  }
  const networkResourceGroup =
    raw["networkResourceGroup"] === undefined
      ? resourceGroup
      : resourceGroupName("networkResourceGroup", raw["networkResourceGroup"], true);

  const subnet = raw["subnet"];
  if (subnet === undefined)
    throw invalid("subnet", "is required (a subnet name of `network`, or a subnet id)");
  if (typeof subnet !== "string" || subnet === "") {
    throw invalid("subnet", `must be a subnet name or a subnet id; got ${show(subnet)}`);
  }
  let network: string | undefined;
  let subnetId: string;
  if (subnet.startsWith("/")) {
    if (!SUBNET_ID.test(subnet)) {
      throw invalid(
        "subnet",
        `must be a subnet id (/subscriptions/<sub>/resourceGroups/<rg>/providers/Microsoft.Network/virtualNetworks/<vnet>/subnets/<name>) or a subnet name; got ${show(subnet)}`,
      );
    }
    if (raw["network"] !== undefined) {
      throw invalid("network", "must be left out when subnet is a full subnet id");
    }
    subnetId = subnet;
  } else {
    if (!NETWORK_NAME.test(subnet)) {
      throw invalid(
        "subnet",
        `must be a subnet name (letters, digits, -._) or a subnet id; got ${show(subnet)}`,
      );
    }
    const vnet = raw["network"];
    if (vnet === undefined) throw invalid("network", "is required with a subnet name (the virtual network)");
    if (typeof vnet !== "string" || !NETWORK_NAME.test(vnet)) {
      throw invalid("network", `must be a virtual network name (letters, digits, -._); got ${show(vnet)}`);
    }
    network = vnet;
    subnetId =
      `/subscriptions/${subscriptionId}/resourceGroups/${networkResourceGroup}` +
      `/providers/Microsoft.Network/virtualNetworks/${vnet}/subnets/${subnet}`;
  }

  const image = raw["image"] ?? "";
  if (typeof image !== "string" || (image !== "" && !isImageId(image))) {
    throw invalid("image", `must be ${IMAGE_FORMAT}; got ${show(image)}`);
  }

  const adminUsername = raw["adminUsername"] ?? AZURE_DEFAULTS.adminUsername;
  if (
    typeof adminUsername !== "string" ||
    !/^[a-z_][a-z0-9_-]{0,31}$/.test(adminUsername) ||
    adminUsername.endsWith("-")
  ) {
    throw invalid(
      "adminUsername",
      `must be a Linux user name (lowercase letters, digits, _ and -, at most 32) such as "crunch"; got ${show(adminUsername)}`,
    );
  }
  if (RESERVED_ADMIN_NAMES.has(adminUsername)) {
    throw invalid("adminUsername", `is a name Azure refuses for the admin user: ${show(adminUsername)}`);
  }

  const storageAccountType = raw["storageAccountType"] ?? AZURE_DEFAULTS.storageAccountType;
  if (
    typeof storageAccountType !== "string" ||
    !(STORAGE_ACCOUNT_TYPES as readonly string[]).includes(storageAccountType)
  ) {
    throw invalid(
      "storageAccountType",
      `must be one of ${STORAGE_ACCOUNT_TYPES.join(", ")}; got ${show(storageAccountType)}`,
    );
  }

  const deleteDanglingResourcesAfterMs = duration(
    "deleteDanglingResourcesAfter",
    raw,
    AZURE_DEFAULTS.deleteDanglingResourcesAfter,
    true,
  );
  const pollIntervalMs = duration("pollInterval", raw, AZURE_DEFAULTS.pollInterval, false);
  const requestTimeoutMs = duration("requestTimeout", raw, AZURE_DEFAULTS.requestTimeout, false);

  const result: Omit<AzureParameters, "servicePrincipal"> = {
    subscriptionId,
    cloudEnvironment: cloudEnvironment as CloudEnvironment,
    endpoint,
    authorityHost,
    tokenScope: `${endpoint}/.default`,
    tlsCa,
    resourceGroup,
    location: location.toLowerCase(),
    network,
    networkResourceGroup,
    subnet,
    subnetId,
    image,
    adminUsername,
    storageAccountType: storageAccountType as StorageAccountType,
    deleteDanglingResourcesAfterMs,
    pollIntervalMs,
    requestTimeoutMs,
  };
  Object.defineProperty(result, "servicePrincipal", { value: servicePrincipal, enumerable: false });
  return result as AzureParameters;
}

function httpsUrl(key: string, value: unknown): string {
  let url: URL | undefined;
  if (typeof value === "string") {
    try {
      url = new URL(value);
    } catch {
      url = undefined;
    }
  }
  if (url === undefined || url.protocol !== "https:") {
    throw invalid(
      key,
      `must be an https:// URL (the Azure SDK refuses tokens over http); got ${show(value)}`,
    );
  }
  if (url.username !== "" || url.password !== "") {
    throw invalid(key, "must not contain a user name or password");
  }
  if (url.search !== "" || url.hash !== "") throw invalid(key, "must not have a query or fragment");
  return url.href.replace(/\/+$/, "");
}

function resourceGroupName(key: string, value: unknown, required: boolean): string {
  if (value === undefined && required) throw invalid(key, "is required (a resource group name)");
  if (typeof value !== "string" || !RESOURCE_GROUP.test(value)) {
    throw invalid(
      key,
      `must be a resource group name (letters, digits, _-.(), at most 90, not ending with .); got ${show(value)}`,
    );
  }
  return value;
}

/** All three or none; each a literal, `file:///path` or `env:NAME`. Messages never hold a value. */
function parseServicePrincipal(
  raw: Record<string, unknown>,
  env: Readonly<Record<string, string | undefined>>,
): AzureServicePrincipal | undefined {
  const names = ["tenantId", "clientId", "clientSecret"] as const;
  const given = names.filter((k) => raw[k] !== undefined);
  if (given.length === 0) return undefined;
  const missing = names.find((k) => raw[k] === undefined);
  if (missing !== undefined) {
    throw invalid(
      missing,
      `is required with ${given.join(" and ")} (give tenantId, clientId and clientSecret, or none of them for DefaultAzureCredential)`,
    );
  }
  const tenantId = secretValue("tenantId", raw["tenantId"], env);
  if (!GUID.test(tenantId) && !/^[a-z0-9][a-z0-9.-]*\.[a-z]{2,}$/i.test(tenantId)) {
    throw invalid(
      "tenantId",
      "must be a tenant id (a GUID) or a tenant domain such as contoso.onmicrosoft.com",
    );
  }
  const clientId = secretValue("clientId", raw["clientId"], env);
  if (!/^[\w.-]+$/.test(clientId)) {
    throw invalid(
      "clientId",
      "must be an application (client) id: a GUID such as 11111111-2222-3333-4444-555555555555",
    );
  }
  return { tenantId, clientId, clientSecret: secretValue("clientSecret", raw["clientSecret"], env) };
}
