#!/usr/bin/env bash
# Type-check src/fedswarm with mypy: strict on the sans-IO core (fedswarm.core),
# mypy's normal mode on the rest. The configuration is [tool.mypy] in
# pyproject.toml; extra arguments go to mypy (e.g. a file to check alone).
#
# py-libp2p depends on trio-typing, whose trio-stubs (for an old trio) would
# win over trio's own inline types; a directory holding only a link to the
# installed trio package, put on MYPYPATH, makes mypy read the real ones.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
shadow=$(mktemp -d)
trap 'rm -rf "$shadow"' EXIT
ln -s "$("$PY" -c 'import os, trio; print(os.path.dirname(trio.__file__))')" "$shadow/trio"
MYPYPATH="$shadow" exec "$PY" -m mypy "$@"
