/**
 * Every stable error code of dispatch-cloud, in one table. APIs answer with
 * `{ error: { code, message, path? } }` and the status given here; the CLI and the config checker print the
 * same codes. Codes are never renamed once released; docs/errors.md documents each one (a test checks).
 */
export const ERROR_CODES = {
  // Requests to the users', runner and management APIs.
  "request.invalid_json": { status: 400, description: "The request body is not valid JSON." },
  "request.invalid_body": {
    status: 400,
    description: "A field of the request body is missing, of the wrong type, or out of range.",
  },
  "request.unknown_field": {
    status: 400,
    description: "The request body has a field the API does not know.",
  },
  "request.invalid_query": { status: 400, description: "A query-string parameter is missing or malformed." },
  "request.invalid_param": { status: 400, description: "A path parameter is malformed." },
  "request.body_too_large": {
    status: 413,
    description: "The request body is larger than the server accepts.",
  },
  "request.unsupported_media_type": {
    status: 415,
    description: "The request body's content type is not application/json.",
  },
  "request.not_found": { status: 404, description: "No route matches the request's method and path." },
  "request.invalid_url": {
    status: 400,
    description: "The URL's path cannot be decoded (a %-escape that is not UTF-8, such as %ff).",
  },
  "request.uri_too_long": {
    status: 414,
    description: "A path parameter of the URL is longer than the server accepts (100 characters).",
  },
  "request.timeout": {
    status: 408,
    description:
      "The request's headers or body did not arrive within the server's headersTimeout or requestTimeout; the connection is closed.",
  },
  "request.headers_too_large": {
    status: 431,
    description:
      "The request line and headers are larger than the server accepts (16 KiB); the connection is closed.",
  },
  "request.malformed_http": {
    status: 400,
    description: "The request is not valid HTTP/1.1; the connection is closed.",
  },
  "request.server_closing": {
    status: 503,
    description: "The server is shutting down and takes no new requests; retry once it (or another) is up.",
  },
  "auth.missing_token": { status: 401, description: "The request carries no bearer token." },
  "auth.invalid_token": {
    status: 401,
    description: "The bearer token is not valid (unknown, revoked or expired).",
  },
  "auth.forbidden": { status: 403, description: "The token is valid but not allowed to do this." },
  "management.unknown_instance": {
    status: 404,
    description: "The management API knows no instance with that id (the dispatcher's pool has none).",
  },
  "management.unknown_bundle": {
    status: 404,
    description:
      "The management API knows no bundle with that uuid (in the dispatcher's queue, or at all for kill).",
  },
  "management.not_active": {
    status: 503,
    description:
      "This dispatcher is a standby (another one holds the lock): it has no instances or queue to show or steer.",
  },
  "bundle.not_found": {
    status: 404,
    description:
      "No bundle with that uuid is visible to the caller (other users' bundles are never visible).",
  },
  "bundle.invalid_dependency": {
    status: 400,
    description: "A dependency names a bundle that does not exist or belongs to another user.",
  },
  "bundle.conflict": {
    status: 409,
    description: "The bundle's state changed under the request (for example it is already final).",
  },
  "runner.not_current": {
    status: 409,
    description: "The runner's attempt no longer owns the bundle (it was requeued, killed, or finished).",
  },
  "runner.bad_archive": {
    status: 400,
    description:
      "An uploaded or downloaded archive is not a valid tar of regular files and directories under relative paths.",
  },
  "runner.output_too_large": {
    status: 413,
    description: "The bundle's outputs are larger than restServer.maxOutputSize allows.",
  },
  "runner.output_too_many_files": {
    status: 413,
    description:
      "The outputs hold more files, directories and links than restServer.maxOutputFiles allows; the bundle fails.",
  },
  "runner.log_gap": {
    status: 409,
    description:
      "A log chunk starts beyond the bytes the server has for that stream; the message names the expectedOffset to resend from.",
  },
  "runner.dependency_unavailable": {
    status: 404,
    description:
      "The runner asked for a dependency the bundle does not have, or whose bundle is not ready or lacks the subpath.",
  },
  "cas.invalid_digest": {
    status: 400,
    description:
      "A digest is not `<sha256 hex>/<size>` with a lower-case 64-character hash and a whole size.",
  },
  "cas.digest_mismatch": {
    status: 400,
    description:
      "The uploaded bytes do not hash to, or do not have the size of, the digest they were sent as.",
  },
  "cas.too_large": {
    status: 413,
    description:
      "An upload is larger than its digest says (a compressed body that inflates beyond it is refused as it inflates), or a batch is larger than allowed.",
  },
  "cas.not_found": {
    status: 404,
    description:
      "The store has no blob with that digest that the caller may read (absent and unreadable look the same).",
  },
  "cas.invalid_manifest": {
    status: 400,
    description:
      "A manifest is not the canonical JSON of a valid tree (sorted relative paths, parents listed, links inside); the path names the bad field.",
  },
  "cas.manifest_incomplete": {
    status: 400,
    description:
      "A manifest names blobs that are not in the store for the caller; upload them first, the manifest last.",
  },
  "cas.unsupported_encoding": {
    status: 415,
    description: "A Content-Encoding other than identity, gzip, deflate or br.",
  },
  "cas.range_not_satisfiable": {
    status: 416,
    description: "A Range that starts beyond the blob's size.",
  },
  "cas.upload_offset": {
    status: 409,
    description:
      "A resumed upload's Upload-Offset is not what the server holds; the message names the offset to resume from.",
  },
  "cas.busy": {
    status: 503,
    description: "The blob is being deleted by garbage collection right now; retry the upload.",
  },
  "cas.storage_unavailable": {
    status: 503,
    description:
      "The blob storage (S3-compatible object storage) failed or did not answer; the message names the operation, the key and the storage's own error code.",
  },
  "cas.unknown_manifest": {
    status: 400,
    description:
      "A runner's finish names an outputManifest that is not a manifest stored and readable by the bundle's owner; upload it first.",
  },
  "images.invalid_name": {
    status: 400,
    description:
      "An image name is not a usable reference: 1-255 characters of a-z 0-9 . _ - / : starting with a letter or digit, not `sha256:` (that prefix names an image id).",
  },
  "images.invalid_image_id": {
    status: 400,
    description: "An image id is not `sha256:` followed by 64 lowercase hex digits.",
  },
  "images.unknown_manifest": {
    status: 400,
    description:
      "The image's manifest is not a manifest in the content-addressed store that the caller may read; upload the image's tree first.",
  },
  "images.config_missing": {
    status: 400,
    description:
      "The image's tree holds no file whose bytes hash to the image id (its config), and no manifest.json: it is not the unpacked `docker save` of that image.",
  },
  "images.not_found": {
    status: 404,
    description: "The caller has no image of that name or id in the store.",
  },
  "workers.name_taken": {
    status: 409,
    description:
      "The caller already has a worker of that name (`dispatch-cloud workers token create --name`).",
  },
  "workers.not_found": {
    status: 404,
    description: "No worker of that id (among the caller's own, unless the caller is an admin).",
  },
  "workers.disabled": {
    status: 403,
    description: "The worker token belongs to a worker its owner or an admin disabled: it may not check in.",
  },
  "workers.wrong_worker": {
    status: 403,
    description:
      "The check-in names a worker id other than the one its token was made for. Nothing was stored.",
  },
  "workers.worker_token": {
    status: 403,
    description:
      "A worker token (`dcw_...`) was used on a route other than the worker's own (check-in, check-out, the artifact): it can do nothing else.",
  },
  "workers.implausible_resources": {
    status: 400,
    description:
      "The check-in reports resources out of any plausible range (no CPUs, more than 4096, more than 64 TiB, more slots than 256, ...). Nothing was stored.",
  },
  "workers.not_assigned": {
    status: 403,
    description:
      "The check-in says the worker runs a bundle that is not its owner's: a worker only ever sees its owner's bundles. Nothing was stored.",
  },
  "workers.no_artifact": {
    status: 404,
    description:
      "The server has no runner artifact to offer (it runs from sources): workers cannot upgrade from it.",
  },
  "worker.artifact_mismatch": {
    status: 502,
    description:
      "The runner artifact a worker downloaded does not have the sha256 the server announced: the worker keeps its old program.",
  },
  "worker.checkin_failed": {
    status: 502,
    description:
      "A worker could not check in (network, 5xx): it retries with back-off, and says so when it gives up.",
  },
  "pipeline.not_found": {
    status: 404,
    description: "The caller has no pipeline of that name (`PUT /api/v1/pipelines/:name` stores one).",
  },
  "pipeline.job_not_found": {
    status: 404,
    description: "The pipeline has no such job yet (`pipeline run` creates it).",
  },
  "pipeline.job_active": {
    status: 409,
    description: "The job's bundle is not final yet: it cannot be rerun until it finishes or is killed.",
  },
  "output.not_found": {
    status: 404,
    description: "The bundle's outputs have no file or directory at that path.",
  },
  "user.exists": { status: 409, description: "A user with that name already exists." },
  "user.not_found": { status: 404, description: "No user with that uuid exists (admins' token requests)." },
  "token.not_found": {
    status: 404,
    description:
      "No token with that id is visible to the caller: none exists, it is revoked, or it is another user's (only admins see those).",
  },
  "quota.queued_bundles": {
    status: 429,
    description:
      "The user already has quotas.maxQueuedBundlesPerUser non-final bundles; submit again once some have finished.",
  },
  "quota.rate_limited": {
    status: 429,
    description:
      "The user submits faster than quotas.submissionsPerSecond allows; the Retry-After header says in how many seconds to try again.",
  },
  "quota.tokens": {
    status: 429,
    description: "The user already holds quotas.maxTokensPerUser tokens; revoke one to make another.",
  },
  "pipeline.invalid": {
    status: 400,
    description:
      "A pipeline definition is wrong: not YAML, an unknown key, app or field, a bad value or range, a template that cannot map parent jobs to child jobs, or a cycle. The path names the key (`apps.train.depends_on.by_client[1].date`); `pipeline check` lists every problem.",
  },
  "pipeline.invalid_job_id": {
    status: 400,
    description:
      "A job id is not one of the app's: it does not fit the app's job-id template and field types, or a field's value is not among the app's autofill_values.",
  },
  "internal.error": { status: 500, description: "An unexpected server error; the log has the details." },
  // Configuration (dispatch-cloud config check, and every process at start-up).
  "config.invalid_yaml": { status: 400, description: "The config file is not valid YAML." },
  "config.unknown_key": { status: 400, description: "The config has a key the schema does not know." },
  "config.invalid_value": { status: 400, description: "A config value has the wrong type, format or range." },
  "config.missing_key": { status: 400, description: "A required config key is missing." },
  "config.unreadable_file": {
    status: 400,
    description: "The config file (or a file:// secret) cannot be read.",
  },
  "config.missing_secret": {
    status: 400,
    description: "A secret's env: variable or file:// path is not set.",
  },
  // Cloud drivers (cloud-drivers/errors.ts): classified by how the caller reacts.
  "cloud.rate_limit": {
    status: 503,
    description: "The cloud refused a call for its rate limit; no calls until the error's earliestRetry.",
  },
  "cloud.quota": { status: 503, description: "The cloud account is at an instance or resource quota." },
  "cloud.capacity": {
    status: 503,
    description: "The cloud has no capacity for an instance type, a quota group, or at all, for now.",
  },
  "cloud.error": {
    status: 502,
    description: "A cloud call failed for another reason (the cause has the details).",
  },
  "cloud.unknown_driver": { status: 400, description: "cloud.driver names no registered driver." },
  "cloud.invalid_parameters": {
    status: 400,
    description: "cloud.driverParameters are wrong for the driver.",
  },
  "cloud.instance_gone": { status: 404, description: "The instance no longer exists in the cloud." },
  // SSH executor (dispatcher/sshexec).
  "ssh.connect_failed": {
    status: 502,
    description: "Could not connect or authenticate to the instance's SSH server.",
  },
  "ssh.timeout": {
    status: 504,
    description: "A command on the instance ran past its timeout and was abandoned.",
  },
  "ssh.host_mismatch": {
    status: 502,
    description:
      "The instance's secret file does not match its tag: the host is not ours; nothing more is sent to it.",
  },
  "ssh.not_ready": {
    status: 503,
    description:
      "The instance's SSH server answered but its secret file is not written yet (still booting); try again later.",
  },
  "ssh.closed": { status: 502, description: "The SSH connection closed while a command was running." },
  "ssh.invalid_key": { status: 400, description: "The dispatcher's SSH private key cannot be parsed." },
  // Store.
  "store.invalid_url": {
    status: 400,
    description: "database.url is neither postgres://... nor pglite:<dir>.",
  },
  "store.migration_failed": {
    status: 500,
    description: "A database migration failed; nothing after it ran.",
  },
  // Processes (serve, rest-server, dispatcher).
  "serve.data_dir_in_use": {
    status: 409,
    description:
      "Another `serve` holds the data directory (one per directory); the message names its process. Stop it, or use another dataDir.",
  },
  "serve.cannot_listen": {
    status: 503,
    description:
      "A server could not listen on its configured address (in use by another process, or not allowed); the process exits.",
  },
  // crunch-run (the runner on each instance).
  "output.bad_entry": {
    status: 400,
    description:
      "An output tree holds something that cannot be an output: a symbolic link to a place outside it, a FIFO, socket or device, a path longer than the filesystem holds, an entry that cannot be read, or the output directory itself a link. The bundle fails; the reason names the path as the container saw it.",
  },
  "crunchrun.usage": { status: 400, description: "crunch-run's command line is malformed." },
  "crunchrun.invalid_start_document": {
    status: 400,
    description: "The start document on crunch-run's stdin is not JSON or a field of it is wrong.",
  },
  "crunchrun.already_running": {
    status: 409,
    description: "A live crunch-run supervisor already holds the bundle's lock on this instance.",
  },
  "crunchrun.api_error": {
    status: 502,
    description: "The runner API answered crunch-run with an error or could not be reached.",
  },
  "crunchrun.docker_error": {
    status: 503,
    description: "The Docker daemon could not be reached or failed (the instance marks itself broken).",
  },
  "crunchrun.image_missing": {
    status: 404,
    description:
      "The bundle's image is neither on the instance nor in its registry (no such repository or tag, or not a valid reference). The bundle fails at once; the reason names the image.",
  },
  "crunchrun.image_denied": {
    status: 403,
    description:
      "The image's registry refused the pull: no credentials, or the configured ones (containers.registries) are wrong or lack access. The bundle fails at once; the reason names the image, the registry and the user, never the password.",
  },
  "crunchrun.image_unavailable": {
    status: 503,
    description:
      "The image's registry could not be reached or answered 5xx or 429 for containers.pullRetryTimeout of retries. The bundle is requeued; this does not count against the instance, nor as one of the bundle's attempts (up to containers.unavailableImageRequeues times).",
  },
  "crunchrun.command_unusable": {
    status: 400,
    description:
      "The bundle's command cannot be run: not found (in $PATH or at its path) or not executable. The bundle fails; the reason names the command.",
  },
  "crunchrun.runtime_failed": {
    status: 503,
    description:
      "The container runtime or the Docker daemon failed to create or start the bundle's container (an OCI hook, a mount, a cgroup, a 5xx), which is the instance's fault: the bundle is requeued, and repeated failures mark the instance broken.",
  },
  "crunchrun.preempted": {
    status: 503,
    description:
      "The instance received a spot interruption notice: crunch-run starts no new bundle on it (the dispatcher requeues the bundle).",
  },
  // CLI.
  "cli.usage": { status: 400, description: "The command line is malformed." },
  "cli.no_token": {
    status: 401,
    description: "The CLI found no API token (flag, environment or token file).",
  },
  "cli.unreachable": { status: 503, description: "The CLI could not reach the REST server." },
  "cli.docker_save_failed": {
    status: 400,
    description:
      "`images push` could not save the image with `docker save` (no docker command, no such image, or not a docker save archive); the message has docker's words.",
  },
  // `dispatch-cloud gahp` (docs/htcondor.md): E/F replies and result lines carry "<code>: <message>".
  "gahp.invalid_config": {
    status: 400,
    description:
      "The GAHP's config file is missing, not YAML, or has a bad key or value; the message names the key.",
  },
  "gahp.unknown_command": {
    status: 400,
    description: "A request line names a command the GAHP does not have (COMMANDS lists them).",
  },
  "gahp.bad_arguments": {
    status: 400,
    description:
      "A request has the wrong number of arguments, a count or number that is not one, or a request id already in use.",
  },
  "gahp.malformed_line": {
    status: 400,
    description:
      "A request line is not text the protocol allows: not UTF-8, a control character, or a backslash before anything but space, backslash, CR or LF.",
  },
  "gahp.line_too_long": {
    status: 413,
    description:
      "A request line is longer than the GAHP's maxRequestBytes; it was read to its end and dropped.",
  },
  "gahp.unknown_app": {
    status: 400,
    description: "BOINC_SUBMIT names an app that the GAHP's config has no template for.",
  },
  "gahp.unknown_batch": {
    status: 404,
    description: 'No batch of that name exists for this user (the message ends "no batch named <name>").',
  },
  "gahp.unknown_job": { status: 404, description: "No job of that name exists for this user." },
  "gahp.job_not_done": {
    status: 409,
    description: "BOINC_FETCH_OUTPUT for a job that has not finished, or that ended without a result.",
  },
  "gahp.input_unreadable": {
    status: 400,
    description: "An input file named in BOINC_SUBMIT cannot be read on the submit machine.",
  },
  "gahp.output_failed": {
    status: 500,
    description: "BOINC_FETCH_OUTPUT could not write an output or the stderr file where it was asked to.",
  },
} as const satisfies Record<string, { status: number; description: string }>;

export type ErrorCode = keyof typeof ERROR_CODES;

/** An error a caller can act on: a stable code, an HTTP status, and the path of the bad field if any. */
export class DispatchCloudError extends Error {
  readonly code: ErrorCode;
  readonly status: number;
  readonly path: string | undefined;

  constructor(code: ErrorCode, message: string, options: { path?: string; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = "DispatchCloudError";
    this.code = code;
    this.status = ERROR_CODES[code].status;
    this.path = options.path;
  }

  toJSON(): ErrorBody {
    return errorBody(this.code, this.message, this.path);
  }
}

export interface ErrorBody {
  error: { code: ErrorCode; message: string; path?: string };
}

export function errorBody(code: ErrorCode, message: string, path?: string): ErrorBody {
  return { error: path === undefined ? { code, message } : { code, message, path } };
}
