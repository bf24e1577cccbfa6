#!/usr/bin/env bash
# Lints a real /metrics scrape of the worker with `promtool check metrics`.
# The scrape comes from the server API test (EchoEngine behind the real HTTP server).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
mkdir -p "$CACHE"
promtool="$(command -v promtool || true)"
[ -z "$promtool" ] && [ -x "$CACHE/bin/promtool" ] && promtool="$CACHE/bin/promtool"
if [ -z "$promtool" ] && [ -f scripts/tools.sh ]; then
  # shellcheck disable=SC1091
  source scripts/tools.sh >/dev/null 2>&1 || true
  promtool="$(command -v promtool || true)"
fi
if [ -z "$promtool" ]; then
  # Fallback: Debian's prometheus package ships promtool; extract it without installing.
  tmp="$(mktemp -d)"
  (cd "$tmp" && apt-get download prometheus >/dev/null && dpkg-deb -x prometheus_*.deb x)
  mkdir -p "$CACHE/bin" && cp "$tmp/x/usr/bin/promtool" "$CACHE/bin/promtool"
  rm -rf "$tmp"
  promtool="$CACHE/bin/promtool"
fi
scrape="$(mktemp)"
trap 'rm -f "$scrape"' EXIT
# --workspace: the same feature set as the test command's build, so nothing is rebuilt.
MOLE_SCRAPE_OUT="$scrape" cargo test -q --workspace --test server server_api::metrics_models_and_reload >/dev/null
test -s "$scrape" || { echo "server.sh: no scrape written"; exit 1; }
# vLLM's names that a Gateway API Inference Extension endpoint picker reads: each must be
# scraped under that very name, colon included.
VLLM='vllm:lora_requests_info vllm:num_requests_waiting vllm:num_requests_running vllm:kv_cache_usage_perc vllm:lora_adapter_loaded vllm:num_gpu_loaded_lora_adapters vllm:num_cpu_loaded_lora_adapters vllm:max_gpu_lora_adapters'
for m in $VLLM; do
  grep -q "^$m[{ ]" "$scrape" || { echo "server.sh: $m missing"; exit 1; }
done
# promtool flags recording-rule style names (a colon); for those vLLM names that one finding is
# expected and every other finding fails.
out="$("$promtool" check metrics <"$scrape" 2>&1 || true)"
other="$(printf '%s\n' "$out" | grep -v '^$' || true)"
for m in $VLLM; do
  other="$(printf '%s\n' "$other" | grep -vx "$m metric names should not contain ':'" || true)"
done
other="$(printf '%s\n' "$other" | grep -v '^$' || true)"
if [ -n "$other" ]; then
  printf '%s\n' "$other"
  exit 1
fi
echo "server.sh: promtool check metrics ok ($(grep -c '^mole_' "$scrape") mole_ samples)"
