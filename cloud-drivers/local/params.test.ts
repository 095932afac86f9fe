import { describe, expect, it } from "vitest";
import { DispatchCloudError } from "../../lib/errors.ts";
import { VM_MAIN_PATTERN } from "./launch.ts";
import { parseLocalParameters } from "./params.ts";
import { shQuote, sshdConfig } from "./ssh-openssh.ts";

function errorOf(params: unknown): DispatchCloudError {
  try {
    parseLocalParameters(params, "/srv/dc");
  } catch (err) {
    if (err instanceof DispatchCloudError) return err;
    throw err;
  }
  throw new Error("expected an error");
}

describe("local driver parameters", () => {
  it("fills in defaults and resolves stateDir against the working directory", () => {
    expect(parseLocalParameters(undefined, "/srv/dc")).toEqual({
      stateDir: "/srv/dc/data/local-vms",
      sshServer: "embedded",
      bootDelayMs: 0,
      maxInstances: 0,
      user: "dcvm",
      addressPrefix: "127.0.0.",
    });
  });

  it("takes every parameter", () => {
    expect(
      parseLocalParameters(
        {
          stateDir: "/var/lib/vms",
          sshServer: "openssh",
          bootDelay: "1m30s",
          maxInstances: 4,
          user: "vmuser",
          addressPrefix: "127.1.2.",
        },
        "/srv/dc",
      ),
    ).toEqual({
      stateDir: "/var/lib/vms",
      sshServer: "openssh",
      bootDelayMs: 90_000,
      maxInstances: 4,
      user: "vmuser",
      addressPrefix: "127.1.2.",
    });
  });

  it.each([
    [{ sshServer: "dropbear" }, "sshServer", /embedded.*openssh/],
    [{ bootDelay: 5 }, "bootDelay", /unit/],
    [{ bootDelay: "soon" }, "bootDelay", /duration/],
    [{ maxInstances: -1 }, "maxInstances", /whole number/],
    [{ maxInstances: 1.5 }, "maxInstances", /whole number/],
    [{ maxInstances: "3" }, "maxInstances", /whole number/],
    [{ stateDir: "" }, "stateDir", /non-empty/],
    [{ user: "a b" }, "user", /user name/],
    [{ addressPrefix: "10.0.0." }, "addressPrefix", /loopback/],
    [{ addressPrefix: "127.0.0.1" }, "addressPrefix", /loopback/],
    [{ addressPrefix: "127.300.0." }, "addressPrefix", /loopback/],
    [{ sshserver: "openssh" }, "sshserver", /not a parameter.*sshServer/],
  ])("rejects %j with cloud.invalid_parameters at its path", (params, key, message) => {
    const err = errorOf(params);
    expect(err.code).toBe("cloud.invalid_parameters");
    expect(err.path).toBe(`cloud.driverParameters.${key}`);
    expect(err.message).toMatch(message);
  });

  it("rejects parameters that are not a map", () => {
    expect(errorOf(["x"])).toMatchObject({
      code: "cloud.invalid_parameters",
      path: "cloud.driverParameters",
    });
    expect(errorOf("x")).toMatchObject({ code: "cloud.invalid_parameters", path: "cloud.driverParameters" });
  });
});

describe("sshd config", () => {
  const config = sshdConfig({
    host: "127.0.0.5",
    port: 22,
    user: "dcvm",
    rootDir: "/vms/local-1/root",
    hostKeyFile: "/vms/local-1/sshd/key",
    pidFile: "/vms/local-1/sshd/pid",
    authorizedKeysFile: "/run/keys",
    maxSessions: 10,
  });

  it("listens on the VM's own address, allows only its user by key, and exports DISPATCH_VM_ROOT", () => {
    const lines = config.split("\n");
    expect(lines).toContain("ListenAddress 127.0.0.5:22");
    expect(lines).toContain("AllowUsers dcvm");
    expect(lines).toContain("PasswordAuthentication no");
    expect(lines).toContain("MaxSessions 10");
    expect(lines).toContain('SetEnv "DISPATCH_VM_ROOT=/vms/local-1/root"');
  });

  it("refuses values it cannot quote", () => {
    expect(() =>
      sshdConfig({
        host: "127.0.0.5",
        port: 22,
        user: "dcvm",
        rootDir: '/vms/"x"',
        hostKeyFile: "k",
        pidFile: "p",
        authorizedKeysFile: "a",
        maxSessions: 10,
      }),
    ).toThrow(/quotes/);
  });
});

describe("helpers", () => {
  it("quotes for sh", () => {
    expect(shQuote("it's /a b")).toBe(`'it'\\''s /a b'`);
  });

  it("recognises VM process scripts", () => {
    expect(VM_MAIN_PATTERN.test("/w/cloud-drivers/local/vm-main.ts")).toBe(true);
    expect(VM_MAIN_PATTERN.test("/w/node_modules/.cache/dispatch-cloud/vm-main-0123abcd.cjs")).toBe(true);
    expect(VM_MAIN_PATTERN.test("/w/other-main.ts")).toBe(false);
  });
});
