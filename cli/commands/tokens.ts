/**
 * `tokens create|list|revoke`: the caller's API tokens (an admin's `--user UUID`: another user's). A new token
 * is printed once, on stdout; nothing else ever shows a token.
 */
import { CLIENT_OPTIONS, parse } from "../args.ts";
import { type CliIo, EXIT_FAILED, EXIT_OK, usageError } from "../io.ts";
import { connect, table } from "./client-common.ts";

const USAGE = `usage: dispatch-cloud tokens create [--label TEXT] [--ttl DURATION | --expires-at TIME] [--user UUID] [--json]
       dispatch-cloud tokens list [--user UUID] [--json]
       dispatch-cloud tokens revoke ID...
(--user: admins only; --ttl as 30d, 12h, 90m; --expires-at as 2026-05-01T12:00:00Z)`;

/** A token as the API shows it. */
export interface ApiTokenView {
  id: string;
  userUuid: string;
  label: string;
  createdAt: string;
  expiresAt: string | null;
  lastUsedAt: string | null;
  revokedAt: string | null;
  expired: boolean;
  current: boolean;
}

export async function tokensCommand(io: CliIo): Promise<number> {
  const [sub, ...rest] = io.argv;
  switch (sub) {
    case "create":
      return create(io, rest);
    case "list":
      return list(io, rest);
    case "revoke":
      return revoke(io, rest);
    default:
      throw usageError(sub === undefined ? USAGE : `unknown tokens command "${sub}"\n${USAGE}`);
  }
}

async function create(io: CliIo, argv: string[]): Promise<number> {
  const { values } = parse(
    argv,
    {
      ...CLIENT_OPTIONS,
      label: { type: "string" },
      ttl: { type: "string" },
      "expires-at": { type: "string" },
      user: { type: "string" },
    },
    false,
  );
  if (values.ttl !== undefined && values["expires-at"] !== undefined)
    throw usageError("give --ttl or --expires-at, not both");
  const api = await connect(io, values);
  const body = {
    ...(values.label === undefined ? {} : { label: values.label }),
    ...(values.ttl === undefined ? {} : { ttl: values.ttl }),
    ...(values["expires-at"] === undefined ? {} : { expiresAt: values["expires-at"] }),
    ...(values.user === undefined ? {} : { userUuid: values.user }),
  };
  const t = await api.request<ApiTokenView & { token: string }>("POST", "api/v1/tokens", body);
  if (values.json === true) {
    io.out(JSON.stringify(t, null, 2));
    return EXIT_OK;
  }
  const expiry = t.expiresAt === null ? "never expires" : `expires ${t.expiresAt}`;
  io.err(`created token ${t.id} for ${t.userUuid} (${expiry}); the token, shown only this once:`);
  io.out(t.token);
  return EXIT_OK;
}

async function list(io: CliIo, argv: string[]): Promise<number> {
  const { values } = parse(argv, { ...CLIENT_OPTIONS, user: { type: "string" } }, false);
  const api = await connect(io, values);
  const q = values.user === undefined ? "" : `?${new URLSearchParams({ user: values.user })}`;
  const { items } = await api.request<{ items: ApiTokenView[] }>("GET", `api/v1/tokens${q}`);
  if (values.json === true) {
    io.out(JSON.stringify(items, null, 2));
    return EXIT_OK;
  }
  const rows = [["ID", "CREATED", "EXPIRES", "LAST USED", "STATUS", "LABEL"]];
  for (const t of items) {
    const status = t.current ? "current" : t.expired ? "expired" : "";
    rows.push([t.id, t.createdAt, t.expiresAt ?? "never", t.lastUsedAt ?? "never", status, t.label]);
  }
  for (const line of table(rows)) io.out(line);
  return EXIT_OK;
}

async function revoke(io: CliIo, argv: string[]): Promise<number> {
  const { values, positionals } = parse(argv, CLIENT_OPTIONS);
  if (positionals.length === 0) throw usageError("tokens revoke takes one or more token IDs");
  const api = await connect(io, values);
  let failed = 0;
  for (const id of positionals) {
    try {
      await api.request<ApiTokenView>("DELETE", `api/v1/tokens/${encodeURIComponent(id)}`);
      io.out(`${id}: revoked`);
    } catch (err) {
      failed++;
      const code = (err as { code?: unknown }).code;
      io.out(`${id}: error: ${err instanceof Error ? err.message : String(err)}${code ? ` [${code}]` : ""}`);
    }
  }
  return failed === 0 ? EXIT_OK : EXIT_FAILED;
}
