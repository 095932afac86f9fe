import { describe, expect, it } from "vitest";
import { parseImageRef, registryOf } from "../lib/image-ref.ts";
import {
  authFor,
  classifyPullFailure,
  PullProgress,
  registryAuthHeader,
  splitForPull,
} from "./image-pull.ts";

describe("classifyPullFailure", () => {
  it("reads Docker's answers for a missing tag, repository or bad reference as missing", () => {
    expect(
      classifyPullFailure(
        "manifest for 127.0.0.1:55000/dctest/busybox:nope not found: manifest unknown: manifest unknown",
        404,
      ),
    ).toBe("missing");
    expect(classifyPullFailure("invalid reference format: repository name must be lowercase", 400)).toBe(
      "missing",
    );
    // Docker Hub says this both for a repository that does not exist and a private one without credentials.
    expect(
      classifyPullFailure(
        "pull access denied for nosuch, repository does not exist or may require 'docker login': denied: requested access to the resource is denied",
        500,
      ),
    ).toBe("missing");
    expect(
      classifyPullFailure("no matching manifest for linux/amd64 in the manifest list entries", 500),
    ).toBe("missing");
    // The registry's name does not exist (NXDOMAIN); a resolver that does not answer is another matter (below).
    expect(
      classifyPullFailure(
        'Get "https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io on 10.0.0.53:53: no such host',
        500,
      ),
    ).toBe("missing");
  });

  it("reads refused credentials as denied", () => {
    expect(classifyPullFailure("unauthorized: authentication required", 500)).toBe("denied");
    expect(
      classifyPullFailure('Head "http://127.0.0.1:55001/v2/x/manifests/1": no basic auth credentials', 500),
    ).toBe("denied");
    expect(classifyPullFailure("denied: requested access to the resource is denied", 500)).toBe("denied");
  });

  it("reads network failures, 5xx and rate limits as unavailable, and a full disk as the instance's", () => {
    for (const m of [
      'Get "http://127.0.0.1:55999/v2/": dial tcp 127.0.0.1:55999: connect: connection refused',
      "received unexpected HTTP status: 503 Service Unavailable",
      "toomanyrequests: You have reached your pull rate limit",
      "net/http: TLS handshake timeout",
      "dial tcp: lookup registry.example.org on 10.0.0.53:53: server misbehaving",
      "dial tcp: lookup registry.example.org on 10.0.0.53:53: read udp: i/o timeout",
    ]) {
      expect(classifyPullFailure(m, 500), m).toBe("unavailable");
    }
    expect(classifyPullFailure("write /var/lib/docker/tmp/x: no space left on device", 500)).toBe("broken");
  });
});

describe("PullProgress", () => {
  it("sums the layers being downloaded, finished ones at their size, in decimal MB", () => {
    const p = new PullProgress();
    expect(p.text()).toBeNull();
    p.add({ status: "Pulling fs layer", id: "a" });
    p.add({ status: "Already exists", id: "b" });
    p.add({ status: "Downloading", id: "a", progressDetail: { current: 1_000_000, total: 8_400_000 } });
    expect(p.text()).toBe("1.0 of 8.4 MB");
    p.add({ status: "Downloading", id: "c", progressDetail: { current: 500_000, total: 1_600_000 } });
    expect(p.text()).toBe("1.5 of 10.0 MB");
    p.add({ status: "Download complete", id: "a" });
    p.add({ status: "Pull complete", id: "c" });
    expect(p.text()).toBe("10.0 of 10.0 MB");
    expect([p.done, p.total]).toEqual([10_000_000, 10_000_000]);
  });
});

describe("credentials", () => {
  const auths = [
    { server: "127.0.0.1:5000", username: "u", password: "p@ss" },
    { server: "docker.io", username: "hub", password: "tok" },
  ];

  it("picks the entry of the image's own registry", () => {
    expect(authFor("127.0.0.1:5000/x/y:1", auths)?.username).toBe("u");
    expect(authFor("busybox", auths)?.username).toBe("hub");
    expect(authFor("quay.io/x/y", auths)).toBeUndefined();
    expect(authFor("127.0.0.1:5001/x/y", auths)).toBeUndefined();
  });

  it("encodes X-Registry-Auth as base64url JSON with the server address", () => {
    const header = registryAuthHeader({ server: "127.0.0.1:5000", username: "u", password: "p?>~" });
    expect(header).not.toMatch(/[+/=]/);
    expect(JSON.parse(Buffer.from(header, "base64url").toString("utf8"))).toEqual({
      username: "u",
      password: "p?>~",
      serveraddress: "127.0.0.1:5000",
    });
  });
});

describe("image references", () => {
  it("splits a reference for the pull API", () => {
    expect(splitForPull("busybox")).toEqual({ fromImage: "busybox", tag: "latest" });
    expect(splitForPull("127.0.0.1:5000/a/b:2")).toEqual({ fromImage: "127.0.0.1:5000/a/b", tag: "2" });
    expect(splitForPull(`127.0.0.1:5000/a/b@sha256:${"a".repeat(64)}`)).toEqual({
      fromImage: "127.0.0.1:5000/a/b",
      tag: `sha256:${"a".repeat(64)}`,
    });
  });

  it("finds the registry as Docker does", () => {
    expect(parseImageRef("busybox")).toEqual({
      registry: "docker.io",
      repository: "library/busybox",
      tag: null,
      digest: null,
      name: "busybox",
    });
    expect(parseImageRef("user/img:3")).toMatchObject({
      registry: "docker.io",
      repository: "user/img",
      tag: "3",
    });
    expect(parseImageRef("localhost/img")).toMatchObject({ registry: "localhost", repository: "img" });
    expect(parseImageRef("127.0.0.1:5000/a/b:1@sha256:" + "b".repeat(64))).toMatchObject({
      registry: "127.0.0.1:5000",
      repository: "a/b",
      tag: "1",
      digest: `sha256:${"b".repeat(64)}`,
      name: "127.0.0.1:5000/a/b",
    });
    expect(registryOf("index.docker.io/library/busybox")).toBe("docker.io");
    expect(registryOf("123.dkr.ecr.us-east-1.amazonaws.com/team/x:1")).toBe(
      "123.dkr.ecr.us-east-1.amazonaws.com",
    );
    expect(parseImageRef("UPPER/case")).toBeNull();
    expect(parseImageRef("a@sha256:short")).toBeNull();
    expect(parseImageRef("")).toBeNull();
  });
});
