/**
 * End to end, images in our store (docs/images.md): `serve` on PGlite with local VMs behind the embedded SSH
 * server and real Docker, no registry. `dispatch-cloud images push` saves a local image into the content-addressed
 * store; the image is then removed from the daemon (every local VM shares one dockerd), and a bundle naming it
 * runs on a fresh VM, which loads it from the store. The first VM is destroyed and the image removed again: a
 * bundle on a second VM loads it from the store once more, and nothing is uploaded to the store meanwhile.
 */
import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { join } from "node:path";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { E2eSystem } from "./e2e-harness.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";
import { BIN } from "./serve-process.ts";

const BASE = requireDockerImage();
const run = promisify(execFile);
const docker = (...args: string[]) => run("docker", args, { timeout: 60_000 });

describe("end to end: an image pushed into the store, loaded on fresh VMs", () => {
  let sys: E2eSystem;
  const nonce = randomBytes(6).toString("hex");
  const image = `dctest/e2e-images-${nonce}:1`;
  const container = `dctest-e2e-images-${nonce}`;
  let imageId = "";

  beforeAll(async () => {
    // An image of its own (a layer holding the nonce on top of the test image), so no other test has it.
    await docker("run", "--name", container, BASE, "sh", "-c", `echo ${nonce} > /nonce`);
    await docker("commit", container, image);
    await docker("rm", "-f", container);
    imageId = (await docker("image", "inspect", "--format", "{{.Id}}", image)).stdout.trim();
    sys = await E2eSystem.start({
      database: "pglite",
      sshServer: "embedded",
      runtimeEngine: "docker",
      management: true,
      maxInstances: 1,
    });
  }, 180_000);

  afterAll(async () => {
    await sys?.stop();
    await docker("rm", "-f", container).catch(() => {});
    await docker("rmi", "-f", imageId || image).catch(() => {});
  }, 120_000);

  const cli = (...args: string[]) =>
    run(BIN, [...args, "--api-url", sys.apiUrl], {
      cwd: sys.dir,
      env: { ...process.env, DISPATCH_CLOUD_DATA_DIR: join(sys.dir, "data") },
      timeout: 120_000,
    });
  const removeFromDaemon = async () => {
    await docker("rmi", "-f", imageId);
    await expect(docker("image", "inspect", imageId)).rejects.toThrow();
  };
  const usage = (b: Record<string, unknown>) => (b["resourceUsage"] ?? {}) as Record<string, number>;

  it("push, then bundles on two fresh VMs load it from the store without anything uploaded again", async () => {
    const pushed = await cli("images", "push", image);
    expect(pushed.stdout.trim()).toBe(`${image} ${imageId}`);
    expect(pushed.stderr).toMatch(/uploaded dctest\/e2e-images-[0-9a-f]+:1: \d+ files/);
    const list = await cli("images", "list", "--json");
    const listed = (JSON.parse(list.stdout) as { name: string; imageId: string; bytes: number }[]).find(
      (i) => i.name === image,
    );
    expect(listed?.imageId).toBe(imageId);
    // A second push of the same image sends nothing: every layer is a blob the store has.
    const again = await cli("images", "push", image);
    expect(again.stderr).toMatch(/sent 0 ?B, (\d+) of \1 blobs already stored/);
    const uploaded = await sys.metricSum("dispatchcloud_cas_uploaded_bytes_total", {});
    expect(uploaded).toBeGreaterThan(0);

    await removeFromDaemon();
    const a = await sys.submit({ image, command: ["sh", "-c", "cat /nonce > /out/n"] });
    expect((await sys.get(a))["imagePinned"]).toBe(imageId);
    const av = await sys.waitState(a);
    expect(av.state, JSON.stringify(av)).toBe("ready");
    expect((await sys.text(`/bundles/${a}/outputs/n`)).body.trim()).toBe(nonce);
    const aLog = (await sys.text(`/bundles/${a}/logs?stream=stderr`)).body;
    expect(aLog).toMatch(/image dctest\/e2e-images-\w+:1 is not on this instance: loading it from the store/);
    expect(aLog).toMatch(/fetched image .* from the instance's cache 0 blobs, fetched \d+/);
    expect(aLog).toMatch(/loaded image dctest\/e2e-images-\w+:1 \(sha256:\w+\) into Docker from the store/);
    expect(usage(av).casBlobsFetched).toBeGreaterThan(0);
    // crunch-run tagged what it loaded with the bundle's name.
    expect((await docker("image", "inspect", "--format", "{{.Id}}", image)).stdout.trim()).toBe(imageId);

    // The first VM goes away; the image leaves the daemon again. The next bundle needs a new VM.
    const first = av.instanceId as string;
    await sys.manage("POST", "/instances/kill", { instance_id: first, reason: "e2e: a fresh VM next" });
    await removeFromDaemon();
    const fetchedBefore = await sys.metricSum("dispatchcloud_cas_vm_fetched_bytes_total", {});
    // (A's output, 13 bytes, was uploaded since the push; B's is the same file, so it adds nothing.)
    const uploadedBefore = await sys.metricSum("dispatchcloud_cas_uploaded_bytes_total", {});
    expect(uploadedBefore).toBe(uploaded + nonce.length + 1);
    const b = await sys.submit({ image, command: ["sh", "-c", "cat /nonce > /out/n"] });
    const bv = await sys.waitState(b, ["ready", "failed", "killed"], 240_000);
    expect(bv.state, JSON.stringify(bv)).toBe("ready");
    expect(bv.instanceId).not.toBe(first);
    expect((await sys.text(`/bundles/${b}/outputs/n`)).body.trim()).toBe(nonce);
    const bLog = (await sys.text(`/bundles/${b}/logs?stream=stderr`)).body;
    expect(bLog).toMatch(/loaded image dctest\/e2e-images-\w+:1 \(sha256:\w+\) into Docker from the store/);
    // Loaded from the CAS: the second VM fetched the tree; nobody uploaded anything to the store meanwhile.
    expect(usage(bv).casBlobsFetched).toBe(usage(av).casBlobsFetched);
    expect(await sys.metricSum("dispatchcloud_cas_vm_fetched_bytes_total", {})).toBeGreaterThan(
      fetchedBefore,
    );
    expect(await sys.metricSum("dispatchcloud_cas_uploaded_bytes_total", {})).toBe(uploadedBefore);

    // Removing the name: a new bundle naming it is not pinned; `images list` no longer shows it.
    expect((await cli("images", "rm", image)).stdout).toContain(`removed ${image} ${imageId}`);
    expect(JSON.parse((await cli("images", "list", "--json")).stdout)).toEqual([]);
  }, 600_000);
});
