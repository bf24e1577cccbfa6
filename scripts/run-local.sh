#!/usr/bin/env bash
# Runs one local worker, serving on $MOLE_LISTEN (default 127.0.0.1:8000).
#
# No arguments: SmolLM2-135M-Instruct with the demo adapters (config/local.yaml). Steps: fetch
# the GGUF and the embedding model, import the GGUF to an HF directory (mole-worker import),
# copy the demo adapters, build, serve.
#
# Your own checkpoint (any model the worker serves, Qwen3-VL included) and PEFT adapters, in
# place (nothing is copied):
#   bash scripts/run-local.sh --model DIR [--name NAME] [--adapter NAME[:LABEL]=DIR]... [--dtype bf16|f16|f32]
#     [--image-processor torchvision|pil] [--tool-call-parser hermes] [--reasoning-parser qwen3|deepseek_r1]
# NAME defaults to DIR's last component and must match the adapters' base_model_name_or_path
# (last component, any case); LABEL is what the router's `expert` may name (e.g. 1).
# --image-processor: which of transformers' Qwen-VL image processors the pixels equal
# (torchvision, the default, as transformers 5 and vLLM; pil as qwen-vl-utils). The parsers
# name the model's tool-call and reasoning formats when its chat template does not (a template
# naming <tool_call> or </think> is detected; docs/server.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# Release by default (decode is ~2.5x faster than a debug build); MOLE_BIN runs a binary
# already built instead (the openai check uses the test command's build).
build() {
  if [ -n "${MOLE_BIN:-}" ]; then
    bin="$MOLE_BIN"
  else
    cargo build --release -p mole-worker --bin mole-worker
    bin="${CARGO_TARGET_DIR:-target}/release/mole-worker"
  fi
}
listen="${MOLE_LISTEN:-127.0.0.1:8000}"
if [ $# -gt 0 ]; then
  model="" name="" dtype="bf16" processor="torchvision" adapters=() parsers=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --model) model="$2"; shift 2 ;;
      --name) name="$2"; shift 2 ;;
      --dtype) dtype="$2"; shift 2 ;;
      --image-processor) processor="$2"; shift 2 ;;
      --adapter) adapters+=("$2"); shift 2 ;;
      --tool-call-parser) parsers="$parsers, toolCallParser: $2"; shift 2 ;;
      --reasoning-parser) parsers="$parsers, reasoningParser: $2"; shift 2 ;;
      *) echo "run-local: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
  done
  [ -f "$model/config.json" ] || { echo "run-local: --model DIR must hold config.json" >&2; exit 2; }
  abs() { (cd "$1" && pwd -P); }
  model="$(abs "$model")"
  name="${name:-$(basename "$model")}"
  mkdir -p .mole-local
  cfg=.mole-local/custom.yaml
  # Paths are relative to the model root; the root is / so the directories serve in place.
  {
    echo "mode: local"
    echo "pool: local"
    echo "modelRoot: /"
    echo "baseModel: {name: \"$name\", path: \"${model#/}\", dtype: $dtype, imageProcessor: $processor$parsers}"
    echo "adapters:"
    i=0
    for a in ${adapters[@]+"${adapters[@]}"}; do
      i=$((i + 1))
      key="${a%%=*}" dir="$(abs "${a#*=}")"
      aname="${key%%:*}" label=""
      [ "$key" != "$aname" ] && label=", label: \"${key#*:}\""
      echo "  - {name: \"$aname\", version: v1, loraId: $i, path: \"${dir#/}\"$label}"
    done
    [ "$i" -gt 0 ] || echo "  []"
    echo "router: {strategies: [explicit], fallback: base}"
    echo "limits: {maxTokens: 1024, maxSeqLen: 8192, maxQueue: 64, requestTimeoutSeconds: 300}"
  } >"$cfg"
  build
  exec "$bin" serve --config "$cfg" --listen "$listen"
fi
root=.mole-local/models
gguf="$(bash scripts/fetch-smollm2.sh)"
minilm="$(bash scripts/fetch-minilm.sh)"
build
mkdir -p "$root/adapters"
if [ ! -e "$root/smollm2-135m-instruct/config.json" ]; then
  "$bin" import --gguf "$gguf" --out "$root/smollm2-135m-instruct"
fi
# The embedding router's model (config/local.yaml router.embeddingModel), inside the model root.
[ -s "$root/minilm/model.safetensors" ] || { rm -rf "$root/minilm" && cp -r "$minilm" "$root/minilm"; }
for a in french json; do
  if [ ! -d "tests/fixtures/demo/$a" ]; then
    echo "run-local: tests/fixtures/demo/$a missing; run tests/fixtures/demo/make_adapters.py first" >&2
    exit 2
  fi
  rm -rf "$root/adapters/$a" && cp -r "tests/fixtures/demo/$a" "$root/adapters/$a"
done
exec "$bin" serve --config config/local.yaml --listen "$listen"
