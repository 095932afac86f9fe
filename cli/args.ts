import { type ParseArgsConfig, parseArgs } from "node:util";
import { usageError } from "./io.ts";

type Options = NonNullable<ParseArgsConfig["options"]>;

/** Flags every API-client command takes. */
export const CLIENT_OPTIONS = {
  "api-url": { type: "string" },
  "token-file": { type: "string" },
  "data-dir": { type: "string" },
  json: { type: "boolean" },
  help: { type: "boolean", short: "h" },
} as const satisfies Options;

/** util.parseArgs in strict mode, with its errors turned into usage errors. */
export function parse<O extends Options>(argv: string[], options: O, allowPositionals = true) {
  try {
    return parseArgs({ args: argv, options, allowPositionals, strict: true });
  } catch (err) {
    throw usageError(err instanceof Error ? err.message : String(err));
  }
}
