"""Logits processing, sampling and the lossless acceptance rules: tensors in, tensors out.

No shared random generator: every uniform is a hash of (request seed, absolute token position,
purpose salt), so a request draws the same numbers whatever else is in the batch. The token
emitted at position P always comes from `sample(p, seed, P, SALT_SAMPLE)`; with point-mass
drafts (argmax, n-gram, a greedy or dynamic tree's children) the acceptance rule is realised
through that very sample, so speculation then emits the same tokens as plain decoding with the
same seed. Drafts drawn from the drafter's q (sampled chains and fixed trees) keep p's law but
not those very tokens: the rejection rule, used for requests without a seed.

Requests with a seed draw by a coupling instead (`couple`): the token emitted at position P is
argmax_v log p(v) + G(seed, P, v), Gumbel noise keyed by the token id too (the Gumbel-max
trick: a draw of p), so it depends on nothing but p, the seed and the position. The sampler
makes each such row of p a point mass at that token before any acceptance rule, and every rule
then accepts exactly the drafts equal to it and emits it: speculation, whatever k, tree or
batch, emits plain decoding's tokens. Drafters propose argmax_v log q(v) + G with the same
noise, which the target then accepts with probability at least (1 - TV) / (1 + TV).

A token's position is the index it takes in the request's sequence (prompt + output), so the
first output token of a prompt of length L has position L.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.params import SamplingTensors
from models.attention import cast

SALT_SAMPLE = 0  # the token emitted at a position: plain decode, bonus, recovered, tree
SALT_ACCEPT = 1  # the accept test of a sampled draft token
SALT_DRAFT = 2  # for drafters that sample q; must stay apart from the two above
# a sampled tree: its rank-r children drawn from q (the drafter), their accept tests (the sampler)
SALT_CHILD = 1 << 16  # + r
SALT_CHILD_ACCEPT = 1 << 17  # + r

_MASK32 = 0xFFFFFFFF


def add_logit_bias(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """logits [B, ..., V] plus each row's bias [B, V'] over the first min(V, V') ids (a drafter's
    vocabulary may be padded, or be the target's prefix)."""
    if bias is None:
        return logits
    width = min(logits.shape[-1], bias.shape[-1])
    row = bias[:, :width].view(bias.shape[0], *[1] * (logits.dim() - 2), width)
    head = logits[..., :width] + row.to(logits.dtype)
    return head if width == logits.shape[-1] else torch.cat([head, logits[..., width:]], -1)


@dataclass
class PenaltyState:
    """What the penalties count, per row: token counts of the output so far and which tokens
    the prompt holds."""

    output_counts: torch.Tensor  # [B, V] float32 (whole numbers)
    prompt_mask: torch.Tensor  # [B, V] bool

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        outputs: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> PenaltyState:
        def rows_and_ids(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            rows = [i for i, ids in enumerate(seqs) for _ in ids]
            flat = [t for ids in seqs for t in ids]
            as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
            return as_tensor(rows), as_tensor(flat)

        shape = (len(prompts), vocab_size)
        counts = torch.zeros(shape, dtype=torch.float32, device=device)
        rows, ids = rows_and_ids(outputs)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
        rows, ids = rows_and_ids(prompts)
        prompt_mask[rows, ids] = True
        return cls(counts, prompt_mask)


# ---- random numbers: murmur3 over 32-bit words ----
# On a device, the words are held in int64 tensors and never overflow; on the CPU, in numpy
# uint32 arrays, whose arithmetic wraps as murmur3's does: the same bits at a third of the cost
# of torch's small operations. A step at a small batch hashes a handful of positions, where
# even numpy's per-call cost dominates (a few dozen calls, each slow right after a forward has
# emptied the caches): up to PYTHON_HASH_MAX uniforms, Python's own ints hash them one by one.
# `Words` is any of the three.
Words = Any
HOST_HASH_DEVICES = frozenset({"cpu"})  # device types whose uniforms the host hashes
PYTHON_HASH_MAX = 32


def _mul32(x: Words, c: int) -> Words:
    if isinstance(x, int):
        return x * c & _MASK32
    if isinstance(x, np.ndarray):
        return x * np.uint32(c)
    # x * c mod 2^32 with c split in 16-bit halves: every product stays below 2^49
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _rotl32(x: Words, r: int) -> Words:
    return ((x << r) & _MASK32) | (x >> (32 - r))


def _mix(h: Words, k: Words) -> Words:
    """One 32-bit word k into the murmur3 state h."""
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    return (_rotl32(h ^ k, 13) * 5 + 0xE6546B64) & _MASK32


def _finish(h: Words, num_words: int) -> Words:
    h = h ^ (4 * num_words)
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: Words) -> tuple[Words, Words]:
    """The low and high 32-bit halves of int64 values (as uint32 for a numpy array)."""
    low, high = x & _MASK32, (x >> 32) & _MASK32
    if isinstance(x, np.ndarray):
        return low.astype(np.uint32), high.astype(np.uint32)
    return low, high


# (salt, on the host) -> (seeds, the hash state after their words): the last seeds tensor seen
# per salt, which a batch passes step after step (its SamplingTensors are reused), so that each
# step hashes only the positions' words. Held by reference: an identical object, same seeds.
_seed_states: dict[tuple[int, bool], tuple[torch.Tensor, Words]] = {}


def _seed_state(seeds: torch.Tensor, salt: int, host: bool) -> Words:
    cached = _seed_states.get((salt, host))
    if cached is not None and cached[0] is seeds:
        return cached[1]
    h: Words = np.full(seeds.shape, salt, np.uint32) if host else torch.full_like(seeds, salt)
    for word in _words(seeds.numpy() if host else seeds):
        h = _mix(h, word)
    _seed_states[(salt, host)] = (seeds, h)
    return h


def uniform(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), float64, one per element of `positions`.

    seeds: [B] int64; positions: [B] or [B, S] int64; salt in [0, 2^32). A pure function of
    (seed, position, salt): (h + 1/2) / 2^32 for h the murmur3 hash (x86, 32-bit) of the four
    32-bit halves of seed and position, keyed by the salt. 32 bits put every probability
    within 2^-32 of its exact value, far below float32 rounding of the probabilities themselves.
    Each call is several dozen small tensor operations whatever its size: callers draw a
    step's uniforms in as few calls as they can.
    """
    return uniforms(seeds, positions, (salt,))[0]


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, salts: tuple[int, ...]) -> torch.Tensor:
    """[len(salts), *positions.shape]: `uniform` for several salts in one call."""
    host = positions.device.type in HOST_HASH_DEVICES
    seeds, positions = seeds.long(), positions.long()
    states = [_seed_state(seeds, salt, host) for salt in salts]
    if host and positions.numel() * len(salts) <= PYTHON_HASH_MAX:
        return _python_uniforms(states, positions)
    h = np.stack(states) if host else torch.stack(states)  # [S, B]
    h = h.reshape(*h.shape, *([1] * (positions.dim() - 1)))  # broadcast over the positions
    for word in _words(positions.numpy() if host else positions):
        h = _mix(h, word)
    h = _finish(h, 4)
    return torch.from_numpy((h + 0.5) * 2.0**-32) if host else (h.double() + 0.5) * 2.0**-32


def _python_uniforms(states: list[Words], positions: torch.Tensor) -> torch.Tensor:
    """`uniforms` with Python ints: states [S] of [B] hash states after the seeds' words."""
    per_row = positions[0].numel() if len(positions) else 0
    flat = positions.flatten().tolist()

    def one(h: int, position: int) -> float:
        for word in _words(position):
            h = _mix(h, word)
        return (_finish(h, 4) + 0.5) * 2.0**-32

    values = []
    for state in states:
        row_states = state.tolist()
        values.append([one(row_states[i // per_row], p) for i, p in enumerate(flat)])
    return torch.tensor(values, dtype=torch.float64).view(len(states), *positions.shape)


# ---- the seeded coupling ----

SALT_COUPLING = 3  # the coupling's noise


def coupling_noise(
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, S] int64
    vocab: int,
    rows: torch.Tensor | None = None,  # [B] bool: the rows that need noise (None: all)
) -> torch.Tensor:
    """[B, S, vocab] float32 standard Gumbel noise G(seed, position, token id), a pure function
    of the three (a wider vocabulary extends the same noise; rows not asked for are 0).

    On the CPU each (seed, position) keys a PCG64 stream whose token-id-th number is the
    token's uniform: one vectorised draw per stream. On a device, the murmur3 hash of (seed,
    position, token id), computed there (no host sync)."""
    b, s = positions.shape
    if positions.device.type in HOST_HASH_DEVICES:
        noise = torch.zeros(b, s, vocab)
        wanted = range(b) if rows is None else rows.nonzero().flatten().tolist()
        seeds64 = [x % 2**64 for x in seeds.tolist()]
        places = positions.tolist()
        u = np.empty((s, vocab), np.float32)
        for i in wanted:  # a row at a time: its temporaries stay in the caches
            for j, position in enumerate(places[i]):
                stream = np.random.PCG64DXSM([seeds64[i], position, SALT_COUPLING])
                np.random.Generator(stream).random(vocab, dtype=np.float32, out=u[j])
            noise[i] = _gumbel(torch.from_numpy(u))
        return noise
    else:
        h = _seed_state(seeds.long(), SALT_COUPLING, False)[:, None]  # [B, 1]
        for word in _words(positions.long()):
            h = _mix(h, word)
        tokens = torch.arange(vocab, device=positions.device)
        h = _finish(_mix(h[..., None], tokens), 5)  # [B, S, V]
        noise = _gumbel((h >> 8).float() * 2.0**-24)
        return noise if rows is None else noise * rows[:, None, None]


def _gumbel(r: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log u) from r in [0, 1) in steps of 2^-24 (float32), for u = r +
    2^-25 in the open interval. Float32 throughout, exactly where it matters: below 1/2,
    r + 2^-25 is exact; above, -log u is log1p of -(1 - r - 2^-25), also exact, so that the
    small -log u of u near 1 (the largest noise) keeps its relative precision."""
    half = r < 0.5
    below = (r + 2.0**-25).log_().neg_()  # in place: these tensors are a step's largest
    above = (1 - r).sub_(2.0**-25).neg_().log1p_().neg_()
    return torch.where(half, below, above, out=below).log_().neg_()


def perturbed_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[...] the Gumbel-max token of probs [..., V] under noise [..., >= V]."""
    return torch.log(probs).add_(noise[..., : probs.shape[-1]]).argmax(-1)


def couple(
    probs: torch.Tensor,  # [B, R, V] row r: the distribution at position first + offsets[:, r]
    st: SamplingTensors,
    first: torch.Tensor,  # [B]
    offsets: torch.Tensor | None,  # [B, R] int64 in 0..depth (a tree's); None: 0 .. R - 1
    depth: int,
    noise: torch.Tensor | None = None,  # [B, depth + 1, V'] drawn already for first + 0..depth
) -> torch.Tensor:
    """probs with each coupled row's distributions made point masses at their Gumbel-max token
    (the token the coupling emits there); the other rows as they were. `noise` (a drafter's,
    over its vocabulary) is drawn again when it does not cover the target's. No host sync."""
    if st.coupled is None:
        return probs
    b, r, v = probs.shape
    if noise is None or noise.shape[-1] < v:
        positions = first[:, None] + torch.arange(depth + 1, device=first.device)
        noise = coupling_noise(st.seeds, positions, v, st.coupled)
    noise = noise[..., :v]
    if offsets is not None:  # a tree's rows: each node's depth picks its position's noise
        noise = noise.gather(1, offsets[..., None].expand(b, r, v))  # [B, R, V]
    tokens = perturbed_argmax(probs, noise)[..., None]  # [B, R, 1]
    coupled = st.coupled[:, None, None]
    kept = torch.where(coupled, 1.0, probs.gather(-1, tokens))  # the others' own values
    return probs.masked_fill(coupled, 0.0).scatter_(-1, tokens, kept.to(probs.dtype))


# ---- logits processing ----


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [B, S, V'] at -inf where the grammar's `allowed` [B, S, V] bool is False: over the
    first min(V, V') ids as it says, and always past V (a drafter's padded vocabulary)."""
    if allowed is None:
        return logits
    width = min(logits.shape[-1], allowed.shape[-1])
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    keep[..., :width] = allowed[..., :width].to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))


def process_logits(
    logits: torch.Tensor,
    st: SamplingTensors,
    penalties: PenaltyState | None = None,
    draft_tokens: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Target (or drafter) logits -> the distributions the acceptance rules compare.

    logits: [B, S, V]; draft_tokens: [B, S-1] int64, the tokens before positions 1..S-1
    (-1 for padding); allowed: [B, S, V] bool, a grammar's masks (None: no grammar). Returns
    probabilities [B, S, V] (float32, or float64 for float64 logits) after, in this order:
    penalties (position j counts the output so far plus draft tokens 0..j-1, so that verifying
    k drafts sees what k plain steps would see), logit bias, the grammar's mask, temperature,
    top-k (ties with the k-th kept), top-p, min-p. Greedy rows are one-hot at the argmax of the
    penalised, biased, masked logits.
    """
    logits = cast(logits, torch.promote_types(logits.dtype, torch.float32))
    if penalties is not None and st.any_penalty:
        logits = _apply_penalties(logits, st, penalties, draft_tokens)
    logits = mask_logits(add_logit_bias(logits, st.logit_bias), allowed)
    vocab = logits.shape[-1]
    if st.all_greedy:
        return _one_hot(logits.argmax(-1), vocab, logits.dtype)
    temperature = st.temperature
    if st.any_greedy:
        greedy = temperature == 0  # [B]
        greedy_probs = _one_hot(logits.argmax(-1), vocab, logits.dtype)
        temperature = torch.where(greedy, 1.0, temperature)
    logits = logits / temperature[:, None, None]
    if st.any_top_k_or_p:
        logits = _top_k_top_p(logits, st.top_k, st.top_p)
    probs = logits.softmax(-1)
    if st.any_min_p:
        probs = _min_p(probs, st.min_p)
    if st.any_greedy:
        probs = torch.where(greedy[:, None, None], greedy_probs, probs)
    return probs


def _one_hot(tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., V] one-hot of int64 tokens [...] (F.one_hot would build it in int64)."""
    out = torch.zeros(*tokens.shape, vocab, dtype=dtype, device=tokens.device)
    return out.scatter_(-1, tokens[..., None], 1.0)


def _apply_penalties(
    logits: torch.Tensor,  # [B, S, V]
    st: SamplingTensors,
    penalties: PenaltyState,
    draft_tokens: torch.Tensor | None,  # [B, S-1]
) -> torch.Tensor:
    """vLLM's rules: repetition on prompt + output tokens (divide positive logits, multiply
    negative ones), then frequency and presence on output tokens."""
    batch, steps, vocab = logits.shape
    counts = penalties.output_counts[:, None, :].expand(batch, steps, vocab)
    if steps > 1:
        if draft_tokens is None:
            raise ValueError("penalties over several positions need the draft tokens")
        counts = counts + _prefix_counts(draft_tokens, steps, vocab)
    in_output = counts > 0
    seen = in_output | penalties.prompt_mask[:, None, :]
    rep = st.repetition_penalty[:, None, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - st.frequency_penalty[:, None, None] * counts
    return logits - st.presence_penalty[:, None, None] * in_output


def _prefix_counts(draft_tokens: torch.Tensor, steps: int, vocab: int) -> torch.Tensor:
    """[B, S, V]: how often each token occurs among draft tokens 0..j-1, for position j."""
    batch = draft_tokens.shape[0]
    valid = (draft_tokens >= 0).float()[..., None]  # [B, S-1, 1]
    step_counts = torch.zeros(batch, steps, vocab, device=draft_tokens.device)
    # draft token j precedes position j+1
    step_counts[:, 1:].scatter_(2, draft_tokens.clamp(min=0)[..., None], valid)
    return step_counts.cumsum(1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p (the smallest prefix of mass >= top_p), remove.

    One stable sort serves both; rows with top_k = 0 and top_p = 1 are left whole."""
    batch, steps, vocab = logits.shape
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [B]
    kth = ordered.gather(-1, (k - 1).view(batch, 1, 1).expand(batch, steps, 1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # the first token always has 0 before it
    # top_p = 1 must keep the tail whatever cumsum's rounding does
    limit = torch.where(top_p < 1, top_p, float("inf"))[:, None, None]
    ordered = ordered.masked_fill(mass_before >= limit, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens below min_p times the most likely token's probability; renormalise."""
    floor = min_p[:, None, None] * probs.amax(-1, keepdim=True)
    probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)


# ---- sampling ----


def sample(
    probs: torch.Tensor,  # [B, V], need not sum to 1
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, absolute position of the token drawn
    salt: int = SALT_SAMPLE,
    greedy: bool = False,
) -> torch.Tensor:
    """[B] int64: one draw per row by inverse CDF, the first index whose cdf exceeds u * total.

    Only tokens with positive probability can come out: u * total is kept below the total, and
    if cumsum's rounding still lands on a zero-probability token the row takes its argmax.
    `greedy` says every row has a single positive entry (an all-greedy batch): the draw is then
    that entry, found without the uniforms and the cumsum."""
    if greedy:
        return probs.argmax(-1)
    return draw(probs, uniform(seeds, positions, salt))


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample` with its uniforms u [B] drawn already (a caller drawing a step's at once)."""
    vocab = probs.shape[-1]
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = u.to(cdf.dtype)[:, None]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=vocab - 1)
    drawn = probs.gather(1, tokens[:, None]).squeeze(1) > 0
    return torch.where(drawn, tokens, probs.argmax(-1))


def chain_verify(
    target_probs: torch.Tensor,  # [B, k+1, V] processed target distributions
    draft_tokens: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor | None,  # [B, k, V] processed q; None: point-mass drafts
    num_drafts: torch.Tensor,  # [B] int64, k_r <= k; draft positions past k_r are ignored
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, absolute position of the first token emitted
    greedy: bool = False,  # every row of target_probs is one-hot (see `sample`)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain acceptance rule. Returns (tokens [B, k+1] int64, -1 padded; num_accepted [B]).

    Row r emits num_accepted + 1 tokens: the accepted drafts, then the recovered token (first
    rejection) or the bonus token (all k_r accepted, drawn from p at position k_r).

    Sampled drafts: accept x with probability min(1, p(x)/q(x)), recover from
    norm(max(0, p - q)). Point-mass drafts: accept x with probability p(x), else emit a draw
    of p with p(x) set to 0; realised by drawing t from p and accepting x iff t == x (t is
    then the emitted token), which has exactly that law. Greedy rows (one-hot p) accept
    while x is the argmax, under either rule.
    """
    batch, width, vocab = target_probs.shape
    k = width - 1
    steps = torch.arange(width, device=target_probs.device)
    in_draft = steps[:k] < num_drafts[:, None]  # [B, k]
    drafts = draft_tokens.clamp(min=0)
    if draft_probs is None or k == 0:
        flat = target_probs.reshape(-1, vocab)
        if greedy:
            drawn = flat.argmax(-1).view(batch, width)
        else:
            u = uniform(seeds, positions[:, None] + steps, SALT_SAMPLE)  # [B, W]
            drawn = draw(flat, u.flatten()).view(batch, width)
        num_accepted = _run_length((drawn[:, :k] == drafts) & in_draft)
        return torch.where(steps <= num_accepted[:, None], drawn, -1), num_accepted

    p_x = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, k]
    q_x = draft_probs.gather(2, drafts[..., None]).squeeze(2)  # [B, k]
    # the accept tests' uniforms and those of the token emitted at each position, at once
    u, u_emit = uniforms(seeds, positions[:, None] + steps, (SALT_ACCEPT, SALT_SAMPLE))
    num_accepted = _run_length((u[:, :k] * q_x < p_x) & in_draft)  # u < p/q, never if p(x) = 0

    rows = torch.arange(batch, device=target_probs.device)
    p = target_probs[rows, num_accepted]  # [B, V]
    rejected = (num_accepted < num_drafts)[:, None]
    q = draft_probs[rows, num_accepted.clamp(max=k - 1)] * rejected
    residual = (p - q).clamp(min=0)
    # p == q leaves no residual; a rejection then has probability 0 up to rounding
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    if greedy:
        last = residual.argmax(-1)
    else:
        last = draw(residual, u_emit.gather(1, num_accepted[:, None]).squeeze(1))
    tokens = torch.cat([drafts, last[:, None]], 1)
    tokens = torch.where(steps < num_accepted[:, None], tokens, -1)
    return tokens.scatter(1, num_accepted[:, None], last[:, None]), num_accepted


def _run_length(accepted: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] int64: how many leading positions are True."""
    return accepted.long().cumprod(1).sum(1)


def tree_verify(
    target_probs: torch.Tensor,  # [B, N+1, V]: row 0 the root (last token), row i+1 node i
    node_tokens: torch.Tensor,  # [B, N] int64 (-1: padding, never accepted)
    parents: torch.Tensor,  # [B, N] int64, parent node index, -1: child of the root
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, absolute position of the first token emitted
    depth: int | None = None,  # a bound on the tree's depth, known to the caller (no sync)
    greedy: bool = False,  # every row of target_probs is one-hot (see `sample`)
    node_depths: torch.Tensor | None = None,  # [B, N] from 1, when the caller knows them
    draft_probs: torch.Tensor | None = None,  # [B, N, V] the q each node was drawn from
    siblings: int = 0,  # with draft_probs: a bound on any node's children
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree acceptance rule. Returns (tokens [B, depth+1] int64 -1 padded, num_accepted
    [B], path [B, depth] accepted node indices -1 padded), depth being the tree's or the bound
    given.

    Children as point masses (draft_probs None, or greedy): from the root, the children of the
    current node are tried in index order, child c accepted with probability p(c), p(c) := 0
    and renormalised after each rejection; if none is accepted a draw of the remaining p is
    emitted. Drawing t from p and accepting the first child whose token is t has exactly that
    law, and emits what plain decoding with the same seed would. The draw at a node depends
    only on its row and its depth (the uniform of the position it emits at), so every row
    draws at once and the walk then only compares tokens.

    Children drawn independently from the drafter's q: `_sampled_tree_walk`.
    """
    if node_depths is None:
        node_depths = _node_depths(parents)
    if depth is None:
        depth = int(node_depths.max()) if node_depths.numel() else 0
    if draft_probs is not None and not greedy:
        return _sampled_tree_walk(
            target_probs, node_tokens, parents, draft_probs, seeds, positions, depth, siblings
        )
    if greedy:
        drawn = target_probs.argmax(-1)  # [B, N+1]
    else:
        batch, rows, vocab = target_probs.shape
        levels = torch.arange(depth + 1, device=positions.device)
        u = uniform(seeds, positions[:, None] + levels, SALT_SAMPLE)  # [B, depth + 1]
        row_levels = torch.cat([torch.zeros_like(node_depths[:, :1]), node_depths], 1)
        u_rows = u.gather(1, row_levels)
        drawn = draw(target_probs.reshape(-1, vocab), u_rows.flatten()).view(batch, rows)
    return _walk_tree(drawn, node_tokens, parents, depth)


def _sampled_tree_walk(
    target_probs: torch.Tensor,  # [B, N+1, V]
    node_tokens: torch.Tensor,  # [B, N]
    parents: torch.Tensor,  # [B, N]
    draft_probs: torch.Tensor,  # [B, N, V] q of each node (its siblings share it)
    seeds: torch.Tensor,
    positions: torch.Tensor,
    depth: int,
    siblings: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_verify for children drawn independently from q (SpecInfer's multi-draft rule): at
    the current node its children are tested in index order, child x accepted with probability
    min(1, p(x) / q(x)) and p := norm(max(0, p - q)) after each rejection; if none is accepted
    a draw of the remaining p is emitted. Each level's emitted token then follows p whatever
    q is, as with one sampled draft (the chain's rule is this with one child a node)."""
    batch, _, vocab = target_probs.shape
    siblings = max(siblings, 1)
    rows = torch.arange(batch, device=positions.device)
    nodes = torch.arange(node_tokens.shape[1], device=positions.device)
    levels = torch.arange(depth, device=positions.device)
    salts = tuple(SALT_CHILD_ACCEPT + r for r in range(siblings))
    u = uniforms(seeds, positions[:, None] + levels, salts).permute(1, 2, 0)  # [B, D, S]
    current = torch.full_like(positions, -1)  # node index, -1: the root
    walking = torch.ones_like(positions, dtype=torch.bool)
    steps, kept, remaining = [], [], []
    for level in range(depth):  # the nodes at `depth` have no children: nothing to test
        p = target_probs[rows, current + 1]  # [B, V]
        child = (parents == current[:, None]) & (node_tokens >= 0)  # [B, N]
        order = torch.where(child, nodes, nodes + nodes.numel()).argsort(1)[:, :siblings]
        valid = child.gather(1, order)  # [B, S] the children, in index order, then padding
        x = node_tokens.gather(1, order).clamp(min=0)  # [B, S]
        q = draft_probs[rows, order[:, 0]]  # [B, V]
        residuals = [p]  # p after 0, 1, .. rejections
        for _ in range(siblings):
            left = (residuals[-1] - q).clamp(min=0)
            total = left.sum(-1, keepdim=True)
            # p == q leaves no residual; a rejection then has probability 0 up to rounding
            residuals.append(torch.where(total > 0, left / total, residuals[-1]))
        stacked = torch.stack(residuals, 1)  # [B, S + 1, V]
        p_x = stacked[:, :siblings].gather(2, x[..., None]).squeeze(2)  # [B, S]
        passed = valid & (u[:, level] * q.gather(1, x) < p_x)  # never if p(x) = 0
        first = passed.int().argmax(1)  # the first child that passes
        accepted = walking & passed.any(1)
        remaining.append(stacked[rows, valid.sum(1)])  # what a stop here draws from
        node = order[rows, first]
        steps.append(torch.where(accepted, node, -1))
        kept.append(torch.where(accepted, x[rows, first], -1))
        current = torch.where(accepted, node, current)
        walking = accepted
    remaining.append(target_probs[rows, current + 1])  # a walk through every level
    path = torch.stack(steps, 1) if depth else parents[:, :0]  # [B, depth]
    num_accepted = (path >= 0).sum(1)
    stop = torch.stack(remaining, 1)[rows, num_accepted]  # [B, V]
    last = draw(stop, uniform(seeds, positions + num_accepted, SALT_SAMPLE))
    # [B, depth + 1]: the accepted tokens, -1 from the stop on
    tokens = torch.stack([*kept, torch.full_like(positions, -1)], 1)
    return tokens.scatter(1, num_accepted[:, None], last[:, None]), num_accepted, path


def _walk_tree(
    drawn: torch.Tensor,  # [B, N+1] the token each verify row draws
    node_tokens: torch.Tensor,  # [B, N]
    parents: torch.Tensor,  # [B, N]
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_verify once every row has drawn: a node matches when its token is its parent's
    draw, and once a level finds no matching child of the current node no later level does."""
    matches = node_tokens == drawn.gather(1, parents + 1)  # [B, N]
    current = torch.full_like(parents[:, 0], -1)  # node index, -1: the root
    steps = []
    for _ in range(depth):
        hit = (parents == current[:, None]) & matches
        found = hit.any(1)
        current = torch.where(found, hit.int().argmax(1), current)  # the first hit
        steps.append(torch.where(found, current, -1))
    path = torch.stack(steps, 1) if steps else parents[:, :0]  # [B, depth]
    accepted = (path >= 0).sum(1)
    rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], 1)  # root, path (-1 -> root)
    tokens = drawn.gather(1, rows)
    positions = torch.arange(depth + 1, device=path.device)
    return torch.where(positions <= accepted[:, None], tokens, -1), accepted, path


def _node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] each node's depth (children of the root have depth 1)."""
    depths = torch.ones_like(parents)
    for _ in range(parents.shape[1]):  # a forest of n nodes settles after n rounds
        above = depths.gather(1, parents.clamp(min=0))
        depths = torch.where(parents >= 0, above + 1, 1)
    return depths


def logprobs(
    logits: torch.Tensor,  # [B, V] raw model logits
    tokens: torch.Tensor,  # [B] int64, the tokens emitted
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the raw model distribution (log_softmax of the unprocessed
    logits: no penalties, temperature or truncation), as OpenAI reports them.

    Returns (chosen [B] float32, top_ids [B, n] int64, top_logprobs [B, n] float32), best
    first."""
    log_probs = torch.log_softmax(logits.float(), -1)
    chosen = log_probs.gather(1, tokens[:, None]).squeeze(1)
    top_logprobs, top_ids = log_probs.topk(n, dim=-1)
    return chosen, top_ids, top_logprobs
