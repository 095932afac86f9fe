import type { PGliteOptions } from "@electric-sql/pglite";

export type PgliteAssets = Pick<PGliteOptions, "pgliteWasmModule" | "initdbWasmModule" | "fsBundle">;

/**
 * PGlite's wasm modules and file-system bundle built into the one-file artifact. From sources this is null
 * (PGlite finds its files beside its own modules); the build (scripts/build.ts) replaces this module with one
 * that holds those files' bytes.
 */
export async function pgliteAssets(): Promise<PgliteAssets | null> {
  return null;
}
