#!/usr/bin/env bash
# Fuzzes the worker's HTTP API against its own OpenAPI document (GET /openapi.json) with
# schemathesis (PyPI): every operation, a few hundred generated requests each pass (the
# document's examples, its coverage cases, then random ones), once with auth off and once with
# an API key and admin token (the key sent; requests without it must be refused). A pass fails
# on any 5xx, a status code, content type, header or body the document does not describe, an
# endpoint that ignores auth, data the document calls valid refused or invalid data accepted
# (`--checks all`); the worker must still answer /readyz afterwards. The seed changes every run
# and is printed (MOLE_OPENAPI_SEED=N replays one): the document must hold for any draw. Before
# fuzzing, openapi_drift.py sends the bodies earlier draws found disagreements on, and checks the
# document's verdict on each is the server's. The worker is
# the test command's debug build serving the tiny generated Qwen3-VL and its adapter
# (tests/fixtures/vision), so images are fuzzed too. Skips (exit 0) only when PyPI is
# unreachable.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
bash scripts/tools.sh >/dev/null
venv="$MOLE_CACHE/venv"
if ! "$venv/bin/python" -c 'import schemathesis' 2>/dev/null; then
  if ! "$venv/bin/pip" install --quiet --cache-dir "$MOLE_CACHE/pip" "schemathesis==4.32.5" >&2; then
    echo "openapi.sh: SKIPPED, schemathesis could not be installed from PyPI"
    exit 0
  fi
fi
bin="${CARGO_TARGET_DIR:-target}/debug/mole-worker"
[ -x "$bin" ] || cargo test --workspace --no-run -q
fx="$PWD/tests/fixtures/vision"
work="$(mktemp -d)"
pid=""
stop() { [ -n "$pid" ] && { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }; pid=""; }
trap 'stop; rm -rf "$work"' EXIT
port="${MOLE_TEST_OPENAPI_PORT:-18736}"
url="http://127.0.0.1:$port"
token="openapi-check-token"
echo "$token" >"$work/keys"
echo "$token" >"$work/admin"
# An adapter directory of its own for /v1/load_lora_adapter (see openapi_hooks.py).
cp -r "$fx/adapter" "$work/extra-adapter"
export MOLE_OPENAPI_ADAPTER="${work#/}/extra-adapter"

# $1: with auth or not.
serve() {
  local auth=""
  [ "$1" = on ] && auth="auth: {apiKeysFile: \"$work/keys\", adminTokenFile: \"$work/admin\"}"
  cat >"$work/config.yaml" <<YAML
mode: local
pool: fuzz
modelRoot: /
baseModel: {name: qwen3-vl-tiny, path: "${fx#/}/qwen3_vl", dtype: f32}
adapters:
  - {name: screens, version: v1, loraId: 1, path: "${fx#/}/adapter", label: "1"}
router: {strategies: [explicit], fallback: base}
limits: {maxTokens: 16, maxSeqLen: 2048, maxQueue: 64, requestTimeoutSeconds: 60, maxImages: 2}
$auth
YAML
  MOLE_CONFIG_POLL_SECONDS=0 "$bin" serve --config "$work/config.yaml" --listen "127.0.0.1:$port" >"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do
    curl -fs "$url/readyz" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$work/log"; return 1; }
    sleep 0.5
  done
  echo "openapi.sh: worker not ready"; tail -20 "$work/log"; return 1
}

# Every check, positive-data acceptance (data the document calls valid must be answered 2xx,
# 401/403/404/409/429) and negative-data rejection included: the document states what
# validation enforces. openapi_hooks.py sends real images where the document says "an image".
checks="all"
seed="${MOLE_OPENAPI_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}"
echo "openapi.sh: schemathesis seed $seed (MOLE_OPENAPI_SEED=$seed replays it)"
export PYTHONPATH="$PWD/scripts/checks${PYTHONPATH:+:$PYTHONPATH}" SCHEMATHESIS_HOOKS=openapi_hooks \
  MOLE_OPENAPI_MAX_IMAGES=2
summary=""
# $1: auth on/off; the rest: schemathesis arguments.
fuzz() {
  local mode="$1"; shift
  serve "$mode"
  local out="$work/st-$mode.txt"
  local key=""
  [ "$mode" = on ] && key="$token"
  if ! "$venv/bin/python" scripts/checks/openapi_drift.py "$url" $key; then
    tail -20 "$work/log"; echo "openapi.sh: the document and the server disagree (auth $mode)"; return 1
  fi
  if ! "$venv/bin/schemathesis" run "$url/openapi.json" --checks "$checks" --max-examples 25 \
      --request-timeout 60 --seed "$seed" --no-color "$@" >"$out" 2>&1; then
    grep -v " INFO " "$out" | head -120; tail -20 "$work/log"
    echo "openapi.sh: schemathesis found failures (auth $mode, seed $seed)"; return 1
  fi
  curl -fs "$url/readyz" >/dev/null || { echo "openapi.sh: worker not ready after the run"; return 1; }
  local n
  n=$(grep -Eo '[0-9]+ generated, [0-9]+ passed' "$out" | tail -1)
  [ -n "$n" ] || { cat "$out"; echo "openapi.sh: no count in schemathesis' output"; return 1; }
  summary="$summary auth $mode: $n, $(grep -Eo '[0-9]+ selected / [0-9]+ total' "$out" | head -1) operations;"
  stop
}
fuzz off
fuzz on -H "Authorization: Bearer $token"
echo "openapi.sh: ok (seed $seed);$summary no 5xx, every answer as documented, the worker still ready"
