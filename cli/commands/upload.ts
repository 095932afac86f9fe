/**
 * `dispatch-cloud upload DIR`: a local directory into the content-addressed store (docs/storage.md). Every file
 * is hashed, the store is asked which blobs it lacks, only those are sent (compressed when that pays), then the
 * manifest; the tree becomes a ready bundle that other bundles name with `--depends-on`. Progress goes to
 * stderr; stdout is the new bundle's uuid alone, so scripts can take it.
 */
import { resolve } from "node:path";
import { createCasClient, type UploadProgress, type UploadTreeResult } from "../../lib/cas/client.ts";
import { formatDigest } from "../../lib/cas/digest.ts";
import { formatSize } from "../../lib/units.ts";
import { CLIENT_OPTIONS, parse } from "../args.ts";
import { DEFAULT_API_URL, findToken } from "../client.ts";
import { type CliIo, EXIT_OK, usageError } from "../io.ts";
import { type ApiBundle, connect } from "./client-common.ts";

const USAGE = `usage: dispatch-cloud upload DIR [--name NAME] [--json]
  Uploads DIR's files (only what the store lacks) and keeps the tree as a ready bundle; prints its uuid.
  Use it as an input: dispatch-cloud submit --depends-on UUID[:SUBPATH[:NAME]] ...`;

export async function uploadCommand(io: CliIo): Promise<number> {
  const { values, positionals } = parse(io.argv, { ...CLIENT_OPTIONS, name: { type: "string" } });
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  if (positionals.length !== 1) throw usageError(USAGE);
  const dir = resolve(io.cwd, positionals[0]!);
  const apiUrl = values["api-url"] ?? io.env["DISPATCH_CLOUD_API_URL"] ?? DEFAULT_API_URL;
  const token = await findToken(io, {
    ...(values["token-file"] === undefined ? {} : { tokenFile: values["token-file"] }),
    ...(values["data-dir"] === undefined ? {} : { dataDir: values["data-dir"] }),
  });
  const up = await uploadTreeShowingProgress(io, { apiUrl, token, dir, shownAs: positionals[0]! });
  io.progress(
    `uploaded ${up.files} files, ${formatSize(up.bytes)}: sent ${formatSize(up.bytesSent)}, ` +
      `${up.blobsSkipped} of ${up.blobsSkipped + up.blobsUploaded} blobs already stored; manifest ${formatDigest(up.digest)}`,
  );
  const api = await connect(io, values);
  const b = await api.request<ApiBundle>("POST", "api/v1/bundles/uploads", {
    manifest: formatDigest(up.digest),
    ...(values.name === undefined ? {} : { name: values.name }),
  });
  if (values.json === true) io.out(JSON.stringify(b, null, 2));
  else io.out(b.uuid);
  return EXIT_OK;
}

/**
 * Uploads the tree at `dir` to the store (only what it lacks), with a progress bar on stderr (redrawn at most
 * twice a second while blobs go up); `shownAs` names the tree in messages. Used by `upload` and `images push`.
 */
export async function uploadTreeShowingProgress(
  io: CliIo,
  opts: { apiUrl: string; token: string; dir: string; shownAs: string },
): Promise<UploadTreeResult> {
  const cas = createCasClient({
    url: opts.apiUrl,
    token: opts.token,
    ...(io.signal === undefined ? {} : { signal: io.signal }),
  });
  const started = Date.now();
  let lastShown = 0;
  const show = (p: UploadProgress) => {
    const now = Date.now();
    if (p.phase === "uploaded" && now - lastShown < 500 && p.blobsDone < p.blobsTotal) return;
    lastShown = now;
    const width = 30;
    const filled = p.blobsTotal === 0 ? width : Math.round((p.blobsDone / p.blobsTotal) * width);
    const what =
      p.phase === "hashed" ? "hashed" : p.phase === "checked" ? "checked with the store" : "uploading";
    io.progress(
      `[${"#".repeat(filled)}${".".repeat(width - filled)}] ${p.blobsDone}/${p.blobsTotal} blobs, ` +
        `${formatSize(p.bytesSent)} sent (${what}, ${((now - started) / 1000).toFixed(1)}s)`,
    );
  };
  try {
    return await cas.uploadTree(opts.dir, {
      shownAs: opts.shownAs,
      absoluteRoot: opts.dir,
      onProgress: show,
    });
  } finally {
    cas.close();
  }
}
