#!/usr/bin/env bash
# Runs the official `openai` Python client against a live worker API. Until the real engine is
# wired into `server::build_engine`, the worker runs with the test-only EchoEngine (the ignored
# `serve_for_clients` test), so this checks the HTTP/OpenAI surface, not generation quality.
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${MOLE_PYTHON:-/work/venv/bin/python}"
[ -x "$py" ] || py=python3
"$py" -c 'import openai' 2>/dev/null || { echo "server-openai.sh: python openai package missing"; exit 1; }
port="${MOLE_TEST_PORT:-18734}"
cargo test -q -p mole-worker --test server_api --no-run >/dev/null 2>&1
MOLE_TEST_LISTEN="127.0.0.1:$port" cargo test -q -p mole-worker --test server_api serve_for_clients -- --ignored >/dev/null 2>&1 &
pid=$!
# cargo does not forward signals to the test binary: stop the child first, then cargo.
trap 'pkill -P $pid 2>/dev/null || true; kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
  sleep 0.2
done
"$py" scripts/checks/server_openai.py "http://127.0.0.1:$port"
