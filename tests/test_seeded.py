"""Seeded sampling that speculation cannot change: a seeded request at temperature 1 (top-p)
gets the same tokens alone, inside a batch of 16 other requests (seeded and not) with
preemption, with every drafter, at other draft lengths, and without speculation; and the
coupling's parts follow their laws.

The demo models: their top-two gaps are wide enough that a near-tie flip between the verify
and decode paths is rare, so a divergence here is a bug until shown otherwise.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from core.params import SamplingParams, SamplingTensors
from engine.config import EngineConfig, KVConfig, SpecConfig
from stages import rng
from stages.rng import couple, coupling_noise, perturbed_argmax
from stages.sampling import chain_verify
from tests.engine_util import heldout, running, token_ids
from tests.stats import chi_square_pvalue

NEW_TOKENS = 16
WATCHED = 7  # the seed of the request watched alone and in the batch


def params(seed: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, ignore_eos=True, seed=seed
    )


# the drafters, each at two draft lengths (alone, in the batch) where it has one
DRAFTERS = {
    "draft": [dict(method="draft", num_speculative_tokens=k) for k in (2, 4)],
    # in the batch the cost model picks each step's k in 0..4, as a default server does
    "draft-cost-model": [
        dict(method="draft", num_speculative_tokens=2),
        dict(method="draft", num_speculative_tokens=4, adaptive_k=True),
    ],
    "ngram": [dict(method="ngram", num_speculative_tokens=k) for k in (3, 5)],
    "suffix": [dict(method="suffix", num_speculative_tokens=k) for k in (3, 5)],
    "eagle-chain": [dict(method="eagle", num_speculative_tokens=k) for k in (2, 4)],
    "eagle-fixed": [dict(method="eagle", tree="fixed")] * 2,
    "eagle-dynamic": [dict(method="eagle", tree="dynamic", tree_nodes=n) for n in (6, 10)],
    "mtp-1": [dict(method="mtp", num_speculative_tokens=1)] * 2,
    "mtp-k": [dict(method="mtp", num_speculative_tokens=k) for k in (2, 3)],
    "hybrid": [
        dict(method="hybrid", num_speculative_tokens=k, hybrid_min_score=0.5) for k in (2, 4)
    ],  # fmt: skip
}


def config(spec: dict, pages: int = 512) -> EngineConfig:
    spec = {"adaptive_k": False} | spec  # k as given, unless the case asks for the cost model
    return EngineConfig("demo", SpecConfig(**spec), kv=KVConfig(page_size=4, num_pages=pages))


def batch_prompts() -> list[list[int]]:
    prompts = heldout(17)
    return [p + p[:8] for p in prompts]  # repeats give the n-gram drafter matches


def batch_params() -> list[SamplingParams]:
    """The watched request first, then 8 other seeded and 8 unseeded ones."""
    return [params(WATCHED)] + [params(100 + i if i % 2 else None) for i in range(16)]


async def outputs(engine, prompts, all_params) -> list[list[int]]:
    runs = [engine.generate(p, q) for p, q in zip(prompts, all_params, strict=True)]
    return [token_ids(out) for out in await asyncio.gather(*runs)]


@pytest.fixture(scope="module")
def plain():
    """Each seeded request's tokens from plain decoding, each request alone."""

    async def run():
        async with running(config({"method": "none"})) as engine:
            seeded = [
                (p, q) for p, q in zip(batch_prompts(), batch_params(), strict=True) if q.seed
            ]
            return [token_ids(await engine.generate(p, q)) for p, q in seeded]

    return asyncio.run(run())


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
async def test_a_seeded_request_gets_plain_decodings_tokens_alone_and_in_any_batch(drafter, plain):
    alone_spec, batch_spec = DRAFTERS[drafter]
    prompts, all_params = batch_prompts(), batch_params()
    async with running(config(alone_spec)) as engine:
        alone = token_ids(await engine.generate(prompts[0], all_params[0]))
    assert alone == plain[0]
    # 17 requests in 64 pages of 4 tokens: the youngest are preempted and recomputed
    async with running(config(batch_spec, pages=64)) as engine:
        together = await outputs(engine, prompts, all_params)
        assert engine.scheduler.num_preemptions > 0
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
    seeded = [out for out, q in zip(together, all_params, strict=True) if q.seed]
    assert seeded == plain


async def test_the_engine_seeds_requests_without_one_stably():
    """Without a seed a request gets one derived from the engine's seed and its id, the same
    in every process (so its run can be repeated), and such requests keep the rejection rule."""
    async with running(config({"method": "none"})) as engine:
        assert engine._derived_seed("req-1") == engine._derived_seed("req-1")
        assert engine._derived_seed("req-1") != engine._derived_seed("req-2")
        first = await outputs(engine, batch_prompts()[:2], [params(None)] * 2)
    async with running(config({"method": "none"})) as engine:
        assert await outputs(engine, batch_prompts()[:2], [params(None)] * 2) == first


# ---------------------------------------------------------------- the coupling's parts


def test_the_noise_is_a_function_of_seed_position_and_token_alone():
    seeds, positions = torch.tensor([5, 9, 5]), torch.tensor([[3, 4], [3, 4], [3, 4]])
    noise = coupling_noise(seeds, positions, 40)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    wider = coupling_noise(seeds[:1], positions[:1], 100)
    assert torch.equal(wider[0, :, :40], noise[0])  # a wider vocabulary extends it
    masked = coupling_noise(seeds, positions, 40, torch.tensor([False, True, False]))
    assert torch.equal(masked[1], noise[1]) and not masked[0].any()


def test_the_host_draws_the_devices_noise(monkeypatch):
    """The native kernel's uniforms are the murmur3 path's bits (what an accelerator runs)."""
    seeds, positions = torch.tensor([5, -9, 2**62]), torch.tensor([[3, 4], [0, 7], [2**40, 1]])
    host = rng.coupling_uniforms(seeds, positions, 300)
    monkeypatch.setattr(rng, "HOST_HASH_DEVICES", frozenset())
    assert torch.equal(host, rng.coupling_uniforms(seeds, positions, 300))


@pytest.mark.parametrize("shape", ["peaked", "flat", "sparse"])
def test_the_coupled_token_is_the_gumbel_max_of_p(shape, monkeypatch):
    """A coupled row's token found by the native pass (the logarithm of a few tokens only) is
    the Gumbel-max token of p under coupling_noise, and the device path's (its noise whole)."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 300, 5000
    logits = (
        torch.randn(n, 1, vocab, generator=gen) * {"peaked": 8, "flat": 0.1, "sparse": 3}[shape]
    )
    if shape == "sparse":  # a top-k's zeros
        logits[..., 40:] = float("-inf")
    probs = logits.softmax(-1)
    seeds, positions = torch.arange(n) * 7919, torch.arange(n)[:, None] + 11
    tokens = rng.coupled_tokens(probs, seeds, positions)
    gumbel_max = perturbed_argmax(probs, coupling_noise(seeds, positions, vocab))
    assert torch.equal(tokens, gumbel_max)
    monkeypatch.setattr(rng, "HOST_HASH_DEVICES", frozenset())
    assert torch.equal(rng.coupled_tokens(probs, seeds, positions), tokens)


@pytest.mark.parametrize("where", ["host", "device"])
def test_the_noise_is_standard_gumbel(where, monkeypatch):
    if where == "device":  # the murmur3 path that accelerators run, here on the CPU
        monkeypatch.setattr(rng, "HOST_HASH_DEVICES", frozenset())
    g = coupling_noise(torch.arange(200), torch.arange(200)[:, None], 1000).double()
    assert abs(g.mean() - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(g.var() - torch.pi**2 / 6) < 0.03
    # P(G <= 0) = exp(-1)
    assert abs((g <= 0).double().mean() - 0.3679) < 0.005


P = torch.tensor([0.3, 0.25, 0.0, 0.2, 0.15, 0.1], dtype=torch.float64)


def coupled_draws(probs: torch.Tensor, n: int) -> torch.Tensor:
    st = SamplingTensors.build([params(1)] * n, list(range(n)), "cpu")
    rows = probs.expand(n, 1, -1).clone()
    coupled = couple(rows, st, torch.full((n,), 11), None, 0)
    assert torch.all(coupled.sum(-1) == 1) and torch.all(coupled.max(-1).values == 1)
    return coupled[:, 0].argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the native pass; torch's
def test_the_coupled_sampler_follows_p(dtype):
    draws = coupled_draws(P.to(dtype), 20000)
    assert chi_square_pvalue(draws, P) > 1e-3
    # power: the same draws against p with 3% of the first token's mass moved to the second
    shifted = P.clone()
    shifted[0] -= 0.03
    shifted[1] += 0.03
    assert chi_square_pvalue(draws, shifted) < 1e-3


def test_a_chain_accepts_exactly_the_drafts_equal_to_the_coupled_token():
    """With coupled rows as point masses, the rejection rule (sampled drafts) accepts a draft
    iff it is the coupling's token, and emits that token at the first mismatch; drafts from
    q's Gumbel-max under the same noise are accepted at least (1 - TV) / (1 + TV) of the time."""
    n, vocab = 4000, 6
    q = torch.tensor([0.1, 0.4, 0.05, 0.25, 0.1, 0.1], dtype=torch.float64)
    st = SamplingTensors.build([params(1)] * n, list(range(n)), "cpu")
    first = torch.full((n,), 11)
    noise = coupling_noise(st.seeds, first[:, None] + torch.arange(2), vocab)
    draft = perturbed_argmax(q.expand(n, -1), noise[:, 0])  # [n]
    target = couple(P.expand(n, 2, -1).clone(), st, first, None, 1)
    tokens, accepted = chain_verify(
        target,
        draft[:, None],
        q.expand(n, 1, -1).clone(),
        torch.ones(n, dtype=torch.long),
        st.seeds,
        first,
    )
    coupled_token = target[:, 0].argmax(-1)
    assert torch.equal(accepted.bool(), draft == coupled_token)
    assert torch.equal(tokens[:, 0], coupled_token)  # accepted, or emitted at the mismatch
    tv = 0.5 * (P - q).abs().sum()
    rate = accepted.double().mean()
    assert rate > (1 - tv) / (1 + tv) - 0.02  # 4,000 draws: sd about 0.008
