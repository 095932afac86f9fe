/** SSH key helpers shared by the dispatcher (its own key) and the local driver (host keys). */
import { generateKeyPairSync, randomBytes } from "node:crypto";
import ssh2 from "ssh2";
import { DispatchCloudError } from "./errors.ts";

/**
 * A new ed25519 key pair in OpenSSH formats (private key unencrypted). Built here from node:crypto's raw
 * key bytes: ssh2's own generator drops a public key's leading zero byte (about one key in 128), which
 * OpenSSH then cannot load.
 */
export function generateKeyPair(comment = ""): { privateKey: string; publicKey: string } {
  const { publicKey, privateKey } = generateKeyPairSync("ed25519");
  const pub = Buffer.from(publicKey.export({ format: "jwk" }).x ?? "", "base64url");
  const seed = Buffer.from(privateKey.export({ format: "jwk" }).d ?? "", "base64url");
  const type = Buffer.from("ssh-ed25519");
  const publicBlob = Buffer.concat([sshString(type), sshString(pub)]);
  const check = randomBytes(4);
  let secret = Buffer.concat([
    check,
    check,
    sshString(type),
    sshString(pub),
    sshString(Buffer.concat([seed, pub])),
    sshString(Buffer.from(comment)),
  ]);
  const padding = Buffer.from([1, 2, 3, 4, 5, 6, 7]).subarray(0, (8 - (secret.length % 8)) % 8);
  secret = Buffer.concat([secret, padding]);
  const body = Buffer.concat([
    Buffer.from("openssh-key-v1\0"),
    sshString(Buffer.from("none")),
    sshString(Buffer.from("none")),
    sshString(Buffer.alloc(0)),
    uint32(1),
    sshString(publicBlob),
    sshString(secret),
  ]);
  const lines = body.toString("base64").match(/.{1,70}/g) ?? [];
  return {
    privateKey: `-----BEGIN OPENSSH PRIVATE KEY-----\n${lines.join("\n")}\n-----END OPENSSH PRIVATE KEY-----\n`,
    publicKey: `ssh-ed25519 ${publicBlob.toString("base64")}${comment === "" ? "" : ` ${comment}`}`,
  };
}

function uint32(n: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32BE(n);
  return b;
}

function sshString(data: Buffer): Buffer {
  return Buffer.concat([uint32(data.length), data]);
}

/** The authorized_keys line for a private key; the error never quotes the key. */
export function publicKeyOf(privateKey: string, path = "dispatcher.privateKey"): string {
  const parsed = ssh2.utils.parseKey(privateKey);
  const key = Array.isArray(parsed) ? parsed[0] : parsed;
  if (key === undefined || key instanceof Error) {
    throw new DispatchCloudError("ssh.invalid_key", "the SSH private key cannot be parsed", { path });
  }
  return `${key.type} ${key.getPublicSSH().toString("base64")}`;
}
