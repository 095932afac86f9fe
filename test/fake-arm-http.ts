/**
 * Plumbing for the fake Azure Resource Manager endpoint (test/fake-arm.ts): its self-signed TLS certificate, request
 * bodies, and the error shapes of ARM (`{"error":{"code","message","target"}}`) and of the Microsoft identity
 * platform's token endpoint (`{"error","error_description","error_codes",...}`).
 */
import { execFileSync } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdtempSync, readFileSync } from "node:fs";
import type { IncomingMessage } from "node:http";
import { tmpdir } from "node:os";
import path from "node:path";

const MAX_BODY_BYTES = 1 << 20;

/** An ARM error answer. */
export class ArmError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly target?: string,
    readonly retryAfter?: number,
  ) {
    super(message);
  }

  body(): { error: { code: string; message: string; target?: string } } {
    return {
      error: {
        code: this.code,
        message: this.message,
        ...(this.target === undefined ? {} : { target: this.target }),
      },
    };
  }
}

/** An answer of the token endpoint (or its OpenID configuration) in the identity platform's error shape. */
export class AadError extends Error {
  constructor(
    readonly status: number,
    readonly error: string,
    readonly aadsts: number,
    description: string,
  ) {
    super(`AADSTS${aadsts}: ${description}`);
  }

  body(): Record<string, unknown> {
    return {
      error: this.error,
      error_description: `${this.message}\r\nTrace ID: ${randomUUID()}\r\nCorrelation ID: ${randomUUID()}\r\nTimestamp: ${new Date().toISOString()}`,
      error_codes: [this.aadsts],
      timestamp: new Date()
        .toISOString()
        .replace("T", " ")
        .replace(/\.\d+Z$/, "Z"),
      trace_id: randomUUID(),
      correlation_id: randomUUID(),
    };
  }
}

/** 400 InvalidParameter naming the bad field, as the compute resource provider answers. */
export function invalidParameter(target: string, why = ""): ArmError {
  return new ArmError(
    400,
    "InvalidParameter",
    `The value of parameter ${target} is invalid.${why === "" ? "" : ` ${why}`}`,
    target,
  );
}

/** 400 InvalidParameter for a required field that is absent. */
export function missingParameter(target: string): ArmError {
  return new ArmError(400, "InvalidParameter", `Required parameter '${target}' is missing (null).`, target);
}

/** A key/certificate pair for 127.0.0.1 and localhost, made by openssl in a fresh directory. */
export interface SelfSignedCert {
  dir: string;
  keyFile: string;
  certFile: string;
  key: Buffer;
  cert: Buffer;
}

export function makeSelfSignedCert(): SelfSignedCert {
  const dir = mkdtempSync(path.join(tmpdir(), "fake-arm-tls-"));
  const keyFile = path.join(dir, "key.pem");
  const certFile = path.join(dir, "cert.pem");
  execFileSync(
    "openssl",
    [
      "req",
      "-x509",
      "-newkey",
      "ec",
      "-pkeyopt",
      "ec_paramgen_curve:prime256v1",
      "-nodes",
      "-keyout",
      keyFile,
      "-out",
      certFile,
      "-days",
      "7",
      "-subj",
      "/CN=fake-arm",
      "-addext",
      "subjectAltName=IP:127.0.0.1,DNS:localhost",
    ],
    { stdio: ["ignore", "ignore", "pipe"], timeout: 30_000 },
  );
  return { dir, keyFile, certFile, key: readFileSync(keyFile), cert: readFileSync(certFile) };
}

export function readBody(req: IncomingMessage): Promise<string> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    req.on("data", (d: Buffer) => {
      size += d.length;
      if (size > MAX_BODY_BYTES) {
        reject(
          new ArmError(
            413,
            "RequestEntityTooLarge",
            `The request body is larger than ${MAX_BODY_BYTES} bytes`,
          ),
        );
        req.resume();
        return;
      }
      chunks.push(d);
    });
    req.on("end", () => resolve(Buffer.concat(chunks).toString("utf8")));
    req.on("error", reject);
  });
}

/** Parses a JSON request body that must be an object. */
export function jsonBody(text: string): Record<string, unknown> {
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch (err) {
    throw new ArmError(
      400,
      "InvalidRequestContent",
      `The request content was invalid and could not be deserialized: ${(err as Error).message}`,
    );
  }
  if (typeof v !== "object" || v === null || Array.isArray(v)) {
    throw new ArmError(400, "InvalidRequestContent", "The request content must be a JSON object.");
  }
  return v as Record<string, unknown>;
}

export type Json = Record<string, unknown>;

/** `obj[key]` when it is an object (absent -> undefined); anything else is InvalidParameter at `target`. */
export function objAt(obj: Json | undefined, key: string, target: string): Json | undefined {
  const v = obj?.[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "object" || Array.isArray(v)) throw invalidParameter(target, "It must be an object.");
  return v as Json;
}

export function strAt(obj: Json | undefined, key: string, target: string): string | undefined {
  const v = obj?.[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "string") throw invalidParameter(target, "It must be a string.");
  return v;
}

export function arrAt(obj: Json | undefined, key: string, target: string): unknown[] | undefined {
  const v = obj?.[key];
  if (v === undefined || v === null) return undefined;
  if (!Array.isArray(v)) throw invalidParameter(target, "It must be an array.");
  return v;
}

/** ARM compares locations without case and spaces ("West US 2" is "westus2"). */
export function normalizeLocation(loc: string): string {
  return loc.replaceAll(" ", "").toLowerCase();
}

export function isBase64(s: string): boolean {
  return s.length % 4 === 0 && /^[A-Za-z0-9+/]*={0,2}$/.test(s);
}

/** An OpenSSH public key line of a type Azure accepts (RSA of 2048 bits or more, or ed25519). */
export function isSshPublicKey(line: string): boolean {
  const [type, b64] = line.trim().split(/\s+/);
  if (type === undefined || b64 === undefined || !isBase64(b64)) return false;
  const blob = Buffer.from(b64, "base64");
  if (blob.length < 4) return false;
  const len = blob.readUInt32BE(0);
  if (blob.subarray(4, 4 + len).toString("latin1") !== type) return false;
  if (type === "ssh-ed25519") return blob.length === 4 + len + 4 + 32;
  return type === "ssh-rsa" && blob.length >= 256;
}
