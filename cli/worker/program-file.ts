/**
 * The file this program runs from, which an upgrade replaces: the executable of a Node single executable
 * application, or the one-file `.cjs` artifact (its launcher sets the bundle's __filename, which the build puts
 * in import.meta.url). From TypeScript sources there is none: such a worker reports artifactSha256 "" and is
 * never told to upgrade.
 */
import { createHash } from "node:crypto";
import { createReadStream } from "node:fs";
import { fileURLToPath } from "node:url";
import { isSea } from "../../lib/self.ts";

/** This program's own file, or null when it runs from sources. */
export function ownProgramFile(): string | null {
  if (isSea()) return process.execPath;
  const url = new URL(import.meta.url);
  if (url.pathname.endsWith(".ts")) return null;
  url.hash = "";
  return fileURLToPath(url);
}

/** The sha256 (hex) of a file's bytes. */
export async function sha256File(file: string): Promise<string> {
  const hash = createHash("sha256");
  for await (const chunk of createReadStream(file)) hash.update(chunk as Buffer);
  return hash.digest("hex");
}
