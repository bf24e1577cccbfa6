#!/usr/bin/env bash
# Runs on a GPU machine what scripts/gpu-bundle.sh built (no Rust needed there): the device
# tests with MOLE_TEST_DEVICE=cuda (lora_kernels with --include-ignored: its tests are
# device-only), then `mole-bench decode` in bf16 on the 0.5B default (with transformers + PEFT
# beside it and the vision tower on a 1024x768 screenshot) and on the 5.9B shape (hidden
# 4096, 32 layers), each twice: LoRA by the grouped ops (`--lora-kernel ops`, the default)
# and by the BGMV kernels (`bgmv`, unproven until this run), then one table of both. Logs go
# to $OUT (default /tmp/gpu-out); a summary is printed last. Stages: MOLE_GPU_STAGES="tests
# small large" (any subset, in that order). The whole run stays within MOLE_GPU_BUDGET_S
# seconds (default 450: a device call is 10 minutes at most, and the machine takes time to
# start); a stage that would start past it is skipped and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
STAGES=${MOLE_GPU_STAGES:-tests small large}
BUDGET=${MOLE_GPU_BUDGET_S:-450}
START=$(date +%s)
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
if ldd .gpu/mole-worker .gpu/mole-bench | grep 'not found'; then echo "gpu-run: missing libraries" >&2; exit 1; fi
summary=()

# Seconds a step may take: `want`, or what is left of the budget (0: none left).
limit() {
  local left=$((BUDGET - ($(date +%s) - START)))
  [ "$left" -lt 10 ] && { echo 0; return; }
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

# Device-to-device copy bandwidth (read + write bytes per second), for the memory bound.
python3 - >"$OUT/hbm.txt" 2>/dev/null <<'EOF' || echo "n/a" >"$OUT/hbm.txt"
import time, torch
n = 1 << 31  # bytes per buffer
a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    b.copy_(a)
torch.cuda.synchronize()
print(2 * n * 20 / (time.perf_counter() - t))
EOF
echo "device copy: $(cat "$OUT/hbm.txt") bytes/s"

# One `mole-bench decode` run: $1 the log's name, $2 the LoRA kernel, $3 its time cap, the rest
# the bench's arguments.
bench() {
  local name=$1 kernel=$2 want=$3 s t rc
  shift 3
  t=$(limit "$want")
  if [ "$t" -eq 0 ]; then summary+=("bench $name: skipped (budget of $BUDGET s spent)"); return; fi
  s=$(date +%s)
  MOLE_LORA_KERNEL=$kernel timeout "$t" .gpu/mole-bench decode --dtype bf16 "$@" 2>&1 |
    tee "$OUT/bench-$name.log"
  rc=${PIPESTATUS[0]}
  summary+=("bench $name: rc $rc in $(($(date +%s) - s)) s (cap $t s)")
}

for stage in $STAGES; do
  case $stage in
  tests)
    # binary:module:cap[:LoRA kernel of the tests' engines] (a test binary holds several
    # modules, worker/tests/*/main.rs); op_count_transfers twice: the engine end to end with
    # the BGMV kernels too (transformers' greedy tokens, one upload a step).
    for t in model:numerics:120 model:vision:60 op_count:op_count_transfers:60 \
      op_count:op_count_transfers:60:bgmv model:lora_kernels:60; do
      IFS=: read -r bin t want kernel <<<"$t"
      kernel=${kernel:-ops}
      log="$OUT/test-$t-$kernel.log"
      [ -x ".gpu/$bin" ] || { summary+=("$t: not bundled"); continue; }
      lim=$(limit "$want")
      [ "$lim" -eq 0 ] && { summary+=("$t ($kernel): skipped (budget spent)"); continue; }
      extra=()
      [ "$t" = lora_kernels ] && extra=(--include-ignored)
      s=$(date +%s)
      MOLE_TEST_DEVICE=cuda MOLE_LORA_KERNEL=$kernel timeout "$lim" ".gpu/$bin" "$t::" --test-threads 4 "${extra[@]}" >"$log" 2>&1
      rc=$?
      summary+=("$t, engines' LoRA $kernel (rc $rc, $(($(date +%s) - s)) s): $(grep -E '^test result' "$log" | tail -1)")
      grep -E 'relative|error|FAILED|panicked|differ from|bgmv vs|LoRA bgmv' "$log" | head -40
    done
    ;;
  small)
    bench 0.5b-ops ops 180 --python python3
    bench 0.5b-bgmv bgmv 120 --image none
    ;;
  large)
    bench 5.9b-ops ops 240 --hidden 4096 --layers 32 --image none --python python3
    bench 5.9b-bgmv bgmv 150 --hidden 4096 --layers 32 --image none
    ;;
  esac
done

echo "== summary"
cat "$OUT/gpu.txt"
printf '%s\n' "${summary[@]}"
# The two LoRA kernels side by side, from each run's `bench-summary` line.
python3 - "$OUT" <<'EOF'
import glob, os, re, sys
out = sys.argv[1]
try:
    bw = float(open(os.path.join(out, "hbm.txt")).read().split()[0])
except (OSError, ValueError, IndexError):
    bw = None
rows = []
for log in sorted(glob.glob(os.path.join(out, "bench-*.log"))):
    for line in open(log, errors="replace"):
        if line.startswith("bench-summary "):
            f = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
            rows.append((os.path.basename(log)[6:-4], f))
if not rows:
    print("no bench-summary lines (see the bench logs)")
    sys.exit(0)
print(f"device copy bandwidth: {bw / 1e12:.2f} TB/s" if bw else "device copy bandwidth: n/a")
print("| run | LoRA kernel | merged b1 tok/s | % of HBM bound | dynamic ÷ merged b1 | dynamic ÷ merged b16 | 16 distinct ÷ one b16 | b16 step ÷ b1 step |")
print("|---|---|---|---|---|---|---|---|")
for name, f in rows:
    g = lambda k: float(f[k])
    bound = bw / g("weight_bytes") if bw else None
    share = f"{100 * g('merged_b1') / bound:.0f}% of {bound:.0f}" if bound else "n/a"
    print(f"| {name} | {f['lora_kernel']} | {g('merged_b1'):.1f} | {share} | "
          f"{g('dynamic_b1') / g('merged_b1'):.2f} | {g('one_b16') / g('merged_b16'):.2f} | "
          f"{g('distinct_b16') / g('one_b16'):.2f} | {16 * g('merged_b1') / g('merged_b16'):.2f} |")
print("goals (issue 54, 5.9B): merged b1 >= 80% of the bound; dynamic ÷ merged >= 0.90 at b1 "
      "and b16; 16 distinct ÷ one >= 0.90; b16 step ÷ b1 step <= 1.3")
EOF
echo "total: $(($(date +%s) - START)) s"
