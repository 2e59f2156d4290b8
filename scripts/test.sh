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
# tests/ray (a real local Ray cluster) is not yet reliable or fast enough for CI on 2 cores:
# FEDSWARM_RAY_TESTS=1 installs the [ray] extra and runs it too
if [ "${FEDSWARM_RAY_TESTS:-0}" = 1 ]; then
    .venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev,ray]'
    exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q --ignore=tests/ray "$@"
