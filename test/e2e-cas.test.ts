/**
 * End to end through the content-addressed store (docs/storage.md): `serve` on PGlite with a local VM behind the
 * embedded SSH server and real Docker. A bundle's 1,000 output files go to the store by digest; a bundle that
 * depends on it is staged on the instance from the instance's cache, which fetches only that bundle's blobs; a
 * second such bundle on the same instance fetches nothing. The runner's figures reach the bundle's resource
 * usage, its stderr log and the store's metrics.
 */
import { execFile } from "node:child_process";
import { mkdir, symlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { parseDigest } from "../lib/cas/digest.ts";
import { E2eSystem } from "./e2e-harness.ts";
import { requireDockerImage } from "./local-driver-helpers.ts";
import { BIN } from "./serve-process.ts";

const IMAGE = requireDockerImage();

describe("end to end: inputs and outputs by digest, the instance's cache", () => {
  let sys: E2eSystem;

  beforeAll(async () => {
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
  }, 120_000);

  const usage = (b: Record<string, unknown>) => (b["resourceUsage"] ?? {}) as Record<string, number>;

  it("stages B's input from the store once, then from the instance's cache alone", async () => {
    const a = await sys.submit({
      image: IMAGE,
      command: [
        "sh",
        "-c",
        "mkdir -p /out/d && i=0 && while [ $i -lt 1000 ]; do echo file-$i > /out/d/f$i; i=$((i+1)); done",
      ],
    });
    const av = await sys.waitState(a);
    expect(av.state, JSON.stringify(av)).toBe("ready");
    const manifest = parseDigest(av["outputManifest"]);
    const outputBytes = av["outputBytes"] as number;
    expect(outputBytes).toBe(
      Array.from({ length: 1000 }, (_, i) => `file-${i}\n`.length).reduce((x, y) => x + y),
    );
    // The outputs API reads them from the store.
    expect((await sys.text(`/bundles/${a}/outputs/d/f7`)).body).toBe("file-7\n");

    const reader = (name: string) =>
      sys.submit({
        image: IMAGE,
        name,
        command: [
          "sh",
          "-c",
          "ls /in/a/d | wc -l > /out/n && cat /in/a/d/f999 > /out/last && ! touch /in/a/d/f1",
        ],
        dependencies: [{ bundle: a, name: "a" }],
      });
    const b = await reader("B");
    const bv = await sys.waitState(b);
    expect(bv.state, JSON.stringify(bv)).toBe("ready");
    expect((await sys.text(`/bundles/${b}/outputs/n`)).body.trim()).toBe("1000");
    expect((await sys.text(`/bundles/${b}/outputs/last`)).body).toBe("file-999\n");
    // Every file differs: 1,000 blobs and the manifest, their bytes and nothing more.
    expect(usage(bv)).toMatchObject({
      casBlobsHit: 0,
      casBlobsFetched: 1001,
      casBytesFetched: outputBytes + manifest.size,
    });

    const c = await reader("C");
    const cv = await sys.waitState(c);
    expect(cv.state, JSON.stringify(cv)).toBe("ready");
    expect(cv.instanceId).toBe(bv.instanceId);
    expect(usage(cv)).toMatchObject({ casBlobsHit: 1000, casBlobsFetched: 0, casBytesFetched: 0 });
    expect((await sys.text(`/bundles/${c}/outputs/n`)).body.trim()).toBe("1000");

    const stderr = (await sys.text(`/bundles/${c}/logs?stream=stderr`)).body;
    expect(stderr).toMatch(/staged dependency 0 .* fetched 0 \(0 ?B\) in \d+ ms/);
    expect(usage(cv).stagingSeconds).toBeGreaterThan(0);
    expect(await sys.metricSum("dispatchcloud_cas_vm_cache_misses_total", {})).toBe(1001);
    expect(await sys.metricSum("dispatchcloud_cas_vm_cache_hits_total", {})).toBe(1000);
    expect(await sys.metricSum("dispatchcloud_cas_vm_fetched_bytes_total", {})).toBe(
      outputBytes + manifest.size,
    );
  }, 300_000);

  it("`upload DIR` stores a local tree once, as a ready bundle that a bundle mounts as its input", async () => {
    const tree = join(sys.dir, "upload-me");
    await mkdir(join(tree, "sub"), { recursive: true });
    await writeFile(join(tree, "sub", "data.txt"), "uploaded bytes\n");
    await writeFile(join(tree, "big"), Buffer.alloc(300_000, 7));
    await symlink("sub/data.txt", join(tree, "alias"));
    const upload = () =>
      promisify(execFile)(BIN, ["upload", tree, "--name", "my-tree", "--api-url", sys.apiUrl], {
        cwd: sys.dir,
        env: { ...process.env, DISPATCH_CLOUD_DATA_DIR: join(sys.dir, "data") },
      });
    const first = await upload();
    const uuid = first.stdout.trim();
    expect(first.stderr).toMatch(
      /uploaded 2 files.* 0 of 2 blobs already stored; manifest [0-9a-f]{64}\/\d+/,
    );
    const uploaded = await sys.get(uuid);
    expect(uploaded).toMatchObject({ state: "ready", name: "my-tree", stateReason: "uploaded" });
    // The same tree again: nothing is sent; a new bundle names the same manifest.
    const again = await upload();
    expect(again.stderr).toMatch(/sent 0 ?B, 2 of 2 blobs already stored/);
    expect((await sys.get(again.stdout.trim()))["outputManifest"]).toBe(uploaded["outputManifest"]);

    const user = await sys.submit({
      image: IMAGE,
      command: ["sh", "-c", "cat /in/t/alias > /out/copy && wc -c < /in/t/big > /out/size"],
      dependencies: [{ bundle: uuid, name: "t" }],
    });
    const v = await sys.waitState(user);
    expect(v.state, JSON.stringify(v)).toBe("ready");
    expect((await sys.text(`/bundles/${user}/outputs/copy`)).body).toBe("uploaded bytes\n");
    expect((await sys.text(`/bundles/${user}/outputs/size`)).body.trim()).toBe("300000");
  }, 300_000);
});
