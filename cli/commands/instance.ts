import { DispatchCloudError } from "../../lib/errors.ts";
import { parse } from "../args.ts";
import { type CliIo, EXIT_FAILED, EXIT_OK, usageError } from "../io.ts";
import { connectManagement, MANAGEMENT_OPTIONS, type ManagementInstance } from "../management-client.ts";
import { table } from "./client-common.ts";

const USAGE = `usage: dispatch-cloud instance list [--header] [--json]
       dispatch-cloud instance hold|drain|run ID...
       dispatch-cloud instance kill ID... [--reason TEXT]
(clients of the management API: --management-url URL or DISPATCH_CLOUD_MANAGEMENT_URL, default
http://127.0.0.1:8901; token from DISPATCH_CLOUD_MANAGEMENT_TOKEN, --token-file F, or the
management-token file serve writes in its data directory)
  hold   never shut down automatically, gets no new bundles (investigate a suspect VM)
  drain  gets no new bundles, shut down as soon as nothing runs on it
  run    the normal behaviour again
  kill   destroy at once; bundles on it are lost and retried`;

export const INSTANCE_HEADER = [
  "INSTANCE",
  "ADDRESS",
  "STATE",
  "IDLE BEHAVIOR",
  "TYPE",
  "PROVIDER TYPE",
  "PRICE",
  "RUNNING BUNDLES",
  "PROBLEM",
];

/**
 * The `instance list` table: one row per instance, running bundles comma-separated ("-" for none); the state of
 * an instance with a spot interruption notice reads e.g. `running,preempted`; the last column says what is wrong
 * with it ("-" when nothing is).
 */
export function formatInstances(items: ManagementInstance[], header: boolean): string[] {
  const rows = header ? [INSTANCE_HEADER] : [];
  for (const i of items) {
    rows.push([
      i.instanceId,
      i.address === "" ? "-" : i.address,
      i.preempted === true ? `${i.state},preempted` : i.state,
      i.idleBehavior,
      i.instanceType,
      i.providerType,
      i.price.toFixed(4),
      i.runningBundles.length === 0 ? "-" : i.runningBundles.join(","),
      i.problem == null || i.problem === "" ? "-" : i.problem,
    ]);
  }
  return table(rows);
}

export async function instanceCommand(io: CliIo): Promise<number> {
  const [sub, ...rest] = io.argv;
  switch (sub) {
    case "list":
    case "ls":
      return list(io, rest);
    case "hold":
    case "drain":
    case "run":
    case "kill":
      return act(io, sub, rest);
    default:
      throw usageError(sub === undefined ? USAGE : `unknown instance command "${sub}"\n${USAGE}`);
  }
}

async function list(io: CliIo, argv: string[]): Promise<number> {
  const { values } = parse(argv, { ...MANAGEMENT_OPTIONS, header: { type: "boolean" } }, false);
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  const api = await connectManagement(io, values);
  const res = await api.request<{ items: ManagementInstance[] }>("GET", "management/v1/instances");
  if (values.json === true) io.out(JSON.stringify(res.items, null, 2));
  else for (const line of formatInstances(res.items, values.header === true)) io.out(line);
  return EXIT_OK;
}

function describeError(err: unknown): string {
  if (err instanceof DispatchCloudError) return `${err.message} [${err.code}]`;
  return err instanceof Error ? err.message : String(err);
}

async function act(io: CliIo, action: "hold" | "drain" | "run" | "kill", argv: string[]): Promise<number> {
  const options =
    action === "kill" ? { ...MANAGEMENT_OPTIONS, reason: { type: "string" } as const } : MANAGEMENT_OPTIONS;
  const { values, positionals } = parse(argv, options);
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  if (positionals.length === 0) throw usageError(`instance ${action} takes one or more instance ids`);
  const api = await connectManagement(io, values);
  const reason = "reason" in values && typeof values.reason === "string" ? values.reason : "operator kill";
  let failed = 0;
  for (const id of positionals) {
    try {
      if (action === "kill") {
        const r = await api.request<{ instanceId: string; state: string }>(
          "POST",
          "management/v1/instances/kill",
          { instance_id: id, reason },
        );
        io.out(`${r.instanceId}: ${r.state}`);
      } else {
        const r = await api.request<{ instanceId: string; idleBehavior: string }>(
          "POST",
          `management/v1/instances/${action}`,
          { instance_id: id },
        );
        io.out(`${r.instanceId}: idle behavior ${r.idleBehavior}`);
      }
    } catch (err) {
      // Unreachable server or bad token: every other id would fail the same way.
      if (err instanceof DispatchCloudError && err.code.startsWith("cli.")) throw err;
      failed++;
      io.out(`${id}: error: ${describeError(err)}`);
    }
  }
  return failed === 0 ? EXIT_OK : EXIT_FAILED;
}
