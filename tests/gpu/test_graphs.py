"""CUDA graphs through the engine: for every drafter, greedy output with the decode forwards
captured and replayed equals eager decoding on the same device, in float32 and bfloat16, but
at the dtype's near-ties (a bucket pads the batch, and a padded product may round apart);
MTP's one-token step (mtp-1) captured whole, as one graph a bucket; with torch's attention
and FlashInfer's (planned once a bucket, over its CUDA-graph buffers).

Run on an accelerator with tests/gpu/check.sh (its graphs step); its --dry-run runs the same
cases on the CPU, where the static buffers run eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest

from core.params import SamplingParams
from models.graphs import GraphedForward
from tests.engine_util import (
    DRAFTERS,
    ROUNDING,
    assert_departs_only_at_near_ties,
    make_config,
    running,
    staggered,
)

pytestmark = pytest.mark.gpu

DEVICE = "cpu" if os.environ.get("TANDEM_CHECK_DEVICE") == "cpu" else "cuda"
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    "dtype, attention",
    [("float32", "torch"), ("bfloat16", "torch"), ("bfloat16", "flashinfer")],
)
async def test_every_drafter_with_graphs_equals_eager(models, prompts, dtype, attention):
    if attention == "flashinfer" and DEVICE != "cuda":
        pytest.skip("FlashInfer runs on CUDA (its static plans: tests/test_flashinfer_plan.py)")
    cases = {"none": ("none", None, 3, {}), **DRAFTERS}
    logprobs = dataclasses.replace(GREEDY, logprobs=2)
    for name, (method, draft, k, spec) in cases.items():
        config = functools.partial(
            make_config,
            models["target"],
            method,
            models[draft] if draft else None,
            k=k,
            spec_kw=spec or None,
            device=DEVICE,
            dtype=dtype,
            attention=attention,
        )
        async with running(config(cuda_graphs="off")) as engine:  # the reference, logprobs too
            eager = [await engine.generate(p, logprobs) for p in prompts]
        async with running(config(cuda_graphs="on")) as engine:
            graphed = await staggered(engine, prompts, GREEDY, seed=5)
            run, whole = engine.stages.verifier.run, engine.stages.graph
            assert isinstance(run, GraphedForward), name
            if whole is not None:  # MTP's one-token step, one graph (engine/step_graph.py)
                assert name == "mtp-1" and whole.steps and not whole.eager
                assert DEVICE != "cuda" or len(whole.captures) == len(whole.graphs) > 0
            else:
                assert run.inputs and (DEVICE != "cuda" or run.graphs), name  # replayed
        assert_departs_only_at_near_ties(eager, graphed, ROUNDING[dtype], name)
