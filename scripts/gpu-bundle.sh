#!/usr/bin/env bash
# Builds what a GPU run needs on a machine without one, for a GPU machine that has the CUDA
# driver but no Rust toolchain: `mole-worker` and the numerics test binary with
# `--features cuda`, stripped and xz-compressed into .gpu/ (ignored by git; about 10 MiB each,
# where the plain binaries are over 60 MiB). Needs a CUDA toolkit: CUDA_HOME, or the PyPI one
# from ../shared/tools/cuda13-from-pypi.sh at /work/cuda13.
#
# On the GPU machine, from the repository root (the test binary finds its fixtures at the
# path it was built in, so that path is linked to the checkout):
#   mkdir -p "$(dirname "$(cat .gpu/built-in)")" && ln -sfn "$PWD" "$(cat .gpu/built-in)"
#   xz -dk .gpu/*.xz && chmod +x .gpu/mole-worker .gpu/numerics
#   MOLE_TEST_DEVICE=cuda .gpu/numerics
#   .gpu/mole-worker bench decode --python python3
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME="${CUDA_HOME:-/work/cuda13/venv/lib/python3.11/site-packages/nvidia/cu13}"
export PATH="$CUDA_HOME/bin:$PATH"
# Hopper (H100/H200); override for other GPUs.
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/cuda}"
command -v nvcc >/dev/null || { echo "gpu-bundle: no nvcc under $CUDA_HOME" >&2; exit 1; }

cargo build --release -p mole-worker --features cuda
test_bin=$(cargo test --release -p mole-worker --features cuda --test numerics --no-run \
  --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "numerics" and m.get("executable"):
        print(m["executable"])')
[ -n "$test_bin" ] || { echo "gpu-bundle: the numerics test binary was not built" >&2; exit 1; }

mkdir -p .gpu
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
for pair in "$CARGO_TARGET_DIR/release/mole-worker:mole-worker" "$test_bin:numerics"; do
  src=${pair%%:*} name=${pair##*:}
  strip -o ".gpu/$name" "$src"
  xz -T0 -6 -f ".gpu/$name"
done
echo "$PWD" >.gpu/built-in
ls -l .gpu
echo "carry .gpu; see the top of scripts/gpu-bundle.sh for the commands on the GPU machine"
