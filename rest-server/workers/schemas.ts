/**
 * The request bodies of the workers' routes (lib/worker-protocol.ts is the contract), as TypeBox schemas the
 * routes validate with and the OpenAPI document shows, and the plausibility check of a check-in's claims.
 */
import { Type } from "@sinclair/typebox";
import { DispatchCloudError } from "../../lib/errors.ts";
import { BUNDLE_UUID_PATTERN, WORKER_ID_PATTERN } from "../../lib/tokens.ts";
import {
  type CheckinRequest as CheckinBody,
  MAX_BYTES,
  MAX_CACHE_KEYS,
  MAX_GPUS,
  MAX_SLOTS,
  MAX_TAGS,
  MAX_VCPUS,
  TAG_PATTERN,
  WORKER_NAME_PATTERN,
} from "../../lib/worker-protocol.ts";
import { MAX_INT4 } from "../logs.ts";

const PRINTABLE = "^[^\\u0000-\\u001f\\u007f]*$";
/** The smallest RAM a worker may claim: 64 MiB. */
export const MIN_WORKER_RAM = 64 * 1024 ** 2;

export const CreateWorkerRequest = Type.Object(
  {
    name: Type.Optional(
      Type.String({
        pattern: WORKER_NAME_PATTERN,
        description: "Unique among the caller's workers; default worker-<n>.",
        errorMessage: "must be 1 to 100 characters of A-Z a-z 0-9 . _ - starting with a letter or digit",
      }),
    ),
  },
  { additionalProperties: false },
);

const Gpu = Type.Object(
  {
    stack: Type.Union([Type.Literal("cuda"), Type.Literal("rocm")], { errorMessage: "must be cuda or rocm" }),
    deviceCount: Type.Integer(),
    vram: Type.Integer({ description: "Bytes of memory per device." }),
    driverVersion: Type.Optional(
      Type.Union([Type.String({ maxLength: 100, pattern: PRINTABLE }), Type.Null()]),
    ),
    hardwareTarget: Type.Optional(
      Type.Union([Type.String({ maxLength: 100, pattern: PRINTABLE }), Type.Null()]),
    ),
  },
  { additionalProperties: false },
);

export const CheckinRequest = Type.Object(
  {
    workerId: Type.String({ pattern: WORKER_ID_PATTERN, errorMessage: "must be a worker id" }),
    version: Type.String({
      minLength: 1,
      maxLength: 100,
      pattern: PRINTABLE,
      errorMessage: "must be 1 to 100 characters without control characters",
    }),
    artifactSha256: Type.String({
      pattern: "^([0-9a-f]{64})?$",
      errorMessage: "must be 64 lowercase hex characters, or empty",
    }),
    resources: Type.Object(
      {
        vcpus: Type.Integer(),
        ram: Type.Integer({ description: "Bytes." }),
        freeDisk: Type.Integer({ description: "Free bytes of the work directory's file system." }),
        gpu: Type.Union([Gpu, Type.Null()]),
      },
      { additionalProperties: false },
    ),
    slots: Type.Integer(),
    tags: Type.Array(Type.String({ pattern: TAG_PATTERN, errorMessage: `must match ${TAG_PATTERN}` }), {
      maxItems: MAX_TAGS,
    }),
    cache: Type.Array(
      Type.String({ pattern: "^[0-9a-f]{16}$", errorMessage: "must be a cache key (16 hex characters)" }),
      {
        maxItems: MAX_CACHE_KEYS,
        description: "Keys of the manifests whose trees the worker's cache holds.",
      },
    ),
    running: Type.Array(
      Type.Object(
        {
          uuid: Type.String({ pattern: BUNDLE_UUID_PATTERN, errorMessage: "must be a bundle uuid" }),
          attempt: Type.Integer({ minimum: 1, maximum: MAX_INT4 }),
        },
        { additionalProperties: false },
      ),
      // Shape only; more than MAX_SLOTS is refused as implausible.
      { maxItems: MAX_CACHE_KEYS },
    ),
    draining: Type.Boolean(),
  },
  { additionalProperties: false },
);

export const CheckoutRequest = Type.Object(
  {
    workerId: Type.String({ pattern: WORKER_ID_PATTERN, errorMessage: "must be a worker id" }),
    handBack: Type.Optional(
      Type.Boolean({
        description:
          "Give its bundles back: starting ones go back to the queue, running ones are lost (requeued while attempts remain).",
      }),
    ),
  },
  { additionalProperties: false },
);

const implausible = (path: string, message: string) =>
  new DispatchCloudError("workers.implausible_resources", `${path}: ${message}`, { path });

function within(path: string, v: number, min: number, max: number): void {
  if (v < min || v > max) throw implausible(path, `${v} is out of the plausible range ${min}..${max}`);
}

/** Refuses claims no machine makes (workers.implausible_resources, with the path); the shape is checked already. */
export function checkPlausible(body: CheckinBody): void {
  const r = body.resources;
  within("resources.vcpus", r.vcpus, 1, MAX_VCPUS);
  within("resources.ram", r.ram, MIN_WORKER_RAM, MAX_BYTES);
  within("resources.freeDisk", r.freeDisk, 0, MAX_BYTES);
  if (r.gpu !== null) {
    within("resources.gpu.deviceCount", r.gpu.deviceCount, 1, MAX_GPUS);
    within("resources.gpu.vram", r.gpu.vram, 1, MAX_BYTES);
  }
  within("slots", body.slots, 1, MAX_SLOTS);
  if (body.running.length > MAX_SLOTS) {
    throw implausible("running", `${body.running.length} bundles at once is more than ${MAX_SLOTS}`);
  }
  const seen = new Set<string>();
  for (const [i, e] of body.running.entries()) {
    if (seen.has(e.uuid)) throw implausible(`running[${i}].uuid`, `${e.uuid} is reported twice`);
    seen.add(e.uuid);
  }
  const tags = new Set<string>();
  for (const [i, t] of body.tags.entries()) {
    if (tags.has(t))
      throw new DispatchCloudError("request.invalid_body", `tags[${i}]: ${t} is given twice`, {
        path: `tags[${i}]`,
      });
    tags.add(t);
  }
}
