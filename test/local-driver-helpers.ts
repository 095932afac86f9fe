import { execFileSync } from "node:child_process";
/** Shared by the local driver's tests: a bare ssh2 client, and a check for leftover VM processes. */
import { readdirSync, readFileSync } from "node:fs";
import ssh2 from "ssh2";
import { expect } from "vitest";
import { openSshUnavailable } from "../cloud-drivers/local/ssh-openssh.ts";
import type { Instance, InstanceSet, Tags } from "../cloud-drivers/types.ts";
import { generateKeyPair } from "../lib/ssh-keys.ts";

export interface RunResult {
  stdout: string;
  stderr: string;
  code: number | null;
  signal: string | null;
}

export function connect(address: string, username: string, privateKey: string): Promise<ssh2.Client> {
  const [host, port] = address.includes(":") ? address.split(":") : [address, "22"];
  return new Promise((resolve, reject) => {
    const client = new ssh2.Client();
    client.once("ready", () => {
      // Later errors (the server going away under a test) end the connection; tests see that through run().
      client.on("error", () => {});
      resolve(client);
    });
    client.once("error", reject);
    client.connect({ host: host ?? "", port: Number(port), username, privateKey, readyTimeout: 10_000 });
  });
}

/**
 * Runs one command; `onChannel` sees the channel once it is open (to send signals: ssh2 sends none once
 * stdin is closed, so with onChannel and no stdin, stdin stays open).
 */
export function run(
  client: ssh2.Client,
  command: string,
  opts: { stdin?: Buffer; onChannel?: (ch: ssh2.ClientChannel) => void } = {},
): Promise<RunResult> {
  return new Promise((resolve, reject) => {
    client.exec(command, (err, ch) => {
      if (err) {
        reject(err);
        return;
      }
      const out: Buffer[] = [];
      const errs: Buffer[] = [];
      let code: number | null = null;
      let signal: string | null = null;
      ch.on("data", (d: Buffer) => out.push(d));
      ch.stderr.on("data", (d: Buffer) => errs.push(d));
      ch.on("exit", (c: number | null, s?: string) => {
        code = c;
        signal = s ?? null;
      });
      ch.on("close", () =>
        resolve({
          stdout: Buffer.concat(out).toString(),
          stderr: Buffer.concat(errs).toString(),
          code,
          signal,
        }),
      );
      opts.onChannel?.(ch);
      if (opts.stdin !== undefined) ch.end(opts.stdin);
      else if (opts.onChannel === undefined) ch.end();
    });
  });
}

/** Pids (not zombies) whose command line or DISPATCH_VM_ROOT mentions `dir`. */
export function processesUnder(dir: string): number[] {
  const out: number[] = [];
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name) || Number(name) === process.pid) continue;
    try {
      const stat = readFileSync(`/proc/${name}/stat`, "utf8");
      if (stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z")) continue;
      const cmdline = readFileSync(`/proc/${name}/cmdline`, "utf8");
      const environ = readFileSync(`/proc/${name}/environ`, "utf8");
      if (cmdline.includes(dir) || environ.includes(`DISPATCH_VM_ROOT=${dir}`)) out.push(Number(name));
    } catch {
      // Gone meanwhile.
    }
  }
  return out;
}

export async function waitFor(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 10_000) {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

/** The login user for openssh VMs; throws with the way to get one when this machine cannot run sshd VMs. */
export function requireOpenSsh(): string {
  const unavailable = openSshUnavailable();
  if (unavailable !== undefined) throw new Error(unavailable);
  return process.env["DISPATCH_CLOUD_TEST_VM_USER"] ?? "dcvm";
}

/**
 * The test image for Docker (made by scripts/test-services.sh with `docker import` from a busybox-static root),
 * after checking that the daemon answers and the image exists; throws saying how to get them otherwise.
 */
export function requireDockerImage(): string {
  const image = process.env["DISPATCH_CLOUD_TEST_IMAGE"] ?? "dctest/busybox:1";
  const hint =
    "run `bash scripts/test-services.sh` as root (installs docker.io and busybox-static, starts dockerd, makes the image)";
  try {
    execFileSync("docker", ["image", "inspect", image], { stdio: "ignore", timeout: 20_000 });
  } catch {
    throw new Error(`Docker test image ${image} is not available (no daemon, or no image): ${hint}`);
  }
  return image;
}

/**
 * What a cloud driver's VM backed by a local VM (test/fake-cloud-vms.ts) must do: `create` (given an init script
 * and the dispatcher's public key) returns an instance at an address matching `address`, listed with that
 * address; its sshd admits the key as `user`; the init script has run. Returns the instance, still up.
 */
export async function expectSshBackedInstance(
  set: InstanceSet,
  create: (init: string, publicKey: string) => Promise<Instance>,
  o: { address: RegExp; listFilter: Tags; user: string; what: string },
): Promise<Instance> {
  const key = generateKeyPair();
  // The VM's root is $DISPATCH_VM_ROOT (set for the init script and for SSH sessions).
  const init =
    '#!/bin/sh\nmkdir -p "$DISPATCH_VM_ROOT/var/run" && echo booted > "$DISPATCH_VM_ROOT/var/run/driver-test"\n';
  const inst = await create(init, key.publicKey);
  expect(inst.address).toMatch(o.address);
  expect((await set.instances(o.listFilter)).find((i) => i.id === inst.id)?.address).toBe(inst.address);
  const client = await connect(inst.address, inst.remoteUser, key.privateKey);
  try {
    await waitFor(`the init script (${o.what}) to run`, async () => {
      const r = await run(client, 'cat "$DISPATCH_VM_ROOT/var/run/driver-test" 2>/dev/null');
      return r.stdout.trim() === "booted";
    });
    expect((await run(client, "id -un")).stdout.trim()).toBe(o.user);
  } finally {
    client.end();
  }
  return inst;
}
