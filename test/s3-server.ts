/**
 * An S3-compatible server on loopback for tests: moto's server mode (`moto_server`, Python), which speaks S3's wire
 * format (SigV4-signed requests, XML errors, ListObjectsV2, Range, x-amz-checksum-sha256) and keeps objects in
 * memory. It is part of the project's machine image (pip package moto); scripts/test-services.sh checks it is
 * there. Each call starts its own server on a free port and stops it in `close()`.
 *
 * Where it is missing the tests fail, saying how to get it: `pip install 'moto[server]'`, or point
 * DISPATCH_CLOUD_TEST_MOTO at a `moto_server` executable.
 */
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { existsSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { CreateBucketCommand, S3Client } from "@aws-sdk/client-s3";

export interface TestS3Server {
  endpoint: string;
  region: string;
  credentials: { accessKeyId: string; secretAccessKey: string };
  /** Makes a bucket (the name must be unique within this server). */
  createBucket(name: string): Promise<void>;
  close(): Promise<void>;
}

const HOW_TO_GET =
  "moto's S3 server is needed for the S3 backend's tests and was not found: install it with " +
  "`pip install 'moto[server]'` (it is part of the project's machine image), or set DISPATCH_CLOUD_TEST_MOTO " +
  "to a moto_server executable";

/** The moto_server executable: $DISPATCH_CLOUD_TEST_MOTO (scripts/test-services.sh sets it), else on PATH, else pyenv's. */
export function findMotoServer(): string {
  const pyenv = join(process.env.HOME ?? "/root", ".pyenv", "versions");
  const versions = existsSync(pyenv) ? readdirSync(pyenv).sort().reverse() : [];
  const candidates = [
    process.env.DISPATCH_CLOUD_TEST_MOTO,
    "moto_server",
    ...versions.map((v) => join(pyenv, v, "bin", "moto_server")),
  ].filter((c): c is string => c !== undefined && c !== "");
  for (const c of candidates) {
    if (c.includes("/") && !existsSync(c)) continue;
    const probe = spawnSync(c, ["--help"], { stdio: "ignore", timeout: 30_000 });
    if (probe.status === 0) return c;
  }
  throw new Error(HOW_TO_GET);
}

export async function startS3Server(): Promise<TestS3Server> {
  const exe = findMotoServer();
  const child: ChildProcess = spawn(exe, ["-H", "127.0.0.1", "-p", "0"], {
    stdio: ["ignore", "ignore", "pipe"],
    env: { ...process.env, PYTHONUNBUFFERED: "1" },
  });
  const port = await new Promise<number>((resolve, reject) => {
    let seen = "";
    const onData = (b: Buffer) => {
      seen += b.toString();
      const m = /Running on http:\/\/127\.0\.0\.1:(\d+)/.exec(seen);
      if (m?.[1] !== undefined) {
        child.stderr?.off("data", onData);
        child.stderr?.resume();
        resolve(Number(m[1]));
      }
    };
    child.stderr?.on("data", onData);
    child.once("exit", (code) =>
      reject(new Error(`moto_server exited (${code}) before listening:\n${seen}`)),
    );
    child.once("error", reject);
  });
  const endpoint = `http://127.0.0.1:${port}`;
  const region = "us-east-1";
  const credentials = { accessKeyId: "testing-access-key", secretAccessKey: "testing-secret-key-0123456789" };
  const admin = new S3Client({ endpoint, region, credentials, forcePathStyle: true });
  return {
    endpoint,
    region,
    credentials,
    async createBucket(name) {
      await admin.send(new CreateBucketCommand({ Bucket: name }));
    },
    async close() {
      admin.destroy();
      if (child.exitCode !== null) return;
      const exited = new Promise((r) => child.once("exit", r));
      child.kill("SIGTERM");
      await exited;
    },
  };
}
