"""Structured output: the grammar's token masks along a step's drafts (host work).

A request with a grammar carries a matcher (xgrammar's `GrammarMatcher`, made by
engine/grammar_compiler.py) that stands after the request's committed tokens. The sample stage alone
moves it on (`commit`, the emitted tokens); drafting and sampling walk it along draft tokens
and roll it back on the compute stream, and so do host drafts at plan time (`host_drafts`),
which the engine plans only once the step before has been sampled (a drafter with host
drafts needs every token), while no device stage reads the matcher. The masks it gives are
the law's support: the target's p and the drafter's q at a position are both restricted to
the tokens the grammar allows after the tokens before it (DESIGN.md, the acceptance rules),
so a draft the grammar forbids has p = 0 and is rejected, and the matcher never takes a token
past a rejection.

Masks are xgrammar's bitmasks (int32 words, bit v of word v // 32 set where token v is allowed),
unpacked here to bool tensors [..., V] for `masked_fill`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np
import torch

from core.request import Matcher
from core.step import Sequence


class GrammarWalk:
    """One step's masks for a batch: row b's matcher walked along its own tokens.

    `allowed(b, tokens)` gives the mask after each prefix of `tokens` (the first: after the
    committed tokens alone) and stops at the first token the grammar forbids; every walk is
    undone before the next, so the matchers end where they began."""

    def __init__(self, matchers: Seq[Matcher | None]):
        self.matchers = matchers
        self.vocab = next(m.vocab_size for m in matchers if m is not None)
        self.words = (self.vocab + 31) // 32

    @classmethod
    def of(cls, seqs: Seq[Sequence]) -> GrammarWalk | None:
        """A walk over the batch's matchers; None when no request has a grammar."""
        matchers = [s.request.matcher for s in seqs]
        return cls(matchers) if any(m is not None for m in matchers) else None

    def mask(self, matcher: Matcher, tokens: Seq[int]) -> tuple[torch.Tensor, int]:
        """(allowed [len(tokens) + 1, V] bool, how many of `tokens` the grammar allows in a
        row); rows past the first forbidden token allow everything (nothing reads them)."""
        bits = torch.full((len(tokens) + 1, self.words), -1, dtype=torch.int32)
        walked = 0
        for j in range(len(tokens) + 1):
            if matcher.is_terminated():  # past the grammar's end: the request ends here
                break
            matcher.fill_next_token_bitmask(bits, j)
            if j == len(tokens) or not _has(bits[j], tokens[j]):
                break
            matcher.accept_token(tokens[j])
            walked += 1
        if walked:
            matcher.rollback(walked)
        return _revive(unpack(bits, self.vocab), matcher), walked

    def chain(self, drafts: list[list[int]], width: int) -> torch.Tensor:
        """[B, width, V] bool: each row's mask at the step's positions, along its drafts."""
        out = torch.ones(len(self.matchers), width, self.vocab, dtype=torch.bool)
        for b, matcher in enumerate(self.matchers):
            if matcher is not None:
                allowed, _ = self.mask(matcher, drafts[b][: width - 1])
                out[b, : allowed.shape[0]] = allowed
        return out

    def tree(self, tokens: list[list[int]], parents: list[list[int]]) -> torch.Tensor:
        """[B, N + 1, V] bool: the root's mask, then each node's after the tokens on its path
        (its ancestors' and its own); a node below a forbidden token allows everything."""
        n = len(tokens[0]) if tokens else 0
        out = torch.ones(len(self.matchers), n + 1, self.vocab, dtype=torch.bool)
        for b, matcher in enumerate(self.matchers):
            if matcher is None:
                continue
            out[b, 0] = self.mask(matcher, [])[0][0]
            for i in range(n):
                path = _path(tokens[b], parents[b], i)
                if path:
                    allowed, walked = self.mask(matcher, path)
                    if walked == len(path):
                        out[b, i + 1] = allowed[-1]
        return out

    def after(self, paths: list[list[list[int]]]) -> torch.Tensor:
        """[B, m, V] bool: each row's mask after each of its m token paths (from the committed
        tokens); a path the grammar forbids allows everything (nothing it drafts is kept)."""
        m = len(paths[0]) if paths else 0
        out = torch.ones(len(self.matchers), m, self.vocab, dtype=torch.bool)
        for b, matcher in enumerate(self.matchers):
            if matcher is None:
                continue
            for i, path in enumerate(paths[b]):
                allowed, walked = self.mask(matcher, path)
                if walked == len(path):
                    out[b, i] = allowed[-1]
        return out

    def commit(self, tokens: list[list[int]], emitted: list[int]) -> None:
        """Each row's matcher advanced over the tokens the step emitted for it."""
        for matcher, row, n in zip(self.matchers, tokens, emitted, strict=True):
            if matcher is not None:
                commit(matcher, row[:n])


class DraftWalk:
    """The masks a grammar-aware drafter draws from, one position at a time: each row's
    matcher advanced along the tokens drafted so far, all rolled back by `undo`. A row whose
    draft the grammar forbade (its q allowed nothing, or a drafter drafted unmasked) stops
    there: its later masks allow everything, and the sampler rejects that draft anyway."""

    def __init__(self, walk: GrammarWalk):
        self.walk = walk
        self.walked = [0] * len(walk.matchers)
        self.stuck = [m is None for m in walk.matchers]
        self.bits = torch.full((len(walk.matchers), walk.words), -1, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """[B, V] bool: each row's mask at the next draft position."""
        self.bits.fill_(-1)
        live = []
        for b, matcher in enumerate(self.walk.matchers):
            if matcher is not None and not self.stuck[b] and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(self.bits, b)
                live.append((b, matcher))
        allowed = unpack(self.bits, self.walk.vocab)
        for b, matcher in live:
            _revive(allowed[b : b + 1], matcher)
        return allowed

    def advance(self, tokens: list[int]) -> None:
        """Each row's matcher takes the token drafted at this position."""
        for b, matcher in enumerate(self.walk.matchers):
            if self.stuck[b] or matcher is None:
                continue
            if matcher.is_terminated():
                self.stuck[b] = True
            elif _has(self.bits[b], tokens[b]) and matcher.accept_token(tokens[b]):
                self.walked[b] += 1
            else:
                self.stuck[b] = True

    def undo(self) -> None:
        for matcher, walked in zip(self.walk.matchers, self.walked, strict=True):
            if matcher is not None and walked:
                matcher.rollback(walked)
        self.walked = [0] * len(self.walked)


def host_drafts(
    matcher: Matcher,
    proposed: list[int],
    k: int,
    spell: Callable[[str], list[int]] | None = None,
) -> list[int]:
    """Up to k drafts for a request with a grammar, made on the host at plan time (when its
    matcher stands after every committed token): the proposed tokens (n-gram's) while the
    grammar allows them; then, position by position, the token the grammar forces (the one
    its mask allows, which the target's masked law accepts with probability 1: a free draft),
    else the usual spelling (`spell`) of the string it forces next (a key of a schema's object,
    say, which a tokenizer can spell several ways: a draft the target verifies, never forced).
    """
    bits = torch.zeros(1, (matcher.vocab_size + 31) // 32, dtype=torch.int32)
    queue, drafts = list(proposed), list[int]()  # queue: the tokens to try next, in order
    while len(drafts) < k and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(bits, 0)
        if not (queue and _has(bits[0], queue[0])):
            queue = _grammar_next(matcher, bits, spell)
            if not (queue and _has(bits[0], queue[0])):
                break
        token = queue.pop(0)
        matcher.accept_token(token)
        drafts.append(token)
    if drafts:
        matcher.rollback(len(drafts))
    return drafts


def _grammar_next(
    matcher: Matcher, bits: torch.Tensor, spell: Callable[[str], list[int]] | None
) -> list[int]:
    """What the grammar implies next: its one allowed token, else its forced string spelled."""
    allowed = unpack(bits, matcher.vocab_size)[0].nonzero()
    if len(allowed) == 1:
        return [int(allowed[0])]
    forced = matcher.find_jump_forward_string() if spell is not None else ""
    return spell(forced) if forced and spell is not None else []


def commit(matcher: Matcher, tokens: Seq[int]) -> None:
    """Advance a matcher over tokens the sampler emitted (each allowed by its mask), up to the
    grammar's end: a token past it (after eos) finishes the request anyway."""
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(token):
            return


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmasks [..., W] -> bool [..., vocab]: bit v % 32 of word v // 32 (little-endian)."""
    as_bytes = bits.numpy().view(np.uint8)
    flat = np.unpackbits(as_bytes, axis=-1, bitorder="little")[..., :vocab]
    return torch.from_numpy(flat.astype(bool))


def _revive(allowed: torch.Tensor, matcher: Matcher) -> torch.Tensor:
    """Masks [n, V] of a matcher: one that allows nothing (a dead end: no token of the
    vocabulary continues the grammar) allows the grammar's stop tokens, which end the request
    (its finish reason says why: engine/output.py)."""
    dead = ~allowed.any(-1)
    if bool(dead.any()):
        for stop in matcher.stop_token_ids:
            allowed[dead, stop] = True
    return allowed


def _has(bits: torch.Tensor, token: int) -> bool:
    """Whether the bitmask row [W] allows token."""
    if not 0 <= token < bits.shape[0] * 32:
        return False
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the root's first child down to `node` (empty for a padding node)."""
    path = []
    while node >= 0:
        if tokens[node] < 0:
            return []
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]
