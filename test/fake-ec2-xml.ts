/**
 * Wire-format helpers of the fake EC2 endpoint (test/fake-ec2.ts): reading EC2 Query parameters (flattened
 * `Name.N.Sub` keys) and writing EC2's XML answers and error documents. Values are escaped here; callers pass
 * element names and already-built child XML.
 */

export const EC2_XMLNS = "http://ec2.amazonaws.com/doc/2016-11-15/";

/** A query parameter set as received: flattened keys (`TagSpecification.1.Tag.2.Key`) to values. */
export type QueryParams = Record<string, string>;

export function escapeXml(s: string): string {
  return s.replace(/[<>&"']/g, (c) =>
    c === "<" ? "&lt;" : c === ">" ? "&gt;" : c === "&" ? "&amp;" : c === '"' ? "&quot;" : "&apos;",
  );
}

export type XmlValue = string | number | boolean | Date | null | undefined;

/** `<name>value</name>`, escaped; nothing at all when the value is null or undefined. */
export function leaf(name: string, value: XmlValue): string {
  if (value === null || value === undefined) return "";
  const text = value instanceof Date ? value.toISOString() : String(value);
  return `<${name}>${escapeXml(text)}</${name}>`;
}

/** `<name>...</name>` around already-built child XML. */
export function node(name: string, ...children: string[]): string {
  return `<${name}>${children.join("")}</${name}>`;
}

/** An EC2 list: `<name><item>...</item>...</name>`, one item per element of `children`. */
export function itemSet(name: string, children: string[]): string {
  return `<${name}>${children.map((c) => `<item>${c}</item>`).join("")}</${name}>`;
}

/** A tag list as EC2 writes it: `<tagSet><item><key/><value/></item>...</tagSet>`. */
export function tagSet(tags: Record<string, string>, name = "tagSet"): string {
  return itemSet(
    name,
    Object.entries(tags).map(([k, v]) => leaf("key", k) + leaf("value", v)),
  );
}

/** A successful answer: `<ActionResponse xmlns=...><requestId/>...</ActionResponse>`. */
export function responseDocument(action: string, requestId: string, body: string): string {
  return (
    `<?xml version="1.0" encoding="UTF-8"?>\n<${action}Response xmlns="${EC2_XMLNS}">` +
    `${leaf("requestId", requestId)}${body}</${action}Response>`
  );
}

/** EC2's error document (the same for every action). */
export function errorDocument(code: string, message: string, requestId: string): string {
  return (
    `<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>${leaf("Code", code)}` +
    `${leaf("Message", message)}</Error></Errors>${leaf("RequestID", requestId)}</Response>`
  );
}

/** The values of `prefix.1`, `prefix.2`, ... in index order (EC2 accepts gaps in the numbering). */
export function listParam(params: QueryParams, prefix: string): string[] {
  const found: [number, string][] = [];
  const head = `${prefix}.`;
  for (const [key, value] of Object.entries(params)) {
    if (!key.startsWith(head)) continue;
    const rest = key.slice(head.length);
    if (/^[1-9]\d*$/.test(rest)) found.push([Number(rest), value]);
  }
  return found.sort((a, b) => a[0] - b[0]).map(([, v]) => v);
}

/**
 * The members of a list of structures, `prefix.N.<sub key>`, each as its own parameter set keyed by the sub
 * key (`Filter.2.Value.1` -> member 2's `Value.1`), in index order, with the index.
 */
export function structListParam(
  params: QueryParams,
  prefix: string,
): { index: number; params: QueryParams }[] {
  const members = new Map<number, QueryParams>();
  const head = `${prefix}.`;
  for (const [key, value] of Object.entries(params)) {
    if (!key.startsWith(head)) continue;
    const m = /^([1-9]\d*)\.(.+)$/.exec(key.slice(head.length));
    if (m === null) continue;
    const index = Number(m[1]);
    let member = members.get(index);
    if (member === undefined) {
      member = {};
      members.set(index, member);
    }
    member[m[2]!] = value;
  }
  return [...members.entries()].sort((a, b) => a[0] - b[0]).map(([index, p]) => ({ index, params: p }));
}

/** The sub-parameters of one structure, `prefix.<sub key>` -> `<sub key>`. */
export function structParam(params: QueryParams, prefix: string): QueryParams {
  const out: QueryParams = {};
  const head = `${prefix}.`;
  for (const [key, value] of Object.entries(params))
    if (key.startsWith(head)) out[key.slice(head.length)] = value;
  return out;
}
