/**
 * The dispatcher learns an instance's warm pool from `crunch-run --detach`'s answer (`spare`), not only from the
 * next probe's `--list`: with probes 10 minutes apart, an instance's first bundle starts the pool through
 * `--detach`, and the bundles after it go to the pool's spares (`serve` on PGlite, the local driver with its
 * embedded SSH server, the process runtime). Both ways `serve` may hand a spare its document: as the claim leaves
 * (dispatcher.handOffWithClaim, the default) and once the claim is back.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { E2eSystem } from "./e2e-harness.ts";

describe.each([true, false])(
  "end to end: the warm pool named by --detach (handOffWithClaim: %s)",
  (withClaim) => {
    let sys: E2eSystem;

    beforeAll(async () => {
      sys = await E2eSystem.start({
        database: "pglite",
        sshServer: "embedded",
        runtimeEngine: "process",
        maxInstances: 1,
        // No probe after the instance is ready, within the test.
        probeInterval: "10m",
        dispatcherYaml: `  handOffWithClaim: ${withClaim}`,
      });
    }, 180_000);

    afterAll(async () => {
      await sys?.stop();
    }, 120_000);

    it("hands the bundles after an instance's first to its warm pool without waiting for a probe", async () => {
      const uuids: string[] = [];
      for (let i = 0; i < 4; i++) {
        const uuid = await sys.submit({ image: "busybox", command: ["true"] });
        expect((await sys.waitState(uuid)).state, sys.output().slice(-4000)).toBe("ready");
        uuids.push(uuid);
      }
      const started = new Map<string, string>();
      for (const line of sys.output().split("\n")) {
        if (!line.startsWith("{")) continue;
        const entry = JSON.parse(line) as { msg?: string; uuid?: string; via?: string; withClaim?: boolean };
        if (entry.msg === "runner started" && entry.uuid !== undefined)
          started.set(
            entry.uuid,
            `${entry.via}${entry.withClaim === undefined ? "" : ` withClaim=${entry.withClaim}`}`,
          );
      }
      // The first starts the pool (--detach); a hand-off waits up to 3 s for one of its spares to be ready.
      const spare = `spare withClaim=${withClaim}`;
      expect(uuids.map((u) => started.get(u))).toEqual(["detach", spare, spare, spare]);
    }, 180_000);
  },
);
