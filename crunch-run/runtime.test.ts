import { describe, expect, it } from "vitest";
import { classifySpawnFailure, classifyStartFailure } from "./runtime.ts";

// Messages as Docker 20.10 with runc 1.1 answers them (recorded on the test machine), and as the issue quotes.
const OCI =
  "failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process:";

describe("classifyStartFailure", () => {
  it.each([
    [
      ["no-such-command"],
      `${OCI} exec: "no-such-command": executable file not found in $PATH: unknown`,
      'the command "no-such-command" cannot be run: executable file not found in $PATH',
    ],
    [
      ["/no/such/file", "arg"],
      `${OCI} exec: "/no/such/file": stat /no/such/file: no such file or directory: unknown`,
      'the command "/no/such/file" cannot be run: no such file or directory',
    ],
    [
      ["/bin"],
      `${OCI} exec: "/bin": permission denied: unknown`,
      'the command "/bin" cannot be run: permission denied',
    ],
    [
      ["./rel"],
      `${OCI} exec: "./rel": stat ./rel: no such file or directory: unknown`,
      'the command "./rel" cannot be run: no such file or directory',
    ],
    [
      ['we"ird'],
      `${OCI} exec: "we\\"ird": executable file not found in $PATH: unknown`,
      'the command "we\\"ird" cannot be run: executable file not found in $PATH',
    ],
  ])("%j: the command's fault, naming it", (command, message, reason) => {
    const err = classifyStartFailure(message, command[0] ?? "");
    expect(err.code).toBe("crunchrun.command_unusable");
    expect(err.message).toBe(reason);
  });

  it.each([
    [
      "a failing OCI hook (issue 14)",
      `${OCI} error running hook #0: error running hook: exit status 1, stdout: , stderr: fork/exec /usr/bin/nvidia-container-runtime-hook: no such file or directory: unknown`,
    ],
    [
      "a hook named like the command",
      `${OCI} error running hook #0: exec: "sh": executable file not found in $PATH: unknown`,
    ],
    [
      "a mount onto a path that cannot be created",
      `${OCI} error during container init: error mounting "/w/in/first" to rootfs at "/in/first": open o_path procfd: open /var/lib/docker/overlay2/x/merged/in/first: not a directory: unknown`,
    ],
    [
      "a device missing on the instance (a 500)",
      'error gathering device information while adding custom device "/dev/kfd": no such file or directory',
    ],
    ["no GPU driver (a 500)", 'could not select device driver "nvidia" with capabilities: [[gpu]]'],
    [
      "a cgroup setting",
      `${OCI} error during container init: error setting cgroup config for procHooks process`,
    ],
    ["another program than the command", `${OCI} exec: "other": executable file not found in $PATH: unknown`],
  ])("%s: the runtime's fault", (_what, message) => {
    const err = classifyStartFailure(message, "sh");
    expect(err.code).toBe("crunchrun.runtime_failed");
    expect(err.message).toContain(message.slice(0, 100));
  });

  it("keeps the runtime's message on one line, at most 500 characters of it", () => {
    const err = classifyStartFailure(`line one\nline two\t${"x".repeat(600)}`, "sh");
    expect(err.message).not.toMatch(/[\n\t]/);
    expect(err.message).toMatch(/^the container runtime failed: line one line two x+\.\.\.$/);
    expect(err.message.length).toBeLessThan(560);
  });
});

describe("classifySpawnFailure", () => {
  const errno = (code: string) => Object.assign(new Error(`spawn x ${code}`), { code });
  it.each([
    ["ENOENT", "no such file or directory (or not found in $PATH)"],
    ["EACCES", "permission denied"],
    ["ENOEXEC", "exec format error"],
  ])("%s is the command's", (code, why) => {
    const err = classifySpawnFailure(errno(code), "x");
    expect(err.code).toBe("crunchrun.command_unusable");
    expect(err.message).toBe(`the command "x" cannot be run: ${why}`);
  });

  it.each(["EPERM", "EINVAL", "EAGAIN", "ENOMEM"])("%s is the instance's", (code) => {
    expect(classifySpawnFailure(errno(code), "x").code).toBe("crunchrun.runtime_failed");
  });
});
