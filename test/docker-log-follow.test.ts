/**
 * A container's log read to its end through the real Docker daemon (crunch-run/docker-logs.ts), including when
 * the follow stops short. Docker 20.10's follower can end at the container's exit before its last entries, and a
 * follow can break while the container runs; both are made to happen here by a client that passes the daemon's
 * answers through but cuts the first follow (the daemon, the container and every other request are real).
 * A missing daemon or image fails the suite with how to get them.
 */

import { mkdtempSync, rmSync } from "node:fs";
import type http from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { PassThrough } from "node:stream";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { RunnerSpec } from "../crunch-run/api-client.ts";
import { createDockerClient, type DockerClient } from "../crunch-run/docker-api.ts";
import type { RunningContainer } from "../crunch-run/runtime.ts";
import { createDockerRuntime } from "../crunch-run/runtime-docker.ts";
import { requireDockerImage } from "./docker-check.ts";

const IMAGE = "dctest/busybox:1";

/**
 * The daemon's client, with its first follow cut after `afterBytes` bytes: "drop-tail" passes nothing more and
 * ends when the daemon's answer ends (the follower that stopped before the last entries); "break" fails the
 * stream at once (a follow that broke while the container runs). everyFollow cuts the resumed follows too.
 */
function cuttingClient(
  docker: DockerClient,
  mode: "drop-tail" | "break",
  afterBytes: number,
  cutting: { everyFollow?: boolean } = {},
) {
  const paths: string[] = [];
  let cut = false;
  const client: DockerClient = {
    socketPath: docker.socketPath,
    call: (...args) => docker.call(...args),
    json: (...args) => docker.json(...args),
    async stream(method, path, opts) {
      paths.push(path);
      const res = await docker.stream(method, path, opts);
      if ((cut && cutting.everyFollow !== true) || !path.includes("follow=1")) return res;
      cut = true;
      const out = new PassThrough();
      let passed = 0;
      let stopped = false;
      res.on("data", (chunk: Buffer) => {
        if (stopped) return;
        const room = afterBytes - passed;
        out.write(chunk.subarray(0, room));
        passed += Math.min(room, chunk.length);
        if (chunk.length < room) return;
        stopped = true;
        if (mode === "break") {
          res.destroy();
          out.destroy(new Error("the follow broke (made by the test)"));
        }
      });
      res.on("end", () => {
        if (!out.destroyed) out.end();
      });
      return out as unknown as http.IncomingMessage;
    },
  };
  return { client, paths };
}

describe("a container's log, read to its end (docker runtime)", () => {
  const docker = createDockerClient(process.env);
  const dir = mkdtempSync(join(tmpdir(), "dc-log-follow-"));
  let n = 0;

  beforeAll(async () => {
    await requireDockerImage(docker, IMAGE);
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  /** Runs `script` in a container through the docker runtime with `client`; its whole stdout and stderr. */
  async function run(client: DockerClient, script: string) {
    n++;
    const uuid = `zzzzz-bndl-logfollow${String(n).padStart(6, "0")}`;
    const spec: RunnerSpec = {
      uuid,
      attempt: 1,
      command: ["sh", "-c", script],
      image: IMAGE,
      env: {},
      resources: { vcpus: 1, ram: 64 * 2 ** 20, scratch: 0, gpu: null },
      limits: { time: null, disk: null, network: false },
      dependencies: [],
      gpuDevices: [],
      instanceType: "test",
    };
    const outDir = mkdtempSync(join(dir, "out-"));
    const runtime = createDockerRuntime(client, { pullLockDir: join(dir, "locks") });
    const container: RunningContainer = await runtime.start({
      uuid,
      attempt: 1,
      spec,
      outDir,
      inDir: join(dir, "in"),
      inputs: [],
      gpuDevices: [],
      vmRoot: dir,
    });
    const text = (s: NodeJS.ReadableStream) =>
      new Promise<string>((resolve) => {
        let t = "";
        s.on("data", (c: Buffer) => {
          t += c.toString();
        });
        s.on("end", () => resolve(t));
      });
    try {
      const [stdout, stderr, exit] = await Promise.all([
        text(container.stdout),
        text(container.stderr),
        container.wait(),
      ]);
      return { stdout, stderr, exitCode: exit.exitCode };
    } finally {
      await container.remove();
    }
  }
  /** The tail=N of each read of the end again. */
  const tails = (paths: string[]) =>
    paths.filter((p) => p.includes("tail=")).map((p) => Number(/tail=(\d+)/.exec(p)?.[1]));
  const lines = (prefix: string, count: number) =>
    Array.from({ length: count }, (_, i) => `${prefix}${i + 1}\n`).join("");

  it("delivers every entry of each stream once, in order, when nothing goes wrong", async () => {
    const { client, paths } = cuttingClient(docker, "drop-tail", Number.MAX_SAFE_INTEGER);
    const r = await run(client, "i=1; while [ $i -le 300 ]; do echo o$i; echo e$i >&2; i=$((i+1)); done");
    expect(r).toEqual({ stdout: lines("o", 300), stderr: lines("e", 300), exitCode: 0 });
    // The end was read again once, and it reached back at the first try.
    expect(tails(paths)).toEqual([64]);
  });

  it("reads the end again when the follow stopped short at the container's exit", async () => {
    const { client, paths } = cuttingClient(docker, "drop-tail", 4000);
    const r = await run(client, "i=1; while [ $i -le 300 ]; do echo o$i; echo e$i >&2; i=$((i+1)); done");
    expect(r).toEqual({ stdout: lines("o", 300), stderr: lines("e", 300), exitCode: 0 });
    // 4,000 bytes hold about 90 of 600 entries: the read again grew until it reached back to them.
    expect(tails(paths)).toEqual([64, 512]);
  });

  it("reads a long log's end again, growing the read until it reaches back", async () => {
    const { client, paths } = cuttingClient(docker, "drop-tail", 2000);
    const r = await run(client, "seq 1 20000 | sed 's/^/o/'; seq 1 5 | sed 's/^/e/' >&2");
    expect(r).toEqual({ stdout: lines("o", 20000), stderr: lines("e", 5), exitCode: 0 });
    expect(tails(paths)).toEqual([64, 512, 4096, 32768]);
  });

  it("reads an end of long lines again as the whole log, streamed, rather than hold it all", async () => {
    const { client, paths } = cuttingClient(docker, "drop-tail", 100_000);
    // 3,000 lines of 10,000 bytes (docker keeps each as one entry): tail=4096 would hold them all, past 8 MiB.
    const r = await run(client, "head -c 30000000 /dev/zero | tr '\\0' a | fold -w 10000");
    expect(r.exitCode).toBe(0);
    // fold ends the last line without a newline: that entry arrives too.
    expect(r.stdout).toBe(`${"a".repeat(10000)}\n`.repeat(2999) + "a".repeat(10000));
    expect(tails(paths)).toEqual([64, 512, 4096]);
    expect(paths.filter((p) => !p.includes("follow=1") && !p.includes("tail="))).toHaveLength(1);
  });

  it("resumes a follow that broke while the container runs, and delivers nothing twice", async () => {
    const { client, paths } = cuttingClient(docker, "break", 3000);
    const r = await run(
      client,
      "i=1; while [ $i -le 100 ]; do echo o$i; echo e$i >&2; i=$((i+1)); done; sleep 2; " +
        "while [ $i -le 200 ]; do echo o$i; echo e$i >&2; i=$((i+1)); done",
    );
    expect(r).toEqual({ stdout: lines("o", 200), stderr: lines("e", 200), exitCode: 0 });
    expect(paths.filter((p) => p.includes("follow=1") && p.includes("since="))).toHaveLength(1);
    expect(r.stderr).not.toContain("lost the container's log stream");
  });

  it("says on stderr that the log was lost when the follow keeps breaking while the container runs", async () => {
    const { client, paths } = cuttingClient(docker, "break", 0, { everyFollow: true });
    const r = await run(client, "echo o1; sleep 5; echo o2");
    expect(paths.filter((p) => p.includes("follow=1"))).toHaveLength(6);
    expect(r.stdout).toBe("");
    expect(r.stderr).toBe(
      "[crunch-run] lost the container's log stream: the follow broke (made by the test)\n",
    );
    expect(r.exitCode).toBe(0);
  });
});
