"""The page at / and what it reads: the stream's opt-in "speculation" field (who proposed each
token), the page's files, and the API key and browser-origin rules that let the page in.
(tests/test_browser.py drives the page itself in a headless browser.)"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from tests.fakes import FakeEngine, served

KEY = "sesame"


def self_drafting(checkpoint: Any, method: str = "draft") -> AsyncEngine:
    """The tiny target drafting for itself: greedy drafts are all accepted."""
    draft = str(checkpoint) if method == "draft" else None
    spec = SpecConfig(method=method, draft=draft, num_speculative_tokens=3, adaptive_k=False)
    config = EngineConfig(
        model=str(checkpoint), spec=spec, kv=KVConfig(page_size=4, num_pages=256), max_model_len=128
    )
    return AsyncEngine(config)


async def stream_chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            text = await response.text()
    lines = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_the_stream_tells_who_proposed_each_token(tiny_target):
    body = {"prompt": "the quick brown", "max_tokens": 24, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    async with served(self_drafting(tiny_target)) as url:
        chunks = await stream_chunks(url, body | {"show_speculation": True})
        plain = await stream_chunks(url, body)
    usage = chunks[-1]["usage"]
    marked = [c["speculation"] for c in chunks if c["choices"]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert "".join(s["text"] for m in marked for s in m["spans"]) == text
    drafted = [d for m in marked for d in m["drafted"]]
    assert len(drafted) == usage["completion_tokens"] == 24
    accepted = sum(m["accepted"] for m in marked)
    assert accepted == usage["speculative"]["accepted_tokens"] > 0
    assert accepted == sum(d == "draft" for d in drafted)
    assert set(drafted) == {"draft", None}
    for m in marked:  # each step: its accepted drafts, then the target's own token
        assert m["drafted"] == ["draft"] * m["accepted"] + [None] * (
            len(m["drafted"]) > m["accepted"]
        )
    # an unmodified client sees the stream as before
    assert all("speculation" not in c for c in plain)
    assert "".join(c["choices"][0]["text"] for c in plain if c["choices"]) == text


async def test_host_drafts_are_named_by_their_drafter(tiny_target):
    prompt = "a b c d a b c d a b c d a b c d"  # n-gram drafting has something to look up
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    async with served(self_drafting(tiny_target, "ngram")) as url:
        chunks = await stream_chunks(url, body | {"show_speculation": True, "ignore_eos": True})
    drafted = [d for c in chunks if c["choices"] for d in c["speculation"]["drafted"]]
    assert set(drafted) == {"ngram", None}


async def test_show_speculation_must_be_a_boolean():
    async with served(FakeEngine()) as url, aiohttp.ClientSession() as session:
        body = {"prompt": "x", "show_speculation": "yes"}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 400
            assert "show_speculation" in (await response.json())["error"]["message"]


async def test_the_page_loads_without_the_key_and_its_calls_need_it():
    async with served(FakeEngine(), api_key=KEY) as url, aiohttp.ClientSession() as session:
        async with session.get(url + "/") as response:
            assert response.status == 200
            page = await response.text()
        assert 'data-key-required="true"' in page and "fake-model" in page
        for asset in ("page.js", "page.css", "favicon.svg"):
            async with session.get(f"{url}/static/{asset}") as response:
                assert response.status == 200, asset
        async with session.get(url + "/static/missing.js") as response:
            assert response.status == 404
        body = {"prompt": "x", "max_tokens": 2}
        origin = {"Origin": url}  # the page's own origin, as a browser sends it
        async with session.post(url + "/v1/completions", json=body, headers=origin) as response:
            assert response.status == 401
            assert "API key" in (await response.json())["error"]["message"]
        bearer = origin | {"Authorization": f"Bearer {KEY}"}
        async with session.post(url + "/v1/completions", json=body, headers=bearer) as response:
            assert response.status == 200
        foreign = bearer | {"Origin": "http://127.0.0.1:1"}  # another port: another origin
        async with session.post(url + "/v1/completions", json=body, headers=foreign) as response:
            assert response.status == 403


@pytest.mark.parametrize("name", ["<b>&", "plain"])
async def test_the_page_names_the_model_as_text(name):
    async with served(FakeEngine(), served_model_name=name) as url:
        async with aiohttp.ClientSession() as session, session.get(url + "/") as response:
            page = await response.text()
    assert 'data-key-required="false"' in page
    assert ("&lt;b&gt;&amp;" if name != "plain" else "plain") in page and "<b>&" not in page
