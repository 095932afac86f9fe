/**
 * Building blocks of the OpenAPI 3.1 documents (rest-server/openapi.ts for the users' API,
 * management-api/openapi.ts for the operators'): plain JSON Schema from TypeBox schemas, references, JSON
 * responses, the error responses of a route by status with their codes (lib/errors.ts), query parameters, and
 * the error shape every API answers with. Documents are 3.1 because their schemas are JSON Schema 2020-12
 * (`const`, `patternProperties`, type arrays); test/openapi.test.ts checks both with a standard validator.
 */
import { type TSchema, Type } from "@sinclair/typebox";
import { ERROR_CODES } from "./errors.ts";

export type Json = Record<string, unknown>;

export const plain = (schema: TSchema): Json => JSON.parse(JSON.stringify(schema)) as Json;
export const ref = (name: string): Json => ({ $ref: `#/components/schemas/${name}` });
export const json = (schema: Json, description: string): Json => ({
  description,
  content: { "application/json": { schema } },
});
/** The error responses of a route: each status with the codes that answer with it. */
export function errors(codes: readonly (keyof typeof ERROR_CODES)[]): Json {
  const byStatus = new Map<number, string[]>();
  for (const c of codes) {
    const s = ERROR_CODES[c].status;
    byStatus.set(s, [...(byStatus.get(s) ?? []), c]);
  }
  const out: Json = {};
  for (const [status, list] of byStatus) out[String(status)] = json(ref("Error"), list.join(", "));
  return out;
}
export const query = (name: string, description: string, required: boolean): Json => ({
  name,
  in: "query",
  required,
  description,
  schema: { type: "string" },
});

/** `{ error: { code, message, path? } }`: every error of every API. */
export const ErrorResponse = Type.Object(
  {
    error: Type.Object({
      code: Type.String({ description: "A stable code (docs/errors.md)." }),
      message: Type.String(),
      path: Type.Optional(Type.String({ description: "The bad parameter, when one is to blame." })),
    }),
  },
  { additionalProperties: false },
);
