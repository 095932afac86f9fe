import { ERROR_CODES } from "./errors.ts";

/** docs/errors.md, rendered from the one table of codes (`npm run docs:errors` writes it; a test compares). */
export function renderErrorsDoc(): string {
  const rows = Object.entries(ERROR_CODES).map(
    ([code, { status, description }]) => `| \`${code}\` | ${status} | ${description} |`,
  );
  return [
    "# Error codes",
    "",
    "Every error dispatch-cloud reports carries one of these stable codes. The APIs answer",
    '`{ "error": { "code", "message", "path"? } }` with the HTTP status below (`path` names the bad field, as',
    "`resources.ram` or `dependencies[2].bundle`); the CLI prints `message (at path) [code]`; `config check`",
    "prints `path: message (code) [line N]`. Codes are never renamed; messages may improve. Generated from",
    "`lib/errors.ts` by `npm run docs:errors`.",
    "",
    "| code | HTTP status | meaning |",
    "| --- | --- | --- |",
    ...rows,
    "",
  ].join("\n");
}

if (process.argv[1] !== undefined && import.meta.filename === process.argv[1]) {
  process.stdout.write(renderErrorsDoc());
}
