/**
 * The fake EC2 endpoint (test/fake-ec2.ts) through the real @aws-sdk/client-ec2: every action's answers and
 * parameter checks, EC2's error XML as the SDK parses it, each fault, pagination over 2,500 instances, and
 * instances backed by local sshd VMs (reachable by private IP with the key pair's key, UserData run, IMDS
 * endpoint file written, gone once terminated).
 */
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import {
  CreateTagsCommand,
  DeleteTagsCommand,
  DescribeInstancesCommand,
  type DescribeInstancesCommandInput,
  type DescribeInstancesCommandOutput,
  DescribeKeyPairsCommand,
  DescribeSpotPriceHistoryCommand,
  EC2Client,
  type Instance as Ec2Instance,
  ImportKeyPairCommand,
  type ImportKeyPairCommandInput,
  paginateDescribeInstances,
  paginateDescribeSpotPriceHistory,
  RunInstancesCommand,
  type RunInstancesCommandInput,
  TerminateInstancesCommand,
} from "@aws-sdk/client-ec2";
import ssh2 from "ssh2";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { generateKeyPair } from "../lib/ssh-keys.ts";
import { ec2ErrorStatus, ec2ImportedKeyFingerprint, FakeEc2, vcpusOf } from "./fake-ec2.ts";
import { FakeImds } from "./fake-imds.ts";
import { connect, processesUnder, requireOpenSsh, run, waitFor } from "./local-driver-helpers.ts";

const ADDRESS_PREFIX = "127.0.12.";

function clientFor(fake: FakeEc2): EC2Client {
  return new EC2Client({
    endpoint: fake.url,
    region: "us-east-1",
    credentials: { accessKeyId: "AKIAFAKEEC2TEST", secretAccessKey: "fake-ec2-test-secret" },
    maxAttempts: 1,
  });
}

/** Awaits `p` expecting the SDK to throw EC2's error `code` with HTTP `status`; returns the error. */
async function ec2Error(p: Promise<unknown>, code: string, status = ec2ErrorStatus(code)) {
  let caught: unknown;
  try {
    await p;
  } catch (err) {
    caught = err;
  }
  expect(caught, `expected ${code}`).toBeInstanceOf(Error);
  const err = caught as Error & { $metadata?: { httpStatusCode?: number } };
  expect({ name: err.name, status: err.$metadata?.httpStatusCode }).toEqual({ name: code, status });
  return err;
}

const b64 = (s: string) => Buffer.from(s).toString("base64");

/** A RunInstances request as the ec2 driver sends it (record-only fakes: no key pair needed). */
function launch(over: Partial<RunInstancesCommandInput> = {}): RunInstancesCommandInput {
  return {
    ImageId: "ami-0123456789abcdef0",
    InstanceType: "m5.large",
    MinCount: 1,
    MaxCount: 1,
    UserData: b64("#!/bin/sh\necho hello\n"),
    NetworkInterfaces: [
      { DeviceIndex: 0, SubnetId: "subnet-0a", AssociatePublicIpAddress: false, Groups: ["sg-0a1"] },
    ],
    InstanceInitiatedShutdownBehavior: "terminate",
    MetadataOptions: { HttpTokens: "required", HttpEndpoint: "enabled" },
    TagSpecifications: [
      { ResourceType: "instance", Tags: [{ Key: "DispatchCloudInstanceSetID", Value: "zzzzz" }] },
      { ResourceType: "volume", Tags: [{ Key: "DispatchCloudInstanceSetID", Value: "zzzzz" }] },
    ],
    ...over,
  };
}

/** A raw EC2 Query request (for what the SDK never sends). */
async function rawRequest(fake: FakeEc2, body: Record<string, string>, auth = true) {
  const res = await fetch(fake.url, {
    method: "POST",
    headers: {
      "content-type": "application/x-www-form-urlencoded",
      ...(auth
        ? { authorization: "AWS4-HMAC-SHA256 Credential=AKIA/20260101/us-east-1/ec2/aws4_request" }
        : {}),
    },
    body: new URLSearchParams(body).toString(),
  });
  const text = await res.text();
  return { status: res.status, code: /<Code>([^<]*)<\/Code>/.exec(text)?.[1] ?? null, text };
}

const allInstances = (out: DescribeInstancesCommandOutput): Ec2Instance[] =>
  (out.Reservations ?? []).flatMap((r) => r.Instances ?? []);

describe("fake EC2 through the real SDK: instances", () => {
  let fake: FakeEc2;
  let ec2: EC2Client;

  beforeAll(async () => {
    fake = await new FakeEc2({ terminatedLingerMs: 600_000 }).start();
    ec2 = clientFor(fake);
  });
  afterAll(async () => {
    ec2?.destroy();
    await fake?.stop();
  });
  afterEach(() => fake.resetFaults());

  it("RunInstances: answers one pending instance and keeps what was asked for", async () => {
    const out = await ec2.send(
      new RunInstancesCommand(
        launch({
          InstanceType: "c5.2xlarge",
          NetworkInterfaces: [
            {
              DeviceIndex: 0,
              SubnetId: "subnet-0b",
              AssociatePublicIpAddress: false,
              Groups: ["sg-0a1", "sg-0b2"],
            },
          ],
          BlockDeviceMappings: [
            {
              DeviceName: "/dev/xvdt",
              Ebs: { VolumeSize: 50, VolumeType: "gp3", DeleteOnTermination: true },
            },
          ],
          IamInstanceProfile: { Name: "dispatch-worker" },
          InstanceMarketOptions: {
            MarketType: "spot",
            SpotOptions: {
              SpotInstanceType: "one-time",
              InstanceInterruptionBehavior: "terminate",
              MaxPrice: "0.34",
            },
          },
          TagSpecifications: [
            {
              ResourceType: "instance",
              Tags: [
                { Key: "DispatchCloudInstanceSetID", Value: "zzzzz" },
                { Key: "Padded", Value: "007" },
              ],
            },
            { ResourceType: "volume", Tags: [{ Key: "Owner", Value: "dispatch" }] },
          ],
        }),
      ),
    );
    expect(out.Instances).toHaveLength(1);
    const i = out.Instances![0]!;
    expect(out.ReservationId).toMatch(/^r-[0-9a-f]{17}$/);
    expect(out.OwnerId).toBe("123456789012");
    expect(i.InstanceId).toMatch(/^i-[0-9a-f]{17}$/);
    expect(i.State).toEqual({ Code: 0, Name: "pending" });
    expect(i.InstanceType).toBe("c5.2xlarge");
    expect(i.ImageId).toBe("ami-0123456789abcdef0");
    expect(i.SubnetId).toBe("subnet-0b");
    expect(i.Placement?.AvailabilityZone).toBe("us-east-1b");
    expect(i.PrivateIpAddress).toMatch(/^10\.1\.\d+\.\d+$/);
    expect(i.SecurityGroups?.map((g) => g.GroupId)).toEqual(["sg-0a1", "sg-0b2"]);
    expect(i.InstanceLifecycle).toBe("spot");
    expect(i.LaunchTime).toBeInstanceOf(Date);
    expect(i.Tags).toEqual([
      { Key: "DispatchCloudInstanceSetID", Value: "zzzzz" },
      { Key: "Padded", Value: "007" },
    ]);
    expect(i.MetadataOptions?.HttpTokens).toBe("required");
    expect(i.IamInstanceProfile?.Arn).toBe("arn:aws:iam::123456789012:instance-profile/dispatch-worker");
    expect(i.BlockDeviceMappings?.map((b) => b.DeviceName)).toEqual(["/dev/xvda", "/dev/xvdt"]);

    const rec = fake.instances.get(i.InstanceId!)!;
    expect(rec.state).toBe("running");
    expect(rec.privateIp).toBe(i.PrivateIpAddress);
    expect(rec.userData).toBe("#!/bin/sh\necho hello\n");
    expect(rec.keyName).toBeNull();
    expect(rec.tags).toEqual({ DispatchCloudInstanceSetID: "zzzzz", Padded: "007" });
    expect(rec.volumeTags).toEqual({ Owner: "dispatch" });
    expect(rec.spot).toEqual({ maxPrice: "0.34", interruptionBehavior: "terminate", type: "one-time" });
    expect(rec.params).toMatchObject({
      "MetadataOptions.HttpTokens": "required",
      "MetadataOptions.HttpEndpoint": "enabled",
      InstanceInitiatedShutdownBehavior: "terminate",
      "BlockDeviceMapping.1.DeviceName": "/dev/xvdt",
      "BlockDeviceMapping.1.Ebs.VolumeSize": "50",
      "BlockDeviceMapping.1.Ebs.VolumeType": "gp3",
      "IamInstanceProfile.Name": "dispatch-worker",
      "InstanceMarketOptions.MarketType": "spot",
      "InstanceMarketOptions.SpotOptions.MaxPrice": "0.34",
      "TagSpecification.2.ResourceType": "volume",
      "NetworkInterface.1.AssociatePublicIpAddress": "false",
      "NetworkInterface.1.SecurityGroupId.2": "sg-0b2",
    });

    const described = allInstances(
      await ec2.send(new DescribeInstancesCommand({ InstanceIds: [i.InstanceId!] })),
    );
    expect(described.map((d) => [d.InstanceId, d.State?.Name, d.PrivateIpAddress])).toEqual([
      [i.InstanceId, "running", i.PrivateIpAddress],
    ]);
    expect(described[0]!.NetworkInterfaces?.[0]?.PrivateIpAddress).toBe(i.PrivateIpAddress);
  });

  it("RunInstances: a retry with the same ClientToken gets the first instance; other parameters are refused", async () => {
    const first = await ec2.send(new RunInstancesCommand(launch({ ClientToken: "retry-me-1" })));
    const again = await ec2.send(new RunInstancesCommand(launch({ ClientToken: "retry-me-1" })));
    expect(again.Instances?.[0]?.InstanceId).toBe(first.Instances?.[0]?.InstanceId);
    await ec2Error(
      ec2.send(new RunInstancesCommand(launch({ ClientToken: "retry-me-1", InstanceType: "m5.xlarge" }))),
      "IdempotentParameterMismatch",
    );
  });

  const badLaunches: [string, string, Partial<RunInstancesCommandInput>][] = [
    ["no ImageId", "MissingParameter", { ImageId: undefined }],
    ["a malformed ImageId", "InvalidAMIID.Malformed", { ImageId: "image-1" }],
    ["no InstanceType", "MissingParameter", { InstanceType: undefined }],
    ["a malformed InstanceType", "InvalidParameterValue", { InstanceType: "huge" as never }],
    ["MinCount 2", "InvalidParameterValue", { MinCount: 2, MaxCount: 2 }],
    ["no network interface", "MissingParameter", { NetworkInterfaces: undefined }],
    ["an instance-level subnet as well", "InvalidParameterCombination", { SubnetId: "subnet-0a" }],
    [
      "an instance-level security group as well",
      "InvalidParameterCombination",
      { SecurityGroupIds: ["sg-0a1"] },
    ],
    [
      "two network interfaces",
      "InvalidParameterValue",
      {
        NetworkInterfaces: [
          { DeviceIndex: 0, SubnetId: "subnet-0a", AssociatePublicIpAddress: false },
          { DeviceIndex: 1, SubnetId: "subnet-0a", AssociatePublicIpAddress: false },
        ],
      },
    ],
    [
      "DeviceIndex 1",
      "InvalidParameterValue",
      { NetworkInterfaces: [{ DeviceIndex: 1, SubnetId: "subnet-0a", AssociatePublicIpAddress: false }] },
    ],
    [
      "a public IP",
      "InvalidParameterValue",
      { NetworkInterfaces: [{ DeviceIndex: 0, SubnetId: "subnet-0a", AssociatePublicIpAddress: true }] },
    ],
    [
      "AssociatePublicIpAddress left out",
      "InvalidParameterValue",
      { NetworkInterfaces: [{ DeviceIndex: 0, SubnetId: "subnet-0a" }] },
    ],
    [
      "an unknown subnet",
      "InvalidSubnetID.NotFound",
      { NetworkInterfaces: [{ DeviceIndex: 0, SubnetId: "subnet-0zz", AssociatePublicIpAddress: false }] },
    ],
    [
      "a malformed security group",
      "InvalidGroupId.Malformed",
      {
        NetworkInterfaces: [
          { DeviceIndex: 0, SubnetId: "subnet-0a", AssociatePublicIpAddress: false, Groups: ["default"] },
        ],
      },
    ],
    ["an unknown key pair", "InvalidKeyPair.NotFound", { KeyName: "nobody" }],
    ["UserData that is not base64", "InvalidParameterValue", { UserData: "echo hello" }],
    ["UserData over 16 KiB", "InvalidParameterValue", { UserData: b64("x".repeat(16 * 1024 + 1)) }],
    [
      "a bad shutdown behaviour",
      "InvalidParameterValue",
      { InstanceInitiatedShutdownBehavior: "explode" as never },
    ],
    ["a bad HttpTokens", "InvalidParameterValue", { MetadataOptions: { HttpTokens: "maybe" as never } }],
    ["a hop limit of 65", "InvalidParameterValue", { MetadataOptions: { HttpPutResponseHopLimit: 65 } }],
    [
      "spot options without a market type",
      "MissingParameter",
      { InstanceMarketOptions: { SpotOptions: { MaxPrice: "0.1" } } },
    ],
    [
      "a spot stop behaviour on a one-time request",
      "InvalidParameterCombination",
      {
        InstanceMarketOptions: {
          MarketType: "spot",
          SpotOptions: { SpotInstanceType: "one-time", InstanceInterruptionBehavior: "stop" },
        },
      },
    ],
    [
      "a negative spot price",
      "InvalidParameterValue",
      { InstanceMarketOptions: { MarketType: "spot", SpotOptions: { MaxPrice: "-1" } } },
    ],
    [
      "an unknown tag resource type",
      "InvalidParameterValue",
      { TagSpecifications: [{ ResourceType: "bucket" as never, Tags: [] }] },
    ],
    [
      "a reserved tag key",
      "InvalidParameterValue",
      { TagSpecifications: [{ ResourceType: "instance", Tags: [{ Key: "aws:owner", Value: "x" }] }] },
    ],
    [
      "a tag without a key",
      "MissingParameter",
      { TagSpecifications: [{ ResourceType: "instance", Tags: [{ Value: "x" }] }] },
    ],
    [
      "a volume of 0 GiB",
      "InvalidParameterValue",
      { BlockDeviceMappings: [{ DeviceName: "/dev/xvdt", Ebs: { VolumeSize: 0 } }] },
    ],
    [
      "a block device without a name",
      "MissingParameter",
      { BlockDeviceMappings: [{ Ebs: { VolumeSize: 10 } }] },
    ],
    [
      "an instance profile by name and ARN",
      "InvalidParameterCombination",
      { IamInstanceProfile: { Name: "a", Arn: "arn:aws:iam::123456789012:instance-profile/a" } },
    ],
    [
      "a malformed instance profile ARN",
      "InvalidParameterValue",
      { IamInstanceProfile: { Arn: "profile-a" } },
    ],
    ["DryRun", "DryRunOperation", { DryRun: true }],
  ];
  it.each(badLaunches)("RunInstances with %s is refused: %s, creating nothing", async (_what, code, over) => {
    const before = fake.instances.size;
    const err = await ec2Error(ec2.send(new RunInstancesCommand(launch(over))), code);
    expect(err.message.length).toBeGreaterThan(0);
    expect(fake.instances.size).toBe(before);
  });

  it("RunInstances without a subnet launches in the default VPC's default subnet; without a default VPC it is refused", async () => {
    const noSubnet = launch({ NetworkInterfaces: [{ DeviceIndex: 0, AssociatePublicIpAddress: false }] });
    const out = await ec2.send(new RunInstancesCommand(noSubnet));
    const i = out.Instances![0]!;
    expect(i.SubnetId).toBe("subnet-0a");
    expect(i.Placement?.AvailabilityZone).toBe("us-east-1a");
    expect(i.PrivateIpAddress).toMatch(/^10\.0\./);

    const elsewhere = await new FakeEc2({ defaultSubnet: "subnet-0c" }).start();
    const none = await new FakeEc2({ defaultSubnet: null }).start();
    const [c1, c2] = [clientFor(elsewhere), clientFor(none)];
    try {
      expect((await c1.send(new RunInstancesCommand(noSubnet))).Instances?.[0]?.SubnetId).toBe("subnet-0c");
      const err = await ec2Error(c2.send(new RunInstancesCommand(noSubnet)), "VPCIdNotSpecified", 400);
      expect(err.message).toMatch(/^No default VPC for this user/);
      expect(none.instances.size).toBe(0);
      // A subnet named still works there.
      await c2.send(new RunInstancesCommand(launch()));
    } finally {
      c1.destroy();
      c2.destroy();
      await elsewhere.stop();
      await none.stop();
    }
    expect(() => new FakeEc2({ defaultSubnet: "subnet-0zz" })).toThrow(/not one of the subnets/);
  });

  it("DescribeInstances: filters by tag, tag key, state and id, with wildcards", async () => {
    const [a, b] = fake.addInstances(2, { tags: { Set: "filters", Role: "worker" } });
    const [c] = fake.addInstances(1, { tags: { Set: "filters", Role: "head" }, type: "m5.xlarge" });
    const [gone] = fake.addInstances(1, { tags: { Set: "filters", Role: "worker" }, state: "shutting-down" });
    const ids = async (input: DescribeInstancesCommandInput) =>
      allInstances(await ec2.send(new DescribeInstancesCommand(input)))
        .map((i) => i.InstanceId)
        .sort();
    const sorted = (...xs: { id: string }[]) => xs.map((x) => x.id).sort();

    expect(await ids({ Filters: [{ Name: "tag:Set", Values: ["filters"] }] })).toEqual(
      sorted(a!, b!, c!, gone!),
    );
    expect(
      await ids({
        Filters: [
          { Name: "tag:Set", Values: ["filters"] },
          { Name: "tag:Role", Values: ["worker"] },
          { Name: "instance-state-name", Values: ["pending", "running"] },
        ],
      }),
    ).toEqual(sorted(a!, b!));
    expect(
      await ids({
        Filters: [
          { Name: "tag:Set", Values: ["filt*"] },
          { Name: "tag:Role", Values: ["h?ad"] },
        ],
      }),
    ).toEqual(sorted(c!));
    expect(
      await ids({
        Filters: [
          { Name: "tag:Set", Values: ["filters"] },
          { Name: "tag-key", Values: ["Role"] },
        ],
      }),
    ).toHaveLength(4);
    expect(await ids({ Filters: [{ Name: "tag-key", Values: ["NoSuchKey"] }] })).toEqual([]);
    expect(await ids({ Filters: [{ Name: "instance-id", Values: [a!.id, c!.id] }] })).toEqual(sorted(a!, c!));
    expect(
      await ids({
        InstanceIds: [a!.id, b!.id, c!.id],
        Filters: [{ Name: "instance-type", Values: ["m5.xlarge"] }],
      }),
    ).toEqual(sorted(c!));
    expect(
      await ids({
        Filters: [
          { Name: "tag:Set", Values: ["filters"] },
          { Name: "instance-state-code", Values: ["32"] },
        ],
      }),
    ).toEqual(sorted(gone!));
  });

  it("DescribeInstances: refuses bad filters, MaxResults, ids and tokens", async () => {
    const [a] = fake.addInstances(6, {});
    const send = (input: DescribeInstancesCommandInput) => ec2.send(new DescribeInstancesCommand(input));
    await ec2Error(send({ Filters: [{ Name: "colour", Values: ["red"] }] }), "InvalidParameterValue");
    await ec2Error(send({ Filters: [{ Name: "tag:Set", Values: [] }] }), "InvalidParameterValue");
    await ec2Error(send({ MaxResults: 4 }), "InvalidParameterValue");
    await ec2Error(send({ MaxResults: 1001 }), "InvalidParameterValue");
    await ec2Error(send({ MaxResults: 5, InstanceIds: [a!.id] }), "InvalidParameterCombination");
    await ec2Error(send({ InstanceIds: ["i-0123456789abcdef0"] }), "InvalidInstanceID.NotFound");
    await ec2Error(send({ InstanceIds: ["instance-1"] }), "InvalidInstanceID.Malformed");
    await ec2Error(send({ MaxResults: 5, NextToken: "not-a-token" }), "InvalidPaginationToken");
    const page = await send({ MaxResults: 5 });
    expect(page.NextToken).toBeDefined();
    // A token only continues the listing it came from.
    await ec2Error(
      send({ MaxResults: 5, NextToken: page.NextToken!, Filters: [{ Name: "tag-key", Values: ["x"] }] }),
      "InvalidPaginationToken",
    );
    await ec2Error(send({ DryRun: true }), "DryRunOperation");
  });

  it("DescribeInstances: pages through 2,500 instances, 1,000 at a time, and lists all without MaxResults", async () => {
    const made = fake.addInstances(2500, { tags: { Set: "big", Padded: "0042" } });
    fake.addInstances(3, { tags: { Set: "other" } });
    const filters = [{ Name: "tag:Set", Values: ["big"] }];
    const pages: number[] = [];
    const seen: string[] = [];
    for await (const page of paginateDescribeInstances(
      { client: ec2 },
      { Filters: filters, MaxResults: 1000 },
    )) {
      const insts = allInstances(page);
      pages.push(insts.length);
      for (const i of insts) {
        seen.push(i.InstanceId!);
        expect(i.Tags).toContainEqual({ Key: "Padded", Value: "0042" });
      }
    }
    expect(pages).toEqual([1000, 1000, 500]);
    expect(new Set(seen).size).toBe(2500);
    expect(new Set(seen)).toEqual(new Set(made.map((m) => m.id)));
    const calls = fake.calls.filter((c) => c.action === "DescribeInstances").slice(-3);
    expect(calls.map((c) => c.params["NextToken"] !== undefined)).toEqual([false, true, true]);

    const all = await ec2.send(new DescribeInstancesCommand({ Filters: filters }));
    expect(allInstances(all)).toHaveLength(2500);
    expect(all.NextToken).toBeUndefined();
  });

  it("CreateTags and DeleteTags: add, overwrite, delete by key or by key and value, or all", async () => {
    const [a, b] = fake.addInstances(2, { tags: { Keep: "yes" } });
    await ec2.send(
      new CreateTagsCommand({
        Resources: [a!.id, b!.id],
        Tags: [
          { Key: "IdleBehavior", Value: "run" },
          { Key: "Empty", Value: "" },
        ],
      }),
    );
    await ec2.send(
      new CreateTagsCommand({ Resources: [a!.id], Tags: [{ Key: "IdleBehavior", Value: "hold" }] }),
    );
    expect(fake.instances.get(a!.id)!.tags).toEqual({ Keep: "yes", IdleBehavior: "hold", Empty: "" });
    expect(fake.instances.get(b!.id)!.tags).toEqual({ Keep: "yes", IdleBehavior: "run", Empty: "" });
    const described = allInstances(await ec2.send(new DescribeInstancesCommand({ InstanceIds: [a!.id] })));
    expect(described[0]?.Tags).toContainEqual({ Key: "IdleBehavior", Value: "hold" });

    // A value that does not match keeps the tag; a key alone deletes whatever the value.
    await ec2.send(
      new DeleteTagsCommand({ Resources: [a!.id], Tags: [{ Key: "IdleBehavior", Value: "run" }] }),
    );
    expect(fake.instances.get(a!.id)!.tags["IdleBehavior"]).toBe("hold");
    await ec2.send(new DeleteTagsCommand({ Resources: [a!.id], Tags: [{ Key: "IdleBehavior" }] }));
    await ec2.send(
      new DeleteTagsCommand({ Resources: [b!.id], Tags: [{ Key: "IdleBehavior", Value: "run" }] }),
    );
    expect(fake.instances.get(a!.id)!.tags).toEqual({ Keep: "yes", Empty: "" });
    expect(fake.instances.get(b!.id)!.tags).toEqual({ Keep: "yes", Empty: "" });
    await ec2.send(new DeleteTagsCommand({ Resources: [b!.id] }));
    expect(fake.instances.get(b!.id)!.tags).toEqual({});
  });

  it("CreateTags and DeleteTags: refuse unknown instances (changing nothing), bad tags and missing parameters", async () => {
    const [a] = fake.addInstances(1, { tags: { Keep: "yes" } });
    await ec2Error(
      ec2.send(
        new CreateTagsCommand({
          Resources: [a!.id, "i-0123456789abcdef0"],
          Tags: [{ Key: "X", Value: "1" }],
        }),
      ),
      "InvalidInstanceID.NotFound",
    );
    expect(fake.instances.get(a!.id)!.tags).toEqual({ Keep: "yes" });
    await ec2Error(
      ec2.send(new DeleteTagsCommand({ Resources: ["i-0123456789abcdef0"], Tags: [{ Key: "Keep" }] })),
      "InvalidInstanceID.NotFound",
    );
    await ec2Error(
      ec2.send(new CreateTagsCommand({ Resources: [], Tags: [{ Key: "X", Value: "1" }] })),
      "MissingParameter",
    );
    await ec2Error(ec2.send(new CreateTagsCommand({ Resources: [a!.id], Tags: [] })), "MissingParameter");
    await ec2Error(
      ec2.send(new CreateTagsCommand({ Resources: ["vol-0123"], Tags: [{ Key: "X", Value: "1" }] })),
      "InvalidID",
    );
    await ec2Error(
      ec2.send(new CreateTagsCommand({ Resources: [a!.id], Tags: [{ Key: "aws:x", Value: "1" }] })),
      "InvalidParameterValue",
    );
    await ec2Error(
      ec2.send(new CreateTagsCommand({ Resources: [a!.id], Tags: [{ Key: "k".repeat(129), Value: "1" }] })),
      "InvalidParameterValue",
    );
    const many = Array.from({ length: 50 }, (_, i) => ({ Key: `T${i}`, Value: "v" }));
    await ec2Error(ec2.send(new CreateTagsCommand({ Resources: [a!.id], Tags: many })), "TagLimitExceeded");
    expect(fake.instances.get(a!.id)!.tags).toEqual({ Keep: "yes" });
  });

  it("TerminateInstances: running -> shutting-down in the answer, then terminated and still listed", async () => {
    const out = await ec2.send(new RunInstancesCommand(launch()));
    const id = out.Instances![0]!.InstanceId!;
    const t = await ec2.send(new TerminateInstancesCommand({ InstanceIds: [id] }));
    expect(t.TerminatingInstances).toEqual([
      {
        InstanceId: id,
        PreviousState: { Code: 16, Name: "running" },
        CurrentState: { Code: 32, Name: "shutting-down" },
      },
    ]);
    expect(fake.instances.get(id)!.state).toBe("terminated");
    const again = await ec2.send(new TerminateInstancesCommand({ InstanceIds: [id] }));
    expect(again.TerminatingInstances?.[0]?.CurrentState?.Name).toBe("terminated");
    const listed = allInstances(
      await ec2.send(new DescribeInstancesCommand({ Filters: [{ Name: "instance-id", Values: [id] }] })),
    );
    expect(listed.map((i) => [i.State?.Name, i.StateReason?.Code])).toEqual([
      ["terminated", "Client.UserInitiatedShutdown"],
    ]);
  });

  it("a terminated instance leaves the listing and the API after terminatedLingerMs; its record stays", async () => {
    const brief = await new FakeEc2({ terminatedLingerMs: 50 }).start();
    const client = clientFor(brief);
    try {
      const id = (await client.send(new RunInstancesCommand(launch()))).Instances![0]!.InstanceId!;
      await client.send(new TerminateInstancesCommand({ InstanceIds: [id] }));
      await waitFor("the terminated instance to leave the listing", async () => {
        const r = await client.send(new DescribeInstancesCommand({}));
        return allInstances(r).length === 0;
      });
      await ec2Error(
        client.send(new DescribeInstancesCommand({ InstanceIds: [id] })),
        "InvalidInstanceID.NotFound",
      );
      await ec2Error(
        client.send(new TerminateInstancesCommand({ InstanceIds: [id] })),
        "InvalidInstanceID.NotFound",
      );
      expect(brief.instances.get(id)?.state).toBe("terminated");
    } finally {
      client.destroy();
      await brief.stop();
    }
  });

  it("TerminateInstances: refuses unknown, malformed and missing ids, terminating none of them", async () => {
    const [a] = fake.addInstances(1, {});
    await ec2Error(
      ec2.send(new TerminateInstancesCommand({ InstanceIds: [a!.id, "i-0123456789abcdef0"] })),
      "InvalidInstanceID.NotFound",
    );
    expect(fake.instances.get(a!.id)!.state).toBe("running");
    await ec2Error(
      ec2.send(new TerminateInstancesCommand({ InstanceIds: ["i-x"] })),
      "InvalidInstanceID.Malformed",
    );
    await ec2Error(ec2.send(new TerminateInstancesCommand({ InstanceIds: [] })), "MissingParameter");
    await ec2Error(
      ec2.send(new TerminateInstancesCommand({ InstanceIds: [a!.id], DryRun: true })),
      "DryRunOperation",
    );
    expect(fake.instances.get(a!.id)!.state).toBe("running");
  });

  it("answers requests without a SigV4 Authorization header, unknown actions and versions with EC2's errors", async () => {
    const version = { Version: "2016-11-15" };
    expect(await rawRequest(fake, { Action: "DescribeInstances", ...version }, false)).toMatchObject({
      status: 401,
      code: "AuthFailure",
    });
    const ok = await rawRequest(fake, { Action: "DescribeInstances", ...version });
    expect(ok.status).toBe(200);
    expect(ok.text).toMatch(
      /^<\?xml[^>]*>\s*<DescribeInstancesResponse xmlns="http:\/\/ec2\.amazonaws\.com\/doc\/2016-11-15\/">/,
    );
    expect(ok.text).toMatch(/<requestId>[^<]+<\/requestId>/);
    const bad = await rawRequest(fake, { Action: "LaunchRockets", ...version });
    expect(bad).toMatchObject({ status: 400, code: "InvalidAction" });
    expect(bad.text).toMatch(
      /^<\?xml[^>]*>\s*<Response><Errors><Error><Code>InvalidAction<\/Code><Message>[^<]+<\/Message><\/Error><\/Errors><RequestID>[^<]+<\/RequestID><\/Response>$/,
    );
    expect(await rawRequest(fake, { ...version })).toMatchObject({ status: 400, code: "MissingAction" });
    expect(await rawRequest(fake, { Action: "DescribeInstances" })).toMatchObject({
      status: 400,
      code: "MissingParameter",
    });
    expect(await rawRequest(fake, { Action: "DescribeInstances", Version: "2014-01-01" })).toMatchObject({
      status: 400,
      code: "NoSuchVersion",
    });
    const recorded = fake.calls.at(-1)!;
    expect(recorded).toMatchObject({ action: "DescribeInstances", status: 400, code: "NoSuchVersion" });
  });

  describe("faults", () => {
    it("next: one-shot errors for one action or any, with EC2's status or the one given", async () => {
      fake.faults.next.push(
        { action: "DescribeInstances", code: "Unavailable" },
        { action: "*", code: "InternalFailure" },
        { action: "CreateTags", code: "Custom.Thing", status: 409, message: "told to fail" },
      );
      await ec2Error(ec2.send(new DescribeInstancesCommand({})), "Unavailable", 503);
      await ec2Error(ec2.send(new DescribeKeyPairsCommand({})), "InternalFailure", 500);
      await ec2.send(new DescribeInstancesCommand({}));
      const [a] = fake.addInstances(1, {});
      const err = await ec2Error(
        ec2.send(new CreateTagsCommand({ Resources: [a!.id], Tags: [{ Key: "k", Value: "v" }] })),
        "Custom.Thing",
        409,
      );
      expect(err.message).toBe("told to fail");
      expect(fake.faults.next).toEqual([]);
      await ec2.send(new CreateTagsCommand({ Resources: [a!.id], Tags: [{ Key: "k", Value: "v" }] }));
    });

    it("throttleRate 1: every request is 503 RequestLimitExceeded; 0: none", async () => {
      fake.faults.throttleRate = 1;
      await ec2Error(ec2.send(new DescribeInstancesCommand({})), "RequestLimitExceeded", 503);
      await ec2Error(ec2.send(new RunInstancesCommand(launch())), "RequestLimitExceeded", 503);
      await ec2Error(ec2.send(new DescribeKeyPairsCommand({})), "RequestLimitExceeded", 503);
      fake.faults.throttleRate = 0;
      await ec2.send(new DescribeInstancesCommand({}));
    });

    it("throttleRate 0.5: some requests are throttled and some are not", async () => {
      fake.faults.throttleRate = 0.5;
      const outcomes = new Set<string>();
      await waitFor("both throttled and answered requests", async () => {
        try {
          await ec2.send(new DescribeKeyPairsCommand({}));
          outcomes.add("ok");
        } catch (err) {
          outcomes.add((err as Error).name);
        }
        return outcomes.size === 2;
      });
      expect(outcomes).toEqual(new Set(["ok", "RequestLimitExceeded"]));
    });

    it("serverErrorRate 1: every request is 500 InternalError", async () => {
      fake.faults.serverErrorRate = 1;
      await ec2Error(ec2.send(new DescribeInstancesCommand({})), "InternalError", 500);
      await ec2Error(
        ec2.send(new TerminateInstancesCommand({ InstanceIds: ["i-0123456789abcdef0"] })),
        "InternalError",
        500,
      );
    });

    it("applies one-shots before throttling, and throttling before server errors", async () => {
      fake.faults.throttleRate = 1;
      fake.faults.serverErrorRate = 1;
      fake.faults.next.push({ action: "*", code: "Unavailable" });
      await ec2Error(ec2.send(new DescribeInstancesCommand({})), "Unavailable", 503);
      await ec2Error(ec2.send(new DescribeInstancesCommand({})), "RequestLimitExceeded", 503);
    });

    it("slowMs: answers wait (a client that gives up first gets nothing); without it they come at once", async () => {
      fake.faults.slowMs = 600_000;
      const impatient = new EC2Client({
        endpoint: fake.url,
        region: "us-east-1",
        credentials: { accessKeyId: "AKIAFAKEEC2TEST", secretAccessKey: "fake-ec2-test-secret" },
        maxAttempts: 1,
        requestHandler: { requestTimeout: 300, throwOnRequestTimeout: true },
      });
      try {
        const err = await impatient.send(new DescribeKeyPairsCommand({})).catch((e: unknown) => e as Error);
        expect(err).toBeInstanceOf(Error);
        expect((err as Error).name).toBe("TimeoutError");
        fake.faults.slowMs = 20;
        expect((await impatient.send(new DescribeKeyPairsCommand({}))).KeyPairs).toEqual([]);
      } finally {
        impatient.destroy();
      }
    });

    it("subnetErrors: every RunInstances in that subnet gets the code and its status; other subnets work", async () => {
      const codes = [
        "InsufficientFreeAddressesInSubnet",
        "InsufficientAddressCapacity",
        "InsufficientInstanceCapacity",
        "Unsupported",
        "InvalidSubnetID.NotFound",
      ];
      const inA = launch();
      const inB = launch({
        NetworkInterfaces: [{ DeviceIndex: 0, SubnetId: "subnet-0b", AssociatePublicIpAddress: false }],
      });
      for (const code of codes) {
        fake.faults.subnetErrors.set("subnet-0a", code);
        await ec2Error(ec2.send(new RunInstancesCommand(inA)), code, ec2ErrorStatus(code));
        const ok = await ec2.send(new RunInstancesCommand(inB));
        expect(ok.Instances?.[0]?.SubnetId).toBe("subnet-0b");
      }
      expect(ec2ErrorStatus("InsufficientAddressCapacity")).toBe(500);
      expect(ec2ErrorStatus("InsufficientFreeAddressesInSubnet")).toBe(400);
      // Other actions in that subnet's instances are not affected.
      await ec2.send(
        new DescribeInstancesCommand({ Filters: [{ Name: "subnet-id", Values: ["subnet-0a"] }] }),
      );
    });

    it("typesAtCapacity: 500 InsufficientInstanceCapacity for those types only", async () => {
      fake.faults.typesAtCapacity.add("p3.2xlarge");
      await ec2Error(
        ec2.send(new RunInstancesCommand(launch({ InstanceType: "p3.2xlarge" }))),
        "InsufficientInstanceCapacity",
        500,
      );
      await ec2.send(new RunInstancesCommand(launch({ InstanceType: "p3.8xlarge" })));
    });

    it("maxInstances: pending and running instances count; a terminated one frees its place", async () => {
      const live = [...fake.instances.values()].filter((i) => i.state === "running" || i.state === "pending");
      fake.faults.maxInstances = live.length + 2;
      const a = await ec2.send(new RunInstancesCommand(launch()));
      await ec2.send(new RunInstancesCommand(launch()));
      await ec2Error(ec2.send(new RunInstancesCommand(launch())), "InstanceLimitExceeded", 400);
      await ec2.send(new TerminateInstancesCommand({ InstanceIds: [a.Instances![0]!.InstanceId!] }));
      await ec2.send(new RunInstancesCommand(launch()));
    });

    it("vcpuLimit: counts vCPUs of pending and running instances by type", async () => {
      expect([
        vcpusOf("t3.small"),
        vcpusOf("m5.large"),
        vcpusOf("m5.xlarge"),
        vcpusOf("c5.2xlarge"),
        vcpusOf("p3.2xlarge"),
        vcpusOf("c5.24xlarge"),
      ]).toEqual([2, 2, 4, 8, 8, 96]);
      const used = [...fake.instances.values()]
        .filter((i) => i.state === "running" || i.state === "pending")
        .reduce((sum, i) => sum + vcpusOf(i.type), 0);
      fake.faults.vcpuLimit = used + 8;
      await ec2.send(new RunInstancesCommand(launch({ InstanceType: "m5.xlarge" })));
      await ec2.send(new RunInstancesCommand(launch({ InstanceType: "m5.large" })));
      await ec2Error(
        ec2.send(new RunInstancesCommand(launch({ InstanceType: "m5.xlarge" }))),
        "VcpuLimitExceeded",
        400,
      );
      await ec2.send(new RunInstancesCommand(launch({ InstanceType: "t3.small" })));
      await ec2Error(
        ec2.send(new RunInstancesCommand(launch({ InstanceType: "t3.small" }))),
        "VcpuLimitExceeded",
        400,
      );
    });

    it.each([
      [
        "InsufficientFreeAddressesInSubnet",
        "InsufficientFreeAddressesInSubnet",
        /^There are not enough free addresses in subnet 'subnet-0a'/,
      ],
      ["not-enough", "InvalidParameterValue", /^Not enough free addresses in subnet subnet-0a/],
      ["ipv4", "InvalidParameterValue", /^There aren't sufficient free Ipv4 addresses or prefixes$/],
    ] as const)(
      "fullSubnets (%s): a launch there is refused as EC2 says it; other subnets work",
      async (style, code, message) => {
        fake.faults.fullSubnets.set("subnet-0a", style);
        const err = await ec2Error(ec2.send(new RunInstancesCommand(launch())), code, 400);
        expect(err.message).toMatch(message);
        const inB = launch({
          NetworkInterfaces: [{ DeviceIndex: 0, SubnetId: "subnet-0b", AssociatePublicIpAddress: false }],
        });
        expect((await ec2.send(new RunInstancesCommand(inB))).Instances?.[0]?.SubnetId).toBe("subnet-0b");
      },
    );

    it("typesNotInZone: Unsupported naming the type and the zone, only in those subnets", async () => {
      fake.faults.typesNotInZone.set("m5.large", new Set(["subnet-0a"]));
      const err = await ec2Error(ec2.send(new RunInstancesCommand(launch())), "Unsupported", 400);
      expect(err.message).toBe(
        "Your requested instance type (m5.large) is not supported in your requested Availability Zone " +
          "(us-east-1a). Please retry your request by not specifying an Availability Zone or choosing " +
          "us-east-1b, us-east-1c.",
      );
      await ec2.send(new RunInstancesCommand(launch({ InstanceType: "m5.xlarge" })));
    });

    it("unsupportedSpotTypes: a spot request of the type is an Unsupported configuration; on-demand works", async () => {
      fake.faults.unsupportedSpotTypes.add("m5.large");
      const spot = launch({ InstanceMarketOptions: { MarketType: "spot" } });
      const err = await ec2Error(ec2.send(new RunInstancesCommand(spot)), "Unsupported", 400);
      expect(err.message).toMatch(/^The requested configuration is currently not supported\./);
      expect(err.message).not.toContain("m5.large");
      await ec2.send(new RunInstancesCommand(launch()));
    });

    it("maxSpotInstances: spot instances beyond it are MaxSpotInstanceCountExceeded; on-demand ones are not counted", async () => {
      const liveSpot = [...fake.instances.values()].filter(
        (i) => i.spot !== null && (i.state === "running" || i.state === "pending"),
      ).length;
      fake.faults.maxSpotInstances = liveSpot + 1;
      const spot = launch({ InstanceMarketOptions: { MarketType: "spot" } });
      await ec2.send(new RunInstancesCommand(spot));
      const err = await ec2Error(
        ec2.send(new RunInstancesCommand(spot)),
        "MaxSpotInstanceCountExceeded",
        400,
      );
      expect(err.message).toBe("Max spot instance count exceeded");
      await ec2.send(new RunInstancesCommand(launch()));
    });

    it("missingImages: InvalidAMIID.NotFound naming the image, creating nothing", async () => {
      fake.faults.missingImages.add("ami-0123456789abcdef0");
      const before = fake.instances.size;
      const err = await ec2Error(ec2.send(new RunInstancesCommand(launch())), "InvalidAMIID.NotFound", 400);
      expect(err.message).toBe("The image id '[ami-0123456789abcdef0]' does not exist");
      expect(fake.instances.size).toBe(before);
      await ec2.send(new RunInstancesCommand(launch({ ImageId: "ami-0another" })));
    });

    it("terminatedCountMs: terminated instances still count toward maxInstances for that long", async () => {
      // Its own endpoint: the shared one holds instances terminated by other tests.
      const own = await new FakeEc2({ terminatedLingerMs: 0 }).start();
      const client = clientFor(own);
      try {
        own.faults.maxInstances = 1;
        own.faults.terminatedCountMs = 600_000;
        const a = (await client.send(new RunInstancesCommand(launch()))).Instances![0]!.InstanceId!;
        await client.send(new TerminateInstancesCommand({ InstanceIds: [a] }));
        expect(own.instances.get(a)!.state).toBe("terminated");
        // Gone from the API (terminatedLingerMs 0), yet counted.
        await ec2Error(
          client.send(new DescribeInstancesCommand({ InstanceIds: [a] })),
          "InvalidInstanceID.NotFound",
        );
        const err = await ec2Error(
          client.send(new RunInstancesCommand(launch())),
          "InstanceLimitExceeded",
          400,
        );
        expect(err.message).toMatch(/0 pending or running, 1 recently terminated/);
        own.faults.terminatedCountMs = 0;
        await client.send(new RunInstancesCommand(launch()));
      } finally {
        client.destroy();
        await own.stop();
      }
    });

    it("listDelayMs: a new instance is missing from DescribeInstances (listed and by id) until the delay has passed", async () => {
      fake.faults.listDelayMs = 600_000;
      const id = (await ec2.send(new RunInstancesCommand(launch({ InstanceType: "t3.nano" })))).Instances![0]!
        .InstanceId!;
      const byType = { Filters: [{ Name: "instance-type", Values: ["t3.nano"] }] };
      expect(allInstances(await ec2.send(new DescribeInstancesCommand(byType)))).toEqual([]);
      await ec2Error(
        ec2.send(new DescribeInstancesCommand({ InstanceIds: [id] })),
        "InvalidInstanceID.NotFound",
      );
      // Older instances are listed as ever; other calls know the new one.
      expect(allInstances(await ec2.send(new DescribeInstancesCommand({}))).length).toBeGreaterThan(0);
      await ec2.send(new CreateTagsCommand({ Resources: [id], Tags: [{ Key: "k", Value: "v" }] }));
      fake.faults.listDelayMs = 0;
      expect(
        allInstances(await ec2.send(new DescribeInstancesCommand(byType))).map((i) => i.InstanceId),
      ).toEqual([id]);
    });

    it("tagNotFoundMs: CreateTags and DeleteTags on a new instance answer InvalidInstanceID.NotFound, changing nothing", async () => {
      const [old] = fake.addInstances(1, {});
      fake.faults.tagNotFoundMs = 600_000;
      const id = (await ec2.send(new RunInstancesCommand(launch()))).Instances![0]!.InstanceId!;
      const tag = { Resources: [id], Tags: [{ Key: "DispatchCloudIdleBehavior", Value: "hold" }] };
      await ec2Error(ec2.send(new CreateTagsCommand(tag)), "InvalidInstanceID.NotFound");
      await ec2Error(
        ec2.send(new DeleteTagsCommand({ Resources: [id], Tags: [{ Key: "DispatchCloudInstanceSetID" }] })),
        "InvalidInstanceID.NotFound",
      );
      expect(fake.instances.get(id)!.tags).toEqual({ DispatchCloudInstanceSetID: "zzzzz" });
      // An instance launched long ago is tagged as ever.
      await ec2.send(new CreateTagsCommand({ ...tag, Resources: [old!.id] }));
      fake.faults.tagNotFoundMs = 0;
      await ec2.send(new CreateTagsCommand(tag));
      expect(fake.instances.get(id)!.tags["DispatchCloudIdleBehavior"]).toBe("hold");
    });

    it("terminateNotFoundMs: TerminateInstances on a new instance answers NotFound and the instance runs on", async () => {
      fake.faults.terminateNotFoundMs = 600_000;
      const id = (await ec2.send(new RunInstancesCommand(launch()))).Instances![0]!.InstanceId!;
      await ec2Error(
        ec2.send(new TerminateInstancesCommand({ InstanceIds: [id] })),
        "InvalidInstanceID.NotFound",
      );
      expect(fake.instances.get(id)!.state).toBe("running");
      expect(allInstances(await ec2.send(new DescribeInstancesCommand({ InstanceIds: [id] })))).toHaveLength(
        1,
      );
      fake.faults.terminateNotFoundMs = 0;
      await ec2.send(new TerminateInstancesCommand({ InstanceIds: [id] }));
      expect(fake.instances.get(id)!.state).toBe("terminated");
    });

    it("loseNext drop: the launch happens, the connection closes without an answer; a retry with the token gets it", async () => {
      fake.faults.loseNext.push({ action: "RunInstances", mode: "drop" });
      const before = fake.instances.size;
      const req = launch({ ClientToken: "lost-answer-drop" });
      const err = await ec2.send(new RunInstancesCommand(req)).catch((e: unknown) => e as Error);
      expect(err).toBeInstanceOf(Error);
      expect((err as Error & { code?: string }).code).toBe("ECONNRESET");
      expect(fake.instances.size).toBe(before + 1);
      const launched = [...fake.instances.values()].at(-1)!;
      expect(launched.params["ClientToken"]).toBe("lost-answer-drop");
      expect(fake.calls.at(-1)).toMatchObject({
        action: "RunInstances",
        status: 200,
        code: null,
        lost: "drop",
      });
      expect(fake.history.at(-1)).toMatchObject({ instanceId: launched.id, event: "launched" });
      const again = await ec2.send(new RunInstancesCommand(req));
      expect(again.Instances?.[0]?.InstanceId).toBe(launched.id);
      expect(fake.instances.size).toBe(before + 1);
      expect(fake.faults.loseNext).toEqual([]);
    });

    it("loseNext late: the answer is held until the client gives up (its timeout); TerminateInstances too", async () => {
      const impatient = new EC2Client({
        endpoint: fake.url,
        region: "us-east-1",
        credentials: { accessKeyId: "AKIAFAKEEC2TEST", secretAccessKey: "fake-ec2-test-secret" },
        maxAttempts: 1,
        requestHandler: { requestTimeout: 300, throwOnRequestTimeout: true },
      });
      try {
        const id = (await impatient.send(new RunInstancesCommand(launch()))).Instances![0]!.InstanceId!;
        fake.faults.loseNext.push({ action: "TerminateInstances", mode: "late" });
        const err = await impatient
          .send(new TerminateInstancesCommand({ InstanceIds: [id] }))
          .catch((e: unknown) => e as Error);
        expect((err as Error).name).toBe("TimeoutError");
        expect(fake.instances.get(id)!.state).toBe("terminated");
        expect(fake.calls.at(-1)).toMatchObject({ action: "TerminateInstances", lost: "late" });
      } finally {
        impatient.destroy();
      }
    });

    it("lostAnswerRate: that fraction of the successful requests of lostAnswerActions loses its answer", async () => {
      const from = fake.calls.length;
      fake.faults.lostAnswerRate = 1;
      fake.faults.lostAnswerActions = new Set(["CreateTags"]);
      const [a] = fake.addInstances(1, {});
      await ec2.send(new DescribeInstancesCommand({}));
      const err = await ec2
        .send(new CreateTagsCommand({ Resources: [a!.id], Tags: [{ Key: "k", Value: "lost" }] }))
        .catch((e: unknown) => e as Error);
      expect(err).toBeInstanceOf(Error);
      expect(fake.instances.get(a!.id)!.tags["k"]).toBe("lost");
      // A refused request has nothing to lose: its error arrives.
      await ec2Error(
        ec2.send(
          new CreateTagsCommand({ Resources: ["i-0123456789abcdef0"], Tags: [{ Key: "k", Value: "v" }] }),
        ),
        "InvalidInstanceID.NotFound",
      );
      fake.faults.lostAnswerRate = 0;
      await ec2.send(new CreateTagsCommand({ Resources: [a!.id], Tags: [{ Key: "k", Value: "v" }] }));
      expect(
        fake.calls
          .slice(from)
          .filter((c) => c.action === "CreateTags")
          .map((c) => c.lost),
      ).toEqual(["drop", null, null]);
    });

    it("checks in order: subnet errors, then capacity, then the instance limit, then the vCPU limit", async () => {
      fake.faults.subnetErrors.set("subnet-0a", "InsufficientFreeAddressesInSubnet");
      fake.faults.typesAtCapacity.add("m5.large");
      fake.faults.maxInstances = 1;
      fake.faults.vcpuLimit = 1;
      await ec2Error(ec2.send(new RunInstancesCommand(launch())), "InsufficientFreeAddressesInSubnet");
      fake.faults.subnetErrors.clear();
      await ec2Error(ec2.send(new RunInstancesCommand(launch())), "InsufficientInstanceCapacity");
      fake.faults.typesAtCapacity.clear();
      await ec2Error(ec2.send(new RunInstancesCommand(launch())), "InstanceLimitExceeded");
      fake.faults.maxInstances = 0;
      await ec2Error(ec2.send(new RunInstancesCommand(launch())), "VcpuLimitExceeded");
    });
  });
});

describe("fake EC2 through the real SDK: key pairs and spot prices", () => {
  let fake: FakeEc2;
  let ec2: EC2Client;
  let dir: string;
  const now = Date.now();
  const at = (minutesAgo: number) => new Date(now - minutesAgo * 60_000);

  beforeAll(async () => {
    dir = mkdtempSync(path.join(tmpdir(), "fake-ec2-keys-"));
    fake = await new FakeEc2({
      spotPrices: [
        { instanceType: "m5.large", availabilityZone: "us-east-1a", price: 0.031, timestamp: at(300) },
        { instanceType: "m5.large", availabilityZone: "us-east-1a", price: 0.034, timestamp: at(120) },
        { instanceType: "m5.large", availabilityZone: "us-east-1a", price: 0.036, timestamp: at(30) },
        { instanceType: "m5.large", availabilityZone: "us-east-1b", price: 0.033, timestamp: at(200) },
        { instanceType: "c5.large", availabilityZone: "us-east-1a", price: 0.029, timestamp: at(10) },
      ],
    }).start();
    ec2 = clientFor(fake);
  });
  afterAll(async () => {
    ec2?.destroy();
    await fake?.stop();
    if (dir !== undefined) rmSync(dir, { recursive: true, force: true });
  });

  /** EC2's imported-key fingerprint computed by OpenSSH and OpenSSL, independently of the fake. */
  function referenceFingerprint(publicKeyLine: string): string {
    const file = path.join(dir, `k${Math.random().toString(36).slice(2)}.pub`);
    writeFileSync(file, `${publicKeyLine}\n`);
    if (publicKeyLine.startsWith("ssh-ed25519")) {
      const out = execFileSync("ssh-keygen", ["-l", "-E", "sha256", "-f", file], { encoding: "utf8" });
      const b = /SHA256:(\S+)/.exec(out)![1]!;
      return b + "=".repeat((4 - (b.length % 4)) % 4);
    }
    const pem = execFileSync("ssh-keygen", ["-e", "-m", "PKCS8", "-f", file]);
    const der = execFileSync("openssl", ["pkey", "-pubin", "-outform", "DER"], { input: pem });
    const md5 = execFileSync("openssl", ["dgst", "-md5", "-hex"], { input: der, encoding: "utf8" });
    return /([0-9a-f]{32})/.exec(md5)![1]!.match(/../g)!.join(":");
  }

  it("ImportKeyPair: rsa and ed25519 keys get EC2's fingerprints; DescribeKeyPairs finds them by fingerprint", async () => {
    const rsa = ssh2.utils.generateKeyPairSync("rsa", { bits: 2048, comment: "rsa-test" }).public;
    const ed = generateKeyPair("ed-test").publicKey;
    for (const [name, line] of [
      ["dispatch-rsa", rsa],
      ["dispatch-ed25519", ed],
    ] as const) {
      const out = await ec2.send(
        new ImportKeyPairCommand({ KeyName: name, PublicKeyMaterial: new TextEncoder().encode(line) }),
      );
      const expected = referenceFingerprint(line);
      expect(out.KeyFingerprint).toBe(expected);
      expect(ec2ImportedKeyFingerprint(line)).toBe(expected);
      expect(out.KeyName).toBe(name);
      expect(out.KeyPairId).toMatch(/^key-[0-9a-f]{17}$/);
      expect(fake.keyPairs.get(name)).toEqual({ name, fingerprint: expected, publicKey: line.trim() });

      const found = await ec2.send(
        new DescribeKeyPairsCommand({
          Filters: [{ Name: "fingerprint", Values: [expected] }],
          IncludePublicKey: true,
        }),
      );
      expect(found.KeyPairs?.map((k) => [k.KeyName, k.KeyFingerprint, k.KeyPairId, k.PublicKey])).toEqual([
        [name, expected, out.KeyPairId, line.trim()],
      ]);
      expect(found.KeyPairs?.[0]?.KeyType).toBe(name.endsWith("rsa") ? "rsa" : "ed25519");
      expect(found.KeyPairs?.[0]?.CreateTime).toBeInstanceOf(Date);
    }
    expect(ec2ImportedKeyFingerprint(ed)).toMatch(/^[A-Za-z0-9+/]{43}=$/);
    const byName = await ec2.send(new DescribeKeyPairsCommand({ KeyNames: ["dispatch-rsa"] }));
    expect(byName.KeyPairs?.map((k) => k.KeyName)).toEqual(["dispatch-rsa"]);
    expect(byName.KeyPairs?.[0]?.PublicKey).toBeUndefined();
    const none = await ec2.send(
      new DescribeKeyPairsCommand({ Filters: [{ Name: "fingerprint", Values: ["00:11"] }] }),
    );
    expect(none.KeyPairs).toEqual([]);
    const all = await ec2.send(new DescribeKeyPairsCommand({}));
    expect(all.KeyPairs?.map((k) => k.KeyName).sort()).toEqual(["dispatch-ed25519", "dispatch-rsa"]);
  });

  it("ImportKeyPair and DescribeKeyPairs: refuse duplicates, bad keys, unknown names and filters", async () => {
    const ed = generateKeyPair().publicKey;
    const material = (s: string) => new TextEncoder().encode(s);
    await ec2.send(new ImportKeyPairCommand({ KeyName: "once", PublicKeyMaterial: material(ed) }));
    await ec2Error(
      ec2.send(new ImportKeyPairCommand({ KeyName: "once", PublicKeyMaterial: material(ed) })),
      "InvalidKeyPair.Duplicate",
    );
    await ec2Error(
      ec2.send(new ImportKeyPairCommand({ KeyName: "junk", PublicKeyMaterial: material("not a key") })),
      "InvalidKey.Format",
    );
    const [type, blob] = ed.split(" ");
    await ec2Error(
      ec2.send(
        new ImportKeyPairCommand({ KeyName: "mixed", PublicKeyMaterial: material(`ssh-rsa ${blob}`) }),
      ),
      "InvalidKey.Format",
    );
    expect(type).toBe("ssh-ed25519");
    const ecdsa = ssh2.utils.generateKeyPairSync("ecdsa", { bits: 256 }).public;
    await ec2Error(
      ec2.send(new ImportKeyPairCommand({ KeyName: "ecdsa", PublicKeyMaterial: material(ecdsa) })),
      "InvalidKey.Format",
    );
    await ec2Error(
      ec2.send(new ImportKeyPairCommand({ KeyName: "empty" } as ImportKeyPairCommandInput)),
      "MissingParameter",
    );
    await ec2Error(
      ec2.send(new ImportKeyPairCommand({ KeyName: "", PublicKeyMaterial: material(ed) })),
      "MissingParameter",
    );
    expect([...fake.keyPairs.keys()]).not.toContain("junk");
    await ec2Error(
      ec2.send(new DescribeKeyPairsCommand({ KeyNames: ["nobody"] })),
      "InvalidKeyPair.NotFound",
    );
    await ec2Error(
      ec2.send(new DescribeKeyPairsCommand({ Filters: [{ Name: "colour", Values: ["red"] }] })),
      "InvalidParameterValue",
    );
  });

  it("DescribeSpotPriceHistory: by type and zone, newest first, with the price in effect at StartTime", async () => {
    const out = await ec2.send(
      new DescribeSpotPriceHistoryCommand({
        InstanceTypes: ["m5.large"],
        ProductDescriptions: ["Linux/UNIX"],
        StartTime: at(60),
      }),
    );
    expect(
      out.SpotPriceHistory?.map((p) => [p.AvailabilityZone, p.SpotPrice, p.Timestamp?.getTime()]),
    ).toEqual([
      ["us-east-1a", "0.036000", at(30).getTime()],
      ["us-east-1a", "0.034000", at(120).getTime()],
      ["us-east-1b", "0.033000", at(200).getTime()],
    ]);
    expect(out.SpotPriceHistory?.[0]).toMatchObject({
      InstanceType: "m5.large",
      ProductDescription: "Linux/UNIX",
    });
    const zone = await ec2.send(
      new DescribeSpotPriceHistoryCommand({ InstanceTypes: ["m5.large"], AvailabilityZone: "us-east-1b" }),
    );
    expect(zone.SpotPriceHistory?.map((p) => p.SpotPrice)).toEqual(["0.033000"]);
    const windows = await ec2.send(
      new DescribeSpotPriceHistoryCommand({
        InstanceTypes: ["m5.large"],
        StartTime: at(250),
        EndTime: at(100),
      }),
    );
    expect(windows.SpotPriceHistory?.map((p) => p.SpotPrice)).toEqual(["0.034000", "0.033000", "0.031000"]);
    const windows2 = await ec2.send(
      new DescribeSpotPriceHistoryCommand({ Filters: [{ Name: "instance-type", Values: ["c5.*"] }] }),
    );
    expect(windows2.SpotPriceHistory?.map((p) => p.InstanceType)).toEqual(["c5.large"]);
    const windows3 = await ec2.send(
      new DescribeSpotPriceHistoryCommand({ ProductDescriptions: ["Windows"] }),
    );
    expect(windows3.SpotPriceHistory).toEqual([]);
    const pages: number[] = [];
    for await (const page of paginateDescribeSpotPriceHistory({ client: ec2 }, { MaxResults: 2 })) {
      pages.push(page.SpotPriceHistory?.length ?? 0);
    }
    expect(pages).toEqual([2, 2, 1]);
    await ec2Error(
      ec2.send(new DescribeSpotPriceHistoryCommand({ StartTime: at(10), EndTime: at(20) })),
      "InvalidParameterValue",
    );
    await ec2Error(
      ec2.send(new DescribeSpotPriceHistoryCommand({ Filters: [{ Name: "colour", Values: ["red"] }] })),
      "InvalidParameterValue",
    );
    expect(
      await rawRequest(fake, {
        Action: "DescribeSpotPriceHistory",
        Version: "2016-11-15",
        StartTime: "yesterday",
      }),
    ).toMatchObject({ status: 400, code: "InvalidParameterValue" });
  });

  it("RunInstances: a spot request below the current spot price is SpotMaxPriceTooLow", async () => {
    const spot = (maxPrice: string) =>
      launch({ InstanceMarketOptions: { MarketType: "spot", SpotOptions: { MaxPrice: maxPrice } } });
    await ec2Error(ec2.send(new RunInstancesCommand(spot("0.035"))), "SpotMaxPriceTooLow");
    const ok = await ec2.send(new RunInstancesCommand(spot("0.04")));
    expect(ok.Instances?.[0]?.InstanceLifecycle).toBe("spot");
  });
});

describe("fake EC2 instances backed by local sshd VMs", () => {
  let fake: FakeEc2;
  let imds: FakeImds;
  let ec2: EC2Client;
  let stateDir: string;
  let user: string;
  const key = generateKeyPair("fake-ec2-test");

  beforeAll(async () => {
    user = requireOpenSsh();
    stateDir = mkdtempSync(path.join(tmpdir(), "fake-ec2-vms-"));
    imds = await new FakeImds().start();
    fake = await new FakeEc2({ localVms: { stateDir, user, addressPrefix: ADDRESS_PREFIX }, imds }).start();
    ec2 = clientFor(fake);
    await ec2.send(
      new ImportKeyPairCommand({
        KeyName: "dispatch",
        PublicKeyMaterial: new TextEncoder().encode(key.publicKey),
      }),
    );
  }, 60_000);
  afterAll(async () => {
    ec2?.destroy();
    await fake?.stop();
    await imds?.stop();
    if (stateDir !== undefined) rmSync(stateDir, { recursive: true, force: true });
  }, 60_000);

  it("runs UserData on a VM reachable by its private IP with the key pair's key, and destroys it on terminate", async () => {
    await ec2Error(ec2.send(new RunInstancesCommand(launch())), "MissingParameter");
    const userData = [
      "#!/bin/sh",
      'echo "user data ran as $(id -un)" > "$DISPATCH_VM_ROOT/tmp/user-data-ran"',
    ].join("\n");
    const [first, second] = await Promise.all(
      [0, 1].map(() =>
        ec2.send(new RunInstancesCommand(launch({ KeyName: "dispatch", UserData: b64(userData) }))),
      ),
    );
    const inst = first!.Instances![0]!;
    const other = second!.Instances![0]!;
    const id = inst.InstanceId!;
    expect(inst.State?.Name).toBe("pending");
    expect(inst.PrivateIpAddress?.startsWith(ADDRESS_PREFIX)).toBe(true);
    expect(other.PrivateIpAddress?.startsWith(ADDRESS_PREFIX)).toBe(true);
    expect(other.PrivateIpAddress).not.toBe(inst.PrivateIpAddress);
    expect(inst.KeyName).toBe("dispatch");
    const listed = allInstances(await ec2.send(new DescribeInstancesCommand({ InstanceIds: [id] })));
    expect(listed.map((i) => [i.State?.Name, i.PrivateIpAddress])).toEqual([
      ["running", inst.PrivateIpAddress],
    ]);

    const ssh = await connect(inst.PrivateIpAddress!, user, key.privateKey);
    try {
      let ran = "";
      await waitFor(
        "the UserData to run",
        async () => {
          ran = (await run(ssh, 'cat "$DISPATCH_VM_ROOT/tmp/user-data-ran" 2>/dev/null')).stdout;
          return ran !== "";
        },
        20_000,
      );
      expect(ran.trim()).toBe(`user data ran as ${user}`);
      const endpoint = await run(ssh, 'head -n 1 "$DISPATCH_VM_ROOT/etc/dispatch-cloud/imds-endpoint"');
      expect(endpoint.stdout.trim()).toBe(imds.endpointFor(id));
    } finally {
      ssh.end();
    }

    // An interruption notice reaches this instance's IMDS; EC2's state is unchanged.
    fake.interrupt(id);
    const base = imds.endpointFor(id);
    const token = await (
      await fetch(`${base}/latest/api/token`, {
        method: "PUT",
        headers: { "X-aws-ec2-metadata-token-ttl-seconds": "60" },
      })
    ).text();
    const notice = await fetch(`${base}/latest/meta-data/spot/instance-action`, {
      headers: { "X-aws-ec2-metadata-token": token },
    });
    expect(notice.status).toBe(200);
    expect(JSON.parse(await notice.text())).toMatchObject({ action: "terminate" });
    expect(fake.instances.get(id)!.state).toBe("running");

    expect(processesUnder(stateDir).length).toBeGreaterThan(0);
    const t = await ec2.send(new TerminateInstancesCommand({ InstanceIds: [id] }));
    expect(t.TerminatingInstances?.[0]?.CurrentState?.Name).toBe("shutting-down");
    await waitFor(
      "the instance to be terminated",
      async () => {
        const r = await ec2.send(new DescribeInstancesCommand({ InstanceIds: [id] }));
        return allInstances(r)[0]?.State?.Name === "terminated";
      },
      20_000,
    );
    await expect(connect(inst.PrivateIpAddress!, user, key.privateKey)).rejects.toThrow();
    expect(fake.instances.get(other.InstanceId!)!.state).toBe("running");

    // A repeated ClientToken arriving while the first launch's VM still starts gets that launch, with its address.
    const byToken = launch({ KeyName: "dispatch", UserData: b64(userData), ClientToken: "vm-token-1" });
    const [t1, t2] = await Promise.all([0, 1].map(() => ec2.send(new RunInstancesCommand(byToken))));
    expect(t2!.Instances?.[0]?.InstanceId).toBe(t1!.Instances?.[0]?.InstanceId);
    expect(t2!.Instances?.[0]?.PrivateIpAddress).toBe(t1!.Instances?.[0]?.PrivateIpAddress);
    expect(t1!.Instances?.[0]?.PrivateIpAddress?.startsWith(ADDRESS_PREFIX)).toBe(true);
    expect([...fake.instances.values()].filter((i) => i.params["ClientToken"] === "vm-token-1")).toHaveLength(
      1,
    );

    // stop() destroys the VM still running.
    await fake.stop();
    expect(processesUnder(stateDir)).toEqual([]);
    expect(fake.instances.get(other.InstanceId!)!.state).toBe("terminated");
  }, 90_000);
});
