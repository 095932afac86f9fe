// Prints the one line CI reads, `tests: N passed, N failed[, N skipped]`, from vitest's JSON report.
// A file that failed without a failing test (a broken hook or import) counts as one failure, so a suite that
// could not run is never reported as passing. The second argument is vitest's exit status: an error outside any
// test (an unhandled rejection) fails the run without failing a test, and the JSON report does not show it, so
// a non-zero status with no failed test counts as one failure too.
import { readFileSync } from "node:fs";

const report = JSON.parse(readFileSync(process.argv[2], "utf8"));
let passed = 0;
let failed = 0;
let skipped = 0;
for (const file of report.testResults ?? []) {
  let fileFailed = 0;
  for (const t of file.assertionResults ?? []) {
    if (t.status === "passed") passed++;
    else if (t.status === "failed") fileFailed++;
    else skipped++;
  }
  if (file.status === "failed" && fileFailed === 0) fileFailed = 1;
  failed += fileFailed;
}
const vitestStatus = Number(process.argv[3] ?? 0);
if ((!report.success || vitestStatus !== 0) && failed === 0) {
  console.log(
    `vitest exited ${vitestStatus} with no failed test: an error outside the tests (see "Errors" above)`,
  );
  failed = 1;
}
console.log(`tests: ${passed} passed, ${failed} failed${skipped > 0 ? `, ${skipped} skipped` : ""}`);
