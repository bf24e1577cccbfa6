#!/usr/bin/env bash
# mole on a Kubernetes of its own, on this machine: a control plane on loopback (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, built from their Go modules by
# scripts/k8s-bins.sh), a node whose pods run as local processes (the test kubelet of
# tests/src/kubelet, each pod in a network namespace of its own), the chart installed with helm
# (its operator pod running this build's mole-operator in-cluster), and SmolLM2-135M-Instruct with
# the demo adapters on a hostPath volume: pool `demo`, Adapters `french` (dynamic) and `json`
# (merged by a Job). It prints KUBECONFIG and the kubectl and curl lines to try, and runs until
# Ctrl+C, which removes everything (processes, network namespaces, the bridge, the volume).
#
# Needs root (network namespaces, a bridge, mounts, cgroups) and, the first time, the Go module
# proxy (about 15 minutes to build the control plane) and PyPI (helm, SmolLM2). The worker is
# this checkout's release build when one exists (target/release/mole-worker, as
# scripts/run-local.sh builds it), else a debug build (decode is ~2.5x slower); set
# MOLE_WORKER_BIN to choose.
#
#   bash scripts/run-cluster.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
if [ "$(id -u)" -ne 0 ]; then
  echo "run-cluster: needs root (the pods get network namespaces, a bridge, mounts and cgroups)" >&2
  exit 2
fi
rc=0
k8s_bin=$(bash scripts/k8s-bins.sh) || rc=$?
if [ "$rc" -ne 0 ]; then
  echo "run-cluster: the control plane is not built and scripts/k8s-bins.sh could not build it" >&2
  exit "$rc"
fi
helm_dir=$(bash scripts/tools.sh)
bash scripts/fetch-smollm2.sh >/dev/null
target="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
cargo build -q -p mole-operator --bin mole-operator -p mole-tests --bin mole-cluster
if [ -z "${MOLE_WORKER_BIN:-}" ]; then
  if [ -x "$target/release/mole-worker" ]; then
    MOLE_WORKER_BIN="$target/release/mole-worker"
  else
    cargo build -q -p mole-worker --bin mole-worker
    MOLE_WORKER_BIN="$target/debug/mole-worker"
  fi
fi
echo "run-cluster: worker $MOLE_WORKER_BIN (built $(date -r "$MOLE_WORKER_BIN" '+%F %T'))" >&2
export MOLE_K8S_BIN="$k8s_bin" MOLE_HELM="$helm_dir/helm"
export MOLE_WORKER_BIN MOLE_OPERATOR_BIN="$target/debug/mole-operator"
# exec: Ctrl+C and SIGTERM reach mole-cluster itself, which cleans up.
exec "$target/debug/mole-cluster"
