"""Keyed random numbers: every uniform a hash of (request seed, absolute token position,
purpose salt), so a request draws the same numbers whatever else is in the batch; and the
seeded coupling's Gumbel noise, a pure function of (seed, position, token id).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.params import SamplingTensors
from models import native
from models.graphs import in_whole_step

SALT_SAMPLE = 0  # the token emitted at a position: plain decode, bonus, recovered, tree
SALT_ACCEPT = 1  # the accept test of a sampled draft token
SALT_DRAFT = 2  # for drafters that sample q; must stay apart from the two above
# a sampled tree: its rank-r children drawn from q (the drafter), their accept tests (the sampler)
SALT_CHILD = 1 << 16  # + r
SALT_CHILD_ACCEPT = 1 << 17  # + r

_MASK32 = 0xFFFFFFFF


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
    of the three (a wider vocabulary extends the same noise; rows not asked for are 0): G =
    -log(-log u) for u = r + 2^-25, r the murmur3 hash of (seed, position, token id) on 24
    bits, computed where the tensors are (on the CPU by the native kernel where it built)."""
    noise = _gumbel(coupling_uniforms(seeds, positions, vocab))
    return noise if rows is None else noise * rows[:, None, None]


def coupling_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, S, vocab] float32: each token's r in [0, 1) in steps of 2^-24 (coupling_noise)."""
    b, s = positions.shape
    if positions.device.type in HOST_HASH_DEVICES and native.available():
        return native.coupling_uniforms(_coupling_keys(seeds, positions).ravel(), vocab).view(
            b, s, vocab
        )
    h = _seed_state(seeds.long(), SALT_COUPLING, False)[:, None]  # [B, 1]
    for word in _words(positions.long()):
        h = _mix(h, word)
    tokens = torch.arange(vocab, device=positions.device)
    h = _finish(_mix(h[..., None], tokens), 5)  # [B, S, V]
    return (h >> 8).float() * 2.0**-24


def _coupling_keys(seeds: torch.Tensor, positions: torch.Tensor) -> np.ndarray:
    """[B, S] uint32: the hash states after the seed's and the position's words (on the host;
    a few with Python's ints, as `uniforms`)."""
    states = _seed_state(seeds.long(), SALT_COUPLING, True)
    if positions.numel() > PYTHON_HASH_MAX:
        h = states[:, None]
        for word in _words(positions.long().numpy()):
            h = _mix(h, word)
        return np.asarray(h, dtype=np.uint32)
    keys = []
    for state, row in zip(states.tolist(), positions.tolist(), strict=True):
        for position in row:
            h = state
            for word in _words(position):
                h = _mix(h, word)
            keys.append(h)
    return np.array(keys, dtype=np.uint32).reshape(positions.shape)


def coupled_tokens(
    probs: torch.Tensor,  # [B, R, V]
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, R] int64: each row's position
) -> torch.Tensor:
    """[B, R] int64: each row's Gumbel-max token under coupling_noise, found as the token of
    the largest p / E for E = -log u (the same token: argmax log p - log E), in double
    precision. On the CPU in float32, one native pass a row that takes the logarithm of a few
    tokens only (SmolLM2's vocabulary: 60 us a row against 420 for drawing the noise whole
    and perturbing log p); elsewhere from the uniforms drawn whole."""
    b, r, v = probs.shape
    if probs.device.type in HOST_HASH_DEVICES and native.usable(probs):
        keys = _coupling_keys(seeds, positions).ravel()
        return native.coupled_tokens(probs.reshape(b * r, v), keys).view(b, r)
    u = coupling_uniforms(seeds, positions, v).double() + 2.0**-25
    return (probs.double() / u.log().neg()).argmax(-1)


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
    over its vocabulary) is drawn again when it does not cover the target's; on the host,
    coupled_tokens finds each row's token without it. No device sync."""
    if st.coupled is None:
        return probs
    b, r, v = probs.shape
    if probs.device.type in HOST_HASH_DEVICES:  # the coupled rows' tokens, each found alone
        positions = first[:, None] + (torch.arange(r) if offsets is None else offsets)
        # every row where all are coupled, or where shapes must not depend on values (a
        # step's graph: the others' tokens are found and left unused)
        if in_whole_step() or bool(st.coupled.all()):
            tokens = coupled_tokens(probs, st.seeds, positions)[..., None]
        else:
            rows = st.coupled.nonzero().flatten()
            tokens = torch.zeros(b, r, 1, dtype=torch.long)  # the others' are left as they are
            tokens[rows] = coupled_tokens(probs[rows], st.seeds[rows], positions[rows])[..., None]
    else:  # the drafter's noise where it covers the vocabulary, perturbing log p
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
