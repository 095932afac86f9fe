/**
 * What every new instance is given: a fresh secret, the init script that writes it where the dispatcher will
 * read it, and the tags that let a restarted dispatcher recognise the instance (DESIGN.md §4).
 */
import { randomBytes } from "node:crypto";
import { chmod, mkdir, readFile, writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { TAG, type Tags } from "../../cloud-drivers/types.ts";
import type { Config } from "../../config/schema.ts";
import { resolveSecret } from "../../config/secrets.ts";
import { INSTANCE_SECRET_SHELL_PATH } from "../../lib/runner-protocol.ts";
import { generateKeyPair, publicKeyOf } from "../../lib/ssh-keys.ts";

import type { IdleBehavior } from "../types.ts";

export { IDLE_BEHAVIORS, type IdleBehavior } from "../types.ts";

/** Where the init script leaves the secret; always relative to the instance root convention. */
export const SECRET_PATH = INSTANCE_SECRET_SHELL_PATH;

/** 40 hex digits, as Arvados uses. */
export function newInstanceSecret(): string {
  return randomBytes(20).toString("hex");
}

/**
 * The instance's init script: write the secret (readable by its owner only), then the operator's
 * `cloud.instanceInitCommand`. The secret is the only value interpolated, and it is hex by construction.
 */
export function initScript(secret: string, instanceInitCommand: string): string {
  if (!/^[0-9a-f]{40}$/.test(secret)) throw new Error("instance secret must be 40 hex digits");
  const lines = [
    "#!/bin/sh",
    // biome-ignore lint/suspicious/noTemplateCurlyInString: a shell parameter expansion.
    'mkdir -p "${DISPATCH_VM_ROOT:-}/var/run"',
    `(umask 0177 && echo -n '${secret}' >${SECRET_PATH})`,
  ];
  if (instanceInitCommand.trim() !== "") lines.push(instanceInitCommand);
  return `${lines.join("\n")}\n`;
}

/** The full tag map of an instance: set ID (and resource tags, added by the wrappers), type, behaviour, secret. */
export function instanceTags(
  config: Pick<Config, "cloud">,
  typeName: string,
  idleBehavior: IdleBehavior,
  secret: string,
): Tags {
  const p = config.cloud.tagKeyPrefix;
  return {
    [p + TAG.instanceType]: typeName,
    [p + TAG.idleBehavior]: idleBehavior,
    [p + TAG.instanceSecret]: secret,
  };
}

export interface DispatcherKey {
  privateKey: string;
  /** One OpenSSH authorized_keys line. */
  publicKey: string;
}

/**
 * The dispatcher's SSH key: `dispatcher.privateKey` (file:// or env:), or, when that is empty, a key generated
 * once into `<dataDir>/dispatcher-ssh-key` (mode 0600) so the embedded default needs no setup.
 */
export async function loadDispatcherKey(
  config: Pick<Config, "dispatcher" | "dataDir">,
): Promise<DispatcherKey> {
  let privateKey: string;
  if (config.dispatcher.privateKey !== "") {
    privateKey = resolveSecret(config.dispatcher.privateKey, "dispatcher.privateKey");
  } else {
    const file = join(resolve(config.dataDir), "dispatcher-ssh-key");
    try {
      privateKey = await readFile(file, "utf8");
    } catch {
      const pair = generateKeyPair();
      await mkdir(dirname(file), { recursive: true, mode: 0o700 });
      await writeFile(file, pair.privateKey, { mode: 0o600 });
      await chmod(file, 0o600);
      privateKey = pair.privateKey;
    }
  }
  return { privateKey, publicKey: publicKeyOf(privateKey) };
}
