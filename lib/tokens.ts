/**
 * API tokens and uuids. A token is a prefix plus 32 random bytes in base64url; only its sha256 (hex) is
 * ever stored, so a database dump reveals no token.
 */
import { createHash, randomBytes, randomInt, timingSafeEqual } from "node:crypto";
import { DispatchCloudError } from "./errors.ts";

export const USER_TOKEN_PREFIX = "dcu_";
export const RUNNER_TOKEN_PREFIX = "dcr_";
/** A user's worker token (docs/workers.md): it checks in as that one worker and nothing else. */
export const WORKER_TOKEN_PREFIX = "dcw_";
const TOKEN_BODY = /^[A-Za-z0-9_-]{43}$/;

function newToken(prefix: string): string {
  return prefix + randomBytes(32).toString("base64url");
}

/** A fresh user API token (`dcu_` + 43 base64url characters). */
export const newUserToken = (): string => newToken(USER_TOKEN_PREFIX);

/** A fresh per-bundle runner token (`dcr_` + 43 base64url characters). */
export const newRunnerToken = (): string => newToken(RUNNER_TOKEN_PREFIX);

/** A fresh worker token (`dcw_` + 43 base64url characters). */
export const newWorkerToken = (): string => newToken(WORKER_TOKEN_PREFIX);

/** The token of an `Authorization: Bearer <token>` header; throws auth.missing_token if there is none. */
export function bearerTokenOf(header: string | undefined): string {
  if (header === undefined || header.trim() === "") {
    throw new DispatchCloudError(
      "auth.missing_token",
      "this API needs an Authorization: Bearer <token> header",
    );
  }
  const m = /^Bearer[ \t]+(\S+)[ \t]*$/i.exec(header);
  if (m === null) {
    throw new DispatchCloudError("auth.missing_token", "the Authorization header must be 'Bearer <token>'");
  }
  return m[1]!;
}

/** True when `token` has the shape of a token with that prefix (no database lookup). */
export function isTokenShaped(token: string, prefix: string): boolean {
  return token.startsWith(prefix) && TOKEN_BODY.test(token.slice(prefix.length));
}

/** sha256 of the token, lower-case hex: the only form a token is stored in. */
export function hashToken(token: string): string {
  return createHash("sha256").update(token, "utf8").digest("hex");
}

/** Compares two secrets (or their hashes) in time independent of where they differ. */
export function constantTimeEqual(a: string, b: string): boolean {
  // Compare digests so unequal lengths take the same time as equal ones.
  const dx = createHash("sha256").update(a, "utf8").digest();
  const dy = createHash("sha256").update(b, "utf8").digest();
  return timingSafeEqual(dx, dy);
}

const UUID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789";
const CLUSTER_ID = /^[a-z0-9]{5}$/;

function newUuid(clusterId: string, kind: "bndl" | "user" | "wrkr"): string {
  if (!CLUSTER_ID.test(clusterId))
    throw new Error(`clusterId must be 5 characters [a-z0-9], got ${clusterId}`);
  let tail = "";
  for (let i = 0; i < 15; i++) tail += UUID_ALPHABET[randomInt(UUID_ALPHABET.length)];
  return `${clusterId}-${kind}-${tail}`;
}

export const BUNDLE_UUID_PATTERN = "^[a-z0-9]{5}-bndl-[a-z0-9]{15}$";
export const USER_UUID_PATTERN = "^[a-z0-9]{5}-user-[a-z0-9]{15}$";
export const WORKER_ID_PATTERN = "^[a-z0-9]{5}-wrkr-[a-z0-9]{15}$";
/** An API token's id (made by the store: store/queries.ts createToken). */
export const TOKEN_ID_PATTERN = "^[a-z0-9]{5}-tokn-[a-z0-9]{15}$";

/** `<clusterId>-bndl-<15 chars [a-z0-9]>` */
export const newBundleUuid = (clusterId: string): string => newUuid(clusterId, "bndl");

/** `<clusterId>-user-<15 chars [a-z0-9]>` */
export const newUserUuid = (clusterId: string): string => newUuid(clusterId, "user");

/** `<clusterId>-wrkr-<15 chars [a-z0-9]>`: a user's worker. */
export const newWorkerId = (clusterId: string): string => newUuid(clusterId, "wrkr");
