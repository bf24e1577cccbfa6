#!/usr/bin/env bash
# `mole-worker fetch --source s3://...` against moto's S3 server (PyPI `moto[server]`, installed
# into the cache venv once): a tiny model uploaded with boto3 is fetched byte for byte with its
# manifest (SHA-256 checksum and MD5 ETag verified), a rerun is a no-op, a pickle-only prefix is
# refused naming the file (exit 2, termination log), and a killed run's .part is resumed with a
# Range request. Skips (exit 0, says why) only when PyPI is unreachable.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
venv="$MOLE_CACHE/venv"
mkdir -p "$MOLE_CACHE/pip"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if ! "$venv/bin/python" -c 'import moto.server, boto3' 2>/dev/null; then
  if ! "$venv/bin/pip" install --quiet --cache-dir "$MOLE_CACHE/pip" "moto[server]==5.*" boto3 >&2; then
    if ! "$venv/bin/pip" download --quiet --no-deps --dest "$(mktemp -d)" --cache-dir "$MOLE_CACHE/pip" "moto==5.*" >/dev/null 2>&1; then
      echo "fetch-s3.sh: SKIPPED, moto could not be installed from PyPI (unreachable)"
      exit 0
    fi
    echo "fetch-s3.sh: PyPI is reachable but moto[server] did not install" >&2
    exit 1
  fi
fi
# The worker binary of the test command's build (same features: nothing is recompiled).
bin="${CARGO_TARGET_DIR:-target}/debug/mole-worker"
[ -x "$bin" ] || cargo test --workspace --no-run -q
"$venv/bin/python" scripts/checks/fetch_s3.py "$bin" "$venv/bin/moto_server"
