#!/usr/bin/env bash
# Serving benchmark, side by side in one run: guidellm (the vLLM project's client) against
# llama.cpp's llama-server and mole on the same model, SmolLM2-135M-Instruct:
#   llama.cpp on its Q4_1 GGUF, its prompt cache on (its default) and off;
#   mole on the same GGUF file, alone and with a LoRA (the french demo adapter) on top;
#   mole on the bf16 import of that file (what `scripts/run-local.sh` serves), its KV cache in
#   bf16 (the default over bf16 weights) and, as mole-bf16-kv32, in f32 (`kvCacheDtype: f32`).
# Each contender serves alone on the machine, one after the other, with the same 24 requests
# (188 prompt tokens for 64 output tokens, guidellm's synthetic data with a fixed seed) sent
# again at concurrency 1, 4 and 16 (one guidellm run per level, so each level resends the
# prompts of the one before), as benchmark and chat clients resend a prompt. Prints a
# markdown table (time to first token, median; output tokens/s; ratios to llama.cpp with its
# cache) and writes it with the raw guidellm JSON under $MOLE_BENCH_OUT (default
# target/bench-llama). Not part of the test command: the first run builds llama-server (about
# 8 minutes, scripts/build-llama-server.sh) and the release worker.
#
#   bash scripts/bench-llama.sh [contender...]
# contenders: llama-cache llama-nocache mole-gguf mole-gguf-lora mole-bf16 mole-bf16-kv32
# mole-bf16-before (default: all but the last two)
# mole-bf16-before serves the bf16 import with another worker binary, MOLE_BEFORE_BIN (an
# earlier commit's release build), so that a change's cost is measured side by side (issue
# 52's preparation stage: `MOLE_BENCH_STREAMS=16 MOLE_BEFORE_BIN=... bash
# scripts/bench-llama.sh mole-bf16 mole-bf16-before`). For every mole contender the run also
# times /healthz while guidellm runs (the slowest probe) and a JSON-schema request sent with
# a schema new to the server, then five times again (the grammar cache: bench_prepare.py).
# env: MOLE_BENCH_REQUESTS (24), MOLE_BENCH_PROMPT (188), MOLE_BENCH_OUTPUT (64),
#      MOLE_BENCH_STREAMS (1,4,16), MOLE_BENCH_THREADS (2: both servers' compute threads),
#      MOLE_BIN (a worker binary already built; default: build the release one),
#      MOLE_BENCH_GGUF (another GGUF of SmolLM2 for llama-* and mole-gguf*, e.g. a q8_0 one
#      `llama-quantize --allow-requantize` wrote from the Q4_1 file; the bf16 import stays
#      the Q4_1 file's),
#      MOLE_BENCH_ADAPTER (the PEFT LoRA mole-gguf-lora serves, named french; default the demo
#      adapter, SmolLM2's shape: another base needs its own, e.g. make-wide-gguf.py --adapter),
#      MOLE_BENCH_PIN=1 (each server on the last core alone with one compute thread, guidellm
#      on the others: the client never takes a server's core; MOLE_BENCH_THREADS is then 1).
set -euo pipefail
cd "$(dirname "$0")/.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
requests="${MOLE_BENCH_REQUESTS:-24}"
prompt="${MOLE_BENCH_PROMPT:-188}"
output="${MOLE_BENCH_OUTPUT:-64}"
streams="${MOLE_BENCH_STREAMS:-1,4,16}"
threads="${MOLE_BENCH_THREADS:-2}"
# Pinning: the servers on the last core, the client on the rest (taskset execs the command,
# so a server's pid is the one started).
server_pin=() client_pin=()
if [ -n "${MOLE_BENCH_PIN:-}" ]; then
  last=$(($(nproc) - 1))
  [ "$last" -ge 1 ] || { echo "bench-llama: MOLE_BENCH_PIN needs 2 cores" >&2; exit 2; }
  server_pin=(taskset -c "$last") client_pin=(taskset -c "0-$((last - 1))") threads=1
fi
out="${MOLE_BENCH_OUT:-${CARGO_TARGET_DIR:-target}/bench-llama}"
contenders=("$@")
[ ${#contenders[@]} -gt 0 ] || contenders=(llama-cache llama-nocache mole-gguf mole-gguf-lora mole-bf16)

venv="$MOLE_CACHE/guidellm-venv"
if [ ! -x "$venv/bin/guidellm" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --cache-dir "$MOLE_CACHE/pip" "guidellm==0.8.1"
fi
llama=""  # built only when a llama.cpp contender runs (about 8 minutes the first time)
if [[ " ${contenders[*]} " == *" llama-"* ]]; then
  llama="$(bash scripts/build-llama-server.sh)"
fi
q4_1="$(bash scripts/fetch-smollm2.sh)"
gguf="${MOLE_BENCH_GGUF:-$q4_1}"
# MOLE_BIN: a worker binary already built (else the release build, as run-local.sh serves).
if [ -n "${MOLE_BIN:-}" ]; then
  bin="$MOLE_BIN"
else
  cargo build --release -p mole-worker --bin mole-worker
  bin="${CARGO_TARGET_DIR:-target}/release/mole-worker"
fi
root="$PWD/.mole-local/models"
mkdir -p "$root/adapters" "$out"
[ -e "$root/smollm2-135m-instruct/config.json" ] || "$bin" import --gguf "$q4_1" --out "$root/smollm2-135m-instruct"
rm -rf "$root/adapters/french" && cp -r "${MOLE_BENCH_ADAPTER:-tests/fixtures/demo/french}" "$root/adapters/french"

# One worker config per base; both name the base as the demo adapter's base_model_name_or_path.
mole_config() { # $1: model root, $2: base path in it, $3: dtype, $4: more limits (optional)
  cat <<EOF
mode: local
pool: bench
modelRoot: $1
baseModel: {name: smollm2-135m-instruct, path: "$2", dtype: $3}
adapters:
  - {name: french, version: v1, loraId: 1, path: "$root/adapters/french"}
router: {strategies: [explicit], fallback: base}
limits: {maxTokens: 1024, maxSeqLen: 4096, maxQueue: 256, requestTimeoutSeconds: 600${4:-}}
EOF
}
mole_config / "${root#/}/smollm2-135m-instruct" bf16 >"$out/mole-bf16.yaml"
mole_config / "${root#/}/smollm2-135m-instruct" bf16 ", kvCacheDtype: f32" >"$out/mole-bf16-kv32.yaml"
mole_config / "${gguf#/}" f32 >"$out/mole-gguf.yaml"

port="${MOLE_BENCH_PORT:-18790}"
pid=""
stop() { [ -z "$pid" ] || { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; }; }
trap stop EXIT
for c in "${contenders[@]}"; do
  model=smollm2-135m-instruct
  case "$c" in
    llama-cache) LD_LIBRARY_PATH="$(dirname "$llama")" "${server_pin[@]}" "$llama" -m "$gguf" --port "$port" -np 16 -c 32768 -t "$threads" >"$out/$c.log" 2>&1 & ;;
    llama-nocache) LD_LIBRARY_PATH="$(dirname "$llama")" "${server_pin[@]}" "$llama" -m "$gguf" --port "$port" -np 16 -c 32768 -t "$threads" \
        --no-cache-prompt --cache-ram 0 >"$out/$c.log" 2>&1 & ;;
    mole-gguf | mole-gguf-lora | mole-bf16 | mole-bf16-kv32 | mole-bf16-before)
      cfg="$out/${c%-lora}.yaml" run="$bin"
      [ "$c" = mole-gguf-lora ] && model=french
      if [ "$c" = mole-bf16-before ]; then
        cfg="$out/mole-bf16.yaml" run="${MOLE_BEFORE_BIN:?mole-bf16-before needs MOLE_BEFORE_BIN}"
      fi
      RAYON_NUM_THREADS="$threads" "${server_pin[@]}" "$run" serve --config "$cfg" \
        --listen "127.0.0.1:$port" >"$out/$c.log" 2>&1 & ;;
    *) echo "bench-llama: unknown contender $c" >&2; exit 2 ;;
  esac
  pid=$!
  for _ in $(seq 600); do
    curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { tail -20 "$out/$c.log"; exit 1; }
    sleep 0.5
  done
  echo "bench-llama: $c (model $model) at concurrency $streams" >&2
  # One guidellm run per level: each run draws the same 24 prompts (the seed), so a level
  # resends the prompts of the level before it, as the issue's measurement did and as chat
  # clients resend a conversation; a server's prompt cache may serve them.
  probe=""
  if [[ "$c" == mole* ]]; then
    "$venv/bin/python" scripts/bench_prepare.py probe "http://127.0.0.1:$port" >"$out/$c.healthz.json" &
    probe=$!
  fi
  for s in ${streams//,/ }; do
    # HF_HUB_OFFLINE: the tokenizer is the import's local directory; nothing is fetched.
    HF_HUB_OFFLINE=1 "${client_pin[@]}" "$venv/bin/guidellm" run \
      --backend "kind=openai_http,target=http://127.0.0.1:$port,model=$model" \
      --profile "kind=concurrent,streams=$s" \
      --constraint "kind=max_requests,count=$requests" \
      --data "kind=synthetic_text,prompt_tokens=$prompt,output_tokens=$output" \
      --seed "kind=static,value=42" \
      --tokenizer "kind=huggingface_auto,model=$root/smollm2-135m-instruct" \
      --output "kind=json,path=$out/$c-$s.json" --disable-progress >"$out/$c-$s.guidellm.txt" 2>&1 \
      || { tail -30 "$out/$c-$s.guidellm.txt"; exit 1; }
  done
  if [ -n "$probe" ]; then
    kill -INT "$probe" && wait "$probe" || true
    "$venv/bin/python" scripts/bench_prepare.py schema "http://127.0.0.1:$port" "$model" >"$out/$c.schema.json"
  fi
  stop
done
"$venv/bin/python" scripts/bench_llama_table.py "$out" "$output" "${contenders[@]}" | tee "$out/table.md"
