#!/usr/bin/env bash
# Create .venv with the CPU torch wheel and the project with its dev extra. Reruns are quick:
# the install is redone only when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.tandem-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/pip install --quiet --upgrade pip
    # pinned: this is the CPU build; an unpinned torch pulls a multi-GB CUDA build
    .venv/bin/pip install --quiet "torch==2.13.0"
    .venv/bin/pip install --quiet -e ".[dev]"
    echo "$want" > "$stamp"
fi
