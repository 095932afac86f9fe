/**
 * The ec2 driver through the real @aws-sdk/client-ec2, over HTTP, against the fake EC2 endpoint
 * (test/fake-ec2.ts): request parameters as EC2 receives them, XML answers, pagination, error documents.
 */
import { chmod, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { Writable } from "node:stream";
import { Registry } from "prom-client";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import type { Config } from "../../config/schema.ts";
import { createCreateGate } from "../../dispatcher/pool/create-gate.ts";
import { type Clock, systemClock } from "../../lib/clock.ts";
import { createLogger } from "../../lib/logger.ts";
import { generateKeyPair } from "../../lib/ssh-keys.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import { ec2ImportedKeyFingerprint, FakeEc2, type FakeSpotPrice } from "../../test/fake-ec2.ts";
import { expectSshBackedInstance, requireOpenSsh, waitFor } from "../../test/local-driver-helpers.ts";
import { CapacityError, CloudError, CloudQuotaError, CloudRateLimitError } from "../errors.ts";
import { createDefaultRegistry, openInstanceSet } from "../registry.ts";
import type { Instance, InstanceSet, InstanceType, Tags } from "../types.ts";
import { METRIC, wrapInstanceSet } from "../wrappers.ts";
import {
  ec2ClientToken,
  ec2Driver,
  ec2PublicKey,
  ec2QuotaGroup,
  KEY_NAME_PREFIX,
  normalizePrices,
  TAG_RETRY_DELAYS_MS,
} from "./driver.ts";

const SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
const ACCESS_KEY = "AKIAIOSFODNN7EXAMPLE";
const SUBNETS = ["subnet-0a", "subnet-0b", "subnet-0c"];
const IMAGE = "ami-0123456789abcdef0";
const GiB = 2 ** 30;

/** Checked with OpenSSH and OpenSSL: `ssh-keygen -e -m PKCS8 | openssl pkey -pubin -outform DER | openssl md5 -c`. */
const RSA_KEY =
  "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC/3vb/vq3g/0qAQP9J1MZHNfxosxyUcbXBTyLfF9JBL535RSFp5ICodwDNaA6f1NvbxHjyWZaOjJY65Ni3zl5QcIEc4RgdTtabNuXh6RD0ah6ajA/CsviJODel5W6h+kTTVBZRPGLjyVnxfJ/n9E+FaQNLNhcoP7E+DX1FvoMP63sJLEjt4dPS7CyidBuC4fk3LijU2XL+BfZAroWukINojgzmS2g8BGmqh0wDFda1uitHSLG+sgP2U5OJqTZSW6t39Z8GoCqAV6rswNg63iRt5cDSyhwf5GGD4ZhH1nq5Fwn7HYaO1wCkeNipqJptgfzgBlZS4DfbbDnwiltDpaqF";
const RSA_EC2_FINGERPRINT = "0d:77:ca:8d:bc:4e:f3:82:0b:0a:03:c8:00:2e:a6:ee";
const RSA_RFC4716_FINGERPRINT = "70:4b:aa:18:54:85:7e:f7:d7:d9:03:9b:b4:6a:e4:87";
/** `ssh-keygen -l` prints it without the padding. */
const ED_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIN3Co0CR4DHa3WeHCvk3/67EpjpMqOLKYR/dTJsN5tD8 comment";
const ED_FINGERPRINT = "Inqe2hQ6tthQC6SeNa8klyTBXEMe+4R4IDQihSdTHEg=";

function type(over: Partial<InstanceType> = {}): InstanceType {
  return {
    name: "m5l",
    providerType: "m5.large",
    vcpus: 2,
    ram: 8 * GiB,
    includedScratch: 0,
    addedScratch: 0,
    scratch: 0,
    price: 0.096,
    preemptible: false,
    gpu: null,
    ...over,
  };
}

const INIT = "#!/bin/sh\necho hello > /tmp/x\n";

describe("EC2 key fingerprints", () => {
  it("RSA: MD5 of the DER public key (EC2's), plus RFC 4716's MD5 of the SSH blob", () => {
    const key = ec2PublicKey(RSA_KEY);
    expect(key.fingerprints).toEqual([RSA_EC2_FINGERPRINT, RSA_RFC4716_FINGERPRINT]);
    expect(key.type).toBe("ssh-rsa");
    expect(key.keyName).toMatch(new RegExp(`^${KEY_NAME_PREFIX}[0-9a-f]{32}$`));
    expect(ec2ImportedKeyFingerprint(RSA_KEY)).toBe(RSA_EC2_FINGERPRINT);
  });

  it("ed25519: base64 SHA-256 of the SSH blob, padded and not", () => {
    const key = ec2PublicKey(ED_KEY);
    expect(key.fingerprints).toEqual([ED_FINGERPRINT, ED_FINGERPRINT.replace(/=$/, "")]);
    expect(key.line).toBe(ED_KEY.replace(/ comment$/, ""));
    expect(ec2ImportedKeyFingerprint(ED_KEY)).toBe(ED_FINGERPRINT);
  });

  it("refuses key types EC2 cannot import, and malformed keys", () => {
    expect(() => ec2PublicKey("ecdsa-sha2-nistp256 AAAAE2VjZHNh")).toThrow(/ssh-rsa and ssh-ed25519/);
    expect(() => ec2PublicKey("ssh-ed25519 AAAAC3NzaC1yc2E=")).toThrow(/cannot be parsed/);
    expect(() => ec2PublicKey("ssh-rsa AAAAB3NzaC1yc2EAAAADAQAB")).toThrow(/truncated/);
  });
});

describe("ec2QuotaGroup", () => {
  it("is the alphabetic prefix of the type, lowercased, with -spot for preemptible types", () => {
    expect(ec2QuotaGroup({ providerType: "m5.large", preemptible: false }, {})).toBe("m");
    expect(ec2QuotaGroup({ providerType: "p3.2xlarge", preemptible: false }, {})).toBe("p");
    expect(ec2QuotaGroup({ providerType: "Inf2.xlarge", preemptible: true }, {})).toBe("inf-spot");
  });

  it("uses the longest configured prefix first", () => {
    const groups = { m: "standard", c: "standard", p: "p", p5: "p5", "p5e.48": "p5e" };
    expect(ec2QuotaGroup({ providerType: "m7i.large", preemptible: false }, groups)).toBe("standard");
    expect(ec2QuotaGroup({ providerType: "c5.xlarge", preemptible: true }, groups)).toBe("standard-spot");
    expect(ec2QuotaGroup({ providerType: "p5.48xlarge", preemptible: false }, groups)).toBe("p5");
    expect(ec2QuotaGroup({ providerType: "p5e.48xlarge", preemptible: false }, groups)).toBe("p5e");
    expect(ec2QuotaGroup({ providerType: "p4d.24xlarge", preemptible: false }, groups)).toBe("p");
    expect(ec2QuotaGroup({ providerType: "g5.xlarge", preemptible: false }, groups)).toBe("g");
  });
});

describe("normalizePrices", () => {
  it("sorts, keeps the last price per time, and merges repeats", () => {
    expect(
      normalizePrices([
        { startTime: 30, price: 2 },
        { startTime: 10, price: 1 },
        { startTime: 20, price: 1 },
        { startTime: 30, price: 3 },
      ]),
    ).toEqual([
      { startTime: 10, price: 1 },
      { startTime: 30, price: 3 },
    ]);
  });
});

/** A logger whose lines the test can read. */
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

describe("ec2 driver against the fake EC2 endpoint", () => {
  let fake: FakeEc2;
  let sets: InstanceSet[];
  let spotPrices: FakeSpotPrice[];
  let log: ReturnType<typeof capturedLogger>;

  beforeEach(async () => {
    spotPrices = [];
    sets = [];
    log = capturedLogger();
    fake = await new FakeEc2({ spotPrices, terminatedLingerMs: 0 }).start();
  });

  afterEach(async () => {
    for (const s of sets) await s.stop();
    await fake.stop();
    // No secret reached a log line, whatever the test did.
    expect(log.lines.join("")).not.toContain(SECRET_KEY);
  });

  async function openSet(
    extra: Record<string, unknown> = {},
    clock: Clock = systemClock,
  ): Promise<InstanceSet> {
    const set = await ec2Driver.instanceSet(
      {
        region: "us-east-1",
        endpoint: fake.url,
        accessKeyId: ACCESS_KEY,
        secretAccessKey: SECRET_KEY,
        subnetId: SUBNETS,
        securityGroupIds: ["sg-0a1", "sg-0b2"],
        ...extra,
      },
      "zzzzz",
      {},
      { logger: log.logger, clock, registry: new Registry() },
    );
    sets.push(set);
    return set;
  }

  const calls = (action: string) => fake.calls.filter((c) => c.action === action);

  async function errorOf(p: Promise<unknown>): Promise<Error> {
    try {
      await p;
    } catch (err) {
      return err as Error;
    }
    throw new Error("expected the call to fail");
  }

  describe("create", () => {
    it("launches one instance with the dispatcher's parameters and tags it and its volumes", async () => {
      const set = await openSet({ iamInstanceProfile: "compute-node" });
      const key = generateKeyPair();
      const tags = { DispatchCloudInstanceSetID: "zzzzz", DispatchCloudInstanceType: "m5l", Owner: "ops" };
      const inst = await set.create(type(), IMAGE, tags, INIT, key.publicKey);

      const run = calls("RunInstances");
      expect(run).toHaveLength(1);
      const p = run[0]!.params;
      expect(p).toMatchObject({
        MinCount: "1",
        MaxCount: "1",
        ImageId: IMAGE,
        InstanceType: "m5.large",
        InstanceInitiatedShutdownBehavior: "terminate",
        "MetadataOptions.HttpTokens": "required",
        "MetadataOptions.HttpEndpoint": "enabled",
        "NetworkInterface.1.DeviceIndex": "0",
        "NetworkInterface.1.SubnetId": "subnet-0a",
        "NetworkInterface.1.AssociatePublicIpAddress": "false",
        "NetworkInterface.1.DeleteOnTermination": "true",
        "NetworkInterface.1.SecurityGroupId.1": "sg-0a1",
        "NetworkInterface.1.SecurityGroupId.2": "sg-0b2",
        "IamInstanceProfile.Name": "compute-node",
      });
      expect(Buffer.from(p["UserData"]!, "base64").toString()).toBe(INIT);
      expect(Object.keys(p).some((k) => k.startsWith("NetworkInterface.2"))).toBe(false);
      expect(Object.keys(p).some((k) => k.startsWith("BlockDeviceMapping"))).toBe(false);
      expect(Object.keys(p).some((k) => k.startsWith("InstanceMarketOptions"))).toBe(false);

      const recorded = fake.instances.get(inst.id)!;
      expect(recorded.tags).toEqual(tags);
      expect(recorded.volumeTags).toEqual(tags);
      expect(recorded.userData).toBe(INIT);
      expect(recorded.keyName).toBe(ec2PublicKey(key.publicKey).keyName);
      expect(recorded.spot).toBeNull();

      expect(inst.id).toMatch(/^i-/);
      expect(inst.address).toBe(recorded.privateIp);
      expect(inst.address).toMatch(/^10\.\d+\.\d+\.\d+$/);
      expect(inst.remoteUser).toBe("admin");
      expect(inst.providerType).toBe("m5.large");
      expect(inst.tags).toEqual(tags);
      expect(set.quotaGroup(type())).toBe("m");
      expect(inst.priceHistory?.(type())).toEqual([
        { startTime: recorded.launchTime.getTime(), price: 0.096 },
      ]);
    });

    it("names an instance profile by ARN, and sends no key without a public key", async () => {
      const arn = "arn:aws:iam::123456789012:instance-profile/compute";
      const set = await openSet({ iamInstanceProfile: arn, securityGroupIds: [], adminUsername: "debian" });
      const inst = await set.create(type(), IMAGE, {}, INIT, "");
      const p = calls("RunInstances")[0]!.params;
      expect(p["IamInstanceProfile.Arn"]).toBe(arn);
      expect(p["KeyName"]).toBeUndefined();
      expect(Object.keys(p).some((k) => k.startsWith("TagSpecification"))).toBe(false);
      expect(Object.keys(p).some((k) => k.includes("SecurityGroupId"))).toBe(false);
      expect(calls("DescribeKeyPairs")).toHaveLength(0);
      expect(inst.remoteUser).toBe("debian");
    });

    it("maps added scratch to an EBS volume of whole GiB, deleted with the instance", async () => {
      const set = await openSet({ ebsVolumeType: "st1" });
      const scratchType = type({ addedScratch: 10.5 * GiB, scratch: 10.5 * GiB });
      await set.create(scratchType, IMAGE, {}, INIT, "");
      expect(calls("RunInstances")[0]!.params).toMatchObject({
        "BlockDeviceMapping.1.DeviceName": "/dev/xvdt",
        "BlockDeviceMapping.1.Ebs.VolumeSize": "11",
        "BlockDeviceMapping.1.Ebs.VolumeType": "st1",
        "BlockDeviceMapping.1.Ebs.DeleteOnTermination": "true",
      });
      const set2 = await openSet();
      await set2.create(type({ addedScratch: 100 * GiB }), IMAGE, {}, INIT, "");
      expect(calls("RunInstances")[1]!.params).toMatchObject({
        "BlockDeviceMapping.1.Ebs.VolumeSize": "100",
        "BlockDeviceMapping.1.Ebs.VolumeType": "gp3",
      });
    });

    it("asks for a one-time spot instance, terminated on interruption, at most the configured price", async () => {
      const set = await openSet();
      const spotType = type({ name: "m5l.preemptible", preemptible: true, price: 0.0425 });
      const inst = await set.create(spotType, IMAGE, {}, INIT, "");
      expect(calls("RunInstances")[0]!.params).toMatchObject({
        "InstanceMarketOptions.MarketType": "spot",
        "InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior": "terminate",
        "InstanceMarketOptions.SpotOptions.SpotInstanceType": "one-time",
        "InstanceMarketOptions.SpotOptions.MaxPrice": "0.0425",
      });
      expect(fake.instances.get(inst.id)!.spot).toEqual({
        maxPrice: "0.0425",
        interruptionBehavior: "terminate",
        type: "one-time",
      });
      expect(set.quotaGroup(spotType)).toBe("m-spot");
    });
  });

  describe("key pairs", () => {
    it("imports the key once, even for concurrent creates, and reuses it after", async () => {
      const set = await openSet();
      const key = generateKeyPair();
      const [a, b] = await Promise.all([
        set.create(type(), IMAGE, {}, INIT, key.publicKey),
        set.create(type(), IMAGE, {}, INIT, key.publicKey),
      ]);
      await set.create(type(), IMAGE, {}, INIT, key.publicKey);
      expect(calls("DescribeKeyPairs")).toHaveLength(1);
      expect(calls("ImportKeyPair")).toHaveLength(1);
      const name = ec2PublicKey(key.publicKey).keyName;
      expect([...fake.keyPairs.keys()]).toEqual([name]);
      expect(fake.keyPairs.get(name)!.fingerprint).toBe(ec2PublicKey(key.publicKey).fingerprints[0]);
      for (const inst of [a, b]) expect(fake.instances.get(inst.id)!.keyName).toBe(name);
      expect(calls("RunInstances").map((c) => c.params["KeyName"])).toEqual([name, name, name]);

      // A new instance set (a restarted dispatcher) finds the key by its fingerprint.
      const again = await openSet();
      await again.create(type(), IMAGE, {}, INIT, key.publicKey);
      expect(calls("DescribeKeyPairs")).toHaveLength(2);
      expect(calls("DescribeKeyPairs")[1]!.params).toMatchObject({ "Filter.1.Name": "fingerprint" });
      expect(calls("ImportKeyPair")).toHaveLength(1);
      expect(calls("RunInstances").at(-1)!.params["KeyName"]).toBe(name);
    });

    it("finds an RSA key imported under any name by EC2's fingerprint", async () => {
      const set = await openSet();
      await set.create(type(), IMAGE, {}, INIT, RSA_KEY);
      expect(fake.keyPairs.size).toBe(1);
      // An operator's own import of the same key, under another name, is found too.
      fake.keyPairs.clear();
      fake.keyPairs.set("operators-key", {
        name: "operators-key",
        fingerprint: RSA_EC2_FINGERPRINT,
        publicKey: RSA_KEY,
      });
      const again = await openSet();
      await again.create(type(), IMAGE, {}, INIT, RSA_KEY);
      expect(calls("ImportKeyPair")).toHaveLength(1);
      expect(calls("RunInstances").at(-1)!.params["KeyName"]).toBe("operators-key");
    });

    it("uses the derived name when another dispatcher imported it meanwhile (InvalidKeyPair.Duplicate)", async () => {
      const key = generateKeyPair();
      const name = ec2PublicKey(key.publicKey).keyName;
      // Listed under a fingerprint the lookup does not match: the import then finds the name taken.
      fake.keyPairs.set(name, { name, fingerprint: "00:11", publicKey: key.publicKey });
      const set = await openSet();
      await set.create(type(), IMAGE, {}, INIT, key.publicKey);
      expect(calls("ImportKeyPair").map((c) => c.code)).toEqual(["InvalidKeyPair.Duplicate"]);
      expect(calls("RunInstances")[0]!.params["KeyName"]).toBe(name);
    });

    it("a failed lookup is not remembered: the next create looks again", async () => {
      const set = await openSet();
      const key = generateKeyPair();
      fake.faults.next.push({ action: "DescribeKeyPairs", code: "InternalError" });
      const err = await errorOf(set.create(type(), IMAGE, {}, INIT, key.publicKey));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toContain("ec2 DescribeKeyPairs: InternalError");
      expect(calls("RunInstances")).toHaveLength(0);
      await set.create(type(), IMAGE, {}, INIT, key.publicKey);
      expect(calls("DescribeKeyPairs")).toHaveLength(2);
      expect(calls("ImportKeyPair")).toHaveLength(1);
    });
  });

  describe("subnets", () => {
    it("start round-robin: each create begins at the next subnet", async () => {
      const set = await openSet();
      for (let i = 0; i < 4; i++) await set.create(type(), IMAGE, {}, INIT, "");
      expect(calls("RunInstances").map((c) => c.params["NetworkInterface.1.SubnetId"])).toEqual([
        "subnet-0a",
        "subnet-0b",
        "subnet-0c",
        "subnet-0a",
      ]);
    });

    it.each([
      ["InsufficientFreeAddressesInSubnet", CapacityError, "all"],
      ["InvalidSubnetID.NotFound", CloudError, undefined],
      ["InvalidSubnet", CloudError, undefined],
      // An Unsupported that does not name the instance type is about the configuration: not capacity.
      ["Unsupported", CloudError, undefined],
      ["InsufficientInstanceCapacity", CapacityError, "instanceType"],
      ["InsufficientVolumeCapacity", CloudQuotaError, undefined],
    ] as const)(
      "on %s the next subnet is tried; when every subnet fails, the last error counts",
      async (code, cls, scope) => {
        const set = await openSet();
        fake.faults.subnetErrors.set("subnet-0a", code);
        const inst = await set.create(type(), IMAGE, {}, INIT, "");
        expect(fake.instances.get(inst.id)!.subnetId).toBe("subnet-0b");
        expect(calls("RunInstances").map((c) => [c.params["NetworkInterface.1.SubnetId"], c.code])).toEqual([
          ["subnet-0a", code],
          ["subnet-0b", null],
        ]);

        for (const s of SUBNETS) fake.faults.subnetErrors.set(s, code);
        fake.calls.length = 0;
        const err = await errorOf(set.create(type(), IMAGE, {}, INIT, ""));
        expect(err).toBeInstanceOf(cls);
        expect(err.message).toContain(`ec2 RunInstances: ${code}`);
        // The second create started at subnet-0b, and tried each subnet once.
        expect(calls("RunInstances").map((c) => c.params["NetworkInterface.1.SubnetId"])).toEqual([
          "subnet-0b",
          "subnet-0c",
          "subnet-0a",
        ]);
        if (scope !== undefined) expect(err).toMatchObject({ scope, instanceType: "m5l" });
      },
    );

    it.each([
      ["InsufficientFreeAddressesInSubnet", "InsufficientFreeAddressesInSubnet"],
      ["not-enough", "InvalidParameterValue"],
      ["ipv4", "InvalidParameterValue"],
    ] as const)(
      "a subnet out of addresses (%s) sends the create to the next subnet; all of them out: capacity for every type",
      async (style, code) => {
        const set = await openSet();
        fake.faults.fullSubnets.set("subnet-0a", style);
        const inst = await set.create(type(), IMAGE, {}, INIT, "");
        expect(fake.instances.get(inst.id)!.subnetId).toBe("subnet-0b");
        expect(calls("RunInstances").map((c) => c.code)).toEqual([code, null]);

        for (const s of SUBNETS) fake.faults.fullSubnets.set(s, style);
        fake.calls.length = 0;
        const err = await errorOf(set.create(type(), IMAGE, {}, INIT, ""));
        expect(calls("RunInstances").map((c) => c.code)).toEqual([code, code, code]);
        expect(err).toBeInstanceOf(CapacityError);
        expect(err).toMatchObject({ code: "cloud.capacity", scope: "all" });
        expect(err.message).toContain(`ec2 RunInstances: ${code}`);
      },
    );

    it("a type at capacity in one subnet wins over the other subnets' errors: another type may launch there", async () => {
      const set = await openSet();
      fake.faults.fullSubnets.set("subnet-0a", "ipv4");
      fake.faults.typesNotInZone.set("m5.large", new Set(["subnet-0b"]));
      fake.faults.subnetErrors.set("subnet-0c", "InvalidSubnetID.NotFound");
      const err = await errorOf(set.create(type(), IMAGE, {}, INIT, ""));
      expect(calls("RunInstances").map((c) => c.code)).toEqual([
        "InvalidParameterValue",
        "Unsupported",
        "InvalidSubnetID.NotFound",
      ]);
      expect(err).toMatchObject({ code: "cloud.capacity", scope: "instanceType", instanceType: "m5l" });
      expect(err.message).toContain("Your requested instance type (m5.large) is not supported");
    });

    it("Unsupported naming the type (not offered in a zone) moves on; everywhere: capacity for that type", async () => {
      const set = await openSet();
      fake.faults.typesNotInZone.set("m5.large", new Set(["subnet-0a"]));
      const inst = await set.create(type(), IMAGE, {}, INIT, "");
      expect(fake.instances.get(inst.id)!.subnetId).toBe("subnet-0b");
      fake.faults.typesNotInZone.set("m5.large", new Set(SUBNETS));
      const err = await errorOf(set.create(type(), IMAGE, {}, INIT, ""));
      expect(err).toMatchObject({ code: "cloud.capacity", scope: "instanceType", instanceType: "m5l" });
    });

    it("Unsupported configuration (no type named) is a CloudError, not capacity: the type is not blocked", async () => {
      const set = await openSet();
      fake.faults.unsupportedSpotTypes.add("m5.large");
      const err = await errorOf(set.create(type({ preemptible: true }), IMAGE, {}, INIT, ""));
      expect(err).toBeInstanceOf(CloudError);
      expect(err).not.toBeInstanceOf(CapacityError);
      expect(err.message).toMatch(/^ec2 RunInstances: Unsupported: The requested configuration is currently/);
      // On-demand, the same type launches.
      await set.create(type(), IMAGE, {}, INIT, "");
    });

    it("moves on from a type at capacity in one zone to the next zone", async () => {
      const set = await openSet();
      fake.faults.next.push({ action: "RunInstances", code: "InsufficientInstanceCapacity" });
      const inst = await set.create(type(), IMAGE, {}, INIT, "");
      expect(fake.instances.get(inst.id)!.subnetId).toBe("subnet-0b");
    });

    it("does not move on after an error that is not about the subnet", async () => {
      const set = await openSet();
      fake.faults.next.push({ action: "RunInstances", code: "InstanceLimitExceeded" });
      expect(await errorOf(set.create(type(), IMAGE, {}, INIT, ""))).toBeInstanceOf(CloudQuotaError);
      expect(calls("RunInstances")).toHaveLength(1);
    });
  });

  describe("error mapping through the SDK", () => {
    it.each([
      ["RequestLimitExceeded", 503, CloudRateLimitError, undefined],
      ["Throttling", 400, CloudRateLimitError, undefined],
      ["ThrottlingException", 400, CloudRateLimitError, undefined],
      ["RequestThrottled", 503, CloudRateLimitError, undefined],
      ["SlowDown", 503, CloudRateLimitError, undefined],
      ["InstanceLimitExceeded", 400, CloudQuotaError, undefined],
      ["InsufficientAddressCapacity", 500, CloudQuotaError, undefined],
      ["InsufficientVolumeCapacity", 400, CloudQuotaError, undefined],
      ["MaxSpotInstanceCountExceeded", 400, CapacityError, "quotaGroup"],
      ["VcpuLimitExceeded", 400, CapacityError, "quotaGroup"],
      ["InternalError", 500, CloudError, undefined],
      ["AuthFailure", 401, CloudError, undefined],
      ["InvalidAMIID.NotFound", 400, CloudError, undefined],
    ] as const)("RunInstances %s (%i)", async (code, status, cls, scope) => {
      // One subnet: no fallback hides the code.
      const set = await openSet({ subnetId: "subnet-0c" });
      fake.faults.next.push({ action: "RunInstances", code, status });
      const err = await errorOf(set.create(type(), IMAGE, {}, INIT, ""));
      expect(err).toBeInstanceOf(cls);
      expect(err.message).toContain(`ec2 RunInstances: ${code}`);
      expect(err.message).not.toContain(SECRET_KEY);
      if (scope !== undefined) expect(err).toMatchObject({ scope, quotaGroup: "m" });
      expect(calls("RunInstances").map((c) => c.status)).toEqual([status]);
    });

    it.each([
      ["InsufficientInstanceCapacity", undefined, { scope: "instanceType", instanceType: "m5l" }],
      [
        "Unsupported",
        "Your requested instance type (m5.large) is not supported in your requested Availability Zone (us-east-1c).",
        { scope: "instanceType", instanceType: "m5l" },
      ],
      ["Unsupported", "The requested configuration is currently not supported.", undefined],
      ["InsufficientFreeAddressesInSubnet", undefined, { scope: "all", instanceType: "m5l" }],
      ["InvalidParameterValue", "Not enough free addresses in subnet subnet-0c.", { scope: "all" }],
    ] as const)("RunInstances %s (%s) in the only subnet", async (code, message, capacity) => {
      const set = await openSet({ subnetId: "subnet-0c" });
      fake.faults.next.push({ action: "RunInstances", code, ...(message === undefined ? {} : { message }) });
      const err = await errorOf(set.create(type(), IMAGE, {}, INIT, ""));
      if (capacity === undefined) {
        expect(err).toBeInstanceOf(CloudError);
        expect(err).not.toBeInstanceOf(CapacityError);
      } else expect(err).toMatchObject({ ...capacity, code: "cloud.capacity" });
    });

    it("an image that does not exist is a plain CloudError naming it, tried in one subnet only", async () => {
      const set = await openSet();
      fake.faults.missingImages.add(IMAGE);
      const err = await errorOf(set.create(type(), IMAGE, {}, INIT, ""));
      expect(err).toBeInstanceOf(CloudError);
      expect(err).toMatchObject({ code: "cloud.error" });
      expect(err.message).toBe(
        `ec2 RunInstances: InvalidAMIID.NotFound: The image id '[${IMAGE}]' does not exist`,
      );
      expect(calls("RunInstances")).toHaveLength(1);
    });

    it("the spot instance count limit blocks the spot quota group, not on-demand creates", async () => {
      const set = await openSet();
      const spotType = type({ name: "m5l.spot", preemptible: true });
      fake.faults.maxSpotInstances = 1;
      await set.create(spotType, IMAGE, {}, INIT, "");
      const err = await errorOf(set.create(spotType, IMAGE, {}, INIT, ""));
      expect(err).toMatchObject({ code: "cloud.capacity", scope: "quotaGroup", quotaGroup: "m-spot" });
      expect(err.message).toContain("ec2 RunInstances: MaxSpotInstanceCountExceeded");
      // Not subnet-specific: one try.
      expect(calls("RunInstances").filter((c) => c.code !== null)).toHaveLength(1);

      // As the pool's create gate takes it: spot creates of that group wait, on-demand ones do not.
      const config = { cloud: { maxInstances: 0, maxConcurrentInstanceCreateOps: 0 } } as unknown as Config;
      const gate = createCreateGate({
        config,
        clock: systemClock,
        logger: log.logger,
        instanceSet: set,
        fleet: { all: () => 1, real: () => 1 },
      });
      gate.createFailed(spotType, err, log.logger);
      expect(gate.refusalFor(spotType)).toMatchObject({ kind: "capacity" });
      expect(gate.refusalFor(type())).toBeNull();
      expect(gate.quota().atQuota).toBe(false);
      await set.create(type(), IMAGE, {}, INIT, "");
    });

    it("limits the fake enforces map like injected codes", async () => {
      const set = await openSet();
      fake.faults.vcpuLimit = 4;
      await set.create(type(), IMAGE, {}, INIT, "");
      await set.create(type(), IMAGE, {}, INIT, "");
      const vcpu = await errorOf(set.create(type({ preemptible: true, name: "m5l.p" }), IMAGE, {}, INIT, ""));
      expect(vcpu).toMatchObject({ code: "cloud.capacity", scope: "quotaGroup", quotaGroup: "m-spot" });
      fake.faults.vcpuLimit = 0;
      fake.faults.maxInstances = 2;
      expect(await errorOf(set.create(type(), IMAGE, {}, INIT, ""))).toBeInstanceOf(CloudQuotaError);
      fake.faults.maxInstances = 0;
      fake.faults.typesAtCapacity.add("c5.large");
      const cap = await errorOf(
        set.create(type({ name: "c5l", providerType: "c5.large" }), IMAGE, {}, INIT, ""),
      );
      expect(cap).toMatchObject({ code: "cloud.capacity", scope: "instanceType", instanceType: "c5l" });
      // Each of the three subnets was tried for it.
      expect(calls("RunInstances").filter((c) => c.code === "InsufficientInstanceCapacity")).toHaveLength(3);
    });

    it("list, setTags and destroy map throttling and server errors too", async () => {
      const set = await openSet();
      const inst = await set.create(type(), IMAGE, { A: "1" }, INIT, "");
      fake.faults.next.push({ action: "DescribeInstances", code: "RequestLimitExceeded" });
      expect(await errorOf(set.instances({}))).toBeInstanceOf(CloudRateLimitError);
      fake.faults.next.push({ action: "CreateTags", code: "InternalError" });
      const tagErr = await errorOf(inst.setTags({ A: "2" }));
      expect(tagErr).toBeInstanceOf(CloudError);
      expect(tagErr.message).toContain("ec2 CreateTags: InternalError");
      fake.faults.next.push({ action: "TerminateInstances", code: "Throttling", status: 400 });
      expect(await errorOf(inst.destroy())).toBeInstanceOf(CloudRateLimitError);
    });

    it("consecutive throttles push earliestRetry out; a success resets the backoff", async () => {
      const clock = new FakeClock(Date.now());
      const set = await openSet({}, clock);
      const delays: number[] = [];
      for (let i = 0; i < 3; i++) {
        fake.faults.next.push({ action: "*", code: "RequestLimitExceeded" });
        const err = (await errorOf(set.instances({}))) as CloudRateLimitError;
        delays.push(err.earliestRetry - clock.now());
      }
      expect(delays).toEqual([1000, 2500, 4750]);
      await set.instances({});
      fake.faults.next.push({ action: "*", code: "RequestLimitExceeded" });
      const err = (await errorOf(set.instances({}))) as CloudRateLimitError;
      expect(err.earliestRetry - clock.now()).toBe(1000);
    });

    it("a call EC2 does not answer within requestTimeout is a CloudError", async () => {
      const set = await openSet({ requestTimeout: "200ms" });
      fake.faults.slowMs = 5000;
      const err = await errorOf(set.instances({}));
      fake.faults.slowMs = 0;
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toMatch(/^ec2 DescribeInstances: no answer within 200 ms/);
    });

    it("an endpoint that refuses connections is a CloudError", async () => {
      const set = await ec2Driver.instanceSet(
        {
          region: "us-east-1",
          endpoint: "http://127.0.0.1:1",
          accessKeyId: ACCESS_KEY,
          secretAccessKey: SECRET_KEY,
        },
        "zzzzz",
        {},
        { logger: log.logger, clock: systemClock, registry: new Registry() },
      );
      sets.push(set);
      const err = await errorOf(set.instances({}));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toMatch(/^ec2 DescribeInstances: request failed: .*ECONNREFUSED/);
    });
  });

  describe("instances", () => {
    it("sends a tag filter per pair and the live states, and skips shutting-down and terminated ones", async () => {
      const set = await openSet();
      const mine = { DispatchCloudInstanceSetID: "zzzzz" };
      const created = await set.create(type(), IMAGE, { ...mine, Role: "worker" }, INIT, "");
      await set.create(type(), IMAGE, { DispatchCloudInstanceSetID: "other" }, INIT, "");
      fake.addInstances(1, { tags: { ...mine }, state: "shutting-down" });
      fake.addInstances(1, { tags: { ...mine }, state: "terminated" });
      const third = fake.addInstances(1, { tags: { ...mine, Role: "worker" }, type: "c5.large" })[0]!;

      const listed = await set.instances({ ...mine, Role: "worker" });
      expect(listed.map((i) => i.id).sort()).toEqual([created.id, third.id].sort());
      const p = calls("DescribeInstances").at(-1)!.params;
      const filters = new Map<string, string[]>();
      for (let i = 1; p[`Filter.${i}.Name`] !== undefined; i++) {
        const values: string[] = [];
        for (let j = 1; p[`Filter.${i}.Value.${j}`] !== undefined; j++)
          values.push(p[`Filter.${i}.Value.${j}`]!);
        filters.set(p[`Filter.${i}.Name`]!, values);
      }
      expect(Object.fromEntries(filters)).toEqual({
        "tag:DispatchCloudInstanceSetID": ["zzzzz"],
        "tag:Role": ["worker"],
        "instance-state-name": ["pending", "running", "stopping", "stopped"],
      });
      expect(p["MaxResults"]).toBe("1000");

      const again = listed.find((i) => i.id === created.id)!;
      expect(again.tags).toEqual({ ...mine, Role: "worker" });
      expect(again.address).toBe(fake.instances.get(created.id)!.privateIp);
      expect(again.providerType).toBe("m5.large");
      expect(again.remoteUser).toBe("admin");
      expect(listed.find((i) => i.id === third.id)!.providerType).toBe("c5.large");
    });

    it("matches tag values literally, though EC2 filter values are patterns", async () => {
      const set = await openSet();
      const star = await set.create(type(), IMAGE, { Set: "a*?\\" }, INIT, "");
      await set.create(type(), IMAGE, { Set: "abc\\" }, INIT, "");
      await set.create(type(), IMAGE, { Set: "a*x\\" }, INIT, "");
      expect((await set.instances({ Set: "a*?\\" })).map((i) => i.id)).toEqual([star.id]);
      expect(calls("DescribeInstances").at(-1)!.params["Filter.1.Value.1"]).toBe("a\\*\\?\\\\");
    });

    it("follows NextToken past 1,000 instances", async () => {
      const set = await openSet();
      const tags = { DispatchCloudInstanceSetID: "zzzzz" };
      const added = fake.addInstances(2500, { tags });
      fake.addInstances(30, { tags: { DispatchCloudInstanceSetID: "other" } });
      const listed = await set.instances(tags);
      expect(listed).toHaveLength(2500);
      expect(new Set(listed.map((i) => i.id))).toEqual(new Set(added.map((i) => i.id)));
      const pages = calls("DescribeInstances");
      expect(pages).toHaveLength(3);
      expect(pages[0]!.params["NextToken"]).toBeUndefined();
      expect(pages[1]!.params["NextToken"]).toBeDefined();
      expect(pages[2]!.params["NextToken"]).toBeDefined();
      for (const page of pages) expect(page.params["MaxResults"]).toBe("1000");
    });
  });

  describe("instance operations", () => {
    it("setTags creates new and changed tags and deletes removed ones", async () => {
      const set = await openSet();
      const inst = await set.create(type(), IMAGE, { Keep: "k", Change: "old", Drop: "d" }, INIT, "");
      await inst.setTags({ Keep: "k", Change: "new", Add: "a" });
      const create = calls("CreateTags");
      expect(create).toHaveLength(1);
      expect(create[0]!.params).toMatchObject({ "ResourceId.1": inst.id });
      const createdTags = Object.fromEntries(
        [1, 2].map((i) => [create[0]!.params[`Tag.${i}.Key`], create[0]!.params[`Tag.${i}.Value`]]),
      );
      expect(createdTags).toEqual({ Change: "new", Add: "a" });
      expect(create[0]!.params["Tag.3.Key"]).toBeUndefined();
      const del = calls("DeleteTags");
      expect(del).toHaveLength(1);
      expect(del[0]!.params).toMatchObject({ "ResourceId.1": inst.id, "Tag.1.Key": "Drop" });
      expect(del[0]!.params["Tag.1.Value"]).toBeUndefined();
      expect(fake.instances.get(inst.id)!.tags).toEqual({ Keep: "k", Change: "new", Add: "a" });
      expect(inst.tags).toEqual({ Keep: "k", Change: "new", Add: "a" });

      // Nothing changed: no calls. Only removals: DeleteTags alone.
      await inst.setTags({ Keep: "k", Change: "new", Add: "a" });
      await inst.setTags({ Keep: "k" });
      expect(calls("CreateTags")).toHaveLength(1);
      expect(calls("DeleteTags")).toHaveLength(2);
      expect(fake.instances.get(inst.id)!.tags).toEqual({ Keep: "k" });
      const listed = (await set.instances({ Keep: "k" }))[0]!;
      expect(listed.tags).toEqual({ Keep: "k" });
    });

    it("destroy terminates the instance; InvalidInstanceID.NotFound is a CloudError, not proof it is gone", async () => {
      const set = await openSet();
      const inst = await set.create(type(), IMAGE, { T: "1" }, INIT, "");
      await inst.destroy();
      expect(calls("TerminateInstances")[0]!.params).toMatchObject({ "InstanceId.1": inst.id });
      expect(["shutting-down", "terminated"]).toContain(fake.instances.get(inst.id)!.state);
      expect(await set.instances({ T: "1" })).toEqual([]);
      // Gone from EC2 (terminatedLingerMs 0): NotFound, an error; the list no longer showing it is the proof.
      const err = await errorOf(inst.destroy());
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toMatch(
        /^ec2 TerminateInstances: InvalidInstanceID\.NotFound: .*not taken as gone/,
      );
      expect(calls("TerminateInstances").map((c) => c.code)).toEqual([null, "InvalidInstanceID.NotFound"]);
    });

    it("a just-launched instance EC2 does not know yet is not taken as gone: it still runs, listed, and is destroyed later", async () => {
      const set = await openSet();
      const inst = await set.create(type(), IMAGE, { T: "young" }, INIT, "");
      fake.faults.terminateNotFoundMs = 600_000;
      const err = await errorOf(inst.destroy());
      expect(err).toBeInstanceOf(CloudError);
      expect(err).toMatchObject({ code: "cloud.error" });
      // EC2 said NotFound, and the instance runs on: still listed, so the pool destroys it again.
      expect(fake.instances.get(inst.id)!.state).toBe("running");
      expect((await set.instances({ T: "young" })).map((i) => i.id)).toEqual([inst.id]);
      fake.faults.terminateNotFoundMs = 0;
      await inst.destroy();
      expect(fake.instances.get(inst.id)!.state).not.toBe("running");
      expect(await set.instances({ T: "young" })).toEqual([]);
    });

    it("setTags right after launch: InvalidInstanceID.NotFound is sent again after a pause, then succeeds", async () => {
      const clock = new FakeClock(Date.now());
      const set = await openSet({}, clock);
      const inst = await set.create(type(), IMAGE, { B: "run" }, INIT, "");
      fake.faults.next.push({ action: "CreateTags", code: "InvalidInstanceID.NotFound" });
      let settled = false;
      const done = inst.setTags({ B: "hold" }).finally(() => {
        settled = true;
      });
      await waitFor("the tag retry to wait", () => clock.pending === 1);
      expect(settled).toBe(false);
      await clock.advance(1000);
      await done;
      expect(calls("CreateTags").map((c) => c.code)).toEqual(["InvalidInstanceID.NotFound", null]);
      expect(fake.instances.get(inst.id)!.tags).toEqual({ B: "hold" });
      expect(inst.tags).toEqual({ B: "hold" });
    });

    it("setTags: still unknown after the retries is a CloudError; the tags stay as they were, so the next setTags sends them again", async () => {
      const clock = new FakeClock(Date.now());
      const set = await openSet({}, clock);
      const inst = await set.create(type(), IMAGE, { B: "run" }, INIT, "");
      fake.faults.tagNotFoundMs = 600_000;
      const result = errorOf(inst.setTags({ B: "drain" }));
      // Each pause in turn (1, 2 and 4 s), then no more.
      for (const [i, delay] of TAG_RETRY_DELAYS_MS.entries()) {
        await waitFor("a tag retry to wait", () => clock.pending === 1);
        expect(calls("CreateTags")).toHaveLength(i + 1);
        await clock.advance(delay);
      }
      const err = await result;
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toMatch(/^ec2 CreateTags: InvalidInstanceID\.NotFound/);
      expect(calls("CreateTags").map((c) => c.code)).toEqual(Array(4).fill("InvalidInstanceID.NotFound"));
      expect(inst.tags).toEqual({ B: "run" });
      fake.faults.tagNotFoundMs = 0;
      await inst.setTags({ B: "drain" });
      expect(fake.instances.get(inst.id)!.tags).toEqual({ B: "drain" });
    });

    it("setTags on an instance launched long ago: NotFound fails at once (no waiting for a gone instance)", async () => {
      const clock = new FakeClock(Date.now() + 10 * 60_000);
      const set = await openSet({}, clock);
      const inst = await set.create(type(), IMAGE, { B: "run" }, INIT, "");
      fake.faults.next.push({ action: "CreateTags", code: "InvalidInstanceID.NotFound" });
      expect(await errorOf(inst.setTags({ B: "hold" }))).toBeInstanceOf(CloudError);
      expect(clock.pending).toBe(0);
      expect(calls("CreateTags")).toHaveLength(1);
    });
  });

  describe("idempotent creates (ClientToken)", () => {
    const SECRET = "0123456789abcdef0123456789abcdef01234567";
    const tags = (secret = SECRET) => ({
      DispatchCloudInstanceSecret: secret,
      DispatchCloudInstanceType: "m5l",
    });

    it("the ClientToken is a one-way hash of the instance secret and the subnet, 64 ASCII characters", async () => {
      const set = await openSet();
      await set.create(type(), IMAGE, tags(), INIT, "");
      await set.create(type(), IMAGE, tags("f".repeat(40)), INIT, "");
      const [a, b] = calls("RunInstances").map((c) => c.params["ClientToken"] ?? "");
      expect(a).toBe(ec2ClientToken(SECRET, "subnet-0a"));
      expect(b).toBe(ec2ClientToken("f".repeat(40), "subnet-0b"));
      expect(a).toMatch(/^[0-9a-f]{64}$/);
      expect(a).not.toContain(SECRET.slice(0, 8));
      expect(ec2ClientToken(SECRET, "subnet-0b")).not.toBe(a);
      expect(ec2ClientToken(SECRET, undefined)).not.toBe(a);
      // Each subnet tried is its own launch request, with its own token.
      fake.faults.subnetErrors.set("subnet-0c", "InsufficientInstanceCapacity");
      fake.calls.length = 0;
      await set.create(type(), IMAGE, tags("e".repeat(40)), INIT, "");
      expect(calls("RunInstances").map((c) => c.params["ClientToken"])).toEqual([
        ec2ClientToken("e".repeat(40), "subnet-0c"),
        ec2ClientToken("e".repeat(40), "subnet-0a"),
      ]);
      // Tokens and secrets never reach a log line.
      expect(log.lines.join("")).not.toContain(SECRET);
      expect(log.lines.join("")).not.toContain(a);
    });

    it.each(["drop", "late"] as const)(
      "a RunInstances whose answer is lost (%s) is sent again with the same token: one instance, and the create succeeds",
      async (mode) => {
        const set = await openSet({ requestTimeout: "1s" });
        fake.faults.loseNext.push({ action: "RunInstances", mode });
        const inst = await set.create(type(), IMAGE, tags(), INIT, "");
        const run = calls("RunInstances");
        expect(run.map((c) => [c.code, c.lost])).toEqual([
          [null, mode],
          [null, null],
        ]);
        expect(run[1]!.params["ClientToken"]).toBe(run[0]!.params["ClientToken"]);
        expect(run[1]!.params["NetworkInterface.1.SubnetId"]).toBe("subnet-0a");
        expect([...fake.instances.keys()]).toEqual([inst.id]);
        expect(inst.tags).toEqual(tags());
      },
    );

    it("lost twice: the create fails, but the one instance it launched is listed with its tags (the pool adopts it)", async () => {
      const set = await openSet();
      fake.faults.loseNext.push({ action: "RunInstances" }, { action: "RunInstances" });
      const err = await errorOf(set.create(type(), IMAGE, tags(), INIT, ""));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toMatch(/^ec2 RunInstances: the connection closed without an answer: .*ECONNRESET/);
      expect(calls("RunInstances").map((c) => c.lost)).toEqual(["drop", "drop"]);
      expect(fake.instances.size).toBe(1);
      const listed = await set.instances({ DispatchCloudInstanceSecret: SECRET });
      expect(listed.map((i) => i.id)).toEqual([...fake.instances.keys()]);
      expect(listed[0]!.tags).toEqual(tags());
    });

    it("while a create whose answer was lost is still in flight, its instance is left out of lists", async () => {
      const set = await openSet({ requestTimeout: "1s" });
      fake.faults.loseNext.push({ action: "RunInstances", mode: "late" });
      const creating = set.create(type(), IMAGE, tags(), INIT, "");
      // Launched, its answer held until the driver gives up on it: the create may still fail.
      await waitFor("the launch", () => fake.instances.size === 1);
      expect(await set.instances({})).toEqual([]);
      const inst = await creating;
      expect((await set.instances({})).map((i) => i.id)).toEqual([inst.id]);
    });

    it("lost twice: left out of lists until the create has failed, then listed for the pool to adopt", async () => {
      const set = await openSet({ requestTimeout: "1s" });
      fake.faults.loseNext.push(
        { action: "RunInstances", mode: "late" },
        { action: "RunInstances", mode: "late" },
      );
      const creating = errorOf(set.create(type(), IMAGE, tags(), INIT, ""));
      await waitFor("the launch", () => fake.instances.size === 1);
      expect(await set.instances({})).toEqual([]);
      await waitFor("the resend", () => calls("RunInstances").length === 2);
      expect(await set.instances({})).toEqual([]);
      expect((await creating).message).toMatch(/^ec2 RunInstances: no answer within 1000 ms/);
      expect((await set.instances({})).map((i) => i.id)).toEqual([...fake.instances.keys()]);
    });

    it("an EC2 error answer is not sent again (only a lost answer may hide a launch)", async () => {
      const set = await openSet({ subnetId: "subnet-0a" });
      fake.faults.next.push({ action: "RunInstances", code: "InternalError" });
      expect(await errorOf(set.create(type(), IMAGE, tags(), INIT, ""))).toBeInstanceOf(CloudError);
      expect(calls("RunInstances")).toHaveLength(1);
    });
  });

  describe("the default VPC (no subnet configured)", () => {
    it("sends no subnet: EC2 launches in the default VPC's default subnet", async () => {
      const set = await openSet({ subnetId: undefined });
      const inst = await set.create(type(), IMAGE, { DispatchCloudInstanceSecret: "a".repeat(40) }, INIT, "");
      const p = calls("RunInstances")[0]!.params;
      expect(p["NetworkInterface.1.SubnetId"]).toBeUndefined();
      expect(p).toMatchObject({
        "NetworkInterface.1.DeviceIndex": "0",
        "NetworkInterface.1.AssociatePublicIpAddress": "false",
        ClientToken: ec2ClientToken("a".repeat(40), undefined),
      });
      expect(fake.instances.get(inst.id)!.subnetId).toBe("subnet-0a");
      expect(inst.address).toMatch(/^10\.0\./);
      // One "subnet": a capacity error is final at once.
      fake.faults.typesAtCapacity.add("m5.large");
      expect(await errorOf(set.create(type(), IMAGE, {}, INIT, ""))).toMatchObject({ scope: "instanceType" });
      expect(calls("RunInstances")).toHaveLength(2);
    });

    it("an account without a default VPC refuses it: a CloudError saying so", async () => {
      await fake.stop();
      fake = await new FakeEc2({ defaultSubnet: null, terminatedLingerMs: 0 }).start();
      const set = await openSet({ subnetId: undefined });
      const err = await errorOf(set.create(type(), IMAGE, {}, INIT, ""));
      expect(err).toBeInstanceOf(CloudError);
      expect(err.message).toMatch(/^ec2 RunInstances: VPCIdNotSpecified: No default VPC/);
    });
  });

  describe("spot prices", () => {
    it("priceHistory of a spot instance follows the spot price history of its type and zone", async () => {
      const clock = new FakeClock(Date.now());
      const set = await openSet(
        { subnetId: "subnet-0a", spotPriceUpdateInterval: "1h", ebsPrice: 0.072 },
        clock,
      );
      const now = clock.now();
      spotPrices.push(
        {
          instanceType: "m5.large",
          availabilityZone: "us-east-1a",
          price: 0.05,
          timestamp: new Date(now - 86_400_000),
        },
        {
          instanceType: "m5.large",
          availabilityZone: "us-east-1a",
          price: 0.04,
          timestamp: new Date(now - 3_600_000),
        },
        {
          instanceType: "m5.large",
          availabilityZone: "us-east-1b",
          price: 0.09,
          timestamp: new Date(now - 3_600_000),
        },
        {
          instanceType: "c5.large",
          availabilityZone: "us-east-1a",
          price: 0.07,
          timestamp: new Date(now - 3_600_000),
        },
      );
      const spotType = type({ name: "m5l.p", preemptible: true, price: 0.08, addedScratch: 50 * GiB });
      const created = await set.create(spotType, IMAGE, { S: "1" }, INIT, "");
      const onDemand = await set.create(type(), IMAGE, { S: "1" }, INIT, "");
      // Not known before a list.
      const launch = fake.instances.get(created.id)!.launchTime.getTime();
      expect(created.priceHistory?.(spotType)).toEqual([{ startTime: launch, price: 0.08 }]);

      const listed = await set.instances({ S: "1" });
      const spot = listed.find((i) => i.id === created.id)!;
      const ebs = (0.072 * 50) / (30 * 24);
      expect(spot.priceHistory?.(spotType)).toEqual([{ startTime: launch, price: 0.04 + ebs }]);
      const history = calls("DescribeSpotPriceHistory");
      expect(history).toHaveLength(1);
      expect(history[0]!.params).toMatchObject({
        "InstanceType.1": "m5.large",
        AvailabilityZone: "us-east-1a",
        "ProductDescription.1": "Linux/UNIX",
      });
      expect(listed.find((i) => i.id === onDemand.id)!.priceHistory?.(type())).toEqual([
        { startTime: fake.instances.get(onDemand.id)!.launchTime.getTime(), price: 0.096 },
      ]);

      // Refreshed at most every spotPriceUpdateInterval; the history is shared by every instance.
      const later = launch + 60_000;
      spotPrices.push({
        instanceType: "m5.large",
        availabilityZone: "us-east-1a",
        price: 0.045,
        timestamp: new Date(later),
      });
      await set.instances({ S: "1" });
      expect(calls("DescribeSpotPriceHistory")).toHaveLength(1);
      await clock.advance(3_600_001);
      const relisted = await set.instances({ S: "1" });
      expect(calls("DescribeSpotPriceHistory")).toHaveLength(2);
      const expected = [
        { startTime: launch, price: 0.04 + ebs },
        { startTime: later, price: 0.045 + ebs },
      ];
      expect(relisted.find((i) => i.id === created.id)!.priceHistory?.(spotType)).toEqual(expected);
      expect(spot.priceHistory?.(spotType)).toEqual(expected);
    });

    it("before the first known spot price, the configured price counts", async () => {
      const set = await openSet({ subnetId: "subnet-0b" });
      const spotType = type({ preemptible: true, name: "m5l.p", price: 0.07 });
      const created = await set.create(spotType, IMAGE, { S: "1" }, INIT, "");
      const launch = fake.instances.get(created.id)!.launchTime.getTime();
      spotPrices.push({
        instanceType: "m5.large",
        availabilityZone: "us-east-1b",
        price: 0.03,
        timestamp: new Date(launch + 5000),
      });
      const [listed] = await set.instances({ S: "1" });
      expect(listed!.priceHistory?.(spotType)).toEqual([
        { startTime: launch, price: 0.07 },
        { startTime: launch + 5000, price: 0.03 },
      ]);
    });

    it("a failed price refresh does not fail the list", async () => {
      const set = await openSet({ subnetId: "subnet-0a" });
      const spotType = type({ preemptible: true, name: "m5l.p" });
      const created = await set.create(spotType, IMAGE, { S: "1" }, INIT, "");
      fake.faults.next.push({ action: "DescribeSpotPriceHistory", code: "InternalError" });
      const listed = await set.instances({ S: "1" });
      expect(listed.map((i) => i.id)).toEqual([created.id]);
      expect(log.lines.join("")).toContain("cannot refresh the ec2 spot price history");
    });
  });

  describe("through the wrappers, as the pool drives it", () => {
    it("a throttled burst of creates slows down and loses nothing", async () => {
      const clock = new FakeClock(Date.now());
      const raw = await openSet({}, clock);
      // Record when each create reaches the driver, and the retry times the driver hands back.
      let holdUntil = Number.NEGATIVE_INFINITY;
      const early: number[] = [];
      const retries: number[] = [];
      const recorded: InstanceSet = {
        async create(...args: Parameters<InstanceSet["create"]>) {
          if (clock.now() < holdUntil) early.push(clock.now());
          try {
            return await raw.create(...args);
          } catch (err) {
            if (err instanceof CloudRateLimitError) {
              holdUntil = Math.max(holdUntil, err.earliestRetry);
              retries.push(err.earliestRetry);
            }
            throw err;
          }
        },
        instances: (f) => raw.instances(f),
        quotaGroup: (t) => raw.quotaGroup(t),
        stop: () => raw.stop(),
      };
      const registry = new Registry();
      const set = wrapInstanceSet(recorded, {
        registry,
        clock,
        driver: "ec2",
        maxOpsPerSecond: 0,
        defaultTags: {},
        instanceSetTags: { DispatchCloudInstanceSetID: "zzzzz" },
      });
      const THROTTLES = 7;
      for (let i = 0; i < THROTTLES; i++)
        fake.faults.next.push({ action: "RunInstances", code: "RequestLimitExceeded" });
      const key = generateKeyPair();

      // Like the pool: a create that hits the rate limit is tried again; the limiter holds it until earliestRetry.
      const WANTED = 8;
      const createOne = async (n: number): Promise<Instance> => {
        for (;;) {
          try {
            return await set.create(type(), IMAGE, { N: String(n) }, INIT, key.publicKey);
          } catch (err) {
            if (!(err instanceof CloudRateLimitError)) throw err;
          }
        }
      };
      const start = clock.now();
      const all = Promise.all(Array.from({ length: WANTED }, (_, n) => createOne(n)));
      let done = false;
      void all.then(
        () => {
          done = true;
        },
        () => {
          done = true;
        },
      );
      await waitFor(
        "the creates to finish",
        async () => {
          if (!done && clock.pending > 0) await clock.advance(1000);
          return done;
        },
        60_000,
      );
      const created = await all;

      expect(created).toHaveLength(WANTED);
      expect(new Set(created.map((i) => i.tags["N"]))).toEqual(
        new Set(Array.from({ length: WANTED }, (_, n) => String(n))),
      );
      expect(fake.instances.size).toBe(WANTED);
      expect(calls("RunInstances").filter((c) => c.code === "RequestLimitExceeded")).toHaveLength(THROTTLES);
      expect(calls("RunInstances").filter((c) => c.code === null)).toHaveLength(WANTED);
      expect(retries).toHaveLength(THROTTLES);
      // Nothing reached EC2 before the retry time of a throttle already seen, and the burst took (fake) time.
      expect(early).toEqual([]);
      expect(clock.now()).toBeGreaterThanOrEqual(Math.max(...retries));
      expect(clock.now() - start).toBeGreaterThanOrEqual(1000);
      const metrics = await registry.metrics();
      expect(metrics).toContain(
        `${METRIC.errors}{driver="ec2",operation="create",code="cloud.rate_limit"} ${THROTTLES}`,
      );
      expect(metrics).toContain(`${METRIC.operations}{driver="ec2",operation="create",error="0"} ${WANTED}`);
    });

    it("opens from config through the default registry (lazily loaded)", async () => {
      const registry = new Registry();
      const set = await openInstanceSet(
        {
          clusterId: "zzzzz",
          cloud: {
            driver: "ec2",
            driverParameters: {
              region: "us-east-1",
              endpoint: fake.url,
              accessKeyId: ACCESS_KEY,
              secretAccessKey: SECRET_KEY,
              subnetId: "subnet-0b",
            },
            tagKeyPrefix: "DispatchCloud",
            resourceTags: { Owner: "ops" },
            instanceSetId: "",
            maxCloudOpsPerSecond: 0,
          },
        },
        { drivers: createDefaultRegistry(), registry, clock: systemClock, logger: log.logger },
      );
      sets.push(set);
      const inst = await set.create(type(), IMAGE, { DispatchCloudInstanceType: "m5l" }, INIT, "");
      expect(fake.instances.get(inst.id)!.tags).toEqual({
        Owner: "ops",
        DispatchCloudInstanceType: "m5l",
        DispatchCloudInstanceSetID: "zzzzz",
      });
      fake.addInstances(1, { tags: { Owner: "ops" } });
      expect((await set.instances({})).map((i) => i.id)).toEqual([inst.id]);
      expect(calls("DescribeInstances").at(-1)!.params).toMatchObject({
        "Filter.1.Name": "tag:DispatchCloudInstanceSetID",
        "Filter.1.Value.1": "zzzzz",
      });
    });
  });
});

describe("ec2 driver with sshd-backed instances", () => {
  let dir: string;
  let fake: FakeEc2 | undefined;
  let set: InstanceSet | undefined;

  afterEach(async () => {
    await set?.stop();
    await fake?.stop();
    if (dir !== undefined) await rm(dir, { recursive: true, force: true });
  });

  it("the instance's private IP runs its own sshd, which admits the dispatcher's key as adminUsername", async () => {
    const user = requireOpenSsh();
    dir = await mkdtemp(path.join(tmpdir(), "ec2-driver-vms-"));
    await chmod(dir, 0o711); // The VMs' login user reaches its root under it.
    fake = await new FakeEc2({
      localVms: { stateDir: path.join(dir, "vms"), user, addressPrefix: "127.0.12." },
    }).start();
    set = await ec2Driver.instanceSet(
      {
        region: "us-east-1",
        endpoint: fake.url,
        accessKeyId: ACCESS_KEY,
        secretAccessKey: SECRET_KEY,
        subnetId: SUBNETS,
        adminUsername: user,
      },
      "zzzzz",
      {},
      {
        logger: createLogger({ level: "silent", format: "json" }),
        clock: systemClock,
        registry: new Registry(),
      },
    );
    const tags: Tags = { DispatchCloudInstanceSetID: "zzzzz" };
    const vms = set;
    const inst = await expectSshBackedInstance(
      vms,
      (init, publicKey) => vms.create(type(), IMAGE, tags, init, publicKey),
      { address: /^127\.0\.12\.\d+$/, listFilter: tags, user, what: "UserData" },
    );
    await inst.destroy();
    await waitFor("the instance to terminate", () => fake!.instances.get(inst.id)!.state === "terminated");
  });
});
