import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { pathToFileURL } from "node:url";
import { afterAll, describe, expect, it } from "vitest";
import { DispatchCloudError } from "../../lib/errors.ts";
import { EC2_DEFAULTS, parseEc2Parameters } from "./params.ts";

const SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
const KEY_ID = "AKIAIOSFODNN7EXAMPLE";

const dir = mkdtempSync(path.join(tmpdir(), "ec2-params-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function secretFile(name: string, content: string): string {
  const file = path.join(dir, name);
  writeFileSync(file, content, { mode: 0o600 });
  return pathToFileURL(file).href;
}

function errorOf(params: unknown, env: Record<string, string | undefined> = {}): DispatchCloudError {
  try {
    parseEc2Parameters(params, env);
  } catch (err) {
    if (err instanceof DispatchCloudError) return err;
    throw err;
  }
  throw new Error("expected an error");
}

describe("ec2 driver parameters", () => {
  it("needs only a region and fills in the defaults", () => {
    const p = parseEc2Parameters({ region: "us-east-1" }, {});
    expect(p).toEqual({
      region: "us-east-1",
      endpoint: undefined,
      securityGroupIds: [],
      subnetIds: [],
      adminUsername: "admin",
      iamInstanceProfile: undefined,
      ebsVolumeType: "gp3",
      ebsPrice: 0.08,
      spotPriceUpdateIntervalMs: 24 * 3_600_000,
      instanceTypeQuotaGroups: {},
      requestTimeoutMs: 30_000,
    });
    // No keys: the SDK's default credential chain.
    expect(p.credentials).toBeUndefined();
    expect(EC2_DEFAULTS.adminUsername).toBe(p.adminUsername);
  });

  it("takes every parameter", () => {
    const p = parseEc2Parameters(
      {
        region: "eu-west-2",
        endpoint: "http://127.0.0.1:4566",
        accessKeyId: KEY_ID,
        secretAccessKey: "env:EC2_SECRET",
        securityGroupIds: ["sg-01", "sg-02"],
        subnetId: ["subnet-0a", "subnet-0b"],
        adminUsername: "debian",
        iamInstanceProfile: "arn:aws:iam::123456789012:instance-profile/compute",
        ebsVolumeType: "gp2",
        ebsPrice: 0.1,
        spotPriceUpdateInterval: "1h",
        instanceTypeQuotaGroups: { M: "standard", p5: "gpu-big" },
        requestTimeout: "5s",
      },
      { EC2_SECRET: SECRET },
    );
    expect(p).toMatchObject({
      region: "eu-west-2",
      endpoint: "http://127.0.0.1:4566",
      securityGroupIds: ["sg-01", "sg-02"],
      subnetIds: ["subnet-0a", "subnet-0b"],
      adminUsername: "debian",
      iamInstanceProfile: { Arn: "arn:aws:iam::123456789012:instance-profile/compute" },
      ebsVolumeType: "gp2",
      ebsPrice: 0.1,
      spotPriceUpdateIntervalMs: 3_600_000,
      instanceTypeQuotaGroups: { m: "standard", p5: "gpu-big" },
      requestTimeoutMs: 5000,
    });
    expect(p.credentials).toEqual({ accessKeyId: KEY_ID, secretAccessKey: SECRET });
  });

  it("takes one subnet as a string, and a profile by name", () => {
    const p = parseEc2Parameters(
      { region: "us-east-1", subnetId: "subnet-0a", iamInstanceProfile: "compute-node" },
      {},
    );
    expect(p.subnetIds).toEqual(["subnet-0a"]);
    expect(p.iamInstanceProfile).toEqual({ Name: "compute-node" });
  });

  it("reads keys from file:// and env: references, and never shows them when logged or printed", () => {
    const p = parseEc2Parameters(
      {
        region: "us-east-1",
        accessKeyId: "env:EC2_KEY_ID",
        secretAccessKey: secretFile("secret", `${SECRET}\n`),
      },
      { EC2_KEY_ID: KEY_ID },
    );
    expect(p.credentials).toEqual({ accessKeyId: KEY_ID, secretAccessKey: SECRET });
    expect(JSON.stringify(p)).not.toContain(SECRET);
    expect(Object.keys(p)).not.toContain("credentials");
  });

  it("takes literal keys too", () => {
    const p = parseEc2Parameters({ region: "us-east-1", accessKeyId: KEY_ID, secretAccessKey: SECRET }, {});
    expect(p.credentials).toEqual({ accessKeyId: KEY_ID, secretAccessKey: SECRET });
  });

  it.each([
    [{}, "region", /required/],
    [{ region: "" }, "region", /region name/],
    [{ region: "us east" }, "region", /region name/],
    [{ region: 1 }, "region", /region name/],
    [{ region: "us-east-1", Region: "x" }, "Region", /not a parameter.*region, endpoint/],
    [{ region: "us-east-1", endpoint: "ftp://x" }, "endpoint", /http/],
    [{ region: "us-east-1", endpoint: "not a url" }, "endpoint", /http/],
    [{ region: "us-east-1", endpoint: 3 }, "endpoint", /http/],
    [{ region: "us-east-1", endpoint: "https://u:p@ec2.example" }, "endpoint", /user name or password/],
    [{ region: "us-east-1", accessKeyId: KEY_ID }, "secretAccessKey", /required with accessKeyId/],
    [{ region: "us-east-1", secretAccessKey: SECRET }, "accessKeyId", /required with secretAccessKey/],
    [{ region: "us-east-1", accessKeyId: "", secretAccessKey: SECRET }, "accessKeyId", /non-empty/],
    [{ region: "us-east-1", accessKeyId: KEY_ID, secretAccessKey: 5 }, "secretAccessKey", /non-empty/],
    [{ region: "us-east-1", securityGroupIds: "sg-1" }, "securityGroupIds", /list of ids/],
    [{ region: "us-east-1", securityGroupIds: ["sg-1", ""] }, "securityGroupIds.1", /id such as/],
    [{ region: "us-east-1", securityGroupIds: ["sg-1", "sg-1"] }, "securityGroupIds", /sg-1 twice/],
    [{ region: "us-east-1", subnetId: [] }, "subnetId", /at least one/],
    [{ region: "us-east-1", subnetId: 7 }, "subnetId", /list of ids/],
    [{ region: "us-east-1", subnetId: "subnet 1" }, "subnetId", /id such as/],
    [{ region: "us-east-1", subnetId: ["subnet-1", "subnet-1"] }, "subnetId", /twice/],
    [{ region: "us-east-1", adminUsername: "a b" }, "adminUsername", /user name/],
    [{ region: "us-east-1", adminUsername: "" }, "adminUsername", /user name/],
    [{ region: "us-east-1", iamInstanceProfile: "" }, "iamInstanceProfile", /name or ARN/],
    [{ region: "us-east-1", iamInstanceProfile: "a/b" }, "iamInstanceProfile", /profile name/],
    [{ region: "us-east-1", iamInstanceProfile: "arn:aws:iam::1:role/x" }, "iamInstanceProfile", /ARN/],
    [{ region: "us-east-1", ebsVolumeType: "io2" }, "ebsVolumeType", /gp3, gp2.*IOPS/],
    [{ region: "us-east-1", ebsPrice: -1 }, "ebsPrice", />= 0/],
    [{ region: "us-east-1", ebsPrice: "0.1" }, "ebsPrice", />= 0/],
    [{ region: "us-east-1", spotPriceUpdateInterval: 60 }, "spotPriceUpdateInterval", /unit/],
    [{ region: "us-east-1", spotPriceUpdateInterval: "0" }, "spotPriceUpdateInterval", /longer than 0/],
    [{ region: "us-east-1", spotPriceUpdateInterval: "daily" }, "spotPriceUpdateInterval", /duration/],
    [{ region: "us-east-1", requestTimeout: "0s" }, "requestTimeout", /longer than 0/],
    [{ region: "us-east-1", requestTimeout: "-5s" }, "requestTimeout", /negative/],
    [{ region: "us-east-1", instanceTypeQuotaGroups: ["m"] }, "instanceTypeQuotaGroups", /map/],
    [{ region: "us-east-1", instanceTypeQuotaGroups: { m: "" } }, "instanceTypeQuotaGroups.m", /group name/],
    [{ region: "us-east-1", instanceTypeQuotaGroups: { m: 1 } }, "instanceTypeQuotaGroups.m", /group name/],
    [{ region: "us-east-1", instanceTypeQuotaGroups: { "m*": "x" } }, "instanceTypeQuotaGroups.m*", /prefix/],
  ])("rejects %j with cloud.invalid_parameters at its path", (params, key, message) => {
    const err = errorOf(params);
    expect(err.code).toBe("cloud.invalid_parameters");
    expect(err.path).toBe(`cloud.driverParameters.${key}`);
    expect(err.message).toMatch(message);
  });

  it("rejects parameters that are not a map, or none at all", () => {
    expect(errorOf(["x"])).toMatchObject({
      code: "cloud.invalid_parameters",
      path: "cloud.driverParameters",
    });
    expect(errorOf("us-east-1")).toMatchObject({
      code: "cloud.invalid_parameters",
      path: "cloud.driverParameters",
    });
    expect(errorOf(undefined)).toMatchObject({
      code: "cloud.invalid_parameters",
      path: "cloud.driverParameters.region",
    });
  });

  describe("secret references that do not resolve", () => {
    const base = { region: "us-east-1", accessKeyId: KEY_ID };

    it.each([
      ["env:EC2_UNSET", {}, /EC2_UNSET is not set/],
      ["env:EC2_EMPTY", { EC2_EMPTY: "" }, /EC2_EMPTY is not set/],
      ["env:9BAD", {}, /env:NAME/],
      ["file://relative/path", {}, /file:\/\/\/absolute/],
      [`file://${dir}/missing`, {}, /cannot read secret file .*missing \(ENOENT\)/],
    ] as const)("%s -> cloud.invalid_parameters at secretAccessKey", (ref, env, message) => {
      const err = errorOf({ ...base, secretAccessKey: ref }, env);
      expect(err.code).toBe("cloud.invalid_parameters");
      expect(err.path).toBe("cloud.driverParameters.secretAccessKey");
      expect(err.message).toMatch(message);
    });

    it("an empty secret file is an error", () => {
      const err = errorOf({ ...base, secretAccessKey: secretFile("empty", "") });
      expect(err).toMatchObject({
        code: "cloud.invalid_parameters",
        path: "cloud.driverParameters.secretAccessKey",
      });
      expect(err.message).toMatch(/is empty/);
    });

    it("no error message carries a key's value", () => {
      const messages = [
        errorOf({ region: "us-east-1", secretAccessKey: SECRET }).message,
        errorOf({ region: "us-east-1", accessKeyId: SECRET, secretAccessKey: "env:NOPE" }).message,
        errorOf({ region: "us-east-1", accessKeyId: "env:NOPE", secretAccessKey: SECRET }).message,
        errorOf({ region: "us-east-1", accessKeyId: KEY_ID, secretAccessKey: SECRET, bad: SECRET }).message,
      ];
      for (const m of messages) expect(m).not.toContain(SECRET);
      expect(messages[2]).not.toContain(KEY_ID);
    });
  });
});
