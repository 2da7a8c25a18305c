#!/usr/bin/env bash
# Set up a virtual environment (once) and run the linters and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/ruff check llmgw projections cli tests benchmarks
.venv/bin/mypy llmgw projections cli
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
