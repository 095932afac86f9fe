/**
 * The layers of DESIGN.md §1, as rules that `npm run lint` checks (dependency-cruiser). From the bottom:
 *
 *   lib/            small pieces every part uses; imports nothing of the project
 *   config/         the config schema and loader; imports lib/
 *   store/          the database; imports lib/ (and config/ types)
 *   cloud-drivers/  the drivers; import lib/ and config/, never a service
 *   crunch-run/     the runner on each instance; imports lib/ only (the runner protocol lives in lib/)
 *   rest-server/    the users' and runners' API; imports lib/, config/, store/
 *   dispatcher/     queue, scheduler, pool; imports lib/, config/, store/, cloud-drivers/
 *   management-api/ the operators' API; reads the dispatcher only through dispatcher/types.ts
 *   cli/            the composition roots (serve, dispatcher, ...): may import any part
 *
 * The dispatcher and the REST server meet only in the store. No part imports cli/, test/, bench/ or scripts/.
 * Tests (`*.test.ts`, test/, bench/) may import what they test. No import cycles anywhere.
 */
const production = "^(lib|config|store|cloud-drivers|crunch-run|rest-server|dispatcher|management-api|cli)/";
const notTest = "\\.test\\.ts$";

/** A rule forbidding imports from `from` (production files) to `to`. */
function forbid(name, comment, from, to) {
  return { name, comment, severity: "error", from: { path: from, pathNot: notTest }, to };
}

module.exports = {
  forbidden: [
    {
      name: "no-circular",
      comment: "Import cycles make the layers meaningless and the load order fragile.",
      severity: "error",
      from: {},
      to: { circular: true },
    },
    forbid("lib-is-the-bottom", "lib/ imports nothing of the project but lib/.", "^lib/", {
      path: production,
      pathNot: "^lib/",
    }),
    forbid("config-over-lib-only", "config/ imports only lib/.", "^config/", {
      path: production,
      pathNot: "^(lib|config)/",
    }),
    forbid("store-imports-no-service", "The store imports lib/ and config/ only.", "^store/", {
      path: production,
      pathNot: "^(lib|config|store)/",
    }),
    forbid(
      "drivers-import-no-service",
      "Drivers never import the dispatcher, the REST server, the store, crunch-run, the management API or the CLI.",
      "^cloud-drivers/",
      { path: production, pathNot: "^(lib|config|cloud-drivers)/" },
    ),
    forbid(
      "one-driver-one-folder",
      "A driver folder imports no other driver's folder (shared pieces sit in cloud-drivers/*.ts).",
      "^cloud-drivers/([^/]+)/",
      { path: "^cloud-drivers/[^/]+/", pathNot: "^cloud-drivers/$1/" },
    ),
    forbid(
      "crunch-run-imports-lib-only",
      "crunch-run runs on instances: it imports lib/ (where the runner protocol is) and itself only.",
      "^crunch-run/",
      { path: production, pathNot: "^(lib|crunch-run)/" },
    ),
    forbid(
      "rest-server-not-dispatcher",
      "The REST server and the dispatcher meet only in the store.",
      "^rest-server/",
      { path: "^(dispatcher|management-api|cloud-drivers|crunch-run|cli)/" },
    ),
    forbid(
      "dispatcher-not-rest-server",
      "The dispatcher and the REST server meet only in the store.",
      "^dispatcher/",
      { path: "^(rest-server|management-api|crunch-run|cli)/" },
    ),
    forbid(
      "management-reads-dispatcher-types",
      "The management API reads the dispatcher through dispatcher/types.ts only.",
      "^management-api/",
      { path: "^(dispatcher/(?!types\\.ts$)|rest-server|cloud-drivers|crunch-run|cli)/?" },
    ),
    forbid(
      "nobody-imports-the-composition-root",
      "Only cli/ imports cli/.",
      "^(lib|config|store|cloud-drivers|crunch-run|rest-server|dispatcher|management-api)/",
      { path: "^cli/" },
    ),
    {
      name: "no-test-code-in-production",
      comment:
        "Production code imports no test fixtures, benchmarks or build scripts. One exception: the composition " +
        "root's runner loader builds the one-file artifact with scripts/build.ts when it runs from TypeScript " +
        "sources (never inside the built artifact).",
      severity: "error",
      from: { path: production, pathNot: `${notTest}|^cli/runner-artifact\\.ts$` },
      to: { path: "^(test|bench|scripts)/" },
    },
  ],
  options: {
    doNotFollow: { path: "node_modules" },
    exclude: { path: "^(node_modules|dist|data)/" },
    tsPreCompilationDeps: true,
    tsConfig: { fileName: "tsconfig.json" },
    enhancedResolveOptions: { extensions: [".ts", ".js", ".mjs", ".cjs"] },
  },
};
