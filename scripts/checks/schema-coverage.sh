#!/usr/bin/env bash
# JSON Schema coverage as users need it (issue 52 item 6): how many of a corpus of real-world
# shaped schemas (worker/tests/schemas/corpus.json) the grammar engine compiles with OpenAI's
# `strict: true` (every keyword enforced, or refused naming it) and without it (approximated:
# what cannot be enforced is not, and the answer's mole.unenforced says what). Prints the
# measurement, per schema and per keyword; fails when the test's bounds do not hold
# (worker/tests/server/schema_coverage.rs). Needs nothing from the network.
set -euo pipefail
cd "$(dirname "$0")/../.."
# --workspace: the test command's own feature set (mole-bench's seams and the tests' alike),
# so the test binary it built is run, not rebuilt for one package's features.
out="$(cargo test -q --workspace --test server schema_coverage:: -- --nocapture 2>&1)" || { echo "$out"; exit 1; }
echo "$out" | sed -n '/^JSON Schema coverage/,/^test result/p' | grep -v "^test result"
echo "schema-coverage.sh: ok"
