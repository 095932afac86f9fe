/**
 * Registry pulls end to end (docs/images.md "Registries"): `serve` on PGlite, one local VM behind the embedded SSH
 * server, real Docker, and the real distribution registries scripts/test-services.sh runs on loopback (one open,
 * one with basic auth). A bundle whose image is missing from the daemon has it pulled, with progress in its log;
 * the auth registry's credentials come from containers.registries and show up nowhere; a wrong password and a
 * missing tag fail the bundle at once naming the image; two bundles needing one image pull it once; a registry
 * that is down requeues the bundle without using up its attempts, and it runs once the registry is back.
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { writeFile } from "node:fs/promises";
import net from "node:net";
import { join } from "node:path";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { E2eSystem, until } from "./e2e-harness.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";

requireDockerImage();
const HINT =
  "run `bash scripts/test-services.sh` as root (installs docker-registry and apache2-utils, starts both registries on loopback, pushes the test images) and load its export lines";

/** The registries of scripts/test-services.sh, after checking that they answer; throws saying how to get them. */
async function requireRegistries() {
  const env = (name: string) => {
    const v = process.env[name];
    if (v === undefined || v === "") throw new Error(`${name} is not set: ${HINT}`);
    return v;
  };
  const reg = {
    open: env("DISPATCH_CLOUD_TEST_REGISTRY"),
    auth: env("DISPATCH_CLOUD_TEST_REGISTRY_AUTH"),
    user: env("DISPATCH_CLOUD_TEST_REGISTRY_USER"),
    password: env("DISPATCH_CLOUD_TEST_REGISTRY_PASSWORD"),
    data: env("DISPATCH_CLOUD_TEST_REGISTRY_DATA"),
  };
  for (const [host, status] of [
    [reg.open, 200],
    [reg.auth, 401],
  ] as const) {
    const got = await fetch(`http://${host}/v2/`).then(
      (r) => r.status,
      (err: Error) => err.message,
    );
    if (got !== status) throw new Error(`no registry answers at ${host} (got ${got}): ${HINT}`);
  }
  return reg;
}

const REG = await requireRegistries();
/** The auth registry under another name, configured with a wrong password. */
const WRONG = REG.auth.replace(/^127\.0\.0\.1:/, "localhost:");
const PASSWORD_ENV = "DC_E2E_REGISTRY_PASSWORD";
const WRONG_PASSWORD_ENV = "DC_E2E_REGISTRY_WRONG_PASSWORD";

function removeImage(ref: string): void {
  execFileSync("docker", ["rmi", "-f", ref], { stdio: "ignore" });
}

/**
 * Removes every image on the daemon named .../dctest/pull (from any registry), so that the next pull of it has
 * its layers to download (an image still tagged from the other registry would keep them).
 */
function removePullImages(): void {
  const ids = execFileSync("docker", ["images", "--no-trunc", "--format", "{{.Repository}} {{.ID}}"], {
    encoding: "utf8",
  })
    .split("\n")
    .filter((l) => /\/dctest\/pull /.test(l))
    .map((l) => l.split(" ")[1] ?? "");
  for (const id of new Set(ids))
    if (id !== "") execFileSync("docker", ["rmi", "-f", id], { stdio: "ignore" });
}

function onDaemon(ref: string): boolean {
  try {
    execFileSync("docker", ["image", "inspect", ref], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}

async function freePort(): Promise<number> {
  const server = net.createServer();
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const port = (server.address() as net.AddressInfo).port;
  await new Promise<void>((ok) => server.close(() => ok()));
  return port;
}

/** Every file under dir whose bytes contain text (the VMs' logs, work dirs, the data dir). */
function filesContaining(dir: string, text: string): string[] {
  const found: string[] = [];
  const walk = (d: string) => {
    let names: string[];
    try {
      names = readdirSync(d);
    } catch {
      return;
    }
    for (const n of names) {
      const p = join(d, n);
      let st: ReturnType<typeof statSync>;
      try {
        st = statSync(p);
      } catch {
        continue;
      }
      if (st.isDirectory()) walk(p);
      else if (st.isFile() && st.size < 64 * 2 ** 20 && readFileSync(p).includes(text)) found.push(p);
    }
  };
  walk(dir);
  return found;
}

describe("end to end: registry pulls", () => {
  let sys: E2eSystem;
  let extraRegistry: ChildProcess | null = null;

  beforeAll(async () => {
    process.env[PASSWORD_ENV] = REG.password;
    process.env[WRONG_PASSWORD_ENV] = `${REG.password}-wrong`;
    sys = await E2eSystem.start({
      database: "pglite",
      sshServer: "embedded",
      runtimeEngine: "docker",
      maxInstances: 1,
      extraYaml: [
        "containers:",
        "  pullRetryTimeout: 3s",
        "  registries:",
        `    "${REG.auth}": {username: ${REG.user}, password: "env:${PASSWORD_ENV}"}`,
        `    "${WRONG}": {username: ${REG.user}, password: "env:${WRONG_PASSWORD_ENV}"}`,
      ].join("\n"),
    });
  }, 180_000);

  afterAll(async () => {
    if (extraRegistry !== null) {
      extraRegistry.kill("SIGTERM");
    }
    await sys?.stop();
    removePullImages();
  }, 120_000);

  const stderrOf = async (uuid: string) => (await sys.text(`/bundles/${uuid}/logs?stream=stderr`)).body;
  const run = (image: string, script = "test -s /data/blob && echo ok > /out/r") =>
    sys.submit({ image, command: ["sh", "-c", script] });

  it("pulls an image the daemon lacks, saying how far it got", async () => {
    const image = `${REG.open}/dctest/pull:1`;
    removePullImages();
    expect(onDaemon(image)).toBe(false);
    const uuid = await run(image);
    const b = await sys.waitState(uuid);
    const stderr = await stderrOf(uuid);
    expect(b, stderr).toMatchObject({ state: "ready", attempt: 1 });
    expect(stderr).toContain(`[crunch-run] pulling ${image} from ${REG.open}\n`);
    expect(stderr).toMatch(
      new RegExp(
        `\\[crunch-run\\] pulling ${image.replace(/\./g, "\\.")}: [0-9.]+ of (8\\.[0-9]|9\\.[0-9]) MB\\n`,
      ),
    );
    expect(stderr).toMatch(/\[crunch-run\] pulled \S+ in [0-9.]+ s\n/);
    expect(onDaemon(image)).toBe(true);
    // Cleared once the pull ended.
    expect(b["schedulingStatus"] ?? null).toBeNull();
  }, 180_000);

  it("pulls from the registry with basic auth with the configured credentials, which appear nowhere", async () => {
    const image = `${REG.auth}/dctest/pull:1`;
    removePullImages();
    const uuid = await run(image);
    const b = await sys.waitState(uuid);
    const stderr = await stderrOf(uuid);
    expect(b, stderr).toMatchObject({ state: "ready", attempt: 1 });
    // The auth registry is configured, so serve pinned the tag to its digest at submit time: that is pulled.
    const pinned = `${REG.auth}/dctest/pull@sha256:`;
    expect(String(b["imagePinned"] ?? "")).toMatch(/^127\.0\.0\.1:\d+\/dctest\/pull@sha256:[0-9a-f]{64}$/);
    expect(String(b["imagePinned"])).toContain(pinned);
    expect(stderr).toContain(`pulling ${String(b["imagePinned"])} from ${REG.auth} as ${REG.user}`);
    expect(stderr).not.toContain(REG.password);
    expect(sys.output()).not.toContain(REG.password);
    expect(filesContaining(sys.dir, REG.password)).toEqual([]);
  }, 180_000);

  it("fails a bundle at once when the registry refuses the password, naming the image and the registry", async () => {
    const image = `${WRONG}/dctest/busybox:1`;
    removeImage(image);
    const b = await sys.waitState(await run(image, "true"));
    expect(b).toMatchObject({ state: "failed", attempt: 1 });
    expect(b.stateReason).toContain(`image ${image} could not be pulled: registry ${WRONG} refused`);
    expect(b.stateReason).not.toContain(REG.password);
    expect(await sys.requeueReason(b.uuid)).toBeUndefined();
  }, 180_000);

  it("fails a bundle at once when the tag is not in the registry, naming the image", async () => {
    const image = `${REG.open}/dctest/busybox:no-such-tag`;
    const b = await sys.waitState(await run(image, "true"));
    expect(b).toMatchObject({ state: "failed", attempt: 1 });
    expect(b.stateReason).toContain(`image ${image} could not be pulled: no such image (`);
    expect(b.stateReason).toContain("manifest unknown");
  }, 180_000);

  it("pulls an image once for two bundles that need it on one instance", async () => {
    const image = `${REG.open}/dctest/pull:1`;
    removePullImages();
    const [a, c] = await Promise.all([run(image), run(image)]);
    const [ab, cb] = await Promise.all([sys.waitState(a), sys.waitState(c)]);
    expect([ab.state, cb.state]).toEqual(["ready", "ready"]);
    expect(ab["instanceId"] ?? ab["lastInstanceId"]).toBe(cb["instanceId"] ?? cb["lastInstanceId"]);
    const logs = [await stderrOf(a), await stderrOf(c)];
    const pulls = logs.join("").split(`pulling ${image} from `).length - 1;
    expect(pulls, logs.join("\n----\n")).toBe(1);
  }, 180_000);

  it("requeues a bundle whose registry is down without using up its attempts; it runs once the registry is back", async () => {
    const port = await freePort();
    const host = `127.0.0.1:${port}`;
    const image = `${host}/dctest/busybox:1`;
    const uuid = await run(image, "echo ran > /out/r");
    const reason = await until(
      "a requeue for the unavailable registry",
      async () => (await sys.requeueReason(uuid)) ?? undefined,
      120_000,
    );
    expect(reason).toContain(`image ${image} could not be pulled: registry ${host} is unavailable`);
    expect(reason).toMatch(/not counted as an attempt: 1 of 30 such requeues/);
    const stderr = (await sys.text(`/bundles/${uuid}/logs?stream=stderr&attempt=1`)).body;
    expect(stderr).toMatch(
      new RegExp(
        `pulling ${image.replace(/\./g, "\\.")}: registry \\S+ is unavailable \\(.*\\); retrying in 1 s`,
      ),
    );

    // None counted against the instance (a container that starts clears the record: look now).
    const vms = join(sys.dir, "vms");
    const lockDirs = readdirSync(vms).filter((vm) => existsSync(join(vms, vm, "root", "var", "lock")));
    expect(lockDirs.length).toBeGreaterThan(0);
    for (const vm of lockDirs) {
      for (const file of ["crunch-run-runtime-failures", "crunch-run-broken"]) {
        expect(existsSync(join(vms, vm, "root", "var", "lock", file)), `${vm}: ${file}`).toBe(false);
      }
    }
    // The registry comes up, serving the open registry's storage.
    const config = join(sys.dir, "registry.yml");
    await writeFile(
      config,
      `version: 0.1\nlog: {level: warn}\nstorage: {filesystem: {rootdirectory: ${REG.data}}}\nhttp: {addr: "${host}"}\n`,
    );
    extraRegistry = spawn("docker-registry", ["serve", config], { stdio: "ignore" });
    await until("the registry to answer", () =>
      fetch(`http://${host}/v2/`).then(
        (r) => (r.status === 200 ? true : undefined),
        () => undefined,
      ),
    );
    const b = await sys.waitState(uuid, ["ready", "failed", "killed"], 180_000);
    expect(b.state, b.stateReason ?? "").toBe("ready");
    const requeues = b.attempt - 1;
    expect(requeues).toBeGreaterThanOrEqual(1);
    // Every requeue for the registry gave its attempt back.
    expect(b["maxAttempts"]).toBe(3 + requeues);
    removeImage(image);
  }, 300_000);
});
