/** An SQL identifier (a table, schema or channel name) quoted so that any text in it stays one identifier. */
export function quoteIdent(name: string): string {
  return `"${name.replaceAll('"', '""')}"`;
}
