/**
 * `dispatch-cloud images push|list|rm` (docs/images.md "Images in our store"): a local image saved with `docker
 * save`, unpacked into a temporary directory and uploaded through the content-addressed store like `upload DIR`
 * (each layer is one file, so one blob: layers shared by images are stored and sent once), then registered under
 * a name; bundles naming it run it on instances that lack it (crunch-run loads it from the store).
 */
import { spawn } from "node:child_process";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { formatDigest } from "../../lib/cas/digest.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { normalizeImageName } from "../../lib/image-names.ts";
import { extractTar } from "../../lib/tar.ts";
import { formatSize } from "../../lib/units.ts";
import { CLIENT_OPTIONS, parse } from "../args.ts";
import { DEFAULT_API_URL, findToken } from "../client.ts";
import { type CliIo, EXIT_OK, usageError } from "../io.ts";
import { connect, table } from "./client-common.ts";
import { uploadTreeShowingProgress } from "./upload.ts";

const USAGE = `usage: dispatch-cloud images push IMAGE [--name NAME] [--json]
       dispatch-cloud images list [--json]
       dispatch-cloud images rm NAME|sha256:ID...
  push: saves IMAGE from the local Docker daemon (docker save), uploads what the store lacks, and registers it
        as NAME (default IMAGE); bundles that name it (submit --image NAME, or its sha256: id) run it.
  list: your images in the store.   rm: forgets names (bundles already pinned to an image still run it).`;

interface ApiImage {
  name: string;
  imageId: string;
  manifest: string;
  bytes: number;
  createdAt: string;
  replaced?: boolean;
}

export async function imagesCommand(io: CliIo): Promise<number> {
  const [sub, ...rest] = io.argv;
  if (sub === "push") return push({ ...io, argv: rest });
  if (sub === "list" || sub === "ls") return list({ ...io, argv: rest });
  if (sub === "rm") return remove({ ...io, argv: rest });
  if (sub === "--help" || sub === "-h" || sub === "help") {
    io.out(USAGE);
    return EXIT_OK;
  }
  throw usageError(USAGE);
}

const saveFailed = (image: string, why: string) =>
  new DispatchCloudError("cli.docker_save_failed", `docker save ${image} failed: ${why}`);

/** `docker save IMAGE` unpacked into dir (the docker command's stderr is kept for the error). */
async function dockerSave(io: CliIo, image: string, dir: string): Promise<void> {
  const child = spawn("docker", ["save", image], {
    env: io.env as NodeJS.ProcessEnv,
    stdio: ["ignore", "pipe", "pipe"],
    ...(io.signal === undefined ? {} : { signal: io.signal }),
  });
  let stderr = "";
  child.stderr.on("data", (c: Buffer) => {
    if (stderr.length < 2000) stderr += c.toString("utf8");
  });
  const exited = new Promise<number | null>((resolve, reject) => {
    child.on("error", reject);
    child.on("close", (code) => resolve(code));
  });
  let extracted: unknown = null;
  const extracting = extractTar(child.stdout, dir).catch((err: unknown) => {
    extracted = err;
    child.stdout.resume();
  });
  let code: number | null;
  try {
    code = await exited;
  } catch (err) {
    const e = err as NodeJS.ErrnoException;
    throw saveFailed(image, e.code === "ENOENT" ? "no docker command on this machine's PATH" : e.message);
  }
  await extracting;
  if (code !== 0) throw saveFailed(image, stderr.trim() || `docker exited with code ${code}`);
  if (extracted !== null)
    throw saveFailed(image, `its archive could not be unpacked: ${(extracted as Error).message}`);
}

/** The image id (`sha256:<hex>`) from an unpacked save's manifest.json: its config's file name. */
export async function savedImageId(dir: string): Promise<string> {
  let index: unknown;
  try {
    index = JSON.parse(await readFile(join(dir, "manifest.json"), "utf8"));
  } catch (err) {
    throw new Error(`no readable manifest.json: ${(err as Error).message}`);
  }
  const config = Array.isArray(index) ? (index[0] as { Config?: unknown } | undefined)?.Config : undefined;
  const m = typeof config === "string" ? /(?:^|\/)([0-9a-f]{64})(?:\.json)?$/.exec(config) : null;
  if (m === null) throw new Error("manifest.json names no config of the form <sha256 hex>[.json]");
  return `sha256:${m[1]}`;
}

async function push(io: CliIo): Promise<number> {
  const { values, positionals } = parse(io.argv, { ...CLIENT_OPTIONS, name: { type: "string" } });
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  if (positionals.length !== 1) throw usageError(USAGE);
  const image = positionals[0]!;
  const name = values.name ?? image;
  if (/^(sha256:)?[0-9a-f]{12,64}$/.test(name)) {
    throw usageError(`${image} is an image id, not a name: give the name to register it under with --name`);
  }
  // Checked before anything is saved or sent (the server checks again).
  if (normalizeImageName(name) === null) {
    throw usageError(
      `${JSON.stringify(name)} is not an image name (repo[:tag], lowercase repository, optional registry host); give one with --name`,
    );
  }
  const apiUrl = values["api-url"] ?? io.env["DISPATCH_CLOUD_API_URL"] ?? DEFAULT_API_URL;
  const token = await findToken(io, {
    ...(values["token-file"] === undefined ? {} : { tokenFile: values["token-file"] }),
    ...(values["data-dir"] === undefined ? {} : { dataDir: values["data-dir"] }),
  });
  const dir = await mkdtemp(join(tmpdir(), "dispatch-cloud-image-"));
  try {
    io.progress(`saving ${image} (docker save)...`);
    await dockerSave(io, image, dir);
    let imageId: string;
    try {
      imageId = await savedImageId(dir);
    } catch (err) {
      throw saveFailed(image, (err as Error).message);
    }
    const up = await uploadTreeShowingProgress(io, { apiUrl, token, dir, shownAs: image });
    io.progress(
      `uploaded ${image}: ${up.files} files, ${formatSize(up.bytes)}; sent ${formatSize(up.bytesSent)}, ` +
        `${up.blobsSkipped} of ${up.blobsSkipped + up.blobsUploaded} blobs already stored`,
    );
    const api = await connect(io, values);
    const img = await api.request<ApiImage>("POST", "api/v1/images", {
      name,
      manifest: formatDigest(up.digest),
      imageId,
    });
    if (values.json === true) io.out(JSON.stringify(img, null, 2));
    else
      io.out(
        `${img.name} ${img.imageId}${img.replaced === true ? " (replaced the image of that name)" : ""}`,
      );
    return EXIT_OK;
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

async function list(io: CliIo): Promise<number> {
  const { values, positionals } = parse(io.argv, CLIENT_OPTIONS);
  if (values.help === true || positionals.length > 0) {
    if (values.help !== true) throw usageError(USAGE);
    io.out(USAGE);
    return EXIT_OK;
  }
  const api = await connect(io, values);
  const { items } = await api.request<{ items: ApiImage[] }>("GET", "api/v1/images");
  if (values.json === true) {
    io.out(JSON.stringify(items, null, 2));
    return EXIT_OK;
  }
  const rows = items.map((i) => [i.name, i.imageId.slice(7, 19), formatSize(i.bytes), i.createdAt]);
  for (const line of table([["NAME", "IMAGE ID", "SIZE", "PUSHED"], ...rows])) io.out(line);
  return EXIT_OK;
}

async function remove(io: CliIo): Promise<number> {
  const { values, positionals } = parse(io.argv, CLIENT_OPTIONS);
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  if (positionals.length === 0) throw usageError(USAGE);
  const api = await connect(io, values);
  for (const ref of positionals) {
    const { removed } = await api.request<{ removed: ApiImage[] }>(
      "DELETE",
      `api/v1/images/${encodeURIComponent(ref)}`,
    );
    for (const i of removed) io.out(`removed ${i.name} ${i.imageId}`);
  }
  return EXIT_OK;
}
