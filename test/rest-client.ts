/** A fastify.inject client for route tests: method, url, optional token, payload and headers. */
import type { FastifyInstance, InjectOptions } from "fastify";
import { expect } from "vitest";

// biome-ignore lint/suspicious/noExplicitAny: response bodies are JSON of many shapes, checked by assertions
export type Json = any;

export interface Res {
  status: number;
  /** Parsed JSON, or the raw text when the body is not JSON. */
  body: Json;
  raw: Buffer;
  headers: Record<string, unknown>;
}

export function injectClient(app: FastifyInstance) {
  return async (
    method: "GET" | "POST" | "PUT" | "DELETE",
    url: string,
    token?: string,
    payload?: string | object | Buffer,
    headers: Record<string, string> = {},
  ): Promise<Res> => {
    const opts: InjectOptions = {
      method,
      url,
      headers: { ...(token === undefined ? {} : { authorization: `Bearer ${token}` }), ...headers },
    };
    if (payload !== undefined) opts.payload = payload;
    const res = await app.inject(opts);
    let body: unknown;
    try {
      body = res.json();
    } catch {
      body = res.body;
    }
    return { status: res.statusCode, body, raw: res.rawPayload, headers: res.headers };
  };
}

/** Asserts an error answer in the API's shape: status, code, a message, and the bad field's path when given. */
export function expectApiError(res: Res, status: number, code: string, path?: string): void {
  expect(res.status, JSON.stringify(res.body)).toBe(status);
  expect(res.body.error.code).toBe(code);
  expect(typeof res.body.error.message).toBe("string");
  if (path !== undefined) expect(res.body.error.path).toBe(path);
}
