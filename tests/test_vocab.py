"""A draft vocabulary (models/vocab.py): the draft model's head over some tokens, lossless."""

from __future__ import annotations

import collections
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

from core.params import SamplingParams
from models import native
from models.gguf import head_rows
from models.linear import QuantLinear
from models.llama import prepare_for_inference
from models.loader import load_model
from models.tokenizer import Tokenizer
from models.vocab import ReducedHead, float_rows, frequent_ids
from tests.engine_util import make_config, running, staggered

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_the_vocabulary_keeps_the_frequent_tokens_and_the_specials(tiny_target):
    tokenizer = Tokenizer(tiny_target)
    ids = frequent_ids(tokenizer, 320, 100)
    assert ids.tolist() == sorted(set(ids.tolist())) and len(ids) == 100
    assert set(tokenizer.specials.values()) <= set(ids.tolist())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    counts = collections.Counter(tokenizer.encode((stdlib / "abc.py").read_text()))
    common = [i for i, _ in counts.most_common(20) if i < 320]
    assert set(common) <= set(ids.tolist())
    assert torch.equal(frequent_ids(tokenizer, 320, 320), torch.arange(320))


def test_a_reduced_head_gives_its_rows_logits_and_minus_infinity_elsewhere():
    full = nn.Linear(8, 50, bias=False)
    ids = torch.tensor([1, 4, 9, 33])
    head = ReducedHead(float_rows(full, ids), ids, 50)
    x = torch.randn(3, 8)
    out = head(x)
    torch.testing.assert_close(out[:, ids], full(x)[:, ids])
    others = torch.ones(50, dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(out[:, others]).all()


def test_a_quantized_heads_rows_give_the_full_heads_values(tiny_quant_target):
    """The rows read from the file and packed alone give what the whole head gives there,
    bit for bit (a row's result does not depend on the rows beside it)."""
    if native.quant_path() == "torch":
        pytest.skip("the native kernels did not build")
    model = load_model(tiny_quant_target, quantized=True)
    prepare_for_inference(model)
    ids = torch.tensor([0, 3, 17, 100, 319])
    rows = head_rows(tiny_quant_target, ids)
    assert isinstance(rows, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    x = torch.randn(4, model.config.hidden_size)
    assert torch.equal(rows(x), model.lm_head(x)[:, ids])


@pytest.mark.parametrize("quantized", [False, True])
async def test_greedy_speculation_with_a_draft_vocabulary_equals_plain(
    tiny_target, tiny_quant_target, ragged16, quantized
):
    """A draft model drafting over 160 of the 320 tokens: the same output as plain decoding;
    a float draft model's rows, and a quantized file's (the target as its own draft, so that
    drafts are accepted where the vocabulary holds the target's token)."""
    target = draft = tiny_quant_target if quantized else tiny_target
    prompts = ragged16[:6]
    async with running(make_config(target)) as engine:
        plain = await staggered(engine, prompts, GREEDY)
    config = make_config(target, "draft", draft, k=3, spec_kw={"draft_vocab": 160})
    async with running(config) as engine:
        assert isinstance(engine.drafter.model.lm_head, ReducedHead)
        assert await staggered(engine, prompts, GREEDY) == plain
        value = engine.metrics.registry.value
        assert value("tandem_spec_decode_num_accepted_tokens_total") > 0  # drafts were used
