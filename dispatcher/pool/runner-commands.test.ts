import { describe, expect, it } from "vitest";
import { checksumMatches, runnerCommands } from "./runner-commands.ts";

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
});
