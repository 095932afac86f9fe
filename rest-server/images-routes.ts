/**
 * The users' API for images in the content-addressed store (docs/images.md "Images in our store"; docs/api.md
 * "Images"): `dispatch-cloud images push` uploads an image's unpacked `docker save` tree through the CAS, then
 * registers it here under a name; bundles that name the image (by name or by `sha256:` id) are pinned to it at
 * submit time (image-resolve.ts).
 */
import { Type } from "@sinclair/typebox";
import type { FastifyInstance, FastifyRequest } from "fastify";
import { formatDigest, parseDigest } from "../lib/cas/digest.ts";
import { manifestStats } from "../lib/cas/manifest.ts";
import { DispatchCloudError } from "../lib/errors.ts";
import { deleteImage, findImage, listImages, putImage, type StoredImage } from "../store/image-queries.ts";
import { callerOf, userAuthHook } from "./auth.ts";
import { readManifest } from "./cas/routes.ts";
import type { RouteContext } from "./context.ts";
import { IMAGE_ID_PATTERN, normalizeImageName } from "./image-resolve.ts";
import { validate } from "./validate.ts";

/** `POST /images`: an image whose tree the caller uploaded to the store. */
export const ImageRequest = Type.Object(
  {
    name: Type.String({
      maxLength: 255,
      description:
        "The name bundles use (`repo[:tag]`, with an optional registry host); `:latest` is added when there is no tag. A second push of a name replaces what it named.",
    }),
    manifest: Type.String({
      maxLength: 100,
      description:
        "The digest (<sha256 hex>/<size>) of the manifest of the image's unpacked `docker save` tree.",
    }),
    imageId: Type.String({ maxLength: 71, description: "The image's id: `sha256:<hex>` of its config." }),
  },
  { additionalProperties: false },
);

export function imageView(i: StoredImage) {
  return {
    name: i.name,
    imageId: i.imageId,
    manifest: i.manifest,
    bytes: i.bytes,
    createdAt: i.createdAt.toISOString(),
  };
}

const notFound = (ref: string) =>
  new DispatchCloudError(
    "images.not_found",
    `you have no image ${JSON.stringify(ref.slice(0, 300))} in the store`,
    {
      path: "ref",
    },
  );

/** The `:ref` path parameter: an image id, or a name (percent-encoded: `/` as %2F), normalised. */
function refParam(request: FastifyRequest): string {
  const ref = (request.params as Record<string, string | undefined>)["ref"] ?? "";
  if (IMAGE_ID.test(ref)) return ref;
  const name = normalizeImageName(ref);
  if (name === null) {
    throw new DispatchCloudError(
      "images.invalid_name",
      `ref: ${JSON.stringify(ref.slice(0, 300))} is neither an image name nor an image id (sha256:<64 hex>)`,
      { path: "ref" },
    );
  }
  return name;
}

const IMAGE_ID = new RegExp(IMAGE_ID_PATTERN);

export function registerImageRoutes(app: FastifyInstance, ctx: RouteContext): void {
  const { db } = ctx;
  const onRequest = userAuthHook(db, ctx.nowMs, ctx.tokenCache);

  app.post("/api/v1/images", { onRequest }, async (request, reply) => {
    const caller = callerOf(request);
    const body = validate(ImageRequest, request.body);
    const name = normalizeImageName(body.name);
    if (name === null) {
      throw new DispatchCloudError(
        "images.invalid_name",
        `name: ${JSON.stringify(body.name)} is not an image name (repo[:tag], lowercase repository, optional registry host; not sha256:...)`,
        { path: "name" },
      );
    }
    if (!IMAGE_ID.test(body.imageId)) {
      throw new DispatchCloudError(
        "images.invalid_image_id",
        `imageId: ${JSON.stringify(body.imageId)} is not sha256: followed by 64 lowercase hex digits`,
        { path: "imageId" },
      );
    }
    const d = parseDigest(body.manifest, "manifest");
    const backend = ctx.casBackend;
    const manifest =
      backend === null ? null : await readManifest(db, backend, { userUuid: caller.uuid, manifests: [] }, d);
    if (manifest === null) {
      throw new DispatchCloudError(
        "images.unknown_manifest",
        `manifest: ${formatDigest(d)} is not a manifest in the store that you may read; upload the image's tree first`,
        { path: "manifest" },
      );
    }
    // The tree must be what `docker save` wrote for this image: its manifest.json, and its config, a file whose
    // bytes hash to the image id (`<hex>.json` in docker's own layout, `blobs/sha256/<hex>` in OCI's).
    const hex = body.imageId.slice("sha256:".length);
    const hasIndex = manifest.entries.some((e) => e.path === "manifest.json" && e.type === "file");
    const hasConfig = manifest.entries.some((e) => e.type === "file" && e.digest.hash === hex);
    if (!hasIndex || !hasConfig) {
      throw new DispatchCloudError(
        "images.config_missing",
        `imageId: the tree ${formatDigest(d)} has ${hasIndex ? "no file whose bytes hash to" : "no manifest.json: it is not a docker save of"} ${body.imageId}`,
        { path: "imageId" },
      );
    }
    const { bytes } = manifestStats(manifest);
    const { image, replaced } = await putImage(
      db,
      { ownerUuid: caller.uuid, name, imageId: body.imageId, manifest: formatDigest(d), bytes },
      new Date(ctx.nowMs()),
    );
    request.log.info(
      { owner: caller.uuid, name, imageId: body.imageId, bytes, replaced },
      "image registered",
    );
    return reply.code(201).send({ ...imageView(image), replaced });
  });

  app.get("/api/v1/images", { onRequest }, async (request) => ({
    items: (await listImages(db, callerOf(request).uuid)).map(imageView),
  }));

  app.get("/api/v1/images/:ref", { onRequest }, async (request) => {
    const ref = refParam(request);
    const image = await findImage(db, callerOf(request).uuid, ref);
    if (image === null) throw notFound(ref);
    return imageView(image);
  });

  // Removes the name (or, by id, every name of that image). Bundles already pinned to it still run it: their
  // attempts read the tree they were pinned to, kept until they finish (docs/images.md "Pinning").
  app.delete("/api/v1/images/:ref", { onRequest }, async (request) => {
    const ref = refParam(request);
    const removed = await deleteImage(db, callerOf(request).uuid, ref);
    if (removed.length === 0) throw notFound(ref);
    // The owner's right to the image tree's blobs may end here (cas/readable-cache.ts).
    ctx.casReadable.forgetUser(callerOf(request).uuid);
    request.log.info({ owner: callerOf(request).uuid, ref, count: removed.length }, "image removed");
    return { removed: removed.map(imageView) };
  });
}
