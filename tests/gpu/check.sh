#!/usr/bin/env bash
# The GPU check, for a machine with CUDA, torch and Triton but no package registry (README,
# "The GPU check"). It installs only the wheels it carries (.gpu/wheels.tar.xz, made by
# tests/gpu/wheels.py) and runs each step under its own timeout, in about 5 minutes, the
# graphs' timings first:
#   env         the machine, the image's packages (tests/gpu/image.txt), the carried wheels
#               resolved offline against them (pip --dry-run --no-index), then installed
#   triton      the Triton insert kernel, compiled, against the torch one
#   compile     FlashInfer's JIT compile of the engine's kernels, timed
#   flashinfer  its prefill with a causal and a tree mask against the torch backend (SDPA)
#   engine      tiny models in float32 and bfloat16 on cuda and cuda:0, every drafter
#   no-sync     MTP's one-token mode: no device stage of a decode step synchronises
#   server      one request to server.py
#   steps       decode and verify forwards of a SmolLM2-shaped model, bfloat16, batch 1 and 16
#   graphs      CUDA graphs: every drafter's greedy output with graphs equal to eager, with
#               torch's attention and FlashInfer's, MTP's one-token step as one graph
#   graph-times forwards and the whole engine, graphs against eager (SmolLM2-shaped), first
# --dry-run runs on the CPU every step that has a CPU form (tiny models, the Triton kernel
# interpreted, FlashInfer's metadata, the fake device's sync guard, the graphs' static buffers
# run eagerly) and names those it skips. `--only graphs` (after --dry-run, if given) runs the
# environment, the graphs' timings, FlashInfer's compile (24 s on an H200) and the graphs step
# alone, in about 5 minutes (its steps' limits: 690 s). Where $OUT is set, the log and
# image.txt are written there too, each step's lines as it runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1 && shift
ONLY=""
[ "${1:-}" = "--only" ] && ONLY=${2:?--only names a group: graphs}
OUT=${OUT:-}
LOG=${OUT:+$OUT/check.log}
PY=${PYTHON:-python3}
[ $DRY = 1 ] && [ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
failed=()

say() { echo "$@" | tee -a "${LOG:-/dev/null}"; }

step() {  # step NAME SECONDS COMMAND...: run it, timed, logged
    local name=$1 limit=$2 start=$SECONDS rc note=""
    shift 2
    say "== $name (limit ${limit} s): $*"
    local cmd="exec $*"  # a program gets timeout's signal itself
    declare -F "$1" >/dev/null && cmd="$*"
    timeout -k 10 "$limit" bash -c "$cmd" 2>&1 | tee -a "${LOG:-/dev/null}"
    rc=${PIPESTATUS[0]}
    if [ "$rc" = 0 ]; then say "== $name: passed in $((SECONDS - start)) s"; return; fi
    [ "$rc" = 124 ] && note=", timed out"
    say "== $name: FAILED (exit $rc$note) after $((SECONDS - start)) s"
    failed+=("$name")
}

skip() { say "== $1: skipped on the CPU ($2)"; }

PYTEST="$PY -m pytest -q -p no:cacheprovider"

environment() {
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    $PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
    [ $DRY = 1 ] && return 0
    [ -n "$OUT" ] && $PY -m pip list --format=freeze > "$OUT/image.txt"
    local wheels=/tmp/tandem-wheels names resolved=0
    rm -rf "$wheels" /tmp/tandem-site && mkdir -p "$wheels"
    $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
        .gpu/wheels.tar.xz "$wheels" || return 1
    names=$(ls "$wheels" | sed -E 's/-[0-9].*//; s/_/-/g')
    # the proof: the carried set resolves offline against what the image holds
    $PY -m pip install --dry-run --no-index --find-links "$wheels" $names || resolved=1
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/tandem-site \
        "$wheels"/*.whl || return 1
    return $resolved
}

export DRY PY OUT
export -f environment
step env 120 environment
if [ $DRY = 0 ]; then  # FlashInfer builds for this GPU alone, on every core
    export PYTHONPATH=/tmp/tandem-site:$PYTHONPATH MAX_JOBS=${MAX_JOBS:-$(nproc)}
    FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-$($PY -c \
        "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
    export FLASHINFER_CUDA_ARCH_LIST
fi
if [ $DRY = 1 ]; then export TANDEM_CHECK_DEVICE=cpu TRITON_INTERPRET=1; fi
# the graphs' timings first: on a lent GPU's few minutes they are what is asked for first
if [ "$ONLY" = graphs ] && [ $DRY = 1 ]; then
    step graph-times 120 $PY tests/gpu/graph_times.py --device cpu --repeats 2 --tokens 4 \
        --batches 1 2
    skip compile "FlashInfer compiles CUDA kernels"
    step graphs 300 $PYTEST tests/gpu/test_graphs.py
elif [ "$ONLY" = graphs ]; then
    step graph-times 150 $PY tests/gpu/graph_times.py --repeats 20
    step compile 240 $PY tests/gpu/compile_flashinfer.py
    step graphs 180 $PYTEST tests/gpu/test_graphs.py
elif [ $DRY = 1 ]; then
    step graph-times 120 $PY tests/gpu/graph_times.py --device cpu --repeats 2 --tokens 4 \
        --batches 1 2
    step triton 120 $PYTEST tests/test_insert.py -k triton
    skip compile "FlashInfer compiles CUDA kernels"
    step flashinfer 120 $PYTEST tests/test_masks.py tests/test_attention.py \
        tests/test_flashinfer_plan.py
    step no-sync 120 $PYTEST tests/test_no_sync.py
    step engine 300 $PYTEST tests/gpu/test_engine.py
    step server 180 $PYTEST tests/gpu/test_server.py
    skip steps "times CUDA forwards"
    step graphs 300 $PYTEST tests/gpu/test_graphs.py
else
    step graph-times 150 $PY tests/gpu/graph_times.py --repeats 20
    step triton 120 $PYTEST tests/test_insert.py -k triton
    step no-sync 120 $PYTEST tests/gpu/test_no_sync.py
    step compile 240 $PY tests/gpu/compile_flashinfer.py
    step flashinfer 120 $PYTEST tests/gpu/test_flashinfer.py
    step graphs 180 $PYTEST tests/gpu/test_graphs.py
    step engine 240 $PYTEST tests/gpu/test_engine.py
    step server 120 $PYTEST tests/gpu/test_server.py
    step steps 120 $PY tests/gpu/step_times.py --repeats 20
fi
if [ ${#failed[@]} = 0 ]; then say "GPU check passed"; else
    say "GPU check FAILED: ${failed[*]}"
    exit 1
fi
