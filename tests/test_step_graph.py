"""MTP's one-token step as one graph (engine/step_graph.py): the whole step over a key's
static plan, eager on the CPU, against plain decoding and the stages run one by one; what a
graph cannot hold refused while it runs (CaptureGuard); the steps that run eagerly."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from core.params import Grammar, SamplingParams
from engine.config import EngineConfig, SpecConfig
from engine.step_graph import StepGraph
from models.graphs import GraphedForward
from models.loader import load_model
from models.mtp import save_mtp_head
from tests.conftest import CaptureGuard
from tests.engine_util import (
    ROUNDING,
    assert_departs_only_at_near_ties,
    heldout,
    make_config,
    ragged_prompts,
    running,
    staggered,
    token_ids,
)
from tests.tiny import random_mtp_head

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# sampled, seeded, with every sampling feature a graph holds
SAMPLED = SamplingParams(
    max_tokens=16,
    temperature=0.9,
    top_p=0.9,
    top_k=40,
    min_p=0.02,
    presence_penalty=0.4,
    repetition_penalty=1.1,
    logit_bias=((5, 3.0), (7, -2.0)),
    ignore_eos=True,
)


@pytest.fixture(scope="module")
def mtp_head(tiny_target, tmp_path_factory):
    head = tmp_path_factory.mktemp("mtp_step_graph")
    save_mtp_head(random_mtp_head(load_model(tiny_target), seed=7), head)
    return head


def one_token(tiny_target, mtp_head, graphs: str, **kw):
    return make_config(
        tiny_target, "mtp", mtp_head, k=1, max_batch_tokens=64, cuda_graphs=graphs, **kw
    )


def test_the_guard_refuses_what_a_graph_cannot_hold():
    x = torch.arange(6.0)
    with CaptureGuard():
        torch.where(x > 2, x, 0.0).sum()  # fixed shapes pass
        with pytest.raises(RuntimeError, match="not capturable"):
            x[x > 2]
        with pytest.raises(RuntimeError, match="not capturable"):
            x.max().item()
        with pytest.raises(RuntimeError, match="not capturable"):
            x.nonzero()


async def test_one_token_steps_run_whole_and_equal_plain(
    tiny_target, mtp_head, ragged16, plain16, forbid_capture_breaks, forbid_host_sync
):
    """16 ragged requests coming and going (padded buckets of 1 to 16 sequences): every decode
    step runs as one graph, nothing in it reads the device from the host or takes a shape
    from a value, and the output is plain decoding's."""
    async with running(one_token(tiny_target, mtp_head, "on")) as engine:
        assert await staggered(engine, ragged16, GREEDY, seed=5) == plain16
        graph = engine.stages.graph
        assert isinstance(graph, StepGraph) and graph.eager == 0
        buckets = sorted({key.seqs for key in graph.steps})
        assert len(buckets) >= 3 and buckets[-1] >= 8, buckets  # batches grew and shrank
        assert sum(graph.runs.values()) > 24
        # the forwards inside ran as they are, not over buffers of their own
        assert isinstance(engine.stages.verifier.run, GraphedForward)
        assert not engine.stages.verifier.run.inputs
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_half_precision_steps_in_one_graph_equal_the_stages_one_by_one(
    tiny_target, mtp_head, ragged16, dtype, forbid_capture_breaks
):
    """In float16 and bfloat16, every step whole: the stages' greedy tokens one by one but at
    a near-tie of their top two logits (a padded batch may round apart)."""
    logprobs = dataclasses.replace(GREEDY, logprobs=2)
    async with running(one_token(tiny_target, mtp_head, "off", dtype=dtype)) as engine:
        eager = [await engine.generate(p, logprobs) for p in ragged16]
    async with running(one_token(tiny_target, mtp_head, "on", dtype=dtype)) as engine:
        whole = await staggered(engine, ragged16, GREEDY, seed=5)
        assert engine.stages.graph is not None and not engine.stages.graph.eager
    assert_departs_only_at_near_ties(eager, whole, ROUNDING[dtype], dtype)


async def test_sampled_seeded_steps_in_one_graph_equal_the_stages_one_by_one(
    tiny_target, mtp_head, forbid_capture_breaks
):
    """Seeded requests with penalties, a logit bias, top-k, top-p and min-p, greedy ones
    beside them: the same tokens whether each step runs as one graph or stage by stage."""
    prompts = ragged_prompts(10, 300, seed=3)
    params = [
        dataclasses.replace(SAMPLED, seed=i) if i % 3 else GREEDY for i in range(len(prompts))
    ]

    async def outputs(graphs: str):
        async with running(one_token(tiny_target, mtp_head, graphs)) as engine:
            outs = await asyncio.gather(
                *(engine.generate(p, q) for p, q in zip(prompts, params, strict=True))
            )
            return [token_ids(out) for out in outs], engine.stages.graph

    whole, graph = await outputs("on")
    assert graph is not None and graph.eager == 0 and len(graph.steps) > 1
    assert whole == (await outputs("off"))[0]


async def test_logprobs_run_stage_by_stage(tiny_target, mtp_head):
    """A batch with a request asking for logprobs runs its steps eagerly (the stages one by
    one); the others' steps stay whole; the output is plain decoding's either way."""
    prompts = ragged_prompts(4, 300, seed=8)
    logprobs = dataclasses.replace(GREEDY, max_tokens=8, logprobs=2)
    async with running(make_config(tiny_target, k=1)) as engine:
        plain = [token_ids(await engine.generate(p, GREEDY)) for p in prompts]
    async with running(one_token(tiny_target, mtp_head, "on")) as engine:
        alone = [token_ids(await engine.generate(p, GREEDY)) for p in prompts]
        graph = engine.stages.graph
        assert graph.eager == 0
        with_logprobs = await engine.generate(prompts[0], logprobs)
        assert graph.eager >= 7 and all(d.logprobs for d in with_logprobs if d.token_ids)
    assert alone == plain and token_ids(with_logprobs) == plain[0][:8]


def test_a_step_graph_is_made_for_one_token_mtp_alone(tiny_target, mtp_head):
    """Which engines make one: --cuda-graphs with MTP at k = 1; not at k = 2, not without
    graphs."""
    from engine.builder import Builder

    def graph_of(config):
        return Builder(config).build().stages.graph

    assert graph_of(one_token(tiny_target, mtp_head, "on")) is not None
    assert graph_of(one_token(tiny_target, mtp_head, "off")) is None
    k2 = make_config(tiny_target, "mtp", mtp_head, k=2, cuda_graphs="on")
    assert graph_of(k2) is None


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
JSON = SamplingParams(
    max_tokens=24, temperature=0, grammar=Grammar("json_schema", json.dumps(SCHEMA))
)


async def test_a_grammar_runs_stage_by_stage():
    """The demo target with its MTP head at k = 1: a request with a JSON schema (its masks
    are walked on the host) runs its steps eagerly, and answers as without graphs."""
    prompt = heldout(1)[0]
    spec = SpecConfig("mtp", num_speculative_tokens=1, adaptive_k=False)

    async def answer(graphs: str):
        async with running(EngineConfig("demo", spec, cuda_graphs=graphs)) as engine:
            plain = token_ids(await engine.generate(prompt, GREEDY))
            eager = engine.stages.graph.eager if engine.stages.graph else None
            out = await engine.generate(prompt, JSON)
            graph = engine.stages.graph
            return plain, eager, out, graph.eager if graph else None

    plain, before, out, after = await answer("on")
    assert before == 0 and after > 0  # whole steps, then the grammar's eager ones
    json.loads("".join(d.text for d in out))
    eager_plain, _, eager_out, _ = await answer("off")
    assert plain == eager_plain and token_ids(out) == token_ids(eager_out)
