#!/usr/bin/env bash
# The test command (README, .ci/run): installs and starts what the tests need, typechecks, lints, runs every
# test, and ends with one line `tests: N passed, N failed[, N skipped]`. Exit 0 only if all of it passed.
# Run as root on a fresh Debian machine after `npm ci`. Extra arguments go to vitest (e.g. a test file).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0

eval "$(bash scripts/test-services.sh)" || { echo "test.sh: could not start the test services" >&2; exit 1; }

echo "== typecheck (tsc --noEmit)"
npx tsc --noEmit || status=1
echo "== lint, format and the layers (npm run lint: biome, dependency-cruiser)"
npm run --silent lint || status=1

echo "== tests (vitest)"
results=.test-results.json
rm -f "$results"
npx vitest run --reporter=default --reporter=json --outputFile.json="$results" "$@"
vitest_status=$?
[ $vitest_status -eq 0 ] || status=1

if [ -f "$results" ]; then
  node scripts/test-summary.mjs "$results" "$vitest_status" || status=1
else
  echo "tests: 0 passed, 1 failed"
  status=1
fi
exit $status
