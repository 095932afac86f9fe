/**
 * The users' API's OpenAPI 3.1 document (`GET /api/v1/openapi.json`): request bodies are the schemas the routes
 * validate with, built with lib/openapi.ts's building blocks.
 */
import { ErrorResponse, errors, type Json, json, plain, query, ref } from "../lib/openapi.ts";
import { VERSION } from "../lib/version.ts";
import { BundleRequest, MAX_BATCH_ITEMS } from "./bundle-request.ts";
import { BatchReadRequest, BatchUploadRequest, FindMissingRequest } from "./cas/routes.ts";
import { ImageRequest } from "./images-routes.ts";
import { PipelineRequest, RerunRequest, RunRequest } from "./pipelines/routes.ts";
import { TokenRequest } from "./routes-tokens.ts";
import { KillRequest, UploadRequest, UserRequest } from "./routes-users.ts";
import { CheckinRequest, CheckoutRequest, CreateWorkerRequest } from "./workers/schemas.ts";

const nullable = (type: string, extra: Json = {}): Json => ({ type: [type, "null"], ...extra });
/** An API token as the users' API shows it (rest-server/routes-tokens.ts; never the token itself). */
const TOKEN_VIEW: Json = {
  type: "object",
  properties: {
    id: { type: "string" },
    userUuid: { type: "string" },
    label: { type: "string" },
    createdAt: { type: "string", format: "date-time" },
    expiresAt: nullable("string", { format: "date-time" }),
    lastUsedAt: nullable("string", { format: "date-time" }),
    revokedAt: nullable("string", { format: "date-time" }),
    expired: { type: "boolean" },
    current: { type: "boolean", description: "The token this request was made with." },
  },
  required: [
    "id",
    "userUuid",
    "label",
    "createdAt",
    "expiresAt",
    "lastUsedAt",
    "revokedAt",
    "expired",
    "current",
  ],
};

/** A user's worker as the users' API shows it (rest-server/workers/routes.ts; never its token). */
const WORKER_VIEW: Json = {
  type: "object",
  properties: {
    id: { type: "string" },
    ownerUuid: { type: "string" },
    name: { type: "string" },
    state: { type: "string", enum: ["new", "active", "draining", "stopped", "lost"] },
    disabled: { type: "boolean" },
    tags: { type: "array", items: { type: "string" } },
    resources: {
      type: ["object", "null"],
      description: "What its last check-in reported: vcpus, ram and freeDisk (bytes), gpu or null.",
    },
    slots: { type: "integer" },
    version: nullable("string"),
    artifactSha256: nullable("string"),
    cachedTrees: { type: "integer", description: "How many input trees its cache holds in full." },
    running: {
      type: "array",
      items: {
        type: "object",
        properties: { uuid: { type: "string" }, attempt: { type: "integer" } },
        required: ["uuid", "attempt"],
      },
    },
    createdAt: { type: "string", format: "date-time" },
    checkedInAt: nullable("string", { format: "date-time" }),
    checkinAgeMs: nullable("integer", { description: "Milliseconds since its last check-in." }),
  },
  required: [
    "id",
    "ownerUuid",
    "name",
    "state",
    "disabled",
    "tags",
    "resources",
    "slots",
    "version",
    "artifactSha256",
    "cachedTrees",
    "running",
    "createdAt",
    "checkedInAt",
    "checkinAgeMs",
  ],
};

/** A worker's message in a check-in's answer (lib/worker-protocol.ts WorkerMessage). */
const WORKER_MESSAGE: Json = {
  type: "object",
  description:
    "run {uuid, attempt, startDocument}: start this bundle (crunch-run's start document, with a runner token); kill {uuid, attempt, reason}; drain {reason}: take no new bundles; upgrade {sha256, bytes, version}: nothing runs, fetch the artifact and replace yourself.",
  properties: {
    type: { type: "string", enum: ["run", "kill", "drain", "upgrade"] },
    uuid: { type: "string" },
    attempt: { type: "integer" },
    startDocument: { type: "object" },
    reason: { type: "string" },
    sha256: { type: "string" },
    bytes: { type: "integer" },
    version: { type: "string" },
  },
  required: ["type"],
};

/** An image in the store as the users' API shows it (rest-server/images-routes.ts). */
const IMAGE_VIEW: Json = {
  type: "object",
  properties: {
    name: { type: "string" },
    imageId: { type: "string", pattern: "^sha256:[0-9a-f]{64}$" },
    manifest: { type: "string", description: "The tree's manifest digest, <sha256 hex>/<size>." },
    bytes: { type: "integer", description: "The tree's file bytes." },
    createdAt: { type: "string", format: "date-time" },
  },
  required: ["name", "imageId", "manifest", "bytes", "createdAt"],
};

/** A pipeline job as the users' API shows it (rest-server/pipelines/routes.ts). */
const PIPELINE_JOB_VIEW: Json = {
  type: "object",
  properties: {
    app: { type: "string" },
    jobId: { type: "string" },
    state: { type: "string", enum: ["waiting", "queued", "completed", "failed", "skipped"] },
    bundleUuid: nullable("string", { description: "The bundle of its latest attempt." }),
    attempts: { type: "integer" },
    reason: nullable("string"),
    failedParent: {
      type: ["object", "null"],
      description: "The ancestor whose failure this job inherited (it never ran).",
      properties: { app: { type: "string" }, jobId: { type: "string" } },
    },
    createdAt: { type: "string", format: "date-time" },
    updatedAt: { type: "string", format: "date-time" },
  },
  required: [
    "app",
    "jobId",
    "state",
    "bundleUuid",
    "attempts",
    "reason",
    "failedParent",
    "createdAt",
    "updatedAt",
  ],
};

/** The users' API (rest-server/routes-users.ts); request bodies are the schemas the routes validate with. */
export function usersApiDocument(): Json {
  const uuid: Json = { name: "uuid", in: "path", required: true, schema: { type: "string" } };
  const bundle = json({ type: "object", description: "A bundle (docs/api.md)." }, "The bundle.");
  const body = (name: string): Json => ({
    required: true,
    content: { "application/json": { schema: ref(name) } },
  });
  const common = ["auth.missing_token", "auth.invalid_token"] as const;
  const ownBundle = [...common, "request.invalid_param", "bundle.not_found"] as const;
  const pipelineCommon = [...common, "request.invalid_param"] as const;
  const pipelineName: Json = { name: "name", in: "path", required: true, schema: { type: "string" } };
  const casCommon = [...common, "cas.invalid_digest"] as const;
  const imageRef: Json = {
    name: "ref",
    in: "path",
    required: true,
    description:
      "An image name, percent-encoded (`/` as %2F; `:latest` when it has no tag), or `sha256:<image id>`.",
    schema: { type: "string" },
  };
  const digestParams: Json[] = [
    { name: "hash", in: "path", required: true, schema: { type: "string", pattern: "^[0-9a-f]{64}$" } },
    { name: "size", in: "path", required: true, schema: { type: "integer", minimum: 0 } },
  ];
  return {
    openapi: "3.1.0",
    info: {
      title: "dispatch-cloud users' API",
      version: VERSION,
      description: "Submit and follow bundles (docs/api.md). Authorization: Bearer <user token>.",
    },
    security: [{ bearer: [] }],
    paths: {
      "/api/v1/bundles": {
        post: {
          operationId: "createBundle",
          requestBody: body("BundleRequest"),
          responses: {
            "201": bundle,
            ...errors([
              ...common,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "bundle.invalid_dependency",
              "quota.queued_bundles",
              "quota.rate_limited",
            ]),
          },
        },
        get: {
          operationId: "listBundles",
          parameters: [
            query("state", "Comma-separated states.", false),
            query("limit", "1-500, default 50.", false),
            query("cursor", "nextCursor of the previous page.", false),
          ],
          responses: {
            "200": json(
              {
                type: "object",
                properties: {
                  items: { type: "array", items: { type: "object" } },
                  nextCursor: { type: ["string", "null"] },
                },
              },
              "A page of the caller's bundles.",
            ),
            ...errors([...common, "request.invalid_query"]),
          },
        },
      },
      "/api/v1/bundles/batch": {
        post: {
          operationId: "createBundles",
          description:
            "Up to 10,000 bundles in one request, all or nothing; a bad field is named under its item " +
            "(items[42].resources.ram). The answer lists the new bundles in the order given: whole, or with " +
            "`Prefer: return=minimal` only each one's uuid and state (and `Preference-Applied: return=minimal`).",
          parameters: [
            {
              name: "prefer",
              in: "header",
              required: false,
              schema: { type: "string" },
              description: "`return=minimal`: answer each new bundle's uuid and state only.",
            },
          ],
          requestBody: body("BatchRequest"),
          responses: {
            "201": json(
              { type: "object", properties: { items: { type: "array", items: { type: "object" } } } },
              "The new bundles, in the order of the request's items (with return=minimal: {uuid, state} each).",
            ),
            ...errors([
              ...common,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "request.body_too_large",
              "bundle.invalid_dependency",
              "quota.queued_bundles",
              "quota.rate_limited",
            ]),
          },
        },
      },
      "/api/v1/bundles/uploads": {
        post: {
          operationId: "createUploadBundle",
          description:
            "A tree uploaded to the content-addressed store (its manifest digest), kept as a bundle that is ready " +
            "from the start with the tree as its outputs; other bundles name it as a dependency.",
          requestBody: body("UploadRequest"),
          responses: {
            "201": bundle,
            ...errors([
              ...common,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "cas.invalid_digest",
              "cas.unknown_manifest",
            ]),
          },
        },
      },
      "/api/v1/bundles/{uuid}": {
        get: {
          operationId: "getBundle",
          parameters: [uuid],
          responses: { "200": bundle, ...errors(ownBundle) },
        },
      },
      "/api/v1/bundles/{uuid}/kill": {
        post: {
          operationId: "killBundle",
          parameters: [uuid],
          requestBody: { required: false, content: { "application/json": { schema: ref("KillRequest") } } },
          responses: { "200": bundle, ...errors([...ownBundle, "request.invalid_body", "bundle.conflict"]) },
        },
      },
      "/api/v1/bundles/{uuid}/events": {
        get: {
          operationId: "listBundleEvents",
          parameters: [uuid],
          responses: { "200": json({ type: "object" }, "The bundle's state changes."), ...errors(ownBundle) },
        },
      },
      "/api/v1/bundles/{uuid}/logs": {
        get: {
          operationId: "getBundleLogs",
          parameters: [
            uuid,
            query("stream", "stdout or stderr.", false),
            query("follow", "true: keep the response open until the attempt ends.", false),
            query("attempt", "Attempt number; default the current one.", false),
          ],
          responses: {
            "200": {
              description: "The log text.",
              content: { "text/plain": { schema: { type: "string" } } },
            },
            ...errors([...ownBundle, "request.invalid_query"]),
          },
        },
      },
      "/api/v1/bundles/{uuid}/outputs/{path}": {
        get: {
          operationId: "getBundleOutput",
          parameters: [
            uuid,
            { name: "path", in: "path", required: true, schema: { type: "string" } },
            query("limit", "A directory listing: files per page, 1-10000 (default 1000).", false),
            query("cursor", "A directory listing: nextCursor of the previous page.", false),
          ],
          responses: {
            "200": {
              description: "A directory listing (JSON) or a file's bytes.",
              content: {
                "application/json": { schema: { type: "object" } },
                "application/octet-stream": { schema: { type: "string", format: "binary" } },
              },
            },
            ...errors(ownBundle),
          },
        },
      },
      "/api/v1/pipelines": {
        get: {
          operationId: "listPipelines",
          responses: {
            "200": json(
              { type: "object", properties: { items: { type: "array", items: { type: "object" } } } },
              "The caller's pipelines by name: {name, digest, apps, jobs (a count per state), createdAt, updatedAt}.",
            ),
            ...errors(common),
          },
        },
      },
      "/api/v1/pipelines/{name}": {
        put: {
          operationId: "putPipeline",
          description:
            "Stores (201) or replaces (200) a pipeline; the definition is checked as docs/pipelines.md says.",
          parameters: [pipelineName],
          requestBody: body("PipelineRequest"),
          responses: {
            "200": json({ type: "object" }, "Replaced: {name, digest, definition, createdAt, updatedAt}."),
            "201": json({ type: "object" }, "Stored: {name, digest, definition, createdAt, updatedAt}."),
            ...errors([
              ...pipelineCommon,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "pipeline.invalid",
            ]),
          },
        },
        get: {
          operationId: "getPipeline",
          parameters: [pipelineName],
          responses: {
            "200": json(
              { type: "object" },
              "{name, digest, definition, jobs (a count per state), createdAt, updatedAt}.",
            ),
            ...errors([...pipelineCommon, "pipeline.not_found"]),
          },
        },
      },
      "/api/v1/pipelines/{name}/run": {
        post: {
          operationId: "runPipelineJob",
          description:
            "Bubble up: stores the job and every ancestor not yet stored; those whose parents are satisfied get their bundles at once. Running it again creates nothing.",
          parameters: [pipelineName],
          requestBody: body("PipelineRunRequest"),
          responses: {
            "200": json(
              {
                type: "object",
                properties: {
                  job: ref("PipelineJob"),
                  created: { type: "array", items: { type: "object" } },
                  started: { type: "integer" },
                },
              },
              "The job, the jobs this run stored ({app, jobId}) and how many of them started now.",
            ),
            ...errors([
              ...pipelineCommon,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "pipeline.not_found",
              "pipeline.invalid_job_id",
            ]),
          },
        },
      },
      "/api/v1/pipelines/{name}/rerun": {
        post: {
          operationId: "rerunPipelineJob",
          description:
            "The job back to waiting (and with descendants: true, every completed or failed descendant); descendants failed because of it go back to waiting in any case.",
          parameters: [pipelineName],
          requestBody: body("PipelineRerunRequest"),
          responses: {
            "200": json(
              {
                type: "object",
                properties: {
                  job: ref("PipelineJob"),
                  reset: { type: "array", items: { type: "object" } },
                  started: { type: "integer" },
                },
              },
              "The job, the jobs made pending again ({app, jobId}) and how many started now.",
            ),
            ...errors([
              ...pipelineCommon,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "pipeline.not_found",
              "pipeline.job_not_found",
              "pipeline.job_active",
            ]),
          },
        },
      },
      "/api/v1/pipelines/{name}/jobs/{app}/{jobId}": {
        get: {
          operationId: "getPipelineJob",
          parameters: [
            pipelineName,
            { name: "app", in: "path", required: true, schema: { type: "string" } },
            { name: "jobId", in: "path", required: true, schema: { type: "string" } },
          ],
          responses: {
            "200": json(
              { type: "object", properties: { job: ref("PipelineJobNode") } },
              "The job and its ancestors as a tree, each with its state and bundle.",
            ),
            ...errors([...pipelineCommon, "pipeline.not_found", "pipeline.job_not_found"]),
          },
        },
      },
      "/api/v1/tokens": {
        post: {
          operationId: "createToken",
          requestBody: body("TokenRequest"),
          responses: {
            "201": json(ref("TokenWithSecret"), "The token's view and the token, shown only this once."),
            ...errors([
              ...common,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "auth.forbidden",
              "user.not_found",
              "quota.tokens",
            ]),
          },
        },
        get: {
          operationId: "listTokens",
          parameters: [query("user", "A user uuid (admins); default the caller.", false)],
          responses: {
            "200": json(
              { type: "object", properties: { items: { type: "array", items: ref("Token") } } },
              "The user's tokens that are not revoked.",
            ),
            ...errors([...common, "request.invalid_query", "auth.forbidden", "user.not_found"]),
          },
        },
      },
      "/api/v1/tokens/{id}": {
        delete: {
          operationId: "revokeToken",
          parameters: [{ name: "id", in: "path", required: true, schema: { type: "string" } }],
          responses: {
            "200": json(ref("Token"), "The revoked token's view."),
            ...errors([...common, "request.invalid_param", "token.not_found"]),
          },
        },
      },
      "/api/v1/cas/find-missing": {
        post: {
          operationId: "casFindMissing",
          description:
            "Which of up to 10,000 digests the caller must upload: absent, or stored but not readable by the caller (docs/storage.md). Asking about a present blob extends its life.",
          requestBody: body("CasFindMissingRequest"),
          responses: {
            "200": json(
              { type: "object", properties: { missing: { type: "array", items: { type: "string" } } } },
              "The digests to upload, in the order asked.",
            ),
            ...errors([...casCommon, "request.invalid_json", "request.invalid_body"]),
          },
        },
      },
      "/api/v1/cas/batch-upload": {
        post: {
          operationId: "casBatchUpload",
          description:
            "Small blobs (each <= 1 MiB, all <= cas.maxBatchBytes) as base64, verified one by one.",
          requestBody: body("CasBatchUploadRequest"),
          responses: {
            "200": json(
              { type: "object", properties: { results: { type: "array", items: { type: "object" } } } },
              "One result per blob, in order: ok, or an error with its code.",
            ),
            ...errors([...casCommon, "request.invalid_json", "request.invalid_body", "cas.too_large"]),
          },
        },
      },
      "/api/v1/cas/batch-read": {
        post: {
          operationId: "casBatchRead",
          requestBody: body("CasBatchReadRequest"),
          responses: {
            "200": json(
              { type: "object", properties: { blobs: { type: "array", items: { type: "object" } } } },
              "One entry per digest, in order: its data (base64) or an error with its code. With Accept: application/vnd.dispatch-cloud.cas-batch the answer is binary instead: a JSON line {blobs: [{digest, size} | {digest, error}]}, then the bytes of the entries with a size, in order.",
            ),
            ...errors([...casCommon, "request.invalid_json", "request.invalid_body"]),
          },
        },
      },
      "/api/v1/cas/blobs/{hash}/{size}": {
        put: {
          operationId: "casPutBlob",
          description:
            "A blob's bytes, streamed; Content-Encoding identity, gzip, deflate or br; Upload-Offset resumes an interrupted upload (HEAD /api/v1/cas/uploads/...).",
          parameters: [
            ...digestParams,
            { name: "Upload-Offset", in: "header", required: false, schema: { type: "integer", minimum: 0 } },
          ],
          requestBody: {
            required: true,
            content: { "application/octet-stream": { schema: { type: "string", format: "binary" } } },
          },
          responses: {
            "201": json(
              { type: "object", properties: { digest: { type: "string" } } },
              "Verified and stored.",
            ),
            ...errors([
              ...casCommon,
              "request.invalid_body",
              "cas.digest_mismatch",
              "cas.too_large",
              "cas.unsupported_encoding",
              "cas.upload_offset",
              "cas.busy",
            ]),
          },
        },
        get: {
          operationId: "casGetBlob",
          description:
            "A blob's bytes; Range bytes=N- or N-M answers 206; Accept-Encoding gzip compresses what is not compressed already.",
          parameters: digestParams,
          responses: {
            "200": {
              description: "The bytes.",
              content: { "application/octet-stream": { schema: { type: "string", format: "binary" } } },
            },
            "206": {
              description: "The bytes of the range.",
              content: { "application/octet-stream": { schema: { type: "string", format: "binary" } } },
            },
            ...errors([...casCommon, "cas.not_found", "cas.range_not_satisfiable"]),
          },
        },
      },
      "/api/v1/cas/uploads/{hash}/{size}": {
        head: {
          operationId: "casUploadOffset",
          parameters: digestParams,
          responses: {
            "200": {
              description:
                "Upload-Offset: the uncompressed bytes of an interrupted upload the server kept for the caller (0: none).",
            },
            ...errors(casCommon),
          },
        },
      },
      "/api/v1/cas/manifests/{hash}/{size}": {
        put: {
          operationId: "casPutManifest",
          description:
            "A manifest's canonical JSON; every blob it names must be stored and readable by the caller.",
          parameters: digestParams,
          requestBody: { required: true, content: { "application/json": { schema: { type: "object" } } } },
          responses: {
            "201": json(
              {
                type: "object",
                properties: {
                  digest: { type: "string" },
                  files: { type: "integer" },
                  bytes: { type: "integer" },
                },
              },
              "Verified and stored.",
            ),
            ...errors([
              ...casCommon,
              "request.invalid_body",
              "cas.digest_mismatch",
              "cas.too_large",
              "cas.invalid_manifest",
              "cas.manifest_incomplete",
              "cas.busy",
            ]),
          },
        },
        get: {
          operationId: "casGetManifest",
          parameters: digestParams,
          responses: {
            "200": json({ type: "object" }, "The manifest."),
            ...errors([...casCommon, "cas.not_found"]),
          },
        },
      },
      "/api/v1/images": {
        post: {
          operationId: "registerImage",
          description:
            "Registers an image whose unpacked `docker save` tree the caller uploaded to the store (docs/images.md); a second registration of a name replaces what it named (`replaced`).",
          requestBody: body("ImageRequest"),
          responses: {
            "201": json(
              { allOf: [ref("Image"), { type: "object", properties: { replaced: { type: "boolean" } } }] },
              "The image as registered.",
            ),
            ...errors([
              ...common,
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "cas.invalid_digest",
              "images.invalid_name",
              "images.invalid_image_id",
              "images.unknown_manifest",
              "images.config_missing",
            ]),
          },
        },
        get: {
          operationId: "listImages",
          responses: {
            "200": json(
              { type: "object", properties: { items: { type: "array", items: ref("Image") } } },
              "The caller's images, by name.",
            ),
            ...errors(common),
          },
        },
      },
      "/api/v1/images/{ref}": {
        get: {
          operationId: "getImage",
          parameters: [imageRef],
          responses: {
            "200": json(ref("Image"), "The image."),
            ...errors([...common, "images.invalid_name", "images.not_found"]),
          },
        },
        delete: {
          operationId: "deleteImage",
          description:
            "Removes the name (by id: every name of that image). Bundles already pinned to it still run it.",
          parameters: [imageRef],
          responses: {
            "200": json(
              { type: "object", properties: { removed: { type: "array", items: ref("Image") } } },
              "What was removed.",
            ),
            ...errors([...common, "images.invalid_name", "images.not_found"]),
          },
        },
      },
      "/api/v1/workers": {
        post: {
          operationId: "createWorker",
          description: "Makes one of the caller's own workers and its token (docs/workers.md).",
          requestBody: body("CreateWorkerRequest"),
          responses: {
            "201": json(
              {
                type: "object",
                properties: {
                  worker: ref("Worker"),
                  token: { type: "string", description: "dcw_..., shown only this once." },
                },
                required: ["worker", "token"],
              },
              "The worker and its token, shown only this once.",
            ),
            ...errors([
              ...common,
              "workers.worker_token",
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "workers.name_taken",
            ]),
          },
        },
        get: {
          operationId: "listWorkers",
          parameters: [query("all", "true: every user's workers (admins only).", false)],
          responses: {
            "200": json(
              { type: "object", properties: { items: { type: "array", items: ref("Worker") } } },
              "The caller's workers (with all=true, everyone's), by creation.",
            ),
            ...errors([...common, "workers.worker_token", "request.invalid_query", "auth.forbidden"]),
          },
        },
      },
      ...Object.fromEntries(
        (["disable", "enable"] as const).map((action) => [
          `/api/v1/workers/{id}/${action}`,
          {
            post: {
              operationId: `${action}Worker`,
              description:
                action === "disable"
                  ? "The worker's token is refused (workers.disabled) and it is given nothing until enabled. Its owner or an admin."
                  : "The worker may check in again. Its owner or an admin.",
              parameters: [{ name: "id", in: "path", required: true, schema: { type: "string" } }],
              responses: {
                "200": json(ref("Worker"), "The worker."),
                ...errors([...common, "workers.worker_token", "request.invalid_param", "workers.not_found"]),
              },
            },
          },
        ]),
      ),
      "/api/v1/workers/checkin": {
        post: {
          operationId: "workerCheckin",
          description:
            "A worker (Authorization: Bearer dcw_...) reports itself and gets its messages: at once when there are some, else after at most workers.longPoll (docs/workers.md). A refused check-in stores nothing.",
          requestBody: body("WorkerCheckinRequest"),
          responses: {
            "200": json(
              {
                type: "object",
                properties: {
                  workerId: { type: "string" },
                  serverVersion: { type: "string" },
                  artifactSha256: {
                    type: "string",
                    description: 'The server\'s runner artifact, or "" for none.',
                  },
                  messages: { type: "array", items: ref("WorkerMessage") },
                },
                required: ["workerId", "serverVersion", "artifactSha256", "messages"],
              },
              "What the worker is to do, in order: kill, run, drain, upgrade.",
            ),
            ...errors([
              ...common,
              "workers.disabled",
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "workers.implausible_resources",
              "workers.wrong_worker",
              "workers.not_assigned",
            ]),
          },
        },
      },
      "/api/v1/workers/checkout": {
        post: {
          operationId: "workerCheckout",
          description:
            "The worker stops (state stopped); with handBack its starting bundles go back to the queue and its running ones are lost (requeued while attempts remain).",
          requestBody: body("WorkerCheckoutRequest"),
          responses: {
            "200": json(
              {
                type: "object",
                properties: { requeued: { type: "array", items: { type: "string" } } },
                required: ["requeued"],
              },
              "The bundles handed back that are staged again.",
            ),
            ...errors([
              ...common,
              "workers.disabled",
              "request.invalid_json",
              "request.invalid_body",
              "request.unknown_field",
              "workers.wrong_worker",
            ]),
          },
        },
      },
      "/api/v1/workers/artifact": {
        get: {
          operationId: "workerArtifact",
          description:
            "The runner artifact a worker upgrades to; its sha256 in the x-artifact-sha256 header.",
          responses: {
            "200": {
              description: "The artifact's bytes.",
              headers: { "x-artifact-sha256": { schema: { type: "string" } } },
              content: { "application/octet-stream": { schema: { type: "string", format: "binary" } } },
            },
            ...errors([...common, "workers.disabled", "workers.no_artifact"]),
          },
        },
      },
      "/api/v1/users/current": {
        get: {
          operationId: "currentUser",
          responses: { "200": json({ type: "object" }, "The caller."), ...errors(common) },
        },
      },
      "/api/v1/users": {
        post: {
          operationId: "createUser",
          requestBody: body("UserRequest"),
          responses: {
            "201": json({ type: "object" }, "The new user and its token (shown only this once)."),
            ...errors([...common, "auth.forbidden", "request.invalid_body"]),
          },
        },
      },
    },
    components: {
      securitySchemes: { bearer: { type: "http", scheme: "bearer" } },
      schemas: {
        BundleRequest: plain(BundleRequest),
        BatchRequest: {
          type: "object",
          additionalProperties: false,
          required: ["items"],
          properties: {
            items: { type: "array", minItems: 1, maxItems: MAX_BATCH_ITEMS, items: ref("BundleRequest") },
          },
        },
        KillRequest: plain(KillRequest),
        UploadRequest: plain(UploadRequest),
        UserRequest: plain(UserRequest),
        TokenRequest: plain(TokenRequest),
        CasFindMissingRequest: plain(FindMissingRequest),
        CasBatchUploadRequest: plain(BatchUploadRequest),
        CasBatchReadRequest: plain(BatchReadRequest),
        ImageRequest: plain(ImageRequest),
        PipelineRequest: plain(PipelineRequest),
        PipelineRunRequest: plain(RunRequest),
        PipelineRerunRequest: plain(RerunRequest),
        PipelineJob: PIPELINE_JOB_VIEW,
        PipelineJobNode: {
          allOf: [
            ref("PipelineJob"),
            {
              type: "object",
              properties: {
                bundleState: nullable("string"),
                repeated: {
                  type: "boolean",
                  description:
                    "A shared ancestor shown already elsewhere in the tree; its parents are listed there.",
                },
                parents: { type: "array", items: ref("PipelineJobNode") },
              },
              required: ["bundleState", "parents"],
            },
          ],
        },
        Image: IMAGE_VIEW,
        Worker: WORKER_VIEW,
        WorkerMessage: WORKER_MESSAGE,
        CreateWorkerRequest: plain(CreateWorkerRequest),
        WorkerCheckinRequest: plain(CheckinRequest),
        WorkerCheckoutRequest: plain(CheckoutRequest),
        Token: TOKEN_VIEW,
        TokenWithSecret: {
          allOf: [
            ref("Token"),
            { type: "object", properties: { token: { type: "string" } }, required: ["token"] },
          ],
        },
        Error: plain(ErrorResponse),
      },
    },
  };
}
