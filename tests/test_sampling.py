"""The sampler in layers: hand-built cases, reproducibility, then statistics against the exact
distributions (chi-square, fixed seeds, so every run draws the same numbers)."""

import pytest
import torch

import stages.rng as rng_module
import stages.sampling as sample_module
from core.params import SamplingParams, SamplingTensors
from stages.logits import PenaltyState, add_logit_bias, process_logits
from stages.rng import SALT_ACCEPT, SALT_CHILD_ACCEPT, SALT_SAMPLE, uniform, uniforms
from stages.sampling import chain_verify, draw, logprobs, sample, tree_verify
from tests.stats import chi_square_pvalue

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    # these are many small int64 elementwise ops; on two busy cores OpenMP barriers cost more
    # than the work
    torch.set_num_threads(1)


def assert_close(got: torch.Tensor, expected: torch.Tensor, atol=1e-5, rtol=1.3e-6) -> None:
    # torch.testing.assert_close first imports torch.distributed, seconds on a busy machine
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert torch.allclose(got, expected, atol=atol, rtol=rtol), (got, expected)


def tensors(
    params: list[SamplingParams], seeds: list[int] | None = None, vocab: int | None = None
) -> SamplingTensors:
    return SamplingTensors.build(params, seeds or list(range(len(params))), "cpu", vocab)


def one_hot(argmaxes: list[list[int]], vocab: int) -> torch.Tensor:
    """[B, S, V] one-hot target distributions, as process_logits gives greedy rows."""
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] float64: temperature, top-k, top-p, min-p, written out the slow way."""
    x = logits.to(F64).clone()
    if p.greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).to(F64)
    x = x / p.temperature
    if p.top_k:
        x[x < x.sort(descending=True).values[p.top_k - 1]] = float("-inf")
    if p.top_p < 1:
        probs, kept, mass = x.softmax(0), [], 0.0
        for i in x.argsort(descending=True).tolist():
            kept.append(i)
            mass += probs[i].item()
            if mass >= p.top_p:
                break
        x[[i for i in range(x.numel()) if i not in kept]] = float("-inf")
    probs = x.softmax(0)
    if p.min_p:
        probs[probs < p.min_p * probs.max()] = 0
    return probs / probs.sum()


# ---- random numbers ----


@pytest.fixture(params=["python", "numpy", "torch"])
def hash_words(request, monkeypatch):
    """Every murmur3 path on the CPU: Python's ints (a few positions), numpy's uint32 words
    (more) and the int64 tensors an accelerator hashes with."""
    if request.param == "torch":
        monkeypatch.setattr(rng_module, "HOST_HASH_DEVICES", frozenset())
    monkeypatch.setattr(rng_module, "PYTHON_HASH_MAX", 10**9 if request.param == "python" else 0)
    return request.param


def test_uniform_is_a_pure_function_in_the_open_interval(hash_words):
    seeds = torch.tensor([0, 1, -5, 2**62, -(2**63), 2**63 - 1])
    positions = torch.tensor([0, 0, 3, 2**40, 7, -1])
    u = uniform(seeds, positions, SALT_SAMPLE)
    assert u.dtype == F64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniform(seeds, positions, SALT_SAMPLE))
    assert not torch.equal(u, uniform(seeds, positions, SALT_ACCEPT))
    grid = uniform(seeds, positions[:, None] + torch.arange(3), SALT_SAMPLE)  # [B, S]
    assert torch.equal(grid[:, 0], u)
    assert grid.unique().numel() == grid.numel()


def murmur3_32(data: bytes, seed: int) -> int:
    """The reference MurmurHash3 (x86, 32-bit) over bytes, for data of whole 4-byte words."""
    mask, h = 0xFFFFFFFF, seed
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & mask  # noqa: E731
    for i in range(0, len(data), 4):
        k = rotl(int.from_bytes(data[i : i + 4], "little") * 0xCC9E2D51 & mask, 15)
        h = (rotl(h ^ (k * 0x1B873593 & mask), 13) * 5 + 0xE6546B64) & mask
    h ^= len(data)
    h = (h ^ (h >> 16)) * 0x85EBCA6B & mask
    h = (h ^ (h >> 13)) * 0xC2B2AE35 & mask
    return h ^ (h >> 16)


def test_uniform_is_murmur3_of_seed_and_position_whatever_seeds_came_before(hash_words):
    # the seed half of the hash is kept for the last seeds tensor per salt: a different one,
    # then the first again, must each give their own hashes
    first, other = torch.tensor([3, -(2**63), 2**40 + 7]), torch.tensor([4, 5, 6])
    positions = torch.tensor([0, 2**33 + 1, 17])
    for seeds in (first, other, first):
        u = uniform(seeds, positions, SALT_ACCEPT)
        for s, p, got in zip(seeds.tolist(), positions.tolist(), u.tolist(), strict=True):
            data = s.to_bytes(8, "little", signed=True) + p.to_bytes(8, "little", signed=True)
            assert got == (murmur3_32(data, SALT_ACCEPT) + 0.5) * 2.0**-32


def test_uniform_is_uniform():
    u = uniform(torch.arange(100_000), torch.full((100_000,), 9), SALT_SAMPLE)
    assert chi_square_pvalue((u * 20).long(), torch.full((20,), 0.05)) > 1e-3


def test_seeds_build_wraps_any_python_int():
    st = tensors([SamplingParams()] * 3, [2**64 + 5, -1, 2**63])
    assert st.seeds.tolist() == [5, -1, -(2**63)]


# ---- logits processing ----

MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.9, top_k=4, top_p=0.9, min_p=0.05),
]


def test_process_logits_matches_the_reference():
    logits = torch.randn(len(MIXED), 2, 9) * 2
    original = logits.clone()
    probs = process_logits(logits, tensors(MIXED))
    assert torch.equal(logits, original)  # the caller's logits are left alone
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for row, params in enumerate(MIXED):
        for step in range(2):
            expected = reference_probs(logits[row, step], params).float()
            assert_close(probs[row, step], expected, atol=1e-6, rtol=1e-5)


def test_process_logits_keeps_float64_and_lifts_bfloat16():
    logits = torch.randn(len(MIXED), 1, 9) * 2
    exact = process_logits(logits.double(), tensors(MIXED))
    assert exact.dtype == F64
    for row, params in enumerate(MIXED):
        expected = reference_probs(logits[row, 0], params)
        # the parameters themselves are float32 (0.7 is 0.699999988)
        assert_close(exact[row, 0], expected, atol=1e-8, rtol=1e-6)
    assert process_logits(logits.bfloat16(), tensors(MIXED)).dtype == torch.float32


def test_all_greedy_is_one_hot_at_the_argmax():
    logits = torch.randn(3, 4, 11)
    probs = process_logits(logits, tensors([SamplingParams(temperature=0)] * 3))
    assert torch.equal(probs, one_hot(logits.argmax(-1).tolist(), 11))


def test_penalties_follow_vllm():
    logits = torch.tensor([[[2.0, -2.0, 1.0, -1.0, 0.5]]])
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    st = tensors([params])
    penalties = PenaltyState.build([[0, 1]], [[2, 2, 1]], 5, "cpu")
    assert penalties.output_counts.tolist() == [[0, 1, 2, 0, 0]]
    assert penalties.prompt_mask.tolist() == [[True, True, False, False, False]]
    got = process_logits(logits, st, penalties)
    # 0: prompt, 2/2 = 1; 1: prompt+output once, -2*2 - 0.5 - 0.25 = -4.75;
    # 2: output twice, 1/2 - 1 - 0.25 = -0.75; 3, 4 untouched: argmax is token 0 (1.0 > 0.5)
    assert got.argmax(-1).item() == 0
    logits[0, 0, 0] = 0.9  # 0.45 now loses to token 4
    assert process_logits(logits, st, penalties).argmax(-1).item() == 4


def test_logit_bias_is_added_before_temperature_and_moves_the_argmax():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]], [[2.0, 1.0, 0.0, -1.0]]])
    params = [
        SamplingParams(temperature=0.5, logit_bias=((3, 3.5), (0, -100.0))),
        SamplingParams(temperature=0, logit_bias=((2, 2.5),)),
    ]
    got = process_logits(logits, tensors(params, vocab=4))
    biased = torch.tensor([2.0 - 100, 1.0, 0.0, 2.5])
    assert_close(got[0, 0], (biased / 0.5).softmax(-1))
    assert got[1, 0].tolist() == [0.0, 0.0, 1.0, 0.0]  # greedy at the biased argmax
    unbiased = process_logits(logits, tensors([SamplingParams(temperature=0.5)] * 2))
    assert not torch.allclose(unbiased[0], got[0])


def test_logit_bias_reaches_a_drafters_smaller_or_larger_vocabulary():
    bias = torch.tensor([[0.0, 5.0, 0.0, 0.0, 7.0]])  # [B, V] over the target's 5 ids
    narrow = add_logit_bias(torch.zeros(1, 2, 3), bias)  # a drafter over 3 ids
    assert narrow.tolist() == [[[0.0, 5.0, 0.0]] * 2]
    wide = add_logit_bias(torch.zeros(1, 6), bias)  # a padded vocabulary
    assert wide.tolist() == [[0.0, 5.0, 0.0, 0.0, 7.0, 0.0]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tensors([SamplingParams(logit_bias=((9, 1.0),))], vocab=5)


def test_penalties_at_draft_positions_equal_one_position_at_a_time():
    params = [
        SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4),
        SamplingParams(frequency_penalty=0.7, top_k=5),
        SamplingParams(temperature=1.2, repetition_penalty=0.8, frequency_penalty=-0.3),
    ]
    prompts, outputs = [[1, 2], [3], [4, 4]], [[2, 5], [], [6, 6, 1]]
    drafts = torch.tensor([[5, 5, 7], [3, -1, -1], [6, 1, 2]])  # row 1 drafts one token
    logits = torch.randn(3, 4, 8) * 2
    st = tensors(params)
    together = process_logits(logits, st, PenaltyState.build(prompts, outputs, 8, "cpu"), drafts)
    for step in range(4):
        before = [
            out + [t for t in row[:step] if t >= 0]
            for out, row in zip(outputs, drafts.tolist(), strict=True)
        ]
        alone = process_logits(
            logits[:, step : step + 1], st, PenaltyState.build(prompts, before, 8, "cpu")
        )
        assert_close(together[:, step], alone[:, 0])


# ---- sampling and the acceptance rules, by hand ----


def test_sample_of_one_hot_is_its_argmax():
    probs = one_hot([[4, 0, 5]], 6)[0]
    tokens = sample(probs, torch.tensor([1, 2, 3]), torch.tensor([0, 10, 2**33]))
    assert tokens.tolist() == [4, 0, 5]


def test_sample_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5000, 5)
    tokens = sample(probs, torch.arange(5000), torch.zeros(5000, dtype=torch.int64))
    assert set(tokens.tolist()) == {1, 3}
    unnormalised = torch.tensor([[0.0, 3.0, 0.0]]).expand(50, 3)
    assert (sample(unnormalised, torch.arange(50), torch.zeros(50, dtype=torch.int64)) == 1).all()


TARGET = [[3, 1, 4, 2]]  # argmax of p at positions 0..3


def verify_greedy(drafts: list[list[int]], num_drafts: list[int], sampled_drafts: bool):
    batch, k = len(drafts), len(drafts[0])
    draft_probs = torch.full((batch, k, 6), 1 / 6) if sampled_drafts else None
    return chain_verify(
        one_hot(TARGET * batch, 6),
        torch.tensor(drafts),
        draft_probs,
        torch.tensor(num_drafts),
        torch.arange(batch),
        torch.full((batch,), 17),
    )


@pytest.mark.parametrize("sampled_drafts", [False, True])
@pytest.mark.parametrize(
    ("case", "drafts", "tokens", "accepted"),
    [
        ("perfect match", [3, 1, 4], [3, 1, 4, 2], 3),
        ("mismatch at position 1", [3, 0, 4], [3, 1, -1, -1], 1),
        ("all rejected", [0, 0, 0], [3, -1, -1, -1], 0),
    ],
)
def test_chain_greedy(case, drafts, tokens, accepted, sampled_drafts):
    got_tokens, got_accepted = verify_greedy([drafts], [3], sampled_drafts)
    assert got_tokens.tolist() == [tokens], case
    assert got_accepted.tolist() == [accepted], case


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_chain_per_row_draft_lengths(sampled_drafts):
    drafts = [[3, 1, 4], [3, 1, 4], [3, -1, -1], [5, 1, 4]]
    tokens, accepted = verify_greedy(drafts, [3, 1, 0, 2], sampled_drafts)
    assert accepted.tolist() == [3, 1, 0, 0]
    assert tokens.tolist() == [[3, 1, 4, 2], [3, 1, -1, -1], [3, -1, -1, -1], [3, -1, -1, -1]]


def test_chain_no_drafts_is_a_plain_sample():
    probs = torch.softmax(torch.randn(50, 1, 6), -1)
    seeds, positions = torch.arange(50), torch.full((50,), 3)
    empty = torch.zeros(50, 0, dtype=torch.int64)
    tokens, accepted = chain_verify(probs, empty, None, torch.zeros(50).long(), seeds, positions)
    assert accepted.eq(0).all()
    assert torch.equal(tokens[:, 0], sample(probs[:, 0], seeds, positions))


def test_sampled_drafts_equal_to_target_are_always_accepted():
    batch = 2000
    probs = torch.softmax(torch.randn(batch, 4, 6), -1)
    drafts = torch.multinomial(probs[:, :3].reshape(-1, 6), 1).view(batch, 3)
    tokens, accepted = chain_verify(
        probs,
        drafts,
        probs[:, :3],
        torch.full((batch,), 3),
        torch.arange(batch),
        torch.zeros(batch).long(),
    )
    assert accepted.eq(3).all()
    assert torch.equal(tokens[:, :3], drafts)


def test_sampled_draft_with_zero_target_probability_is_always_rejected():
    batch = 2000
    p = torch.tensor([0.0, 0.5, 0.3, 0.2, 0.0, 0.0]).expand(batch, 2, 6)
    q = torch.tensor([[0.6, 0.1, 0.3, 0.0, 0.0, 0.0]]).expand(batch, 1, 6)
    drafts = torch.zeros(batch, 1, dtype=torch.int64)
    tokens, accepted = chain_verify(
        p, drafts, q, torch.ones(batch).long(), torch.arange(batch), torch.zeros(batch).long()
    )
    assert accepted.eq(0).all()
    # residual max(0, p - q) = [0, 0.4, 0, 0.2, 0, 0]
    assert set(tokens[:, 0].tolist()) == {1, 3}
    assert (tokens[:, 1] == -1).all()


def test_point_mass_drafts_emit_what_plain_decoding_emits():
    # the coupling: with the same seed, speculation changes nothing in the tokens
    batch = 500
    probs = torch.softmax(torch.randn(batch, 3, 4), -1)
    drafts = torch.randint(0, 4, (batch, 2))
    seeds, positions = torch.arange(batch) * 7, torch.full((batch,), 100)
    tokens, accepted = chain_verify(probs, drafts, None, torch.full((batch,), 2), seeds, positions)
    for step in range(3):
        plain = sample(probs[:, step], seeds, positions + step)
        emitted = tokens[:, step] >= 0
        assert torch.equal(tokens[emitted, step], plain[emitted])
    assert 0 < accepted.float().mean() < 2


def greedy_model(vocab: int) -> torch.Tensor:
    """[V, V] logits of the next token given the last one, with wide gaps."""
    return torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(5)) * 3


def greedy_sequential(
    model: torch.Tensor, params: SamplingParams, prompt: list[int], length: int
) -> list[int]:
    """Greedy decoding one token at a time, penalties counted from the output so far."""
    out: list[int] = []
    st = tensors([params])
    for _ in range(length):
        logits = model[(prompt + out)[-1]][None, None]
        penalties = PenaltyState.build([prompt], [out], model.shape[0], "cpu")
        out.append(int(process_logits(logits, st, penalties).argmax()))
    return out


def test_greedy_with_penalties_under_speculation_equals_sequential() -> None:
    vocab, prompt, length, k = 8, [1, 2, 3], 14, 3
    model = greedy_model(vocab)
    params = SamplingParams(
        temperature=0, repetition_penalty=1.8, frequency_penalty=0.9, presence_penalty=0.5
    )
    reference = greedy_sequential(model, params, prompt, length)
    assert reference != greedy_sequential(model, SamplingParams(temperature=0), prompt, length)
    out: list[int] = []
    st = tensors([params])
    step = 0
    while len(out) < length:
        # the right continuation, with one wrong token every other step
        drafts = (reference + [0] * k)[len(out) : len(out) + k]
        if step % 2:
            drafts[step % k] = (drafts[step % k] + 1) % vocab
        last = (prompt + out)[-1]
        logits = model[[last] + drafts][None]  # [1, k+1, V]
        penalties = PenaltyState.build([prompt], [out], vocab, "cpu")
        draft_tensor = torch.tensor([drafts])
        probs = process_logits(logits, st, penalties, draft_tensor)
        tokens, accepted = chain_verify(
            probs, draft_tensor, None, torch.tensor([k]), st.seeds, torch.tensor([len(out)])
        )
        out += tokens[0, : int(accepted) + 1].tolist()
        step += 1
    assert out[:length] == reference
    assert step < length  # speculation did accept tokens


def tree_fixture():
    # node: token (parent): 0: 5 (root), 1: 3 (root), 2: 1 (0), 3: 4 (0), 4: 2 (3), 5: 4 (0)
    node_tokens = torch.tensor([[5, 3, 1, 4, 2, 4]])
    parents = torch.tensor([[-1, -1, 0, 0, 3, 0]])
    return node_tokens, parents


@pytest.mark.parametrize(
    ("argmaxes", "tokens", "path"),
    [
        # root -> 5 (node 0) -> 4 (node 3, the first of the two 4s) -> 2 (node 4) -> 0
        ([5, 4, 7, 7, 2, 0, 7], [5, 4, 2, 0], [0, 3, 4]),
        # root -> 3 (node 1, a leaf) -> 7
        ([3, 0, 7, 0, 0, 0, 0], [3, 7, -1, -1], [1, -1, -1]),
        # no child of the root is the argmax
        ([0, 0, 0, 0, 0, 0, 0], [0, -1, -1, -1], [-1, -1, -1]),
    ],
)
def test_tree_greedy_known_path(argmaxes, tokens, path):
    node_tokens, parents = tree_fixture()
    got_tokens, accepted, got_path = tree_verify(
        one_hot([argmaxes], 8), node_tokens, parents, torch.tensor([3]), torch.tensor([9])
    )
    assert got_tokens.tolist() == [tokens]
    assert got_path.tolist() == [path]
    assert accepted.tolist() == [sum(i >= 0 for i in path)]


def test_tree_batch_rows_walk_independently():
    node_tokens, parents = tree_fixture()
    targets = one_hot([[5, 4, 7, 7, 2, 0, 7], [3, 0, 7, 0, 0, 0, 0]], 8)
    tokens, accepted, path = tree_verify(
        targets,
        node_tokens.repeat(2, 1),
        parents.repeat(2, 1),
        torch.tensor([1, 2]),
        torch.tensor([0, 0]),
    )
    assert tokens.tolist() == [[5, 4, 2, 0], [3, 7, -1, -1]]
    assert accepted.tolist() == [3, 1]


def level_by_level_tree_verify(target_probs, node_tokens, parents, seeds, positions, depth):
    """tree_verify as its rule reads: from the root, draw from the current node's row with
    the uniform of the position it emits at, move to the first child holding that token."""
    batch = target_probs.shape[0]
    rows = torch.arange(batch)
    current, active = torch.full((batch,), -1), torch.ones(batch, dtype=torch.bool)
    tokens, path = torch.full((batch, depth + 1), -1), torch.full((batch, depth), -1)
    u = uniform(seeds, positions[:, None] + torch.arange(depth + 1), SALT_SAMPLE)
    for d in range(depth + 1):
        drawn = draw(target_probs[rows, current + 1], u[:, d])
        tokens[:, d] = torch.where(active, drawn, -1)
        if d == depth:
            break
        hit = (parents == current[:, None]) & (node_tokens == drawn[:, None]) & active[:, None]
        found = hit.any(1)
        child = hit.int().argmax(1)
        path[:, d] = torch.where(found, child, -1)
        current = torch.where(found, child, current)
        active = active & found
    return tokens, (path >= 0).sum(1), path


def random_forests(gen: torch.Generator, batch: int, nodes: int, vocab: int):
    """(parents, node tokens [B, N], target probabilities [B, N + 1, V], some zero): random
    forests, parents before children; small vocabularies make repeated siblings."""
    parents = torch.stack([torch.randint(-1, i, (batch,), generator=gen) for i in range(nodes)], 1)
    node_tokens = torch.randint(-1, vocab, (batch, nodes), generator=gen)
    target = torch.softmax(torch.randn(batch, nodes + 1, vocab, generator=gen) * 2, -1)
    target[:, :, 0] *= torch.rand(batch, nodes + 1, generator=gen) < 0.7
    return parents, node_tokens, target


def test_tree_draws_every_row_at_once_as_the_level_by_level_rule_does():
    gen = torch.Generator().manual_seed(5)
    batch, nodes, vocab = 300, 7, 3
    parents, node_tokens, target = random_forests(gen, batch, nodes, vocab)
    seeds, positions = torch.arange(batch) * 7, torch.arange(batch) + 40
    depth = int(sample_module._node_depths(parents).max())
    got = tree_verify(target, node_tokens, parents, seeds, positions)
    expected = level_by_level_tree_verify(target, node_tokens, parents, seeds, positions, depth)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert 0 < got[1].float().mean() and got[1].max() >= 2  # the walks go somewhere


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(3, 10)
    tokens = torch.tensor([1, 5, 9])
    chosen, top_ids, top_logprobs = logprobs(logits, tokens, 4)
    expected = torch.log_softmax(logits, -1)
    assert_close(chosen, expected[torch.arange(3), tokens])
    assert torch.equal(top_ids, expected.argsort(-1, descending=True)[:, :4])
    assert_close(top_logprobs, expected.gather(1, top_ids))
    assert logprobs(logits, tokens, 0)[1].shape == (3, 0)


# ---- a request's draws do not depend on the rest of the batch ----


def bigger_batch_order(batch: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, where): a shuffled batch of batch + extra rows, and where rows 0..batch-1 are."""
    order = torch.randperm(batch + extra, generator=torch.Generator().manual_seed(3))
    return order, order.argsort()[:batch]


def test_sampling_is_reproducible_whatever_the_batch():
    logits = torch.randn(len(MIXED), 1, 9) * 2
    seeds = [11, 22, 33, 44, 55, 66]
    alone = [
        sample(
            process_logits(logits[i : i + 1], tensors([p], [s]))[:, 0],
            torch.tensor([s]),
            torch.tensor([40]),
        )
        for i, (p, s) in enumerate(zip(MIXED, seeds, strict=True))
    ]
    _, where = bigger_batch_order(len(MIXED), 5)
    big_logits = torch.randn(len(MIXED) + 5, 1, 9)
    big_logits[where] = logits
    big_params = [SamplingParams(top_p=0.5, presence_penalty=1.0)] * (len(MIXED) + 5)
    big_seeds = list(range(100, 100 + len(MIXED) + 5))
    for i, j in enumerate(where.tolist()):
        big_params[j], big_seeds[j] = MIXED[i], seeds[i]
    st = tensors(big_params, big_seeds)
    together = sample(process_logits(big_logits, st)[:, 0], st.seeds, torch.full((11,), 40))
    assert together[where].tolist() == torch.cat(alone).tolist()


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_chain_is_reproducible_whatever_the_batch(sampled_drafts):
    batch, extra = 40, 25
    target = torch.softmax(torch.randn(batch + extra, 4, 6), -1)
    q = torch.softmax(torch.randn(batch + extra, 3, 6), -1)
    drafts = torch.multinomial(q.reshape(-1, 6), 1).view(-1, 3)
    num, seeds, pos = torch.randint(0, 4, (batch + extra,)), torch.arange(65) * 3, torch.arange(65)
    run = lambda rows: chain_verify(
        target[rows],
        drafts[rows],
        q[rows] if sampled_drafts else None,
        num[rows],
        seeds[rows],
        pos[rows],
    )
    order, where = bigger_batch_order(batch, extra)
    alone_tokens, alone_accepted = run(torch.arange(batch))
    tokens, accepted = run(order)
    assert torch.equal(tokens[where], alone_tokens)
    assert torch.equal(accepted[where], alone_accepted)


def test_tree_is_reproducible_whatever_the_batch():
    batch, extra = 30, 20
    target = torch.softmax(torch.randn(batch + extra, 5, 4) * 2, -1)
    node_tokens = torch.randint(0, 4, (batch + extra, 4))
    parents = torch.tensor([[-1, -1, 0, 2]]).expand(batch + extra, 4)
    seeds, positions = torch.arange(batch + extra) + 9, torch.arange(batch + extra) * 2
    run = lambda rows: tree_verify(
        target[rows], node_tokens[rows], parents[rows], seeds[rows], positions[rows]
    )
    order, where = bigger_batch_order(batch, extra)
    alone, together = run(torch.arange(batch)), run(order)
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(b[where], a)


def sampled_tree_row_by_row(target, node_tokens, parents, q, seeds, positions, depth, siblings):
    """tree_verify with sampled children as its rule reads, one row at a time: at the current
    node test its children in index order, child x with its rank's uniform against
    p(x) / q(x), p := norm(max(0, p - q)) after each rejection; if none passes, draw from p."""
    batch, nodes = node_tokens.shape
    levels = positions[:, None] + torch.arange(depth + 1)
    tests = uniforms(seeds, levels, tuple(SALT_CHILD_ACCEPT + r for r in range(siblings)))
    emits = uniform(seeds, levels, SALT_SAMPLE)
    tokens, path = torch.full((batch, depth + 1), -1), torch.full((batch, depth), -1)
    for b in range(batch):
        current = -1
        for level in range(depth + 1):
            p = target[b, current + 1]
            children = [
                i for i in range(nodes) if parents[b, i] == current and node_tokens[b, i] >= 0
            ]
            chosen = None
            for rank, node in enumerate(children):
                x = int(node_tokens[b, node])
                if tests[rank, b, level] * q[b, node, x] < p[x]:
                    chosen = node
                    break
                left = (p - q[b, node]).clamp(min=0)
                p = left / left.sum() if left.sum() > 0 else p
            if chosen is None:
                tokens[b, level] = draw(p[None], emits[b, level : level + 1])[0]
                break
            tokens[b, level], path[b, level], current = node_tokens[b, chosen], chosen, chosen
    return tokens, (path >= 0).sum(1), path


def test_sampled_tree_walk_applies_the_rule_row_by_row():
    gen = torch.Generator().manual_seed(9)
    batch, nodes, vocab = 200, 7, 3
    parents, node_tokens, target = random_forests(gen, batch, nodes, vocab)
    target = target / target.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen) * 2, -1)
    # siblings share their parent's q, as drafted
    q = torch.where(
        (parents >= 0)[..., None],
        q.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, vocab)),
        q[:, :1],
    )
    seeds, positions = torch.arange(batch) * 5, torch.arange(batch) + 30
    depth = int(sample_module._node_depths(parents).max())
    siblings = max(int((parents == i).sum(1).max()) for i in range(-1, nodes))
    got = tree_verify(
        target, node_tokens, parents, seeds, positions, draft_probs=q, siblings=siblings
    )
    expected = sampled_tree_row_by_row(
        target, node_tokens, parents, q, seeds, positions, depth, siblings
    )
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert got[1].max() >= 2 and (got[2][:, 0] > 0).any()  # deep walks, not only first children


# ---- statistics ----
#
# Power: N = 200k draws over V = 6 values (5 degrees of freedom), rejected at p < 1e-3
# (statistic above 20.5). An error that moves 2% of a cell of probability 0.2 to another cell
# of 0.2 (0.004 absolute) has noncentrality N * 0.004^2 * (1/0.2 + 1/0.2) = 32, and a
# noncentral chi-square(5, 32) passes 20.5 with probability ~0.94. Larger cells and larger
# errors are caught surer. Each test also shows that its own draws reject such a perturbed p.
# The seeds are fixed, so each run draws the same numbers and the result is deterministic.

N = 200_000
P_FIRST = torch.tensor([0.25, 0.2, 0.0, 0.3, 0.15, 0.1], dtype=F64)
Q_FIRST = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0, 0.0], dtype=F64)


def conditional(seed: int, zeros: bool) -> torch.Tensor:
    """[V, V]: a next-token distribution for each previous token (some zeros if asked)."""
    table = torch.rand(6, 6, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.05
    if zeros:
        table[torch.arange(6), (torch.arange(6) * 2) % 6] = 0
    return table / table.sum(1, keepdim=True)


P_NEXT, Q_NEXT, P_THIRD = conditional(1, True), conditional(2, False), conditional(3, False)


def perturbed(p: torch.Tensor) -> torch.Tensor:
    """p with 2% of its largest cell moved to its smallest positive cell."""
    big, small = int(p.argmax()), int(torch.where(p > 0, p, 2).argmin())
    moved = p.clone()
    moved[big] -= 0.02 * p[big]
    moved[small] += 0.02 * p[big]
    return moved


def assert_follows(values: torch.Tensor, probs: torch.Tensor) -> None:
    assert chi_square_pvalue(values, probs) > 1e-3
    assert chi_square_pvalue(values, perturbed(probs)) < 1e-3  # the draws have the power


def assert_first_two_follow_p(tokens, accepted, seeds, positions):
    """The first two emitted tokens of a step (the second from a plain next step where the
    first was already the last one emitted) are distributed as p(t0) p(t1 | t0)."""
    first = tokens[:, 0]
    next_step = sample(P_NEXT[first].float(), seeds, positions + 1)
    second = torch.where(accepted >= 1, tokens[:, 1], next_step)
    assert_follows(first, P_FIRST)
    assert_follows(first * 6 + second, (P_FIRST[:, None] * P_NEXT).flatten())


@pytest.mark.parametrize(
    "params", MIXED[1:], ids=lambda p: f"{p.temperature}-{p.top_k}-{p.top_p}-{p.min_p}"
)
def test_sampling_follows_the_processed_distribution(params):
    logits = torch.tensor([[[1.2, -0.3, 0.4, 2.0, 0.9, -1.5]]])
    probs = process_logits(logits, tensors([params]))[0, 0]
    exact = reference_probs(logits[0, 0], params)
    assert_close(probs.double(), exact, atol=1e-6, rtol=1e-5)
    tokens = sample(probs.expand(N, 6), torch.arange(N), torch.full((N,), 12))
    assert_follows(tokens, exact)


def test_chain_with_sampled_drafts_follows_p():
    gen = torch.Generator().manual_seed(7)
    first = torch.multinomial(Q_FIRST, N, replacement=True, generator=gen)
    second = torch.multinomial(Q_NEXT[first], 1, generator=gen)[:, 0]
    target = torch.stack([P_FIRST.expand(N, 6), P_NEXT[first], P_THIRD[second]], 1).float()
    q = torch.stack([Q_FIRST.expand(N, 6), Q_NEXT[first]], 1).float()
    seeds, positions = torch.arange(N) + 1000, torch.full((N,), 40)
    num_drafts = torch.arange(N) % 3  # k_r = 0, 1, 2
    tokens, accepted = chain_verify(
        target, torch.stack([first, second], 1), q, num_drafts, seeds, positions
    )
    assert accepted.le(num_drafts).all() and 0.2 < accepted.float().mean() < 1.5
    assert_first_two_follow_p(tokens, accepted, seeds, positions)


def test_chain_with_point_mass_drafts_follows_p():
    first = torch.arange(N) % 6  # any deterministic proposal
    second = (first * 5 + 1) % 6
    target = torch.stack([P_FIRST.expand(N, 6), P_NEXT[first], P_THIRD[second]], 1).float()
    seeds, positions = torch.arange(N) * 3 + 1, torch.full((N,), 7)
    tokens, accepted = chain_verify(
        target, torch.stack([first, second], 1), None, torch.full((N,), 2), seeds, positions
    )
    # the first draft is accepted exactly with probability p(x)
    assert abs(accepted.ge(1).double().mean() - P_FIRST.mean()) < 0.005
    assert_first_two_follow_p(tokens, accepted, seeds, positions)


def test_tree_follows_p():
    rows = torch.arange(N)
    # two children of the root, the first with a child of its own
    node_tokens = torch.stack([rows % 6, (rows + 2) % 6, (rows + 1) % 6], 1)
    parents = torch.tensor([[-1, -1, 0]]).expand(N, 3)
    target = torch.stack(
        [
            P_FIRST.expand(N, 6),
            P_NEXT[node_tokens[:, 0]],
            P_NEXT[node_tokens[:, 1]],
            P_THIRD[node_tokens[:, 2]],
        ],
        1,
    ).float()
    seeds, positions = rows + 5, torch.full((N,), 20)
    tokens, accepted, path = tree_verify(target, node_tokens, parents, seeds, positions)
    assert tokens.shape == (N, 3) and path.shape == (N, 2)
    assert_first_two_follow_p(tokens, accepted, seeds, positions)


def test_tree_with_sampled_children_follows_p():
    gen = torch.Generator().manual_seed(11)
    # the root's three children drawn from q, two below the first, one below the second
    top = torch.multinomial(Q_FIRST, 3 * N, replacement=True, generator=gen).view(N, 3)
    under_first = torch.multinomial(Q_NEXT[top[:, 0]], 2, replacement=True, generator=gen)
    under_second = torch.multinomial(Q_NEXT[top[:, 1]], 1, generator=gen)
    node_tokens = torch.cat([top, under_first, under_second], 1)
    parents = torch.tensor([[-1, -1, -1, 0, 0, 1]]).expand(N, 6)
    rows = [P_FIRST.expand(N, 6), *(P_NEXT[top[:, i]] for i in range(3))]
    rows += [P_THIRD[node_tokens[:, i]] for i in range(3, 6)]
    q = [Q_FIRST.expand(N, 6)] * 3 + [Q_NEXT[top[:, 0]]] * 2 + [Q_NEXT[top[:, 1]]]
    seeds, positions = torch.arange(N) + 77, torch.full((N,), 12)
    tokens, accepted, path = tree_verify(
        torch.stack(rows, 1).float(),
        node_tokens,
        parents,
        seeds,
        positions,
        draft_probs=torch.stack(q, 1).float(),
        siblings=3,
    )
    assert tokens.shape == (N, 3) and path.shape == (N, 2)
    assert_first_two_follow_p(tokens, accepted, seeds, positions)
    # three tries at the root accept more often than one draft, whose rate is 1 - TV(p, q)
    one_draft = torch.minimum(P_FIRST, Q_FIRST).sum()
    assert accepted.ge(1).double().mean() > one_draft + 0.05


def test_greedy_flag_draws_what_the_uniforms_draw_from_one_hot_rows():
    # all-greedy batches skip the uniforms: same tokens, same acceptance, for every rule
    batch, k, vocab = 200, 3, 7
    gen = torch.Generator().manual_seed(11)
    target = one_hot(torch.randint(0, vocab, (batch, k + 1), generator=gen).tolist(), vocab)
    drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    drafts[: batch // 2] = target[: batch // 2, :k].argmax(-1)  # half the rows fully accepted
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    seeds, positions, caps = torch.arange(batch), torch.full((batch,), 30), torch.full((batch,), k)
    assert torch.equal(
        sample(target[:, 0], seeds, positions, greedy=True), sample(target[:, 0], seeds, positions)
    )
    for draft_probs in (None, q):
        plain = chain_verify(target, drafts, draft_probs, caps, seeds, positions)
        fast = chain_verify(target, drafts, draft_probs, caps, seeds, positions, greedy=True)
        assert torch.equal(plain[0], fast[0]) and torch.equal(plain[1], fast[1])
        assert 0 < plain[1].float().mean() < k
    node_tokens, parents = tree_fixture()
    argmaxes = torch.randint(0, 8, (batch, 7), generator=gen)
    argmaxes[: batch // 2, :2] = torch.tensor([5, 4])  # root -> node 0 -> node 3 accepted
    args = (one_hot(argmaxes.tolist(), 8), node_tokens.repeat(batch, 1), parents.repeat(batch, 1))
    plain = tree_verify(*args, seeds, positions)
    fast = tree_verify(*args, seeds, positions, greedy=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, fast, strict=True))
    assert plain[1][: batch // 2].ge(2).all()
