/**
 * The GAHP's own config file (docs/htcondor.md "Config"): where the REST server is, the token, the protocol's
 * limits, and one bundle template per BOINC app. It is not the server's config: a submit node has no other.
 */
import { readFile } from "node:fs/promises";
import { type Static, Type } from "@sinclair/typebox";
import { Value, ValueErrorType } from "@sinclair/typebox/value";
import { parse as parseYaml } from "yaml";
import { resolveSecret } from "../../config/secrets.ts";
import { DispatchCloudError } from "../../lib/errors.ts";
import { parseDuration, parseSize } from "../../lib/units.ts";

const SizeValue = Type.Union([Type.String({ minLength: 1 }), Type.Integer({ minimum: 0 })]);

const AppTemplate = Type.Object(
  {
    image: Type.String({ minLength: 1, description: "The container image the app's jobs run in." }),
    command: Type.Array(Type.String(), {
      minItems: 1,
      description:
        'The command, as a list. An item "{args}" is replaced by the job\'s arguments (zero or more items); ' +
        "{job}, {batch}, {app} and {inputs} inside an item by the job's name, its batch's, the app's and the " +
        "directory its input files are in.",
    }),
    resources: Type.Optional(
      Type.Object(
        {
          vcpus: Type.Optional(Type.Number({ exclusiveMinimum: 0 })),
          ram: Type.Optional(SizeValue),
          scratch: Type.Optional(SizeValue),
        },
        { additionalProperties: false },
      ),
    ),
    limits: Type.Optional(
      Type.Object(
        {
          time: Type.Optional(Type.String({ minLength: 1 })),
          disk: Type.Optional(SizeValue),
          network: Type.Optional(Type.Boolean()),
        },
        { additionalProperties: false },
      ),
    ),
    env: Type.Optional(Type.Record(Type.String(), Type.String())),
    maxAttempts: Type.Optional(Type.Integer({ minimum: 1, maximum: 10 })),
    preemptible: Type.Optional(Type.Boolean()),
    priority: Type.Optional(Type.Integer({ minimum: 0, maximum: 1000 })),
  },
  { additionalProperties: false },
);

export const GahpConfigSchema = Type.Object(
  {
    apiUrl: Type.String({
      default: "http://127.0.0.1:8900",
      description: "The REST server, until BOINC_SELECT_PROJECT names another.",
    }),
    token: Type.String({
      default: "",
      description:
        "The user's API token (file:///path or env:NAME), until BOINC_SELECT_PROJECT's authenticator replaces it.",
    }),
    maxPendingRequests: Type.Integer({
      minimum: 1,
      maximum: 10000,
      default: 64,
      description: 'Requests in progress at once; one more is answered "E Threads limit reached".',
    }),
    maxRequestBytes: Type.Union([Type.String(), Type.Integer()], {
      default: "16MiB",
      description: "The longest request line; a longer one is read to its end, dropped and answered E.",
    }),
    httpConcurrency: Type.Integer({
      minimum: 1,
      maximum: 256,
      default: 16,
      description: "REST requests and file transfers in flight at once, over all GAHP requests.",
    }),
    apps: Type.Record(Type.String({ minLength: 1 }), AppTemplate, {
      default: {},
      description: "One bundle template per BOINC app name.",
    }),
  },
  { additionalProperties: false },
);

export type AppTemplate = Static<typeof AppTemplate>;

/** The config after checking: sizes in bytes, durations checked, the token read. */
export interface GahpConfig {
  apiUrl: string;
  token: string;
  maxPendingRequests: number;
  maxRequestBytes: number;
  httpConcurrency: number;
  apps: Record<string, AppTemplate>;
}

const bad = (path: string, message: string) =>
  new DispatchCloudError("gahp.invalid_config", `${path}: ${message}`, { path });

/** Checks a parsed config document; every problem is thrown with its key path. */
export function checkGahpConfig(doc: unknown, env: Record<string, string | undefined>): GahpConfig {
  const value: unknown = Value.Default(GahpConfigSchema, doc ?? {});
  for (const e of Value.Errors(GahpConfigSchema, value)) {
    const path = e.path.replace(/^\//, "").replaceAll("/", ".") || "(top)";
    if (e.type === ValueErrorType.ObjectAdditionalProperties) throw bad(path, "unknown key");
    throw bad(path, e.message.charAt(0).toLowerCase() + e.message.slice(1));
  }
  const c = value as Static<typeof GahpConfigSchema>;
  const size = (v: string | number, path: string) => {
    try {
      return parseSize(v);
    } catch (err) {
      throw bad(path, err instanceof Error ? err.message : String(err));
    }
  };
  try {
    new URL(c.apiUrl);
  } catch {
    throw bad("apiUrl", `not a URL: ${JSON.stringify(c.apiUrl)}`);
  }
  for (const [name, app] of Object.entries(c.apps)) {
    const at = `apps.${name}`;
    if (app.resources?.ram !== undefined) size(app.resources.ram, `${at}.resources.ram`);
    if (app.resources?.scratch !== undefined) size(app.resources.scratch, `${at}.resources.scratch`);
    if (app.limits?.disk !== undefined) size(app.limits.disk, `${at}.limits.disk`);
    if (app.limits?.time !== undefined) {
      try {
        parseDuration(app.limits.time);
      } catch (err) {
        throw bad(`${at}.limits.time`, err instanceof Error ? err.message : String(err));
      }
    }
  }
  let token = "";
  try {
    token = resolveSecret(c.token, "token", env).trim();
  } catch (err) {
    throw bad("token", err instanceof Error ? err.message : String(err));
  }
  return {
    apiUrl: c.apiUrl,
    token,
    maxPendingRequests: c.maxPendingRequests,
    maxRequestBytes: size(c.maxRequestBytes, "maxRequestBytes"),
    httpConcurrency: c.httpConcurrency,
    apps: c.apps,
  };
}

/** Reads and checks the config file at `path`. */
export async function loadGahpConfig(
  path: string,
  env: Record<string, string | undefined>,
): Promise<GahpConfig> {
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (err) {
    throw new DispatchCloudError("gahp.invalid_config", `cannot read the GAHP config ${path}`, {
      cause: err,
    });
  }
  let doc: unknown;
  try {
    doc = parseYaml(text);
  } catch (err) {
    throw new DispatchCloudError(
      "gahp.invalid_config",
      `${path} is not YAML: ${err instanceof Error ? err.message : String(err)}`,
    );
  }
  return checkGahpConfig(doc, env);
}
