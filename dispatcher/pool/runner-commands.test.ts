import { describe, expect, it } from "vitest";
import { checksumMatches, parseList, runnerCommands } from "./runner-commands.ts";

const SHA = "a".repeat(64);
const UUID = "zzzzz-bndl-0123456789abcde";

describe("runner commands", () => {
  it("builds every command from the directory and hash, under the instance root", () => {
    const c = runnerCommands("/tmp/dispatch-cloud/", SHA);
    const r = `"\${DISPATCH_VM_ROOT:-}/tmp/dispatch-cloud/crunch-run~${SHA}"`;
    expect(c.path).toBe(r);
    expect(c.checksum).toBe(`sha256sum ${r}`);
    expect(c.list).toBe(`${r} --list`);
    expect(c.detach(UUID)).toBe(`${r} --detach ${UUID}`);
    expect(c.kill(UUID)).toBe(`${r} --kill 15 ${UUID}`);
    const tmp = `"\${DISPATCH_VM_ROOT:-}/tmp/dispatch-cloud/crunch-run~${SHA}.tmp"`;
    expect(c.deploy).toBe(
      `mkdir -p "\${DISPATCH_VM_ROOT:-}/tmp/dispatch-cloud" && cat >${tmp} && chmod 0755 ${tmp} && mv -f ${tmp} ${r}`,
    );
  });

  it("refuses anything that is not a bundle uuid, a hash or a plain absolute directory", () => {
    const c = runnerCommands("/opt/dc", SHA);
    expect(() => c.detach("x; rm -rf /")).toThrow(/not a bundle uuid/);
    expect(() => c.kill("$(reboot)")).toThrow(/not a bundle uuid/);
    expect(() => runnerCommands("/opt/dc", "abc")).toThrow(/64 hex/);
    expect(() => runnerCommands('/opt/"dc"', SHA)).toThrow(/unsafe runner directory/);
    expect(() => runnerCommands("/opt/$(x)", SHA)).toThrow(/unsafe runner directory/);
  });

  it("compares sha256sum output with the expected hash", () => {
    expect(checksumMatches(`${SHA}  /tmp/x\n`, SHA)).toBe(true);
    expect(checksumMatches(`${"b".repeat(64)}  /tmp/x\n`, SHA)).toBe(false);
    expect(checksumMatches("", SHA)).toBe(false);
  });

  it("parses --list: running, stale, broken, and ignores junk", () => {
    const other = "zzzzz-bndl-bbbbbbbbbbbbbbb";
    const out = parseList(`${UUID}\n${other} stale\nbroken\n\nsomething odd\n${UUID} weird\n`);
    expect([...out.runners]).toEqual([
      [UUID, "running"],
      [other, "stale"],
    ]);
    expect(out.broken).toBe(true);
    expect(out.unknown).toEqual(["something odd", `${UUID} weird`]);
    expect(out.preempted).toBe(false);
    expect(parseList("")).toEqual({
      runners: new Map(),
      broken: false,
      preempted: false,
      spare: null,
      unknown: [],
    });
    expect(parseList("spare /vm/1/var/run/cr-spare-0123456789.sock\n").spare).toBe(
      "/vm/1/var/run/cr-spare-0123456789.sock",
    );
    // Anything else is not a socket path the pool will connect to.
    for (const bad of ["spare relative.sock", "spare /a b.sock", "spare /x/../y.sock", "spare /x/y"]) {
      expect(parseList(`${bad}\n`)).toMatchObject({ spare: null, unknown: [bad] });
    }
  });

  it("parses --list: preempted (a spot interruption notice) beside runners, broken and a spare", () => {
    const out = parseList(`${UUID}\npreempted\nspare /vm/1/var/run/cr-spare-0123456789.sock\n`);
    expect(out).toEqual({
      runners: new Map([[UUID, "running"]]),
      broken: false,
      preempted: true,
      spare: "/vm/1/var/run/cr-spare-0123456789.sock",
      unknown: [],
    });
    // Only the word on a line of its own.
    expect(parseList("preempted now\n")).toMatchObject({ preempted: false, unknown: ["preempted now"] });
  });
});
