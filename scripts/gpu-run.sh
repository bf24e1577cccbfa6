#!/usr/bin/env bash
# Runs on a GPU machine what scripts/gpu-bundle.sh built (no Rust needed there): the device
# tests with MOLE_TEST_DEVICE=cuda, then `bench decode` in bf16 on the 0.5B default (with
# transformers + PEFT beside it and the vision tower on a 1024x768 screenshot) and on the
# 5.9B shape (hidden 4096, 32 layers). Logs go to $OUT (default /tmp/gpu-out); a summary is
# printed last. Stages: MOLE_GPU_STAGES="tests small large" (any subset, in that order).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
STAGES=${MOLE_GPU_STAGES:-tests small large}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem \
  --format=csv | tee "$OUT/gpu.txt"
# The test binaries find their fixtures at the path they were built in.
built=$(cat .gpu/built-in)
[ "$built" = "$PWD" ] || { mkdir -p "$(dirname "$built")" && ln -sfn "$PWD" "$built"; }
for f in .gpu/*.xz; do [ -e "${f%.xz}" ] || xz -dk "$f"; done
chmod +x .gpu/* 2>/dev/null
# The CUDA 13 libraries of the machine's torch (never the build machine's link stub).
lib=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))')
export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
if ldd .gpu/mole-worker | grep 'not found'; then echo "gpu-run: missing libraries" >&2; exit 1; fi
summary=()
for stage in $STAGES; do
  case $stage in
  tests)
    for t in numerics:120 vision:60 op_count_transfers:60; do
      limit=${t#*:} t=${t%:*}
      [ -x ".gpu/$t" ] || { summary+=("$t: not bundled"); continue; }
      s=$(date +%s)
      MOLE_TEST_DEVICE=cuda timeout "$limit" ".gpu/$t" --test-threads 4 >"$OUT/test-$t.log" 2>&1
      rc=$?
      summary+=("$t (rc $rc, $(($(date +%s) - s)) s): $(grep -E '^test result' "$OUT/test-$t.log" | tail -1)")
      grep -E 'relative|error|FAILED|panicked' "$OUT/test-$t.log" | head -20
    done
    ;;
  small)
    s=$(date +%s)
    timeout 180 .gpu/mole-worker bench decode --dtype bf16 --python python3 2>&1 | tee "$OUT/bench-0.5b.log"
    summary+=("bench 0.5B: rc $? in $(($(date +%s) - s)) s")
    ;;
  large)
    s=$(date +%s)
    timeout 240 .gpu/mole-worker bench decode --dtype bf16 --hidden 4096 --layers 32 --image none \
      --python python3 2>&1 | tee "$OUT/bench-5.9b.log"
    summary+=("bench 5.9B: rc $? in $(($(date +%s) - s)) s")
    ;;
  esac
done
echo "== summary"
cat "$OUT/gpu.txt"
printf '%s\n' "${summary[@]}"
