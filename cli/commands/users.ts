import { CLIENT_OPTIONS, parse } from "../args.ts";
import { type CliIo, EXIT_OK, usageError } from "../io.ts";
import { connect } from "./client-common.ts";

/** `users create NAME [--admin]`: an admin-only API call; prints the new user's token once. */
export async function usersCommand(io: CliIo): Promise<number> {
  const [sub, ...rest] = io.argv;
  if (sub !== "create") throw usageError("usage: dispatch-cloud users create NAME [--admin] [--json]");
  const { values, positionals } = parse(rest, { ...CLIENT_OPTIONS, admin: { type: "boolean" } });
  if (positionals.length !== 1) throw usageError("users create takes one NAME");
  const api = await connect(io, values);
  const user = await api.request<{ uuid: string; name: string; isAdmin: boolean; token: string }>(
    "POST",
    "api/v1/users",
    { name: positionals[0], isAdmin: values.admin === true },
  );
  if (values.json === true) {
    io.out(JSON.stringify(user, null, 2));
  } else {
    io.err(`created user ${user.name} (${user.uuid}); its token, shown only this once:`);
    io.out(user.token);
  }
  return EXIT_OK;
}
