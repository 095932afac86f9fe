/**
 * Container image references as dispatch-cloud reads them (docs/images.md): image ids and the names images in the
 * store are kept under. Shared by the REST server (the images API, submit-time resolution) and the store (the
 * insert statements resolve a bundle's image among its owner's images).
 */

/** `sha256:` and 64 lowercase hex digits: an image id (the config's digest). */
export const IMAGE_ID_PATTERN = "^sha256:[0-9a-f]{64}$";
/**
 * A name `docker tag` accepts: an optional registry host[:port]/, a lowercase repository path, an optional :tag.
 * (Digests are not names: an image in the store is named by its id instead.)
 */
export const IMAGE_NAME_PATTERN =
  "^(?:[a-z0-9][a-z0-9.-]*(?::[0-9]{1,5})?/)?[a-z0-9][a-z0-9._/-]{0,199}(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$";
const IMAGE_NAME = new RegExp(IMAGE_NAME_PATTERN);
export const IMAGE_ID = new RegExp(IMAGE_ID_PATTERN);

/**
 * The name as stored: with its tag (`:latest` when it has none), as docker reads it, so `busybox` and
 * `busybox:latest` are one image. Null when it is not a name.
 */
export function normalizeImageName(name: string): string | null {
  if (name.startsWith("sha256:") || name.length > 255 || !IMAGE_NAME.test(name)) return null;
  const last = name.slice(name.lastIndexOf("/") + 1);
  return last.includes(":") ? name : `${name}:latest`;
}

/**
 * What a bundle's `image` is looked up by among its owner's images: the image id as it is, a name normalised; null
 * when it is neither (it can name no image in the store).
 */
export function imageKey(image: string): string | null {
  return IMAGE_ID.test(image) ? image : normalizeImageName(image);
}
