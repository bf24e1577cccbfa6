#!/usr/bin/env bash
# guidellm (the vLLM project's benchmark client, PyPI) against the local worker with its
# defaults: the OpenAI HTTP backend, whose setup check calls GET /health and /v1/models, then
# streamed chat completions with stream_options.include_usage, whose usage chunk it reads for
# the token counts. 8 synthetic requests at concurrency 1 and 4 against the tiny generated
# Qwen3-VL (tests/fixtures/vision, its tokenizer for guidellm's prompts). Fails on any errored
# or incomplete request, or output token counts other than asked (read from the usage).
# guidellm needs torch, so it lives in its own venv ($MOLE_CACHE/guidellm-venv, about 6 GB,
# installed once). Skips (exit 0) only when PyPI is unreachable.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
venv="$MOLE_CACHE/guidellm-venv"
if [ ! -x "$venv/bin/guidellm" ]; then
  python3 -m venv "$venv"
  if ! "$venv/bin/pip" install --quiet --cache-dir "$MOLE_CACHE/pip" "guidellm==0.8.1" >&2; then
    rm -rf "$venv"
    echo "guidellm.sh: SKIPPED, guidellm could not be installed from PyPI"
    exit 0
  fi
fi
bin="${CARGO_TARGET_DIR:-target}/debug/mole-worker"
[ -x "$bin" ] || cargo test --workspace --no-run -q
fx="$PWD/tests/fixtures/vision"
work="$(mktemp -d)"
port="${MOLE_TEST_GUIDELLM_PORT:-18737}"
MOLE_BIN="$bin" MOLE_LISTEN="127.0.0.1:$port" MOLE_CONFIG_POLL_SECONDS=0 bash scripts/run-local.sh \
  --model "$fx/qwen3_vl" --name qwen3-vl-tiny --dtype f32 --adapter "screens:1=$fx/adapter" >"$work/log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 240); do
  curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { cat "$work/log"; exit 1; }
  sleep 0.5
done
summary=""
for streams in 1 4; do
  out="$work/bench-$streams.json"
  # HF_HUB_OFFLINE: the tokenizer is a local directory; nothing is fetched.
  if ! HF_HUB_OFFLINE=1 "$venv/bin/guidellm" run \
      --backend "kind=openai_http,target=http://127.0.0.1:$port" \
      --profile "kind=concurrent,streams=$streams" \
      --constraint "kind=max_requests,count=8" \
      --data "kind=synthetic_text,prompt_tokens=32,output_tokens=8" \
      --tokenizer "kind=huggingface_auto,model=$fx/qwen3_vl" \
      --output "kind=json,path=$out" --disable-progress >"$work/guidellm-$streams.txt" 2>&1; then
    tail -30 "$work/guidellm-$streams.txt"; tail -20 "$work/log"
    echo "guidellm.sh: guidellm failed at concurrency $streams"; exit 1
  fi
  line=$("$venv/bin/python" - "$out" "$streams" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))["benchmarks"][0]
t = b["metrics"]["request_totals"]
assert t["errored"] == 0 and t["incomplete"] == 0, f"errored or incomplete requests: {t}"
assert t["successful"] == 8, f"expected 8 successful requests: {t}"
out = [r["output_tokens"] for r in b["requests"]["successful"]]
assert out and all(n == 8 for n in out), f"output tokens per request (from the usage chunk): {out}"
print(f"concurrency {sys.argv[2]}: {t['successful']} ok, 0 errored, 8 output tokens each")
PY
) || { echo "guidellm.sh: $line"; exit 1; }
  summary="$summary $line;"
done
echo "guidellm.sh: ok;$summary"
