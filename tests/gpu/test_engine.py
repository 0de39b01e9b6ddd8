"""The whole engine on CUDA, named "cuda" and "cuda:0", in float32 and bfloat16, with torch's
attention and (bfloat16) FlashInfer's: for every drafter, speculation equals plain decoding
on that device but at its near-ties (a verify's rows round apart from a decode's), and plain
decoding departs from the CPU's float32 only where float32's top two logits are within the
dtype's rounding. The tiny target has FlashInfer's head size, 64.

Run on an accelerator with tests/gpu/check.sh; its --dry-run runs the same cases on the CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os

import pytest

from core.params import SamplingParams
from tests.engine_util import (
    DRAFTERS,
    ROUNDING,
    assert_departs_only_at_near_ties,
    make_config,
    running,
    staggered,
    token_ids,
)

pytestmark = pytest.mark.gpu

DEVICES = ["cpu"] if os.environ.get("TANDEM_CHECK_DEVICE") == "cpu" else ["cuda", "cuda:0"]
FLASHINFER = importlib.util.find_spec("flashinfer") is not None
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def cases() -> list[tuple[str, str, str]]:
    out = [(d, dtype, "torch") for d in DEVICES for dtype in ("float32", "bfloat16")]
    if FLASHINFER and DEVICES[0] != "cpu":
        out += [(d, "bfloat16", "flashinfer") for d in DEVICES]
    return out


@pytest.fixture(scope="module")
def exact(models, prompts):
    """The CPU's float32 outputs, with each step's top two logprobs."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)

    async def generate():
        async with running(make_config(models["target"])) as engine:
            return [await engine.generate(p, params) for p in prompts]

    return asyncio.run(generate())


@pytest.mark.parametrize("device, dtype, attention", cases())
async def test_every_drafter_equals_plain_decoding_and_the_cpu(
    models, prompts, exact, device, dtype, attention
):
    def config(method="none", draft=None, k=3, **spec):
        return make_config(
            models["target"],
            method,
            draft,
            k=k,
            spec_kw=spec or None,
            device=device,
            dtype=dtype,
            attention=attention,
        )

    logprobs = dataclasses.replace(GREEDY, logprobs=2)
    async with running(config()) as engine:
        plain = [await engine.generate(p, logprobs) for p in prompts]
    assert_departs_only_at_near_ties(exact, [token_ids(d) for d in plain], ROUNDING[dtype])
    for name, (method, draft, k, spec) in DRAFTERS.items():
        async with running(config(method, models[draft] if draft else None, k, **spec)) as e:
            out = await staggered(e, prompts, GREEDY)
        # a verify's rows round apart from a decode's: equal but at the dtype's near-ties
        assert_departs_only_at_near_ties(plain, out, ROUNDING[dtype], name)
