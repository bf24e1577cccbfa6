#!/usr/bin/env bash
# The official `openai` Python client sending screenshots, against the README's run of a
# Qwen3-VL checkpoint (scripts/run-local.sh --model ...), here the tiny generated Qwen3-VL and
# its adapter (tests/fixtures/vision): image_url data URLs, `/infer`'s image_b64 with an integer
# `expert`, prompt tokens counted as transformers' processor counts them, typed errors for bad
# images. Skips (exit 0, says why) only when PyPI is unreachable.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
if ! bash scripts/tools.sh >/dev/null; then
  echo "server-vision.sh: SKIPPED, the openai client could not be installed from PyPI"
  exit 0
fi
py="$MOLE_CACHE/venv/bin/python"
bin="${CARGO_TARGET_DIR:-target}/debug/mole-worker"
[ -x "$bin" ] || cargo test --workspace --no-run -q
port="${MOLE_TEST_VISION_PORT:-18735}"
log="$(mktemp)"
fx=tests/fixtures/vision
MOLE_BIN="$bin" MOLE_LISTEN="127.0.0.1:$port" MOLE_CONFIG_POLL_SECONDS=0 bash scripts/run-local.sh \
  --model "$fx/qwen3_vl" --name qwen3-vl-tiny --dtype f32 --image-processor pil --adapter "screens:1=$fx/adapter" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 240); do
  curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.5
done
curl -fs "http://127.0.0.1:$port/readyz" >/dev/null || { echo "server-vision.sh: worker not ready after 120 s"; tail -20 "$log"; exit 1; }
"$py" scripts/checks/server_vision.py "http://127.0.0.1:$port" "$fx" || { tail -20 "$log"; exit 1; }
echo "server-vision.sh: ok"
