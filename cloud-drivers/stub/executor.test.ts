import { createHash, randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";
import { afterEach, describe, expect, it } from "vitest";
import { initScript, newInstanceSecret } from "../../dispatcher/pool/bootstrap.ts";
import { createSshExecutor, IDENTITY_COMMAND } from "../../dispatcher/sshexec/executor.ts";
import { type Clock, systemClock } from "../../lib/clock.ts";
import { SshError } from "../../lib/executor.ts";
import { createLogger } from "../../lib/logger.ts";
import { LIST_REQUEST, parseList } from "../../lib/runner-protocol.ts";
import { FakeClock } from "../../test/fake-clock.ts";
import { generateKeyPair } from "../ssh-server.ts";
import type { InstanceType } from "../types.ts";
import { StubCloud } from "./driver.ts";
import { stubListing } from "./executor.ts";
import { parseShell, ShellSyntaxError } from "./shell.ts";

const TYPE: InstanceType = {
  name: "small",
  providerType: "m5.large",
  vcpus: 2,
  ram: 4 << 30,
  includedScratch: 0,
  addedScratch: 0,
  scratch: 0,
  price: 0.1,
  preemptible: false,
  gpu: null,
};

const DIR = `\${DISPATCH_VM_ROOT:-}/tmp/dispatch-cloud`;
const BINARY = randomBytes(64 * 1024);
const HASH = createHash("sha256").update(BINARY).digest("hex");
const RUNNER = `"${DIR}/crunch-run~${HASH}"`;
const INSTALL = `mkdir -p "${DIR}" && cat >${RUNNER}.tmp && chmod 0755 ${RUNNER}.tmp && mv ${RUNNER}.tmp ${RUNNER}`;

const text = (b: Buffer) => b.toString();

async function vmWithExecutor(clock: Clock = new FakeClock(), publicKey = "ssh-ed25519 AAAA test") {
  const cloud = new StubCloud({ clock });
  const secret = newInstanceSecret();
  const inst = await cloud
    .instanceSet("zzzzz")
    .create(TYPE, "img", { Secret: secret }, initScript(secret, "echo hi"), publicKey);
  const vm = cloud.vm(inst.id);
  if (vm === undefined) throw new Error("no VM");
  return { cloud, vm, secret, exec: cloud.executorFor(inst) };
}

describe("stub executor", () => {
  it("answers the identity check with the secret from the init script", async () => {
    const { exec, vm, secret } = await vmWithExecutor();
    const res = await exec.execute(IDENTITY_COMMAND);
    expect(res).toMatchObject({ exitCode: 0, signal: null });
    expect(text(res.stdout)).toBe(secret);
    vm.secret = "not-ours";
    expect(text((await exec.execute(IDENTITY_COMMAND)).stdout)).toBe("not-ours");
    vm.secret = undefined;
    const gone = await exec.execute(IDENTITY_COMMAND);
    expect(gone.exitCode).toBe(1);
    expect(text(gone.stderr)).toMatch(/No such file/);
  });

  it("deploys the runner: sha256sum fails, install from stdin (buffer or stream), sha256sum matches", async () => {
    const { exec, vm } = await vmWithExecutor();
    const before = await exec.execute(`sha256sum ${RUNNER}`);
    expect(before.exitCode).toBe(1);
    const install = await exec.execute(INSTALL, {
      stdin: Readable.from([BINARY.subarray(0, 1000), BINARY.subarray(1000)]),
    });
    expect(install).toMatchObject({ exitCode: 0 });
    expect(vm.files.get(`/tmp/dispatch-cloud/crunch-run~${HASH}`)?.equals(BINARY)).toBe(true);
    expect(vm.files.has(`/tmp/dispatch-cloud/crunch-run~${HASH}.tmp`)).toBe(false);
    const after = await exec.execute(`sha256sum ${RUNNER}`);
    expect(text(after.stdout)).toBe(`${HASH}  /tmp/dispatch-cloud/crunch-run~${HASH}\n`);
    expect(text((await exec.execute(`${RUNNER} --version`)).stdout)).toBe(
      `crunch-run (dispatch-cloud) stub-${HASH.slice(0, 12)}\n`,
    );
    const again = await exec.execute(INSTALL, { stdin: BINARY });
    expect(again.exitCode).toBe(0);
    expect(vm.files.get(`/tmp/dispatch-cloud/crunch-run~${HASH}`)).toBe(BINARY);
  });

  it("runs fake runners: --detach, --list (running, stale, broken), --kill", async () => {
    const { exec, vm, cloud } = await vmWithExecutor();
    await exec.execute(INSTALL, { stdin: BINARY });
    const detached: string[] = [];
    vm.on("runner:detach", (r) => detached.push(r.uuid));
    const doc = { bundle: "zzzzz-bndl-aaaaaaaaaaaaaaa", token: "dcr_x" };
    const start = await exec.execute(`${RUNNER} --detach --stdin-config zzzzz-bndl-aaaaaaaaaaaaaaa`, {
      stdin: JSON.stringify(doc),
    });
    expect(start.exitCode).toBe(0);
    expect(JSON.parse(text(start.stdout))).toEqual({ uuid: "zzzzz-bndl-aaaaaaaaaaaaaaa", pid: 1000 });
    expect(vm.runners.get("zzzzz-bndl-aaaaaaaaaaaaaaa")).toMatchObject({ state: "running", doc });
    await exec.execute(`${RUNNER} --detach zzzzz-bndl-bbbbbbbbbbbbbbb`, { stdin: "{}" });
    expect(detached).toEqual(["zzzzz-bndl-aaaaaaaaaaaaaaa", "zzzzz-bndl-bbbbbbbbbbbbbbb"]);

    const twice = await exec.execute(`${RUNNER} --detach zzzzz-bndl-aaaaaaaaaaaaaaa`, { stdin: "{}" });
    expect(twice.exitCode).toBe(1);
    expect(text(twice.stderr)).toMatch(/lock is held by pid 1000/);
    const badDoc = await exec.execute(`${RUNNER} --detach zzzzz-bndl-ccccccccccccccc`, { stdin: "not json" });
    expect(badDoc.exitCode).toBe(2);

    vm.markStale("zzzzz-bndl-bbbbbbbbbbbbbbb");
    vm.broken = true;
    const list = await exec.execute(`${RUNNER} --list`);
    expect(text(list.stdout)).toBe("zzzzz-bndl-aaaaaaaaaaaaaaa\nzzzzz-bndl-bbbbbbbbbbbbbbb stale\nbroken\n");

    expect((await exec.execute(`${RUNNER} --kill 15 zzzzz-bndl-aaaaaaaaaaaaaaa`)).exitCode).toBe(0);
    expect(vm.runners.get("zzzzz-bndl-aaaaaaaaaaaaaaa")).toMatchObject({ state: "exited", signal: "TERM" });
    expect((await exec.execute(`${RUNNER} --kill TERM zzzzz-bndl-zzzzzzzzzzzzzzz`)).exitCode).toBe(0);
    expect((await exec.execute(`${RUNNER} --kill 99 zzzzz-bndl-aaaaaaaaaaaaaaa`)).exitCode).toBe(2);
    expect(text((await exec.execute(`${RUNNER} --list`)).stdout)).toBe(
      "zzzzz-bndl-bbbbbbbbbbbbbbb stale\nbroken\n",
    );
    expect(cloud.runners().map(({ runner }) => `${runner.uuid}:${runner.state}`)).toEqual([
      "zzzzz-bndl-aaaaaaaaaaaaaaa:exited",
      "zzzzz-bndl-bbbbbbbbbbbbbbb:stale",
    ]);

    // A runner path that was never deployed is not found.
    const missing = await exec.execute("/tmp/dispatch-cloud/crunch-run~0000 --list");
    expect(missing.exitCode).toBe(127);
    expect(text(missing.stderr)).toMatch(/not found/);
  });

  it("interprets the sh subset: quoting, sudo, sh -c, groups, pipes, redirections", async () => {
    const { exec, vm } = await vmWithExecutor();
    const run = async (cmd: string) => {
      const r = await exec.execute(cmd, { stdin: "input" });
      return `${r.exitCode}|${text(r.stdout)}|${text(r.stderr)}`;
    };
    expect(await run(`echo -n 'a  b' "c $HOME\${UNSET:-d}" e\\ f`)).toBe("0|a  b c d e f|");
    expect(await run("false || echo yes; false && echo no")).toBe("1|yes\n|");
    expect(await run("true || echo no && echo yes")).toBe("0|yes\n|");
    expect(await run("(false && echo no) || echo grouped")).toBe("0|grouped\n|");
    expect(await run("sudo -n sh -c 'echo -n x >/var/f && cat /var/f'")).toBe("0|x|");
    expect(await run("cat /nope 2>&1")).toBe("1|cat: /nope: No such file or directory\n|");
    expect(await run("cat /nope 2>/dev/null")).toBe("1||");
    expect(await run("echo more >>/var/f; cat </var/f")).toBe("0|xmore\n|");
    expect(await run("cat | sha256sum")).toBe(
      `0|${createHash("sha256").update("input").digest("hex")}  -\n|`,
    );
    expect(await run("test -s /var/f && [ -e /var/f ] && ! true")).toMatch(/^127\|/);
    expect(await run("test -e /var/nope")).toBe("1||");
    expect(await run("rm /var/f && rm -f /var/f && rm /var/f")).toBe(
      "1||rm: cannot remove '/var/f': No such file or directory\n",
    );
    expect(await run("systemctl status")).toBe("127||stub: unknown command: systemctl\n");
    expect(await run("echo $(id)")).toBe(
      "127||stub: unknown command (command substitution is not supported)\n",
    );
    expect(await run("sleep 10 &")).toMatch(/^127\|\|stub: unknown command \(background/);
    expect(vm.files.has("/var/f")).toBe(false);
  });

  it("parses commands into lists, pipelines and redirections", () => {
    expect(parseShell("a 'b c' 2>&1 >out | d; (e) && f\n")).toEqual({
      first: [
        {
          kind: "simple",
          words: ["a", "b c"],
          redirects: [
            { fd: 2, op: ">&", target: "1" },
            { fd: 1, op: ">", target: "out" },
          ],
        },
        { kind: "simple", words: ["d"], redirects: [] },
      ],
      rest: [
        {
          op: ";",
          pipeline: [
            {
              kind: "group",
              body: { first: [{ kind: "simple", words: ["e"], redirects: [] }], rest: [] },
              redirects: [],
            },
          ],
        },
        { op: "&&", pipeline: [{ kind: "simple", words: ["f"], redirects: [] }] },
      ],
    });
    expect(() => parseShell("echo 'open")).toThrow(ShellSyntaxError);
    expect(() => parseShell("a &&")).toThrow(ShellSyntaxError);
    expect(() => parseShell("cat <<EOF")).toThrow(/here-documents/);
  });

  it("refuses like SSH before boot and after destroy; a closed executor refuses; emits command events", async () => {
    const clock = new FakeClock();
    const { cloud, vm, exec } = await vmWithExecutor(clock);
    const advance = (ms: number) => clock.advance(ms);
    const seen: string[] = [];
    cloud.on("command", (v, cmd, res) => seen.push(`${v.id}:${cmd}:${res.exitCode}`));
    vm.bootAt = clock.now() + 1000;
    const early = await exec.execute("true").catch((e: unknown) => e);
    expect(early).toBeInstanceOf(SshError);
    expect(early).toMatchObject({ code: "ssh.connect_failed" });
    await advance(1000);
    await exec.execute("true");
    expect(seen).toEqual([`${vm.id}:true:0`]);
    await cloud
      .instanceSet("zzzzz")
      .instances({})
      .then((all) => all[0]?.destroy());
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.connect_failed" });
    await expect(cloud.executorFor("stub-vm-404").execute("true")).rejects.toMatchObject({
      code: "ssh.connect_failed",
    });
    await exec.close();
    await expect(exec.execute("true")).rejects.toMatchObject({ code: "ssh.closed" });
  });
});

describe("stub VM over real SSH", () => {
  let cloud: StubCloud | undefined;
  afterEach(async () => {
    await cloud?.close();
  });

  it("serves a stub VM through the embedded SSH server to the real SSH executor", async () => {
    const key = generateKeyPair();
    const made = await vmWithExecutor(systemClock, key.publicKey);
    cloud = made.cloud;
    const server = await cloud.startSshServer(made.vm);
    expect(made.vm.address).toBe(`127.0.0.1:${server.port}`);
    const logger = createLogger({ level: "silent", format: "json" });
    const ssh = createSshExecutor({
      address: made.vm.address,
      user: "root",
      privateKey: key.privateKey,
      expectedSecret: made.secret,
      logger,
      clock: systemClock,
    });
    try {
      const big = randomBytes(10 << 20);
      const bigHash = createHash("sha256").update(big).digest("hex");
      const path = `${DIR}/crunch-run~${bigHash}`;
      expect((await ssh.execute(`mkdir -p "${DIR}" && cat >"${path}"`, { stdin: big })).exitCode).toBe(0);
      expect(text((await ssh.execute(`sha256sum "${path}"`)).stdout)).toMatch(new RegExp(`^${bigHash} `));
      const start = await ssh.execute(`"${path}" --detach u1`, { stdin: '{"a":1}' });
      expect(JSON.parse(text(start.stdout))).toEqual({ uuid: "u1", pid: 1000 });
      expect(text((await ssh.execute(`"${path}" --list`)).stdout)).toBe("u1\n");
      expect((await ssh.execute("nonsense")).exitCode).toBe(127);
    } finally {
      await ssh.close();
    }

    made.vm.secret = "0".repeat(40);
    const impostor = createSshExecutor({
      address: made.vm.address,
      user: "root",
      privateKey: key.privateKey,
      expectedSecret: made.secret,
      logger,
      clock: systemClock,
      backoff: { initialMs: 10, maxMs: 10 },
    });
    try {
      await expect(impostor.execute("true")).rejects.toMatchObject({ code: "ssh.host_mismatch" });
    } finally {
      await impostor.close();
    }
  });

  it("names a warm pool's socket in its listing, and lets the executor reach sockets under streamLocalUnder only", async () => {
    const key = generateKeyPair();
    const made = await vmWithExecutor(systemClock, key.publicKey);
    cloud = made.cloud;
    const dir = mkdtempSync(join(tmpdir(), "stub-pool-"));
    const socket = join(dir, "pool.sock");
    // A pool as crunch-run's answers: one exchange per connection, read to its end.
    const pool = net.createServer((conn) => {
      let got = "";
      conn.on("data", (d) => {
        got += d.toString();
      });
      conn.on("end", () => conn.end(got === LIST_REQUEST ? stubListing(made.vm) : "refused\n"));
    });
    await new Promise<void>((ok) => pool.listen(socket, ok));
    made.vm.spareSocket = socket;
    await cloud.startSshServer(made.vm, { streamLocalUnder: dir });
    const ssh = createSshExecutor({
      address: made.vm.address,
      user: "root",
      privateKey: key.privateKey,
      expectedSecret: made.secret,
      logger: createLogger({ level: "silent", format: "json" }),
      clock: systemClock,
    });
    try {
      expect(stubListing(made.vm)).toBe(`spare ${socket}\n`);
      const answer = (await ssh.exchange(socket, LIST_REQUEST)).toString("utf8");
      expect(parseList(answer).spare).toBe(socket);
      // Outside the directory the server allows: refused, as sshd refuses a path it does not permit.
      await expect(ssh.exchange(join(tmpdir(), "elsewhere.sock"), LIST_REQUEST)).rejects.toThrow();
    } finally {
      await ssh.close();
      pool.close();
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
