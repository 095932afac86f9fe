/**
 * Both OpenAPI documents pass a standard validator (@apidevtools/swagger-parser: the OpenAPI 3.1 schema, then
 * its own checks: unique operation ids, path parameters declared, resolvable $refs), so client generators and
 * API tools accept them. Any schema a route adds goes through this check.
 */
import SwaggerParser from "@apidevtools/swagger-parser";
import { describe, expect, it } from "vitest";
import { managementApiDocument } from "../management-api/openapi.ts";
import { usersApiDocument } from "../rest-server/openapi.ts";

describe.each([
  ["the management API", managementApiDocument],
  ["the users' API", usersApiDocument],
])("the OpenAPI document of %s", (_name, build) => {
  it("is valid OpenAPI 3.1", async () => {
    const doc = build();
    expect(doc["openapi"]).toBe("3.1.0");
    await expect(SwaggerParser.validate(structuredClone(doc) as never)).resolves.toBeDefined();
  });

  it("is refused by the same validator when broken (the check can fail)", async () => {
    const doc = structuredClone(build()) as { paths: Record<string, unknown> };
    const [first] = Object.keys(doc.paths);
    doc.paths[first!] = { get: { responses: { "200": { description: 7 } } } };
    await expect(SwaggerParser.validate(doc as never)).rejects.toThrow();
  });
});
