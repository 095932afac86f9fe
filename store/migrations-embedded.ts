import type { Migration } from "./types.ts";

/**
 * The migrations built into the one-file artifact. From sources this is null and store/migrations/*.sql are
 * read; the build (scripts/build.ts) replaces this module with one holding those files' text.
 */
export const EMBEDDED_MIGRATIONS: Migration[] | null = null;
