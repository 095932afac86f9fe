import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { DispatchCloudError, ERROR_CODES, errorBody } from "./errors.ts";
import { renderErrorsDoc } from "./errors-doc.ts";

describe("error codes", () => {
  it("are dotted lower-case names with a 4xx/5xx status and a description", () => {
    for (const [code, { status, description }] of Object.entries(ERROR_CODES)) {
      expect(code).toMatch(/^[a-z]+(\.[a-z_]+)+$/);
      expect(status).toBeGreaterThanOrEqual(400);
      expect(status).toBeLessThan(600);
      expect(description.length).toBeGreaterThan(10);
    }
  });

  it("are all documented in docs/errors.md (run `npm run docs:errors` after adding one)", () => {
    const doc = readFileSync(join(import.meta.dirname, "..", "docs", "errors.md"), "utf8");
    expect(doc).toBe(renderErrorsDoc());
  });

  it("serialise with the path only when there is one", () => {
    const e = new DispatchCloudError("request.invalid_body", "ram must be a size", { path: "resources.ram" });
    expect(e.status).toBe(400);
    expect(JSON.parse(JSON.stringify(e))).toEqual({
      error: { code: "request.invalid_body", message: "ram must be a size", path: "resources.ram" },
    });
    expect(errorBody("auth.missing_token", "no token")).toEqual({
      error: { code: "auth.missing_token", message: "no token" },
    });
  });
});
