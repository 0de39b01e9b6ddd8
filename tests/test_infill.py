"""llama.cpp's /infill: its prompt, token for token (hand-built cases on the tiny tokenizer,
and fixtures recorded from llama.cpp's own server on Qwen2.5-Coder), the request bodies of
llama.vim and llama.vscode, fill in the middle equal to /v1/completions with a suffix, every
drafter lossless, the warm-up that caches the context, streaming, and bad fields."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import infill
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from models.tokenizer import Tokenizer
from tests.fakes import served
from tests.infill_bodies import LLAMA_VIM, LLAMA_VIM_WARM_UP, LLAMA_VSCODE, PREFIX, SUFFIX
from tests.tiny import write_tokenizer

FIXTURES = Path(__file__).parent / "infill_llamacpp.json"
QWEN = Path.home() / ".cache" / "tandem" / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


# ---------------------------------------------------------------------------------------------
# The prompt, by hand


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tokenizers")
    write_tokenizer(root / "repo", repo=True)
    write_tokenizer(root / "plain")
    return {"repo": Tokenizer(root / "repo"), "plain": Tokenizer(root / "plain")}


def test_the_prompt_puts_the_other_files_behind_the_repository_markers(tokenizers):
    tok = tokenizers["repo"]
    text = tok.encode_text
    repo, sep = tok.fim_repo_ids
    pre, suf, mid = tok.fim_ids
    fields = {"input_prefix": "ab", "input_suffix": "cd", "prompt": "e"}
    fields["input_extra"] = [{"text": "x = 1\n", "filename": "a.py"}, {"text": "y"}]
    files = [repo, *text("myproject\n"), sep, *text("a.py\n"), *text("x = 1\n")]
    files += [sep, *text("tmp\n"), *text("y"), sep, *text("filename\n")]
    middle = [pre, *text("ab"), *tok.encode("e", False), suf, *text("cd"), mid]
    assert infill.prompt_ids(fields, tok, n_ctx=4096) == files + middle
    assert None not in (repo, sep)
    # no room for them (llama.cpp keeps the last n_ctx - n_batch + 2 of their tokens)
    assert infill.prompt_ids(fields, tok, n_ctx=2046) == middle
    assert infill.prompt_ids(fields, tok, n_ctx=2050) == files[-4:] + middle


def test_without_a_file_separator_the_files_are_snippets(tokenizers):
    tok = tokenizers["plain"]
    pre, suf, mid = tok.fim_ids
    fields = {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "z"}]}
    snippet = tok.encode_text("\n\n--- snippet ---\n\n") + tok.encode_text("z")
    assert tok.fim_repo_ids == (None, None)
    expected = [*snippet, pre, *tok.encode_text("a"), suf, *tok.encode_text("b"), mid]
    assert infill.prompt_ids(fields, tok, n_ctx=4096) == expected


def test_prefix_and_suffix_are_cut_to_fit_a_batch(tokenizers):
    tok = tokenizers["repo"]
    pre, suf, mid = tok.fim_ids
    prefix, suffix = tok.encode_text("ab " * 50), tok.encode_text("cd " * 50)
    fields = {"input_prefix": "ab " * 50, "input_suffix": "cd " * 50, "prompt": "x y"}
    prompt = tok.encode("x y", False)
    ids = infill.prompt_ids(fields, tok, n_ctx=62, n_batch=64)  # no room for files
    # the prefix's last 3/4 of a batch, the suffix's first quarter less 2 and the prompt
    kept = 16 - 2 - len(prompt)
    assert ids == [pre, *prefix[-48:], *prompt, suf, *suffix[:kept], mid]


def test_special_spellings_in_code_are_text(tokenizers):
    tok = tokenizers["repo"]
    ids = infill.prompt_ids({"input_prefix": "<|fim_middle|>", "input_suffix": ""}, tok, 64)
    assert ids.count(tok.fim_ids[2]) == 1  # the marker llama.cpp writes, not the user's


@pytest.mark.parametrize(
    ("text", "n_indent", "cut"),
    [
        ("x\n    y\n  z", 4, 10),  # the third line's text starts at 2 spaces: cut there
        ("x\n    y\n    z", 4, None),
        ("    x\ny", 4, 6),
        ("x\n\n    y", 4, 2),  # an empty line is indented less (llama.cpp's rule)
        ("x\n  ", 4, None),  # the line has no text yet
        ("x\ny", 0, None),
    ],
)
def test_n_indent_ends_the_text_at_a_line_indented_less(text, n_indent, cut):
    assert infill.indent_cut(text, n_indent) == cut


def test_response_fields_take_nested_paths():
    body = {"content": "x", "timings": {"prompt_n": 3}, "stop": True}
    assert infill.nested_values(["content", "timings/prompt_n", "nope", ""], body) == {
        "content": "x",
        "timings/prompt_n": 3,
    }


# ---------------------------------------------------------------------------------------------
# llama.cpp's own prompts (recorded from its llama-server on Qwen2.5-Coder-0.5B)


def test_the_prompt_is_llamacpps_token_for_token():
    if not QWEN.is_file():
        pytest.skip(f"{QWEN.name} is not fetched (python -m models.fetch qwen2.5-coder)")
    tok = Tokenizer(QWEN)
    recorded = json.loads(FIXTURES.read_text())
    for case in recorded["cases"]:
        ids = infill.prompt_ids(case["body"], tok, n_ctx=recorded["n_ctx"])
        assert len(ids) == case["tokens_evaluated"] == case["timings"]["prompt_n"], case["name"]
        assert tok.decode(ids, skip_special_tokens=False) == case["prompt"], case["name"]


# ---------------------------------------------------------------------------------------------
# The route, on the tiny target


def engine(checkpoint: Path, method: str = "none", **overrides: Any) -> AsyncEngine:
    draft = str(checkpoint) if method == "draft" else None
    k = 3 if method != "none" else 1
    spec = SpecConfig(method=method, draft=draft, num_speculative_tokens=k, adaptive_k=False)
    settings: dict[str, Any] = dict(
        model=str(checkpoint), spec=spec, kv=KVConfig(page_size=4, num_pages=256)
    )
    return AsyncEngine(EngineConfig(**(settings | {"max_model_len": 256} | overrides)))


async def post(url: str, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + route, json=body) as response:
            if response.content_type == "text/event-stream":
                return response.status, await response.text()
            return response.status, await response.json()


async def test_the_plugins_bodies_are_served(tiny_target):
    async with served(engine(tiny_target)) as url:
        status, vim = await post(url, "/infill", LLAMA_VIM)
        assert status == 200, vim
        assert set(vim) == set(LLAMA_VIM["response_fields"])
        assert vim["timings/prompt_n"] > 0 and isinstance(vim["content"], str)
        status, vscode = await post(url, "/infill", LLAMA_VSCODE)
        assert status == 200, vscode
        assert vscode["stop"] is True and vscode["tokens_predicted"] <= 12
        assert (
            vscode["timings"]["prompt_n"] + vscode["timings"]["cache_n"]
            == (vscode["tokens_evaluated"])
        )
        status, warm = await post(url, "/infill", LLAMA_VIM_WARM_UP)
        assert (status, warm) == (200, {})  # response_fields [""] names nothing


async def test_fill_in_the_middle_equals_completions_with_a_suffix(tiny_target):
    assert Tokenizer(tiny_target).fim_repo_ids == (None, None)  # no repository markers
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 16, "temperature": 0}
    async with served(engine(tiny_target)) as url:
        status, filled = await post(url, "/infill", body)
        assert status == 200, filled
        completion = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 16, "temperature": 0}
        status, completed = await post(url, "/v1/completions", completion)
        assert status == 200, completed
    assert filled["content"] == completed["choices"][0]["text"]
    assert filled["tokens_predicted"] == completed["usage"]["completion_tokens"]
    assert filled["tokens_evaluated"] == completed["usage"]["prompt_tokens"]


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
async def test_every_drafter_fills_as_plain_decoding(tiny_target, method):
    body = LLAMA_VSCODE | {"temperature": 0, "n_indent": 0, "t_max_predict_ms": -1}
    body |= {"n_predict": 24, "input_prefix": PREFIX * 3}  # text to repeat, for n-grams
    async with served(engine(tiny_target)) as url:
        plain = (await post(url, "/infill", body))[1]
    async with served(engine(tiny_target, method)) as url:
        drafted = (await post(url, "/infill", body))[1]
    assert drafted["content"] == plain["content"]
    assert drafted["tokens_predicted"] == plain["tokens_predicted"]
    if method == "draft":  # it drafts for itself: its drafts are accepted
        assert drafted["timings"]["draft_n_accepted"] > 0


@pytest.mark.parametrize("n_predict", [0, 1])
async def test_a_warm_up_caches_the_context(tiny_target, n_predict):
    warm = LLAMA_VIM_WARM_UP | {"n_predict": n_predict, "response_fields": []}
    warm |= {"input_prefix": PREFIX, "input_suffix": SUFFIX}
    async with served(engine(tiny_target)) as url:
        status, first = await post(url, "/infill", warm)
        assert status == 200, first
        assert first["timings"]["cache_n"] == 0
        assert first["tokens_predicted"] == 1  # llama.cpp's too, for 0
        status, then = await post(url, "/infill", warm | {"n_predict": 4})
    cached = then["timings"]["cache_n"]
    # every whole page of the prompt, less the last token's (recomputed for its logits)
    assert cached >= (then["tokens_evaluated"] - 1) // 4 * 4 - 4 > 0
    assert then["timings"]["prompt_n"] == then["tokens_evaluated"] - cached


async def test_the_stream_has_llamacpps_shape(tiny_target):
    body = LLAMA_VSCODE | {"temperature": 0, "n_predict": 16, "n_indent": 0}
    async with served(engine(tiny_target)) as url:
        full = (await post(url, "/infill", body))[1]
        status, text = await post(url, "/infill", body | {"stream": True})
    assert status == 200
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
    assert "[DONE]" not in text
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == full["content"]
    assert events[-1]["tokens_predicted"] == full["tokens_predicted"]
    assert events[-1]["timings"]["prompt_n"] > 0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"lora": [{"id": 0, "scale": 0.5}]}, "lora"),
        ({"n_cmpl": 2}, "n_cmpl"),
        ({"input_extra": [{"text": 1}]}, "input_extra"),
        ({"input_extra": [{"text": "x", "name": "y"}]}, "input_extra"),
        ({"input_prefix": None}, "input_prefix"),
        ({"n_predict": -2}, "n_predict"),
        ({"top_p": 0}, "top_p"),
        ({"model": "another"}, "model"),
    ],
)
async def test_bad_fields_are_refused_by_name(tiny_target, change, named):
    async with served(engine(tiny_target)) as url:
        status, body = await post(url, "/infill", LLAMA_VSCODE | change)
        assert status in (400, 404) and named in body["error"]["message"]
        status, _ = await post(url, "/infill", LLAMA_VSCODE)
        assert status == 200


async def test_a_model_without_fill_in_the_middle_tokens_is_a_400(tiny_target):
    served_engine = engine(tiny_target)
    served_engine.tokenizer.__dict__["fim_ids"] = None  # as a vocabulary without the markers
    async with served(served_engine) as url:
        status, body = await post(url, "/infill", LLAMA_VSCODE)
    assert status == 400 and "fill-in-the-middle" in body["error"]["message"]


@pytest.mark.parametrize(
    ("deltas", "fields", "text"),
    [
        (["x\n", "    y\n", "  z", " w"], {"n_indent": 4}, "x\n    y\n  "),
        (["x\n    y\n  z"], {"n_indent": 4}, "x\n    y\n  "),
        (["x\n", "    y"], {"n_indent": 4}, "x\n    y"),  # to the end: max_tokens
        (["x\n", "y\n"], {"t_max_predict_ms": 1}, "x\n"),  # late at the first new line
        (["x\n", "y\n"], {}, "x\ny\n"),
    ],
)
def test_a_plugins_limits_end_the_output(deltas, fields, text, tokenizers):
    """n_indent cuts before a line indented less; t_max_predict_ms ends at a new line once the
    time is spent (llama.cpp's rules)."""
    from core.params import SamplingParams
    from core.request import Delta, FinishReason

    job = infill.InfillJob("r", [1, 2], SamplingParams(max_tokens=len(deltas)), fields)
    reply = infill.InfillReply(job, "m", tokenizers["repo"])
    reply.first = time.monotonic() - 10  # generation began long ago: a time budget is spent
    done = False
    for i, piece in enumerate(deltas):
        last = FinishReason.LENGTH if i == len(deltas) - 1 else None
        done = reply.add(Delta("r", [5], piece, finish_reason=last))
        if done:
            break
    assert done and reply.text == text and reply.stop_type == "limit"
