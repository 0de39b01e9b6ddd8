"""Streaming out: stop strings split across tokens, UTF-8 safe deltas, finish reasons."""

from __future__ import annotations

import pytest

from core.params import SamplingParams
from core.request import FinishReason, Request
from engine.output import OutputStream
from models.tokenizer import Tokenizer
from tests.tiny import write_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_tokenizer(directory)
    return Tokenizer(directory)


def stream(tokenizer, text: str, **params) -> tuple[list[str], FinishReason | None]:
    """Feed text's tokens one at a time; the deltas' texts and the finish reason."""
    request = Request("r", tokenizer.encode("x"), SamplingParams(max_tokens=1000, **params), 0, 0)
    out = OutputStream(request, tokenizer, max_model_len=4096)
    texts = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        delta = out.add([token], None)
        texts.append(delta.text)
        if delta.finish_reason is not None:
            return texts, delta.finish_reason
    return texts, None


def test_stop_string_split_across_tokens_is_never_streamed(tokenizer):
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    texts, reason = stream(tokenizer, text, stop=("return a",))
    assert reason is FinishReason.STOP
    assert "".join(texts) == "def add(a, b):\n    "
    assert all("ret" not in t for t in texts)


def test_text_that_only_looks_like_a_stop_is_released(tokenizer):
    texts, reason = stream(tokenizer, "for i in range(10):\n", stop=("for j",))
    assert reason is None
    assert "".join(texts) == "for i in range(10):\n"


def test_deltas_never_break_a_character(tokenizer):
    text = "日本語のテキスト 🙂 héllo wörld"
    texts, _ = stream(tokenizer, text)
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == text


def test_max_tokens_and_stop_token(tokenizer):
    request = Request("r", [5], SamplingParams(max_tokens=3, stop_token_ids=(9,)), 0, 0)
    out = OutputStream(request, tokenizer, max_model_len=4096)
    delta = out.add([7, 9, 11], None)
    assert delta.token_ids == [7, 9] and delta.finish_reason is FinishReason.STOP
    request = Request("s", [5], SamplingParams(max_tokens=2), 0, 0)
    delta = OutputStream(request, tokenizer, max_model_len=4096).add([7, 8, 11], None)
    assert delta.token_ids == [7, 8] and delta.finish_reason is FinishReason.LENGTH
    assert delta.usage.completion_tokens == 2
