#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server`, the peer of `tessera-bench serve --peer llama-server`,
# from the llama.cpp source vendored in the PyPI sdist of llama-cpp-python (no other
# source is reachable from this project's machines). About 10 minutes on 2 quiet cores,
# once per machine; nothing else should build or run beside it.
#
# usage: bench/peer/build-llama-server.sh [DIR]
#   DIR defaults to ${TESSERA_HOME:-$HOME/.cache/tessera}/peer/llama-server; the server
#   lands in DIR/build/bin/llama-server, where tessera-bench looks for it.
#   env: LCP_VERSION (default 0.3.36), JOBS (default: every core)
# Needs python3 with venv, gcc/g++ and network access to PyPI (cmake and ninja come from it).
set -euo pipefail
VERSION=${LCP_VERSION:-0.3.36}
DIR=${1:-${TESSERA_HOME:-$HOME/.cache/tessera}/peer/llama-server}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$DIR"
cd "$DIR"
if [ -x build/bin/llama-server ]; then
  echo "$DIR/build/bin/llama-server (already built)"
  exit 0
fi
[ -x tools/bin/python ] || python3 -m venv tools
tools/bin/pip install -q cmake ninja scikit-build-core
export PATH="$DIR/tools/bin:$PATH"
SDIST="llama_cpp_python-$VERSION.tar.gz"
# Without build isolation: pip's isolated environment would build cmake itself from
# source (a quarter of an hour) just to read the sdist's metadata.
[ -f "$SDIST" ] || tools/bin/pip download -q --no-deps --no-binary :all: --no-build-isolation -d . "llama-cpp-python==$VERSION"
SRC="llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || tar xzf "$SDIST"
# The sdist keeps a submodule's .git pointer to nowhere; cmake's version probe trips on it.
rm -f "$SRC/.git"
# Native code for this CPU (AVX-512, VNNI where it has them), one static binary, no web UI.
cmake -S "$SRC" -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > cmake.log 2>&1
cmake --build build --target llama-server -j "$JOBS" > build.log 2>&1
echo "$DIR/build/bin/llama-server ($(build/bin/llama-server --version 2>&1 | grep -m1 version))"
