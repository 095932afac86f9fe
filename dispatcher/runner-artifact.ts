/**
 * The file the dispatcher deploys to instances as crunch-run: its bytes and their sha256 (the runner's name on
 * an instance is `crunch-run~<sha256>`). What goes in it is the composition root's choice (cli/runner-artifact.ts).
 */
import { createHash } from "node:crypto";

export interface RunnerArtifact {
  content: Buffer;
  sha256: string;
}

/** A runner artifact of the given bytes (tests and benchmarks on the stub cloud deploy a few bytes). */
export function artifactOf(content: Buffer): RunnerArtifact {
  return { content, sha256: createHash("sha256").update(content).digest("hex") };
}
