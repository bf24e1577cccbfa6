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
for check in scripts/checks/*.sh; do
  [ -e "$check" ] || continue
  echo "== $check"
  if bash "$check"; then
    passed=$((passed + 1))
  else
    echo "FAILED: $check"
    failed=$((failed + 1))
  fi
done
# One closing line for the whole run: Rust tests plus the check scripts.
read -r rust_passed rust_failed < <(awk '/^test result:/ {p += $4; f += $6} END {print p + 0, f + 0}' "$MOLE_CACHE/cargo-test.log")
echo "checks: $passed passed, $failed failed"
echo "total: $((rust_passed + passed)) passed, $((rust_failed + failed)) failed"
[ "$failed" -eq 0 ]
