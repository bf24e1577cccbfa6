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
MOLE_SCRAPE_OUT="$scrape" cargo test -q --workspace --test server_api metrics_models_and_reload >/dev/null
test -s "$scrape" || { echo "server.sh: no scrape written"; exit 1; }
grep -q '^vllm:lora_requests_info{' "$scrape" || { echo "server.sh: vllm:lora_requests_info missing"; exit 1; }
# promtool flags recording-rule style names; vllm:lora_requests_info must keep vLLM's name
# (gateways read it), so that one finding is expected and every other finding fails.
out="$("$promtool" check metrics <"$scrape" 2>&1 || true)"
other="$(printf '%s\n' "$out" | grep -v '^vllm:lora_requests_info metric names should not contain' | grep -v '^$' || true)"
if [ -n "$other" ]; then
  printf '%s\n' "$other"
  exit 1
fi
echo "server.sh: promtool check metrics ok ($(grep -c '^mole_' "$scrape") mole_ samples)"
