/** The azure driver's config for tests against the fake Resource Manager (test/fake-arm.ts). */
import { FAKE_ARM_IMAGE, type FakeArm } from "./fake-arm.ts";

const SUB = "00000000-0000-0000-0000-000000000001";

/** The azure driver's lines of the config, pointing at the fake. */
export function azureDriverYaml(fake: FakeArm, user: string, secretEnv: string): string {
  return [
    "  driver: azure",
    `  imageId: ${FAKE_ARM_IMAGE}`,
    "  driverParameters:",
    `    subscriptionId: "${SUB}"`,
    '    tenantId: "00000000-0000-0000-0000-0000000000aa"',
    "    clientId: dc-client",
    `    clientSecret: env:${secretEnv}`,
    `    endpoint: "${fake.url}"`,
    `    authorityHost: "${fake.url}"`,
    `    tlsCaFile: ${fake.caFile}`,
    "    resourceGroup: dc-rg",
    "    location: westus2",
    "    network: dc-vnet",
    "    subnet: default",
    `    adminUsername: ${user}`,
    "    pollInterval: 300ms",
    // A request the fake holds without answering (a lost answer) is given up after this.
    "    requestTimeout: 10s",
    "    deleteDanglingResourcesAfter: 2s",
  ].join("\n");
}
