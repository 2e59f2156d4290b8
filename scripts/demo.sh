#!/usr/bin/env bash
# The demo: a real 3-peer swarm on 127.0.0.1 doing real work.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
