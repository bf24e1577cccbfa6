#!/usr/bin/env bash
# Builds what a GPU run needs on a machine without one, for a GPU machine that has the CUDA
# driver but no Rust toolchain: `mole-worker`, `mole-bench` and the test binaries that run on a device
# (`model`, holding numerics, vision and lora_kernels, and `op_count`, holding
# op_count_transfers) with `--features cuda`, stripped and xz-compressed
# into .gpu/ (ignored by git; about 10 MiB each, where the plain binaries are over 60 MiB). Needs a CUDA toolkit: CUDA_HOME, or the PyPI one
# from ../shared/tools/cuda13-from-pypi.sh at /work/cuda13.
#
# On the GPU machine, from the repository root: `bash scripts/gpu-run.sh` (carry .gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME="${CUDA_HOME:-/work/cuda13/venv/lib/python3.11/site-packages/nvidia/cu13}"
export PATH="$CUDA_HOME/bin:$PATH"
# Hopper (H100/H200); override for other GPUs.
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/cuda}"
command -v nvcc >/dev/null || { echo "gpu-bundle: no nvcc under $CUDA_HOME" >&2; exit 1; }

cargo build --release -p mole-worker --features cuda
# Apart from the worker: mole-bench turns its seams on, which must not reach the worker.
cargo build --release -p mole-bench --features cuda
# The tests that read MOLE_TEST_DEVICE (tests/common/mod.rs `test_device`).
# Test binaries (worker/tests/*/main.rs) that hold the device tests; gpu-run.sh picks the
# modules.
TESTS=(model op_count)
targs=()
for t in "${TESTS[@]}"; do targs+=(--test "$t"); done
cargo test --release -p mole-worker --features cuda "${targs[@]}" --no-run \
  --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["test"] and m.get("executable"):
        print(m["target"]["name"], m["executable"])' >"$CARGO_TARGET_DIR/gpu-tests.txt"
for t in "${TESTS[@]}"; do
  grep -q "^$t " "$CARGO_TARGET_DIR/gpu-tests.txt" ||
    { echo "gpu-bundle: the $t test binary was not built" >&2; exit 1; }
done

mkdir -p .gpu
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
rm -f .gpu/*.xz
strip -o .gpu/mole-worker "$CARGO_TARGET_DIR/release/mole-worker"
strip -o .gpu/mole-bench "$CARGO_TARGET_DIR/release/mole-bench"
while read -r name exe; do strip -o ".gpu/$name" "$exe"; done <"$CARGO_TARGET_DIR/gpu-tests.txt"
xz -T0 -6 -f .gpu/mole-worker .gpu/mole-bench "${TESTS[@]/#/.gpu/}"
echo "$PWD" >.gpu/built-in
ls -l .gpu
echo "bundle: $(du -cb .gpu/*.xz | tail -1 | cut -f1) bytes compressed"
echo "carry .gpu; see the top of scripts/gpu-bundle.sh for the commands on the GPU machine"
