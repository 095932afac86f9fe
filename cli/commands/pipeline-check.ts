/**
 * `pipeline check FILE`: every problem of a pipeline definition file, one line each as `FILE: path: message`
 * (exit 1), or a one-line summary (exit 0). Nothing is sent to a server.
 */
import { readFile } from "node:fs/promises";
import { resolve } from "node:path";
import { DispatchCloudError } from "../../lib/errors.ts";
import { checkPipeline, parseYamlText, validatePipeline } from "../../lib/pipeline/definition.ts";
import { type CliIo, EXIT_FAILED, EXIT_OK } from "../io.ts";

export async function pipelineCheck(io: CliIo, file: string): Promise<number> {
  let text: string;
  try {
    text = await readFile(resolve(io.cwd, file), "utf8");
  } catch (err) {
    io.err(`${file}: cannot read: ${err instanceof Error ? err.message : String(err)}`);
    return EXIT_FAILED;
  }
  let value: unknown;
  try {
    value = parseYamlText(text);
  } catch (err) {
    if (err instanceof DispatchCloudError) {
      io.err(`${file}: ${err.message}`);
      return EXIT_FAILED;
    }
    throw err;
  }
  const problems = checkPipeline(value);
  if (problems.length > 0) {
    for (const p of problems) io.err(`${file}: ${p.path === "" ? "" : `${p.path}: `}${p.message}`);
    io.err(`${file}: ${problems.length} problem${problems.length === 1 ? "" : "s"}`);
    return EXIT_FAILED;
  }
  const def = validatePipeline(value);
  const apps = Object.values(def.apps);
  const withParents = apps.filter((a) => a.dependsOn !== null).length;
  io.out(
    `${file}: pipeline ${def.name} is valid: ${apps.length} app${apps.length === 1 ? "" : "s"}, ${withParents} with dependencies`,
  );
  return EXIT_OK;
}
