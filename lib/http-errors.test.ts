import { describe, expect, it } from "vitest";
import { ERROR_CODES } from "./errors.ts";
import { frameworkErrorCode } from "./http-errors.ts";

const err = (code: string | undefined, statusCode?: number): Error =>
  Object.assign(
    new Error("x"),
    code === undefined ? {} : { code },
    statusCode === undefined ? {} : { statusCode },
  );

describe("frameworkErrorCode", () => {
  it("maps fastify's client errors to codes whose status matches", () => {
    for (const [code, status, ours] of [
      ["FST_ERR_BAD_URL", 400, "request.invalid_url"],
      ["FST_ERR_MAX_PARAM_LENGTH", 414, "request.uri_too_long"],
      ["FST_ERR_CTP_BODY_TOO_LARGE", 413, "request.body_too_large"],
      ["FST_ERR_CTP_INVALID_MEDIA_TYPE", 415, "request.unsupported_media_type"],
      ["FST_ERR_CTP_INVALID_JSON_BODY", 400, "request.invalid_json"],
    ] as const) {
      expect(frameworkErrorCode(err(code, status), "request.invalid_body")).toBe(ours);
      expect(ERROR_CODES[ours].status).toBe(status);
    }
  });

  it("maps other client errors by status (the fallback for a plain 400), and server errors to nothing", () => {
    expect(frameworkErrorCode(err("ECONNRESET", 400), "request.invalid_query")).toBe("request.invalid_query");
    expect(frameworkErrorCode(err(undefined, 408), "request.invalid_body")).toBe("request.timeout");
    expect(frameworkErrorCode(err(undefined, 431), "request.invalid_body")).toBe("request.headers_too_large");
    expect(frameworkErrorCode(err("FST_ERR_SOMETHING", 500), "request.invalid_body")).toBeUndefined();
    expect(frameworkErrorCode(new Error("plain"), "request.invalid_body")).toBeUndefined();
  });
});
