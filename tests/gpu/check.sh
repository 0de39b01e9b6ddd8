#!/usr/bin/env bash
# On an accelerator machine: install the CUDA extra and run every gpu-marked test (< 6 min).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install --quiet torch -e ".[dev,cuda]"
timeout 360 .venv-gpu/bin/python -m pytest -q -m gpu tests
