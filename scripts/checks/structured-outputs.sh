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
source scripts/checks/local-worker.bash
local_prepare structured-outputs.sh
if [ -z "${MOLE_BIN:-}" ]; then
  cargo build --release -q -p mole-worker --bin mole-worker
  MOLE_BIN="${CARGO_TARGET_DIR:-target}/release/mole-worker"
fi
local_serve structured-outputs.sh "$MOLE_BIN" "${MOLE_TEST_PORT:-18736}"
"$py" scripts/checks/structured_outputs.py "$url" || { tail -20 "$log"; exit 1; }
