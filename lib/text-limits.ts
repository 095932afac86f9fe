/**
 * What a string from a request may hold before it reaches the filesystem, the database or a log: the length
 * limits of Linux paths (255 bytes per name, 4096 per path), lone UTF-16 surrogates (no UTF-8 encoding
 * exists for them, so storing one would silently replace it), and control characters and line breaks (which
 * make no sense in an image name, a bundle name or a reason, and would forge lines in logs).
 */

/** The longest file name Linux filesystems accept, in bytes (NAME_MAX). */
export const MAX_NAME_BYTES = 255;
/** The longest path Linux accepts, in bytes (PATH_MAX). */
export const MAX_PATH_BYTES = 4096;

/** Why a relative path, split into its names, cannot be a path on Linux (too long), or undefined. */
export function pathLengthProblem(names: readonly string[]): string | undefined {
  for (const name of names) {
    const bytes = Buffer.byteLength(name);
    if (bytes > MAX_NAME_BYTES) {
      return `has a name of ${bytes} bytes (at most ${MAX_NAME_BYTES}): ${JSON.stringify(`${name.slice(0, 40)}...`)}`;
    }
  }
  const bytes = Buffer.byteLength(names.join("/"));
  if (bytes > MAX_PATH_BYTES) return `is ${bytes} bytes long (at most ${MAX_PATH_BYTES})`;
  return undefined;
}

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/** True when `s` has a UTF-16 surrogate without its pair (as JSON's "\ud800" gives), which UTF-8 cannot hold. */
export function hasLoneSurrogate(s: string): boolean {
  return LONE_SURROGATE.test(s);
}

/**
 * The characters refused in names, images and reasons: C0 and C1 controls, DEL, and the Unicode line and
 * paragraph separators. As a JSON Schema `pattern` body (no `u` flag needed), so the OpenAPI documents show it.
 */
export const CONTROL_CHARACTERS = "\\u0000-\\u001f\\u007f-\\u009f\\u2028\\u2029";

const CONTROL = new RegExp(`[${CONTROL_CHARACTERS}]`);

/** True when `s` has a control character or a line break (see CONTROL_CHARACTERS). */
export function hasControlCharacter(s: string): boolean {
  return CONTROL.test(s);
}

/** A JSON Schema pattern: no control characters or line breaks. */
export const NO_CONTROL_PATTERN = `^[^${CONTROL_CHARACTERS}]*$`;
