"""The sample stage: target logits and drafts in, a Verdict out (device work)."""

from __future__ import annotations

import torch

from stages.draft import Drafts, TargetOutput, Verdict
from stages.history import TokenHistory
from stages.plan import DevicePlan, Plan
from stages.sample import PenaltyState, chain_verify, logprobs, process_logits, sample


class SampleStage:
    def __init__(self, history: TokenHistory, vocab_size: int):
        self.history = history
        self.vocab_size = vocab_size

    def __call__(self, plan: Plan, dev: DevicePlan, out: TargetOutput, drafts: Drafts) -> Verdict:
        st = plan.sampling
        first = dev.base + 1  # position of the first token this step emits
        penalties = self._penalties(dev, first) if st.any_penalty else None
        draft_tokens = drafts.tokens if plan.k else None
        probs = process_logits(out.logits, st, penalties, draft_tokens)  # [B, W, V]
        if plan.k:
            tokens, accepted = chain_verify(
                probs, drafts.tokens, drafts.probs, dev.num_drafts, st.seeds, first
            )
        else:
            tokens = sample(probs[:, 0], st.seeds, first)[:, None]
            accepted = torch.zeros_like(first)
        emitted = torch.where(dev.emits, accepted + 1, 0)
        verdict = Verdict(tokens, accepted, emitted)
        if plan.top_logprobs is not None:
            self._logprobs(verdict, out.logits, plan.top_logprobs)
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
