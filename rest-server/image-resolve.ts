/**
 * Submit-time resolution of a bundle's image (docs/images.md "Pinning"): a chain of resolvers is asked in order
 * (our store first, then registries) and the first answer is stored on the bundle, so every attempt runs the
 * same image. No answer leaves the reference unpinned (run as given: an image already on the instance, or a
 * pull of the name); that is not an error.
 */

import { imageKey } from "../lib/image-names.ts";
import type { Db } from "../store/db.ts";
import { findImage } from "../store/image-queries.ts";
import type { ImageStoreRef, NewBundle } from "../store/types.ts";

export { IMAGE_ID_PATTERN, IMAGE_NAME_PATTERN, normalizeImageName } from "../lib/image-names.ts";

export interface ImageResolution {
  /** The immutable reference to run: `sha256:<image id hex>` (our store) or `repo@sha256:<hex>` (a registry). */
  pinned: string;
  /** The image is in our store: its tree's manifest, image id and bytes; null otherwise. */
  store: ImageStoreRef | null;
}

/** One way to resolve a reference for its owner; null: not this resolver's to answer. */
export type ImageResolver = (ref: string, ownerUuid: string) => Promise<ImageResolution | null>;

/** The store resolver: the owner's image named `ref`, by name or by `sha256:` image id. */
export function storeImageResolver(db: Db): ImageResolver {
  return async (ref, ownerUuid) => {
    const key = imageKey(ref);
    if (key === null) return null;
    const img = await findImage(db, ownerUuid, key);
    if (img === null) return null;
    return { pinned: img.imageId, store: { manifest: img.manifest, imageId: img.imageId, bytes: img.bytes } };
  };
}

/** The first answer of the chain, or null. */
export async function resolveImage(
  chain: readonly ImageResolver[],
  ref: string,
  ownerUuid: string,
): Promise<ImageResolution | null> {
  for (const resolve of chain) {
    const r = await resolve(ref, ownerUuid);
    if (r !== null) return r;
  }
  return null;
}

/** Distinct references resolved at once by pinImages (a batch of 10,000 bundles may name many images). */
const RESOLVE_CONCURRENCY = 8;

/**
 * The bundles with their images resolved (each distinct image once, a few at a time), ready to insert:
 * `imagePinned` and `imageStore` set where the chain answered. A bundle without an image (an upload) is left as it is.
 */
export async function pinImages<T extends NewBundle>(
  chain: readonly ImageResolver[],
  bundles: readonly T[],
): Promise<T[]> {
  if (chain.length === 0) return [...bundles];
  const key = (b: NewBundle) => `${b.ownerUuid}\u0000${b.image}`;
  const distinct = [...new Map(bundles.filter((b) => b.image !== "").map((b) => [key(b), b])).values()];
  const answers = new Map<string, ImageResolution | null>();
  let next = 0;
  const worker = async () => {
    while (next < distinct.length) {
      const b = distinct[next++]!;
      answers.set(key(b), await resolveImage(chain, b.image, b.ownerUuid));
    }
  };
  await Promise.all(Array.from({ length: Math.min(RESOLVE_CONCURRENCY, distinct.length) }, worker));
  return bundles.map((b) => {
    const r = b.image === "" ? null : (answers.get(key(b)) ?? null);
    return r === null ? b : { ...b, imagePinned: r.pinned, imageStore: r.store };
  });
}
