#!/usr/bin/env bash
# Builds a real Kubernetes control plane from its Go modules, once, into $MOLE_CACHE/k8s/<pins>/bin:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl (the server's own
#   version, so kubectl never warns about skew).
# Only what is missing is built; a warm run prints the directory in milliseconds. Prints the bin
# directory on stdout (everything else goes to stderr). Exits 3 when the Go module proxy cannot be
# reached, so callers can report SKIPPED instead of failing.
#
# Why a wrapper module: k8s.io/kubernetes requires its staging modules (k8s.io/api, client-go, ...)
# at v0.0.0 with replace directives into its own tree, which `go install pkg@version` refuses. A
# module of our own replaces each of them with the published v0.<minor>.<patch>; the list is read
# from the pinned release's own go.mod, never written by hand, so a version bump needs no edit.
# etcd gets a wrapper module of its own (its server module is a library with a main package).
#
# Cost on 2 cores, cold: about 15 minutes (kube-apiserver is most of it) and 4-5 GB of Go module
# and build caches, which are removed afterwards unless MOLE_K8S_KEEP_GO=1 (only the binaries,
# ~450 MB, stay cached).
set -euo pipefail
K8S_VERSION="${MOLE_K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${MOLE_ETCD_VERSION:-v3.6.16}"
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
root="$MOLE_CACHE/k8s/$K8S_VERSION-etcd$ETCD_VERSION"
bin="$root/bin"
mkdir -p "$bin"

want=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl)
missing=()
for b in "${want[@]}"; do
  [ -x "$bin/$b" ] || missing+=("$b")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "$bin"
  exit 0
fi

command -v go >/dev/null || { echo "k8s-bins: go is not installed" >&2; exit 3; }
work="$root/work"
mkdir -p "$work"
# Go's caches live beside the build, not in ~/go, so a CI cache of $MOLE_CACHE is self-contained.
export GOPATH="$work/gopath" GOCACHE="$work/gocache" GOFLAGS="-modcacherw" CGO_ENABLED=0
export GOTOOLCHAIN=local
cleanup() {
  if [ "${MOLE_K8S_KEEP_GO:-0}" != 1 ]; then
    rm -rf "$work"
  fi
}

# The proxy answers in a second when it is reachable; a closed network fails fast here rather
# than in the middle of a 15-minute build.
if ! go list -m -versions "k8s.io/kubernetes" >/dev/null 2>&1; then
  echo "k8s-bins: the Go module proxy is unreachable" >&2
  exit 3
fi

start=$(date +%s)
need_k8s=()
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  [ -x "$bin/$b" ] || need_k8s+=("$b")
done
if [ "${#need_k8s[@]}" -gt 0 ]; then
  mod="$work/k8s"
  mkdir -p "$mod"
  minor=${K8S_VERSION#v1.}
  staging="v0.$minor"
  (
    cd "$mod"
    [ -f go.mod ] || go mod init mole.local/k8s >&2
    gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    # The release's own replace directives into ./staging/ name exactly its staging modules, each
    # published as v0.N.P.
    python3 - "$gomod" "$staging" >replaces.txt <<'PY'
import re, sys
path, staging = sys.argv[1], sys.argv[2]
mods = sorted(set(re.findall(r"^\s*(k8s\.io/[\w.\-/]+) => \./staging/", open(path).read(), re.M)))
for m in mods:
    print(f"-replace={m}={m}@{staging}")
PY
    [ -s replaces.txt ] || { echo "k8s-bins: no staging modules found in $gomod" >&2; exit 1; }
    xargs go mod edit <replaces.txt
    pkgs=()
    for b in "${need_k8s[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
    # `go get` of the packages (not just the module) records the sums of everything they import.
    go get "${pkgs[@]/%/@$K8S_VERSION}" >&2
    # Mirrors hack/lib/version.sh: without these the binaries report v0.0.0 and kubectl warns.
    vpkg=k8s.io/component-base/version
    ldflags="-s -w -X $vpkg.gitVersion=$K8S_VERSION -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=${minor%%.*}"
    ldflags="$ldflags -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
    echo "k8s-bins: building ${need_k8s[*]} $K8S_VERSION" >&2
    go build -trimpath -ldflags "$ldflags" -o "$bin/" "${pkgs[@]}" >&2
  )
fi
if [ ! -x "$bin/etcd" ]; then
  mod="$work/etcd"
  mkdir -p "$mod"
  (
    cd "$mod"
    [ -f go.mod ] || go mod init mole.local/etcd >&2
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
    echo "k8s-bins: building etcd $ETCD_VERSION" >&2
    go build -trimpath -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3 >&2
  )
fi
echo "k8s-bins: built in $(($(date +%s) - start)) s" >&2
cleanup
echo "$bin"
