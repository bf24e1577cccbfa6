#!/usr/bin/env bash
# Brings up a kind cluster, builds and loads the mole image, installs the chart and runs the
# real-cluster suite (tests/tests/e2e_cluster.rs). Needs docker, kind, kubectl and helm
# (scripts/tools.sh provides helm and kubectl). Not part of scripts/test.sh: no cluster there.
set -euo pipefail
cd "$(dirname "$0")/.."
cluster="${MOLE_E2E_CLUSTER:-mole-e2e}"
bin=$(bash scripts/tools.sh)
export PATH="$bin:$PATH"
kubeconfig="$(mktemp)"
trap 'kind delete cluster --name "$cluster" >/dev/null 2>&1 || true; rm -f "$kubeconfig"' EXIT

kind create cluster --name "$cluster" --kubeconfig "$kubeconfig" --wait 120s
docker build -t mole:e2e .
kind load docker-image mole:e2e --name "$cluster"
helm --kubeconfig "$kubeconfig" install mole charts/mole --namespace mole-system --create-namespace \
  --set image.repository=mole --set image.tag=e2e --set image.pullPolicy=Never --wait --timeout 180s
MOLE_E2E_KUBECONFIG="$kubeconfig" cargo test -p mole-tests --test e2e_cluster -- --nocapture
