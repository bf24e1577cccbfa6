#!/usr/bin/env bash
# Runs one local worker on SmolLM2-135M-Instruct with the demo adapters (config/local.yaml).
# Steps: fetch the GGUF and the embedding model, import the GGUF to an HF directory (mole-worker import), copy the demo
# adapters, build, serve on $MOLE_LISTEN (default 127.0.0.1:8000).
set -euo pipefail
cd "$(dirname "$0")/.."
root=.mole-local/models
gguf="$(bash scripts/fetch-smollm2.sh)"
minilm="$(bash scripts/fetch-minilm.sh)"
# Release by default (decode is ~2.5x faster than a debug build); MOLE_BIN runs a binary
# already built instead (the openai check uses the test command's build).
if [ -n "${MOLE_BIN:-}" ]; then
  bin="$MOLE_BIN"
else
  cargo build --release -p mole-worker --bin mole-worker
  bin="${CARGO_TARGET_DIR:-target}/release/mole-worker"
fi
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
exec "$bin" serve --config config/local.yaml --listen "${MOLE_LISTEN:-127.0.0.1:8000}"
