"""make_plan alone, without a model: what a prefill and a decode step pack, and what the
device unpacks from it."""

from __future__ import annotations

import torch

from core.params import SamplingTensors
from core.step import Batch, Sequence, StepKind
from stages.pack import make_plan, pack, unpack
from tests.engine_util import sequence

PAGE = 4


def sampling(seqs: list[Sequence]) -> SamplingTensors:
    return SamplingTensors.build([s.request.params for s in seqs], [0] * len(seqs), "cpu")


def test_a_prefill_plan_packs_each_chunk_and_samples_only_after_a_final_one():
    done = sequence(0, 3, [7])  # a whole 3-token prompt: the step samples its first token
    part = sequence(1, 6, [2, 5])  # tokens 2..4 of 6: nothing to sample yet
    part.num_prefilled = 2
    batch = Batch(StepKind.PREFILL, [done, part], [3, 3])
    plan = make_plan(batch, 0, 4, PAGE, sampling(batch.seqs))
    f = plan.fields
    assert plan.k == 0 and plan.kind == StepKind.PREFILL  # prefill never drafts
    assert f["input_ids"] == [10, 11, 12, 12, 13, 14]
    assert f["positions"] == [0, 1, 2, 2, 3, 4]
    assert f["slot_mapping"] == [28, 29, 30, 10, 11, 20]  # page 7 then pages 2, 5
    assert f["logits_index"] == [2, 5]  # each chunk's last token
    assert plan.emits == [True, False] and f["emit_index"] == [0]
    assert f["base"] == [2, 4]
    # a final chunk keeps a key for the token it samples: 4 keys; the partial one 5
    assert f["kv_indptr"] == [0, 1, 3] and f["kv_indices"] == [7, 2, 5]
    assert f["kv_last_page_len"] == [4, 1]
    assert f["tail_slots"] == [30, 31, 0, 0]  # base, base + 1 (only a final chunk's)
    assert plan.num_tokens == 6 and plan.max_q == 3 and plan.max_kv == 2 * PAGE


def test_a_decode_plan_verifies_k_drafts_capped_by_each_request():
    a = sequence(0, 5, [3, 4])  # position 5 next
    b = sequence(1, 2, [9, 1], max_tokens=2)  # one output token left: no drafts
    b.num_tokens = 3  # its first output token is committed
    batch = Batch(StepKind.DECODE, [a, b], [0, 0])
    plan = make_plan(batch, 4, 2, PAGE, sampling(batch.seqs), [[7, 8], []], [0, 1])
    f = plan.fields
    assert plan.k == 2 and plan.width == 3
    assert plan.num_drafts == [2, 0]  # b: max_tokens leaves room for the bonus token only
    assert f["positions"] == [4, 5, 6, 2, 3, 4]  # the last committed token, then k drafts
    assert f["slot_mapping"] == [16, 17, 18, 38, 39, 4]
    assert f["logits_index"] == list(range(6))
    assert f["base"] == [4, 2] and plan.emits == [True, True]
    assert f["host_drafts"] == [7, 8, -1, -1]
    # keys after the step: n + k (+ 1 where the previous step's acceptance is unknown)
    assert f["kv_last_page_len"] == [4, 3] and f["unknown"] == [0, 1]  # 8 and 7 keys
    assert f["tail_slots"] == [16, 17, 18, 19, 38, 39, 4, 5]


def test_the_device_plan_unpacks_what_was_packed():
    a, b = sequence(2, 5, [3, 4], logprobs=2), sequence(0, 3, [6, 8], logprobs=5)
    batch = Batch(StepKind.DECODE, [a, b], [0, 0])
    plan = make_plan(batch, 1, 1, PAGE, sampling(batch.seqs))
    assert plan.top_logprobs == 5  # the most any request of the batch wants
    flat, layout = pack(plan.fields)
    dev = unpack(plan, torch.tensor(flat, dtype=torch.int32), layout)
    assert dev.rows.tolist() == [2, 0]
    assert dev.positions.tolist() == plan.fields["positions"]
    assert dev.tail_slots.tolist() == [[16, 17, 18], [26, 27, 32]]
    assert dev.token_rows.tolist() == [2, 2, 0, 0]  # each query token's request row
    assert dev.host_drafts.tolist() == [[-1], [-1]]
    assert dev.target_meta.kv_lens.tolist() == [7, 5]
    assert dev.target_meta.slot_mapping.tolist() == plan.fields["slot_mapping"]
