"""Tensor parallelism: the sharding rule, the step message, and 2 ranks over gloo giving the
output of one process for every drafter, the sampled law, and faults that end the engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from core.params import SamplingParams, SamplingTensors
from core.request import FinishReason
from core.step import Batch, Drafts, StepKind
from engine.builder import DEMO_DIR
from engine.parallel import Workers, decode, decode_step, encode, encode_step, free_port
from models.eagle import save_eagle3_head, save_eagle_head
from models.llama import LlamaConfig
from models.loader import load_model
from models.mtp import save_mtp_head
from models.shard import Shard, fitting_sizes
from stages.pack import FIELDS, make_plan, pack
from tests.engine_util import (
    make_config,
    running,
    running_parallel,
    sequence,
    staggered,
    token_ids,
    wait_healthy,
)
from tests.stats import PARAMS, PROMPT, N, assert_law, exact_joint, law_config
from tests.tiny import (
    random_eagle3_head,
    random_eagle_head,
    random_mtp_head,
    write_model,
    write_tokenizer,
)

# processes and process groups: the full tier
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(40, 75)), [7] * 12, [901, 17, 5, 3]]
DEMO_HEADS = {"draft": "draft", "eagle": "eagle", "mtp": "mtp"}


# ---- the rule, without processes ----


def smollm2_shapes() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
    )


def test_sizes_the_heads_do_not_divide_are_refused_with_the_rule():
    cfg = smollm2_shapes()
    assert fitting_sizes(cfg) == [1, 3]
    Shard(0, 3).check(cfg)
    with pytest.raises(ValueError, match="9 attention heads must divide by 2.*fit: 1, 3"):
        Shard(0, 2).check(cfg)


def test_a_rank_takes_its_heads_and_replicates_a_kv_head_it_shares():
    cfg = LlamaConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=6,
        num_layers=1,
        num_heads=4,
        num_kv_heads=1,
        head_dim=2,
    )
    rows = torch.arange(8)[:, None].expand(8, 8)  # row i holds i
    shard = Shard(1, 2)
    assert shard.take("layers.0.self_attn.q_proj.weight", rows, cfg, True)[:, 0].tolist() == [
        4, 5, 6, 7,
    ]  # fmt: skip
    kv = torch.arange(2)[:, None].expand(2, 8)  # one kv head of head_dim 2
    assert shard.take("layers.0.self_attn.k_proj.weight", kv, cfg, True)[:, 0].tolist() == [0, 1]
    embed = torch.arange(10)[:, None].expand(10, 8).float()
    last = shard.take("embed_tokens.weight", embed, cfg, True)  # rows 5..9
    assert last[:, 0].tolist() == [5, 6, 7, 8, 9]
    assert Shard(0, 3).take("lm_head.weight", embed, cfg, True).shape[0] == 4
    padded = Shard(2, 3).take("lm_head.weight", embed, cfg, True)  # rows 8, 9, two zero rows
    assert padded[:, 0].tolist() == [8, 9, 0, 0]
    assert shard.take("norm.weight", torch.ones(8), cfg, True).shape == (8,)


def test_encoded_tensors_come_back_whole():
    tensors = [
        torch.tensor([3, -(2**40), 7]),  # int64 at an odd word
        None,
        torch.randn(2, 3),
        torch.tensor([True, False]),
        torch.zeros(0, 4),
    ]
    body = torch.cat([torch.tensor([9], dtype=torch.int32), encode(tensors)])
    back, end = decode(body, 1, len(tensors))
    assert end == body.numel()
    for a, b in zip(tensors, back, strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_a_step_message_gives_the_follower_the_leaders_plan():
    seqs = [sequence(0, 5, [3, 4, 5]), sequence(1, 9, [9, 1, 2, 6], temperature=0.7, seed=3)]
    params = [s.request.params for s in seqs]
    sampling = SamplingTensors.build(params, [11, 2**62], "cpu")
    assert sampling.coupled is not None  # a seeded sampled row: every tensor travels
    plan = make_plan(Batch(StepKind.DECODE, seqs, [0, 0]), 7, 3, 4, sampling)
    assert tuple(plan.fields) == FIELDS
    flat, layout = pack(plan.fields)
    buffer = torch.tensor(flat, dtype=torch.int32)
    drafts = Drafts(torch.tensor([[4, 5, 6], [7, 8, 9]]), torch.rand(2, 3, 12))
    got = decode_step(encode_step(plan, buffer, layout, drafts), FIELDS)
    p = got.plan
    assert (p.step, p.kind, p.k, p.page_size, p.batch_size) == (7, StepKind.DECODE, 3, 4, 2)
    assert p.fields == plan.fields and (p.max_q, p.max_kv) == (plan.max_q, plan.max_kv)
    assert (p.num_drafts, p.base, p.emits, p.unknown) == (
        plan.num_drafts, plan.base, plan.emits, plan.unknown,
    )  # fmt: skip
    assert torch.equal(got.buffer, buffer) and got.layout == layout
    for f in dataclasses.fields(SamplingTensors):
        a, b = getattr(sampling, f.name), getattr(p.sampling, f.name)
        assert (a is None and b is None) or (
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        ), f.name
    assert got.drafts is not None and torch.equal(got.drafts.tokens, drafts.tokens)
    assert torch.equal(got.drafts.probs, drafts.probs) and got.drafts.parents is None
    assert decode_step(encode_step(plan, buffer, layout, None), FIELDS).drafts is None


# ---- two ranks ----


def demo_config(method: str, **spec_kw):
    head = DEMO_HEADS.get(method)
    draft = DEMO_DIR / head if head else None
    k = 1 if spec_kw.pop("one_token", False) else 3
    return make_config(DEMO_DIR / "target", method, draft, k=k, pages=64, spec_kw=spec_kw)


async def greedy_both(config, prompts=PROMPTS, kept=True):
    """Greedy output of one process and of 2 ranks; `kept`: some drafts are accepted."""
    async with running(config) as engine:
        one = await staggered(engine, prompts, GREEDY)
    parallel = dataclasses.replace(config, tensor_parallel_size=2)
    async with running_parallel(parallel) as (engine, _):
        two = await staggered(engine, prompts, GREEDY)
        metrics = engine.metrics.render()
    assert "tandem_tensor_parallel_size 2" in metrics
    if kept and config.spec.method != "none":
        accepted = re.search(r"^tandem_spec_decode_num_accepted_tokens_total (\S+)$", metrics, re.M)
        assert accepted and float(accepted.group(1)) > 0
    return one, two


@pytest.mark.timeout(240)
# Each path under two ranks once, between this table and the GQA one below: here plain
# decoding, the leader's draft model (its drafts broadcast with the plan), a dynamic tree
# (the verify's tree mask and the accepted path's KV move) and MTP's one-token mode (steps
# planned before the host knows the last one's tokens); there n-gram, the sharded head drafter
# (EAGLE-1, EAGLE-3's target layers, MTP) and the fixed tree over a replicated KV head.
@pytest.mark.parametrize(
    "method, spec_kw",
    [("none", {}), ("draft", {}), ("eagle", {"tree": "dynamic"}), ("mtp", {"one_token": True})],
    ids=["none", "draft", "eagle-dynamic", "mtp-1"],
)
async def test_two_ranks_give_one_process_greedy_output(method, spec_kw):
    one, two = await greedy_both(demo_config(method, **spec_kw))
    assert all(len(t) == GREEDY.max_tokens for t in one)
    assert two == one


@pytest.fixture(scope="module")
def hf_gqa_llama(tmp_path_factory):
    """A transformers-written Llama with 4 query heads over 1 KV head (so 2 ranks replicate
    it), tied embeddings, and weights scaled for wide top-2 gaps."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("hf_gqa")
    vocab = write_tokenizer(directory, 331)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def gqa_drafters(hf_gqa_llama, tmp_path_factory):
    """Heads for the GQA Llama: random EAGLE-1 and EAGLE-3 heads (the latter reads the stream
    entering layer 1 and the output) and a random MTP head, whose drafts the target rejects:
    with them the test checks that the sharded heads run and leave the target's output
    alone."""
    root = tmp_path_factory.mktemp("gqa_heads")
    target = load_model(hf_gqa_llama)
    save_eagle_head(random_eagle_head(target, norms=True), root / "eagle")
    save_eagle3_head(random_eagle3_head(target, (1, 2), draft_vocab=200), root / "eagle3")
    save_mtp_head(random_mtp_head(target, seed=7), root / "mtp")
    return {kind: root / kind for kind in ("eagle", "eagle3", "mtp")}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "method, head, k, spec_kw",
    [
        ("ngram", None, 3, {}),
        ("eagle", "eagle", 3, {}),
        ("eagle", "eagle", 3, {"tree": "fixed"}),
        ("eagle", "eagle3", 3, {}),
        ("mtp", "mtp", 3, {}),
    ],
    ids=["ngram", "eagle-chain", "eagle-fixed", "eagle3-chain", "mtp-k"],
)  # fmt: skip
async def test_two_ranks_on_a_transformers_llama_with_gqa(
    hf_gqa_llama, gqa_drafters, method, head, k, spec_kw
):
    draft = gqa_drafters[head] if head else None
    config = make_config(hf_gqa_llama, method, draft, k=k, pages=64, spec_kw=spec_kw)
    prompts = [[p % 300 for p in prompt] for prompt in PROMPTS]
    one, two = await greedy_both(config, prompts, kept=method == "ngram")
    assert all(len(t) == GREEDY.max_tokens for t in one)
    assert two == one


@pytest.mark.timeout(300)
async def test_two_ranks_sample_the_targets_law(tmp_path):
    """The chi-square law test (tests/stats.py) with the draft model on the leader and the
    target over 2 ranks: every rank samples the same verdict from the same keyed draws."""
    target = write_model(tmp_path / "t", layers=1, hidden=16, seed=3, scale=1.5, model_vocab=6)
    draft = write_model(tmp_path / "d", layers=1, hidden=16, seed=4, scale=1.5, model_vocab=6)
    config = law_config(target, "draft", draft, tensor_parallel_size=2)
    async with running_parallel(config) as (engine, _):
        outs = await asyncio.gather(
            *(engine.generate(PROMPT, SamplingParams(**PARAMS)) for _ in range(N))
        )
    observed: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(token_ids(out))
        observed[key] = observed.get(key, 0) + 1
    assert_law(observed, exact_joint(target), N)


@pytest.mark.timeout(120)
async def test_a_worker_killed_mid_stream_ends_every_stream_and_the_engine():
    config = dataclasses.replace(demo_config("none"), tensor_parallel_size=2)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    async with running_parallel(config) as (engine, workers):
        streams = [engine.submit(p, long) for p in PROMPTS[:3]]
        assert (await anext(streams[0])).token_ids  # streaming
        workers.processes[0].kill()
        ends = await asyncio.wait_for(asyncio.gather(*(last(s) for s in streams)), 10)
        assert all(end.finish_reason == FinishReason.ERROR for end in ends)
        await asyncio.wait_for(engine.failed.wait(), 5)  # the server exits on it
        assert "rank 1 exited (killed by SIGKILL)" in (engine.failure or "")


async def last(stream):
    deltas = [delta async for delta in stream]
    return deltas[-1]


def _fails_to_start(rank, size, address, reports, message):
    reports.put((rank, f"ValueError: {message}"))
    raise SystemExit(1)


def test_a_rank_that_fails_to_start_is_named_with_its_cause():
    workers = Workers(2, _fails_to_start, "no such checkpoint")
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: no such checkpoint"):
            workers.join_as_leader(2)
    finally:
        workers.stop()


# ---- server.py ----

ROOT = Path(__file__).resolve().parent.parent


def children(pid: int) -> list[int]:
    """The spawned rank processes of `pid` (not multiprocessing's resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
            if int(fields[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(stat.parent.name))
    return found


@pytest.mark.timeout(120)
def test_the_server_exits_naming_a_killed_rank(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "server.py",
            "--model",
            "demo",
            "--port",
            str(port),
            "--tensor-parallel-size",
            "2",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(port, 60)
        [worker] = children(server.pid)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        assert server.wait(timeout=10) == 1
        assert time.monotonic() - killed < 5
        _, err = server.communicate()
        assert "rank 1 exited (killed by SIGKILL)" in err
        assert children(server.pid) == []
    finally:
        server.kill()


def test_the_server_refuses_a_size_the_heads_do_not_divide(tmp_path):
    target = write_model(tmp_path / "t", hidden=48)  # 3 heads, 1 KV head
    done = subprocess.run(
        [
            sys.executable,
            "server.py",
            "--model",
            str(target),
            "--tensor-parallel-size",
            "2",
            "--speculative",
            "none",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "its 3 attention heads must divide by 2" in done.stderr


def rank_processes(pid: int) -> dict[int, int]:
    """{rank: pid} of the processes torchrun's agent `pid` started."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
            rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
            found[rank] = int(stat.parent.name)
    return found


@pytest.mark.timeout(180)
async def test_torchrun_ranks_serve_one_process_output_and_end_on_a_killed_rank():
    """Every rank started by torchrun runs server.py; rank 0 serves. Its greedy completion
    equals one process's; a killed rank ends all of them (torchrun's agent watches its
    ranks), non-zero, naming the rank."""
    prompt = [5, 6, 7, 8, 9]
    async with running(demo_config("none")) as engine:
        deltas = await engine.generate(prompt, GREEDY)
    expected = "".join(delta.text for delta in deltas)
    port = free_port()
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "server.py",
            "--model",
            "demo",
            "--port",
            str(port),
            "--tensor-parallel-size",
            "2",
            "--speculative",
            "draft",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(port, 90)
        body = {"prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        post = urllib.request.Request(
            f"{base}/v1/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(post, timeout=30) as response:
            answer = json.load(response)
        assert answer["choices"][0]["text"] == expected
        assert answer["usage"]["speculative"]["accepted_tokens"] > 0
        ranks = rank_processes(agent.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        assert agent.wait(timeout=15) != 0
        assert time.monotonic() - killed < 10
        _, err = agent.communicate()
        assert re.search(r"rank\s*: 1 .*\n.*exitcode\s*: -9", err)
        assert not Path(f"/proc/{ranks[0]}").exists()  # rank 0 ended with it, no orphan
    finally:
        agent.kill()
