#!/usr/bin/env bash
# Brings up a kind cluster, builds and loads the operator and CPU worker images
# (docker/operator.Dockerfile, docker/worker-cpu.Dockerfile), installs the chart with the CPU
# worker as the operator's default (the test pools name no image) and runs the
# real-cluster suite (tests/tests/e2e_cluster.rs). Needs docker, kind, kubectl and helm
# (scripts/tools.sh provides helm and kubectl). Not part of scripts/test.sh: no cluster there.
#
# Model volume: the merge → serve → rollback scenario needs a base model and adapters on a
# volume. The script copies the tiny committed fixtures into a host directory:
#   base/llama               <- tests/fixtures/engine/llama (random-weight llama, safetensors)
#   adapters/calendar/v1     <- tests/fixtures/engine/adapters/llama/a_r8_all (PEFT, r=8)
#   adapters/calendar/v2     <- tests/fixtures/engine/adapters/llama/b_r4_qv  (PEFT, r=4)
#   merged/                  (written by the merge Jobs)
# made writable for the pods' uid 65532, and kind mounts it into the node at /mole-models
# (extraMounts). The test serves it through a hostPath PersistentVolume bound to the PVC
# `models` of its namespace (MOLE_E2E_MODELS_HOSTPATH names the node path); the S3 scenario
# uploads base/llama from there to an in-cluster moto server and fetches it back into
# base/llama-from-s3-<pid> (pods pull python:3.12-slim from Docker Hub and pip-install
# moto[server] and boto3: both must be reachable from the node). On a real
# cluster, fill a ReadWriteMany volume the same way (e.g. `kubectl cp` into a pod that
# mounts the PVC) and point the pool's spec.storage.claimName at it.
set -euo pipefail
cd "$(dirname "$0")/.."
cluster="${MOLE_E2E_CLUSTER:-mole-e2e}"
bin=$(bash scripts/tools.sh)
export PATH="$bin:$PATH"
kubeconfig="$(mktemp)"
models="$(mktemp -d)"
kind_config="$(mktemp)"
trap 'kind delete cluster --name "$cluster" >/dev/null 2>&1 || true; rm -rf "$kubeconfig" "$models" "$kind_config"' EXIT

mkdir -p "$models/base" "$models/adapters/calendar" "$models/merged"
cp -r tests/fixtures/engine/llama "$models/base/llama"
cp -r tests/fixtures/engine/adapters/llama/a_r8_all "$models/adapters/calendar/v1"
cp -r tests/fixtures/engine/adapters/llama/b_r4_qv "$models/adapters/calendar/v2"
chmod -R a+rwX "$models"
cat >"$kind_config" <<YAML
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      - hostPath: $models
        containerPath: /mole-models
YAML

kind create cluster --name "$cluster" --kubeconfig "$kubeconfig" --config "$kind_config" --wait 120s
docker build -f docker/operator.Dockerfile -t mole-operator:e2e .
docker build -f docker/worker-cpu.Dockerfile -t mole-worker:e2e-cpu .
kind load docker-image mole-operator:e2e mole-worker:e2e-cpu --name "$cluster"
helm --kubeconfig "$kubeconfig" install mole charts/mole --namespace mole-system --create-namespace \
  --set image.repository=mole-operator --set image.tag=e2e --set image.pullPolicy=Never \
  --set workerImage.cpu.repository=mole-worker --set workerImage.cpu.tag=e2e-cpu \
  --wait --timeout 180s
MOLE_E2E_KUBECONFIG="$kubeconfig" MOLE_E2E_MODELS_HOSTPATH=/mole-models \
  cargo test -p mole-tests --test e2e_cluster -- --ignored --nocapture --test-threads=1
