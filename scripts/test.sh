#!/usr/bin/env bash
# The one command that runs every test of mole (README "Test"). CI calls exactly this.
# It installs what the tests need (helm, promtool, a small Python env for the openai client)
# into $MOLE_CACHE (default ~/.cache/mole) once, then runs:
#   1. cargo fmt --check and cargo clippy -D warnings
#   2. cargo test --workspace (unit, mock-apiserver, numerics against committed fixtures)
#   3. every scripts/checks/*.sh (helm lint/template + schema check, openai client, promtool...)
set -euo pipefail
cd "$(dirname "$0")/.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
mkdir -p "$MOLE_CACHE"

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
cargo test --workspace --no-fail-fast 2>&1 | tee "$MOLE_CACHE/cargo-test.log"

passed=0
failed=0
skipped=0
# Rust tests that checks run themselves (the real control plane's suite) are counted from
# their own `test result:` lines, collected here.
: > "$MOLE_CACHE/checks.log"
for check in scripts/checks/*.sh; do
  [ -e "$check" ] || continue
  echo "== $check"
  set +e
  bash "$check" 2>&1 | tee -a "$MOLE_CACHE/checks.log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
  elif [ "$rc" -eq 77 ]; then
    # The check could not run here (it says why): neither passed nor failed.
    echo "SKIPPED: $check"
    skipped=$((skipped + 1))
  else
    echo "FAILED: $check"
    failed=$((failed + 1))
  fi
done
# One closing line for the whole run: Rust tests (the workspace's and those checks ran) plus
# the check scripts. Tests `cargo test` ignored are neither passed nor failed (checks run some
# of them: those are counted from the checks' own results).
read -r rust_passed rust_failed < <(awk '/^test result:/ {p += $4; f += $6} END {print p + 0, f + 0}' "$MOLE_CACHE/cargo-test.log" "$MOLE_CACHE/checks.log")
read -r ignored < <(awk '/^test result:/ {i += $8} END {print i + 0}' "$MOLE_CACHE/cargo-test.log")
echo "checks: $passed passed, $failed failed, $skipped skipped"
echo "total: $((rust_passed + passed)) passed, $((rust_failed + failed)) failed ($skipped checks skipped, $ignored tests ignored by cargo test)"
[ "$failed" -eq 0 ]
