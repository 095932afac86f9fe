import { parse } from "../args.ts";
import { type CliIo, EXIT_OK, usageError } from "../io.ts";
import { connectManagement, MANAGEMENT_OPTIONS, type ManagementBundle } from "../management-client.ts";
import { table } from "./client-common.ts";

const USAGE = `usage: dispatch-cloud queue [--header] [--json]
       dispatch-cloud queue show UUID [--json]
The dispatcher's queue in scheduler order, each bundle with the reason it is not running yet (a client of the
management API: --management-url URL or DISPATCH_CLOUD_MANAGEMENT_URL, default http://127.0.0.1:8901; token
from DISPATCH_CLOUD_MANAGEMENT_TOKEN, --token-file F, or <data dir>/management-token).`;

export const QUEUE_HEADER = ["UUID", "STATE", "PRIORITY", "TYPE", "WAITING SINCE", "STATUS"];

/** The `queue` table: first eligible type ("-" when none fits), first-seen time, scheduling status. */
export function formatQueue(items: ManagementBundle[], header: boolean): string[] {
  const rows = header ? [QUEUE_HEADER] : [];
  for (const b of items) {
    rows.push([
      b.uuid,
      b.state,
      String(b.priority),
      b.eligibleTypes[0] ?? "-",
      b.firstSeenAt,
      b.schedulingStatus ?? (b.instanceId === null ? "" : `on ${b.instanceId}`),
    ]);
  }
  return table(rows);
}

export async function queueCommand(io: CliIo): Promise<number> {
  const { values, positionals } = parse(io.argv, { ...MANAGEMENT_OPTIONS, header: { type: "boolean" } });
  if (values.help === true) {
    io.out(USAGE);
    return EXIT_OK;
  }
  if (positionals[0] === "show") {
    if (positionals.length !== 2) throw usageError("queue show takes one UUID");
    const api = await connectManagement(io, values);
    const b = await api.request<ManagementBundle>(
      "GET",
      `management/v1/bundles/${encodeURIComponent(positionals[1]!)}`,
    );
    if (values.json === true) {
      io.out(JSON.stringify(b, null, 2));
      return EXIT_OK;
    }
    const rows = [
      ["uuid:", b.uuid],
      ["state:", b.state],
      ["priority:", String(b.priority)],
      ["resources:", JSON.stringify(b.resources)],
      ["eligible types:", b.eligibleTypes.length === 0 ? "(none)" : b.eligibleTypes.join(", ")],
      ["waiting since:", b.firstSeenAt],
      ["instance:", b.instanceId ?? ""],
      ["status:", b.schedulingStatus ?? ""],
    ];
    for (const line of table(rows)) io.out(line);
    return EXIT_OK;
  }
  if (positionals.length !== 0) throw usageError(`unexpected argument "${positionals[0]}"\n${USAGE}`);
  const api = await connectManagement(io, values);
  const res = await api.request<{ items: ManagementBundle[] }>("GET", "management/v1/bundles");
  if (values.json === true) io.out(JSON.stringify(res.items, null, 2));
  else for (const line of formatQueue(res.items, values.header === true)) io.out(line);
  return EXIT_OK;
}
