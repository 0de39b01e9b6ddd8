"""The sample stage: target logits and drafts in, a Verdict out (device work). The rules it
applies are stages/logits.py (logits processing), stages/sampling.py (the acceptance rules) and
stages/rng.py (keyed uniforms)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
import torch.nn.functional as F

from core.params import SamplingParams, SamplingTensors
from core.step import DevicePlan, Drafts, Plan, TargetOutput, Verdict
from models import native
from stages.grammar import GrammarWalk
from stages.history import TokenHistory
from stages.logits import PenaltyState, adjusted_logits, process_logits
from stages.rng import couple
from stages.sampling import chain_verify, logprobs, point_mass_verify, sample, tree_verify


class SampleStage:
    def __init__(self, history: TokenHistory, vocab_size: int):
        self.history = history
        self.vocab_size = vocab_size

    def __call__(self, plan: Plan, dev: DevicePlan, out: TargetOutput, drafts: Drafts) -> Verdict:
        """The verdict; the requests' grammars (if any) then stand after the emitted tokens."""
        walk = GrammarWalk.of(plan.seqs)
        verdict = self._verdict(plan, dev, out, drafts, walk)
        if walk is not None:  # the host needs the tokens: a sync where the device is not it
            walk.commit(verdict.tokens.tolist(), verdict.num_emitted.tolist())
        return verdict

    @staticmethod
    def _forced(verdict: Verdict, allowed: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Verdict.forced from the masks [B, R, V] of the rows the emitted tokens were drawn
        from (`rows` [B, W]; None: row j for token j)."""
        single = allowed.sum(-1) == 1  # [B, R]
        if rows is not None:
            single = single.gather(1, rows.cpu())
        verdict.forced = single.to(verdict.tokens.device)

    def _verdict(
        self,
        plan: Plan,
        dev: DevicePlan,
        out: TargetOutput,
        drafts: Drafts,
        walk: GrammarWalk | None,
    ) -> Verdict:
        st = dev.sampling
        first = dev.base + 1  # position of the first token this step emits
        penalties = self._penalties(dev, first) if st.any_penalty else None
        if plan.k and drafts.parents is not None:
            return self._tree(plan, dev, out, drafts, penalties, walk)
        draft_tokens = drafts.tokens if plan.k else None
        allowed = None
        if walk is not None:
            listed = draft_tokens.tolist() if draft_tokens is not None else [[]] * len(plan.seqs)
            capped = [row[:n] for row, n in zip(listed, plan.num_drafts, strict=True)]
            allowed = walk.chain(capped, plan.width)
        if st.all_greedy and drafts.probs is None:  # the argmax; no distribution is needed
            adjusted = adjusted_logits(out.logits, st, penalties, draft_tokens, allowed)
            drawn = native.argmax(adjusted)  # [B, W]
            verdict = self._greedy(dev, drawn, drafts)
        else:
            probs = process_logits(out.logits, st, penalties, draft_tokens, allowed)  # [B, W, V]
            verdict = self._chain(plan, dev, probs, drafts, first)
        if plan.top_logprobs is not None:
            self._logprobs(verdict, out.logits, plan.top_logprobs)
        if allowed is not None:
            self._forced(verdict, allowed, None)
        return verdict

    @staticmethod
    def _greedy(dev: DevicePlan, drawn: torch.Tensor, drafts: Drafts) -> Verdict:
        """The chain rule for an all-greedy batch, from the target's argmax tokens [B, W]."""
        tokens, accepted = point_mass_verify(drawn, drafts.tokens, dev.num_drafts)
        return Verdict(tokens, accepted, torch.where(dev.emits, accepted + 1, 0))

    def _chain(
        self, plan: Plan, dev: DevicePlan, probs: torch.Tensor, drafts: Drafts, first: torch.Tensor
    ) -> Verdict:
        st = dev.sampling
        if st.coupled is not None:  # row j: position first + j
            probs = couple(probs, st, first, None, plan.k, drafts.noise)
        if plan.k:
            tokens, accepted = chain_verify(
                probs, drafts.tokens, drafts.probs, dev.num_drafts, st.seeds, first, st.all_greedy
            )
        else:
            tokens = sample(probs[:, 0], st.seeds, first, greedy=st.all_greedy)[:, None]
            accepted = torch.zeros_like(first)
        emitted = torch.where(dev.emits, accepted + 1, 0)
        return Verdict(tokens, accepted, emitted)

    def _tree(
        self,
        plan: Plan,
        dev: DevicePlan,
        out: TargetOutput,
        drafts: Drafts,
        penalties: PenaltyState | None,
        walk: GrammarWalk | None,
    ) -> Verdict:
        """The tree rule; tokens padded to [B, W] like a chain's."""
        st = dev.sampling
        allowed = None
        if walk is not None:
            assert drafts.parents is not None
            allowed = walk.tree(drafts.tokens.tolist(), drafts.parents.tolist())
        probs = _tree_probs(out.logits, st, penalties, drafts, allowed)
        assert drafts.parents is not None and drafts.depths is not None
        first = dev.base + 1
        if st.coupled is not None:  # the root's row: position first; node i's: first + depth_i
            offsets = F.pad(drafts.depths, (1, 0))
            probs = couple(probs, st, first, offsets, drafts.depth, drafts.noise)
        tokens, accepted, path = tree_verify(
            probs,
            drafts.tokens,
            drafts.parents,
            st.seeds,
            first,
            depth=drafts.depth,
            greedy=st.all_greedy,
            node_depths=drafts.depths,
            draft_probs=drafts.probs,
            siblings=drafts.siblings,
        )
        b, w, v = out.logits.shape
        tokens = F.pad(tokens, (0, w - tokens.shape[1]), value=-1)
        emitted = torch.where(dev.emits, accepted + 1, 0)
        verdict = Verdict(tokens, accepted, emitted, path=path)
        # emitted token j was drawn from the row of the path's node j - 1 (the root's: 0)
        rows = torch.zeros_like(tokens)
        rows[:, 1 : path.shape[1] + 1] = 1 + path.clamp(min=0)
        if plan.top_logprobs is not None:
            logits = out.logits.gather(1, rows[..., None].expand(b, w, v))
            self._logprobs(verdict, logits, plan.top_logprobs)
        if allowed is not None:
            self._forced(verdict, allowed, rows)
        return verdict

    def _penalties(self, dev: DevicePlan, first: torch.Tensor) -> PenaltyState:
        counts = self.history.counts(dev.rows, dev.prompt_lens, first, self.vocab_size)
        zeros = torch.zeros_like(dev.prompt_lens)
        in_prompt = self.history.counts(dev.rows, zeros, dev.prompt_lens, self.vocab_size) > 0
        return PenaltyState(counts, in_prompt)

    @staticmethod
    def _logprobs(verdict: Verdict, logits: torch.Tensor, n: int) -> None:
        b, w, v = logits.shape
        chosen, top_ids, top = logprobs(
            logits.reshape(b * w, v), verdict.tokens.clamp(min=0).flatten(), n
        )
        verdict.logprobs = chosen.view(b, w)
        verdict.top_ids = top_ids.view(b, w, n)
        verdict.top_logprobs = top.view(b, w, n)


def probe_sampler(vocab: int, device: torch.device, seeded: bool) -> Callable[[int], None]:
    """`run(n)`: the sampler's work over n rows of one sampled request (a chain of n - 1
    point-mass drafts; `seeded`: drawn by the seeded coupling), which the cost model times
    (engine/cost.py): the distributions, the coupling's noise, the draws."""
    st = SamplingTensors.build([SamplingParams(seed=0 if seeded else None)], [0], device)
    first = torch.zeros(1, dtype=torch.long, device=device)

    def run(rows: int) -> None:
        probs = process_logits(torch.zeros(1, rows, vocab, device=device), st)
        probs = couple(probs, st, first, None, rows - 1)
        drafts = torch.zeros(1, rows - 1, dtype=torch.long, device=device)
        num_drafts = torch.full((1,), rows - 1, device=device)
        chain_verify(probs, drafts, None, num_drafts, st.seeds, first)

    return run


def _tree_probs(
    logits: torch.Tensor,  # [B, N + 1, V] root row, then a row per node
    st: SamplingTensors,
    penalties: PenaltyState | None,
    drafts: Drafts,
    allowed: torch.Tensor | None,  # [B, N + 1, V] bool: the grammar's masks; None: no grammar
) -> torch.Tensor:
    """[B, N + 1, V] processed target distributions; with penalties, a node's row counts the
    tokens on its own path (its ancestors and itself), as plain decoding would."""
    if penalties is None:
        return process_logits(logits, st, allowed=allowed)
    assert drafts.ancestors is not None
    b, w, v = logits.shape
    tokens = drafts.tokens  # [B, N]
    hits = torch.zeros(b, w - 1, v, device=logits.device)
    hits.scatter_(2, tokens.clamp(min=0)[..., None], (tokens >= 0).float()[..., None])
    on_path = drafts.ancestors.float() @ hits  # [B, N, V]
    counts = penalties.output_counts[:, None] + F.pad(on_path, (0, 0, 1, 0))  # [B, W, V]
    rows = PenaltyState(counts.view(b * w, v), penalties.prompt_mask.repeat_interleave(w, 0))
    flat = None if allowed is None else allowed.view(b * w, 1, -1)
    probs = process_logits(logits.view(b * w, 1, v), _repeat_rows(st, w), rows, allowed=flat)
    return probs.view(b, w, v)


def _repeat_rows(st: SamplingTensors, n: int) -> SamplingTensors:
    """Each row's parameters repeated n times in place (row r becomes rows r * n .. r * n + n-1)."""
    values = {f.name: getattr(st, f.name) for f in fields(st)}
    repeated: dict[str, Any] = {
        name: v.repeat_interleave(n, 0) if isinstance(v, torch.Tensor) else v
        for name, v in values.items()
    }
    return SamplingTensors(**repeated)
