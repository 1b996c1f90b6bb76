#!/usr/bin/env bash
# Build llama-server from the llama.cpp vendored in the llama-cpp-python sdist that
# butter pins, so the peer runs the very same kernels as butter's GGUF back end.
#
#   bench/build_llama_server.sh            # prints the binary path on its last line
#
# The build lives outside the repository, in
#   ${BUTTER_BENCH_CACHE:-$HOME/.cache/butter-bench}/llama-server-<version>/
# and is skipped when the binary is already there. Nothing of llama.cpp is committed.
# Like llama-cpp-python's own build, GGML_NATIVE keeps its default; the web UI is
# neither built nor downloaded (the benchmarks only use the HTTP API).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${BUTTER_BENCH_CACHE:-$HOME/.cache/butter-bench}/llama-server-${VERSION}"
BINARY="${CACHE}/build/bin/llama-server"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"

if [[ -x "${BINARY}" ]]; then
    echo "${BINARY}"
    exit 0
fi

mkdir -p "${CACHE}"
SDIST_DIR="${CACHE}/llama_cpp_python-${VERSION}"
if [[ ! -f "${SDIST_DIR}/vendor/llama.cpp/CMakeLists.txt" ]]; then
    echo "downloading the llama-cpp-python ${VERSION} sdist" >&2
    "${PYTHON}" -m pip download --no-deps --no-binary :all: \
        --dest "${CACHE}/download" "llama-cpp-python==${VERSION}" >&2
    tar -xzf "${CACHE}/download/llama_cpp_python-${VERSION}.tar.gz" -C "${CACHE}"
fi

GENERATOR=()
if command -v ninja >/dev/null 2>&1; then
    GENERATOR=(-G Ninja)
fi

echo "configuring ${SDIST_DIR}/vendor/llama.cpp" >&2
cmake -S "${SDIST_DIR}/vendor/llama.cpp" -B "${CACHE}/build" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF >&2

echo "building llama-server with ${JOBS} jobs" >&2
cmake --build "${CACHE}/build" --config Release --target llama-server -j "${JOBS}" >&2

"${BINARY}" --version >&2
echo "${BINARY}"
