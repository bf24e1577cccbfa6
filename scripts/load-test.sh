#!/usr/bin/env bash
# Load test of the real local run (SmolLM2-135M-Instruct + demo adapters, scripts/run-local.sh)
# with `hey`: more concurrent clients than the engine takes (config/local.yaml: 16 running +
# 64 waiting), so the answer mix must be 200s and 429s (Retry-After), never a 5xx or a crash,
# and memory must stay flat. Prints the status distribution, requests/s, latency percentiles
# and the worker's RSS before and after. Traffic stays on 127.0.0.1.
#
#   bash scripts/load-test.sh                 # starts the worker (release build) and stops it
#   MOLE_URL=http://127.0.0.1:8000 MOLE_PID=<pid> bash scripts/load-test.sh   # a running one
#
# Settings: DURATION (30s), CONCURRENCY ("64 128": one run per value), MAX_TOKENS (16).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${DURATION:-30s}"
CONCURRENCY="${CONCURRENCY:-64 128}"
MAX_TOKENS="${MAX_TOKENS:-16}"
if ! command -v hey >/dev/null; then
  echo "load-test: hey not found (apt-get install -y hey, or go install github.com/rakyll/hey@latest)" >&2
  exit 2
fi
url="${MOLE_URL:-}"
pid="${MOLE_PID:-}"
started=""
if [ -z "$url" ]; then
  port="${MOLE_TEST_PORT:-18735}"
  url="http://127.0.0.1:$port"
  log="$(mktemp)"
  MOLE_LISTEN="127.0.0.1:$port" MOLE_CONFIG_POLL_SECONDS=0 bash scripts/run-local.sh >"$log" 2>&1 &
  pid=$!  # run-local.sh execs the worker: same pid
  started=1
  trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
  for _ in $(seq 1800); do
    curl -fs "$url/readyz" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { tail -20 "$log"; exit 1; }
    sleep 1
  done
fi
case "$url" in
  http://127.0.0.1:* | http://localhost:*) ;;
  *) echo "load-test: only local workers (127.0.0.1)" >&2; exit 2 ;;
esac
curl -fs "$url/readyz" >/dev/null || { echo "load-test: $url not ready" >&2; exit 1; }
rss() { [ -n "$pid" ] && awk '/VmRSS/ {print $2 " " $3}' "/proc/$pid/status" 2>/dev/null || echo "?"; }
body='{"model":"demo","messages":[{"role":"user","content":"Say bonjour to my friend, in French."}],"max_tokens":'"$MAX_TOKENS"',"temperature":0}'
# Warm-up (first requests allocate the KV caches and the adapter slots).
for _ in 1 2 3; do curl -fs -o /dev/null -H 'content-type: application/json' -d "$body" "$url/v1/chat/completions"; done
echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'); worker RSS after warm-up: $(rss)"
failed=""
for c in $CONCURRENCY; do
  csv="$(mktemp)"
  echo "== hey -z $DURATION -c $c -t 120 -m POST -T application/json -d '$body' $url/v1/chat/completions"
  hey -z "$DURATION" -c "$c" -t 120 -o csv -m POST -T application/json -d "$body" \
    "$url/v1/chat/completions" >"$csv"
  # Per status: count, rate and latency percentiles (hey's own summary mixes the fast 429s
  # with the served answers).
  if ! python3 - "$csv" "$DURATION" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
secs = float(sys.argv[2].rstrip("s"))
by = {}
for r in rows:
    by.setdefault(r["status-code"], []).append(float(r["response-time"]))
print(f"  total {len(rows)} answers, {len(rows) / secs:.1f}/s")
for code, t in sorted(by.items()):
    t.sort()
    q = lambda p: t[min(len(t) - 1, int(p * len(t)))]
    print(f"  [{code}] {len(t)} ({len(t) / secs:.1f}/s)  p50 {q(.5):.3f}s  p90 {q(.9):.3f}s  p99 {q(.99):.3f}s  max {t[-1]:.3f}s")
bad = [c for c in by if not c.startswith(("2", "429"))]
sys.exit(1 if bad else 0)
PY
  then
    failed=1
  fi
  rm -f "$csv"
  sleep 2
  echo "  worker RSS after: $(rss)"
done
curl -fs "$url/readyz" >/dev/null && alive=yes || alive=no
echo "ready after the runs: $alive"
if [ -n "$failed" ] || [ "$alive" != yes ]; then
  echo "load-test: FAILED (answers other than 200/429, or worker not ready after the run)" >&2
  exit 1
fi
[ -n "$started" ] && echo "load-test: ok (worker stopped)" || echo "load-test: ok"
