#!/usr/bin/env bash
# The test command: set up .venv, then lint, type-check and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy core engine stages kv models server.py client.py api.py page.py infill.py structured.py
# two workers of one torch thread each: the 2-core machines' tests take 60% of one process's time
.venv/bin/python -m pytest -q -n 2 "$@"
