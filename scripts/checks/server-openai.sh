#!/usr/bin/env bash
# The official `openai` Python client against the README's local run: the real
# SmolLM2-135M-Instruct with the demo adapters (scripts/run-local.sh, config/local.yaml).
# Checks chat, streaming, completions, logprobs, seeds, routing and typed errors, and that the
# demo adapters answer exactly what PEFT + transformers answered when they were trained
# (tests/fixtures/demo/*/sample.txt). Skips (exit 0, says why) only when PyPI is unreachable.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/checks/local-worker.bash
local_prepare server-openai.sh
# The worker binary of the test command's build (same features: nothing is recompiled);
# MOLE_BIN serves another binary instead, as in structured-outputs.sh.
bin="${MOLE_BIN:-${CARGO_TARGET_DIR:-target}/debug/mole-worker}"
[ -x "$bin" ] || cargo test --workspace --no-run -q
local_serve server-openai.sh "$bin" "${MOLE_TEST_PORT:-18734}"
"$py" scripts/checks/server_openai.py "$url" || { tail -20 "$log"; exit 1; }
