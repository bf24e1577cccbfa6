#!/usr/bin/env bash
# The scale run (issues 58 and 55; not part of the test command): 500 Adapters in one pool with
# 8 dynamic pods on Kubernetes' own control plane (scripts/k8s-bins.sh) with the test kubelet,
# this build's worker and the operator binary; prints the time until every Adapter is Ready
# and a steady minute's API requests, status writes, operator memory and CPU
# (tests/tests/scale.rs). MOLE_SCALE_ADAPTERS and MOLE_SCALE_PODS change the shape. Needs root
# (network namespaces). About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
MOLE_K8S_BIN=$(bash scripts/k8s-bins.sh)
MOLE_HELM="$(bash scripts/tools.sh)/helm"
export MOLE_K8S_BIN MOLE_HELM
cargo build -q --release -p mole-operator --bin mole-operator -p mole-worker --bin mole-worker
# Absolute: the test runs in its own package's directory.
target=$(realpath "${CARGO_TARGET_DIR:-target}")
export MOLE_OPERATOR_BIN="$target/release/mole-operator"
export MOLE_WORKER_BIN="$target/release/mole-worker"
cargo test -q -p mole-tests --test scale -- --ignored --nocapture
