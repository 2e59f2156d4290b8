#!/usr/bin/env bash
# The test suite, multi-process and browser tests included (they are marked slow, not skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the dashboard's browser test drives Debian's headless Chromium through chromedriver
if ! command -v chromedriver >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing Debian's chromium and chromium-driver for the browser tests" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
        echo "the browser tests need Debian's chromium and chromium-driver: apt-get install chromium chromium-driver" >&2
    fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# tests/ray runs too (a real local Ray cluster; setup.sh installs the [ray] extra):
# FEDSWARM_RAY_TESTS=0 leaves it out, for a machine where Ray cannot start
if [ "${FEDSWARM_RAY_TESTS:-1}" = 0 ]; then
    exec .venv/bin/python -m pytest -q --ignore=tests/ray "$@"
fi
# without Ray tests/ray would skip itself: here that is an error
.venv/bin/python -c "import ray" || { echo "tests/ray needs the [ray] extra: bash scripts/setup.sh" >&2; exit 1; }
exec .venv/bin/python -m pytest -q "$@"
