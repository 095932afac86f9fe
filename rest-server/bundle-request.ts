/**
 * The body of `POST /api/v1/bundles`: one TypeBox schema (unknown fields refused, defaults filled), then
 * normalisation into a NewBundle (sizes in bytes, durations in milliseconds, dependency names filled in) and
 * the checks the schema cannot express: the server's smallest RAM and vCPUs (restServer.minBundleRam and
 * minBundleVcpus, so Docker never gets a 0 that means "no limit") and subpaths the filesystem can hold.
 */

import { type Static, Type } from "@sinclair/typebox";
import { DispatchCloudError } from "../lib/errors.ts";
import { CONTROL_CHARACTERS, NO_CONTROL_PATTERN, pathLengthProblem } from "../lib/text-limits.ts";
import { BUNDLE_UUID_PATTERN } from "../lib/tokens.ts";
import { formatSize, parseDuration, parseSize, SIZE_FORMAT } from "../lib/units.ts";
import { TAG_PATTERN } from "../lib/worker-protocol.ts";
import { GPU_STACKS, type NewBundle } from "../store/types.ts";
import { childPath, invalidBody, validate } from "./validate.ts";

export const MAX_SIZE = 64 * 2 ** 40; // 64TiB
export const MAX_TIME_LIMIT_MS = 366 * 86_400_000;
const KIB64 = 64 * 1024;

/** Text shown to people (names, targets): no control characters or line breaks. */
const Text = (opts: { minLength?: number; maxLength: number; default?: string }) =>
  Type.String({
    ...opts,
    pattern: NO_CONTROL_PATTERN,
    errorMessage: `must be a string of ${opts.minLength ?? 0}-${opts.maxLength} characters without control characters or line breaks`,
  });

/** The smallest resources a bundle may ask for (config restServer.minBundleRam, restServer.minBundleVcpus). */
export interface BundleMinimums {
  /** Bytes. */
  ram: number;
  vcpus: number;
}

const Size = (opts: { default?: string | number; description: string }) =>
  Type.Union(
    [Type.String({ minLength: 1, maxLength: 64 }), Type.Integer({ minimum: 0, maximum: MAX_SIZE })],
    {
      ...opts,
      errorMessage: `must be ${SIZE_FORMAT}, at most 64TiB`,
    },
  );

const Gpu = Type.Object(
  {
    stack: Type.Union(
      GPU_STACKS.map((s) => Type.Literal(s)),
      { errorMessage: `must be one of ${GPU_STACKS.join(", ")}` },
    ),
    deviceCount: Type.Integer({ minimum: 1, maximum: 64 }),
    vram: Type.Optional(Size({ default: 0, description: "Memory per GPU device (0 = any)." })),
    driverVersion: Type.Optional(
      Type.String({
        pattern: "^[0-9]{1,4}\\.[0-9]{1,4}$",
        errorMessage: 'must be a version "X.Y", e.g. "12.2"',
      }),
    ),
    hardwareTarget: Type.Optional(
      Type.Union(
        [
          Type.String({ minLength: 1, maxLength: 64, pattern: NO_CONTROL_PATTERN }),
          Type.Array(Type.String({ minLength: 1, maxLength: 64, pattern: NO_CONTROL_PATTERN }), {
            maxItems: 64,
          }),
        ],
        {
          errorMessage:
            "must be a target name (1-64 characters, no control characters) or a list of at most 64 of them",
        },
      ),
    ),
  },
  { additionalProperties: false },
);

const Resources = Type.Object(
  {
    vcpus: Type.Optional(Type.Number({ exclusiveMinimum: 0, maximum: 1024, default: 1 })),
    ram: Type.Optional(Size({ default: "256MiB", description: "Memory for the container." })),
    scratch: Type.Optional(Size({ default: 0, description: "Scratch disk space." })),
    gpu: Type.Optional(Gpu),
    tag: Type.Optional(
      Type.String({
        pattern: TAG_PATTERN,
        description: "Run only on instance types and users' workers with this tag (docs/workers.md).",
        errorMessage: "must be a tag: 1-63 characters a-z 0-9 . _ -, starting with a letter or digit",
      }),
    ),
    workersOnly: Type.Optional(
      Type.Boolean({
        description: "Run only on your own workers (docs/workers.md), never on a cloud instance.",
      }),
    ),
  },
  { additionalProperties: false },
);

const Limits = Type.Object(
  {
    time: Type.Optional(
      Type.String({ minLength: 1, maxLength: 64, description: "Wall-clock limit, e.g. 2h." }),
    ),
    disk: Type.Optional(Size({ description: "Disk the container may write." })),
    network: Type.Optional(Type.Boolean({ default: false })),
  },
  { additionalProperties: false },
);

const Dependency = Type.Object(
  {
    bundle: Type.String({
      pattern: BUNDLE_UUID_PATTERN,
      errorMessage: "must be a bundle uuid like xxxxx-bndl-xxxxxxxxxxxxxxx",
    }),
    subpath: Type.Optional(Type.String({ maxLength: 1024 })),
    name: Type.Optional(
      Type.String({
        pattern: "^[A-Za-z0-9._-]{1,100}$",
        errorMessage: "must be 1-100 characters from A-Z a-z 0-9 . _ -",
      }),
    ),
  },
  { additionalProperties: false },
);

export const BundleRequest = Type.Object(
  {
    name: Type.Optional(Text({ maxLength: 200, default: "" })),
    // The user's own bytes, passed to the container as they are (NUL and lone surrogates aside).
    command: Type.Array(Type.String({ maxLength: KIB64 }), { minItems: 1, maxItems: 1000 }),
    image: Type.String({
      minLength: 1,
      maxLength: 500,
      pattern: `^[^\\s${CONTROL_CHARACTERS}]+$`,
      errorMessage: "must be an image reference of 1-500 characters without spaces or control characters",
    }),
    env: Type.Optional(
      Type.Record(Type.String(), Type.String({ maxLength: KIB64 }), { maxProperties: 1000 }),
    ),
    resources: Type.Optional(Resources),
    preemptible: Type.Optional(Type.Boolean({ default: false })),
    priority: Type.Optional(Type.Integer({ minimum: 0, maximum: 1000, default: 500 })),
    limits: Type.Optional(Limits),
    dependencies: Type.Optional(Type.Array(Dependency, { maxItems: 1000 })),
    allowFailedDependencies: Type.Optional(Type.Boolean({ default: false })),
    maxAttempts: Type.Optional(Type.Integer({ minimum: 1, maximum: 10 })),
  },
  { additionalProperties: false },
);
export type BundleRequest = Static<typeof BundleRequest>;

const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]*$/;

function size(value: string | number, path: string): number {
  let bytes: number;
  try {
    bytes = parseSize(value);
  } catch (err) {
    if (err instanceof DispatchCloudError) throw invalidBody(path, err.message);
    throw err;
  }
  if (bytes > MAX_SIZE) throw invalidBody(path, "must be at most 64TiB");
  return bytes;
}

/** `a/./b/` -> `a/b`; refuses absolute paths, `..` and names or paths too long for the filesystem. */
function normaliseSubpath(subpath: string, path: string): string {
  if (subpath.startsWith("/")) throw invalidBody(path, "must be a relative path (no leading /)");
  const parts = subpath.split("/").filter((p) => p !== "" && p !== ".");
  if (parts.includes("..")) throw invalidBody(path, 'must not contain ".."');
  const tooLong = pathLengthProblem(parts);
  if (tooLong !== undefined) throw invalidBody(path, tooLong);
  return parts.join("/");
}

/** Validates a request body and turns it into the NewBundle the store inserts. */
export function parseBundleRequest(
  body: unknown,
  ownerUuid: string,
  defaultMaxAttempts: number,
  minimums: BundleMinimums,
): NewBundle {
  const req = validate(BundleRequest, body);

  const env: Record<string, string> = {};
  for (const [name, value] of Object.entries(req.env ?? {})) {
    if (!ENV_NAME.test(name)) {
      throw invalidBody(
        childPath("env", name),
        "environment variable names must match [A-Za-z_][A-Za-z0-9_]*",
      );
    }
    env[name] = value;
  }

  const r = req.resources ?? {};
  const gpu = r.gpu;
  const resources: NewBundle["resources"] = {
    vcpus: r.vcpus ?? 1,
    ram: size(r.ram ?? "256MiB", "resources.ram"),
    scratch: size(r.scratch ?? 0, "resources.scratch"),
    gpu:
      gpu === undefined
        ? null
        : {
            stack: gpu.stack,
            deviceCount: gpu.deviceCount,
            vram: size(gpu.vram ?? 0, "resources.gpu.vram"),
            driverVersion: gpu.driverVersion ?? null,
            hardwareTarget:
              gpu.hardwareTarget === undefined
                ? []
                : typeof gpu.hardwareTarget === "string"
                  ? [gpu.hardwareTarget]
                  : [...gpu.hardwareTarget],
          },
    ...(r.tag === undefined ? {} : { tag: r.tag }),
    ...(r.workersOnly === true ? { workersOnly: true } : {}),
  };

  if (resources.vcpus < minimums.vcpus) {
    throw invalidBody(
      "resources.vcpus",
      `must be at least ${minimums.vcpus} (the smallest this server runs)`,
    );
  }
  if (resources.ram < minimums.ram) {
    throw invalidBody(
      "resources.ram",
      `must be at least ${formatSize(minimums.ram)} (the smallest this server runs)`,
    );
  }

  const l = req.limits ?? {};
  let time: number | null = null;
  if (l.time !== undefined) {
    try {
      time = parseDuration(l.time);
    } catch (err) {
      if (err instanceof DispatchCloudError) throw invalidBody("limits.time", err.message);
      throw err;
    }
    if (time <= 0) throw invalidBody("limits.time", "must be longer than 0");
    if (time > MAX_TIME_LIMIT_MS) throw invalidBody("limits.time", "must be at most 366d");
  }
  const limits: NewBundle["limits"] = {
    time,
    disk: l.disk === undefined ? null : size(l.disk, "limits.disk"),
    network: l.network ?? false,
  };

  const names = new Set<string>();
  const dependencies = (req.dependencies ?? []).map((d, i) => {
    const name = d.name ?? d.bundle;
    const path = `dependencies[${i}]`;
    if (name === "." || name === "..") throw invalidBody(`${path}.name`, 'must not be "." or ".."');
    if (names.has(name)) {
      throw invalidBody(
        `${path}.name`,
        `mount name "${name}" is used by another dependency of this bundle (give each a distinct name)`,
      );
    }
    names.add(name);
    return { bundle: d.bundle, subpath: normaliseSubpath(d.subpath ?? "", `${path}.subpath`), name };
  });

  return {
    ownerUuid,
    name: req.name ?? "",
    command: [...req.command],
    image: req.image,
    env,
    resources,
    preemptible: req.preemptible ?? false,
    priority: req.priority ?? 500,
    limits,
    dependencies,
    allowFailedDependencies: req.allowFailedDependencies ?? false,
    maxAttempts: req.maxAttempts ?? defaultMaxAttempts,
  };
}

/** Most bundles in one `POST /api/v1/bundles/batch`. */
export const MAX_BATCH_ITEMS = 10_000;

/**
 * Validates the body of a batch submission, `{ "items": [<bundle request>, ...] }` with 1 to MAX_BATCH_ITEMS
 * items, each as parseBundleRequest would; the first bad field is reported with its item's path
 * (`items[42].resources.ram`), and nothing of the batch is kept.
 */
export function parseBatchRequest(
  body: unknown,
  ownerUuid: string,
  defaultMaxAttempts: number,
  minimums: BundleMinimums,
): NewBundle[] {
  if (body === null || typeof body !== "object" || Array.isArray(body)) {
    throw invalidBody("", 'must be an object { "items": [...] }');
  }
  for (const key of Object.keys(body)) {
    if (key !== "items")
      throw new DispatchCloudError("request.unknown_field", `unknown field ${key}`, { path: key });
  }
  const items = (body as { items?: unknown }).items;
  if (!Array.isArray(items)) throw invalidBody("items", "must be an array of bundle requests");
  if (items.length === 0 || items.length > MAX_BATCH_ITEMS) {
    throw invalidBody(
      "items",
      `must hold 1 to ${MAX_BATCH_ITEMS} bundle requests (it holds ${items.length})`,
    );
  }
  return items.map((item, i) => {
    try {
      return parseBundleRequest(item, ownerUuid, defaultMaxAttempts, minimums);
    } catch (err) {
      throw err instanceof DispatchCloudError ? withItemPath(err, i) : err;
    }
  });
}

/** The same error with its path (and the path in its message) under `items[i]`. */
function withItemPath(err: DispatchCloudError, i: number): DispatchCloudError {
  const prefix = `items[${i}]`;
  const path = err.path === undefined ? prefix : childPathJoin(prefix, err.path);
  const from = err.path ?? "the body";
  const at = err.message.indexOf(from);
  const message =
    at < 0
      ? `${path}: ${err.message}`
      : err.message.slice(0, at) + path + err.message.slice(at + from.length);
  return new DispatchCloudError(err.code, message, { path, cause: err });
}

/** `items[3]` + `resources.ram` -> `items[3].resources.ram`; + `[2]` or `["a.b"]` -> no dot. */
function childPathJoin(prefix: string, path: string): string {
  return path.startsWith("[") ? prefix + path : `${prefix}.${path}`;
}
