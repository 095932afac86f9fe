// Prints the one line CI reads, `tests: N passed, N failed[, N skipped]`, from vitest's JSON report.
// A file that failed without a failing test (a broken hook or import) counts as one failure, so a suite that
// could not run is never reported as passing.
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
if (!report.success && failed === 0) failed = 1;
console.log(`tests: ${passed} passed, ${failed} failed${skipped > 0 ? `, ${skipped} skipped` : ""}`);
