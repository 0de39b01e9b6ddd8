"""The async client against the server (over a fake engine): streaming, errors, timeouts."""

from __future__ import annotations

import asyncio
import time

import pytest

from client import TandemClient, TandemError, TandemTimeout
from tests.fakes import FakeEngine, served, spy_on_abort


async def test_streams_completions_and_chat() -> None:
    async with served(FakeEngine()) as url, TandemClient(url + "/v1/") as client:
        options = {"include_usage": True}
        chunks = [c async for c in await client.complete("x", stream=True, max_tokens=4)]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "abcd"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        stream = await client.chat(
            [{"role": "user", "content": "hi"}], stream=True, max_tokens=3, stream_options=options
        )
        chunks = [c async for c in stream]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
        assert text == "abc"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        reply = await client.complete([1, 2], max_tokens=2)
        assert reply["choices"][0]["text"] == "ab" and reply["usage"]["prompt_tokens"] == 2


async def test_server_errors_carry_the_servers_message() -> None:
    async with served(FakeEngine()) as url, TandemClient(url) as client:
        with pytest.raises(TandemError) as info:
            await client.complete("x", temperature="hot")
        assert info.value.status == 400 and info.value.type == "invalid_request_error"
        assert "'temperature' must be a number" in info.value.message
        with pytest.raises(TandemError) as info:
            await client.chat([{"role": "user", "content": "hi"}], stream=True, model="other")
        assert (info.value.status, info.value.code) == (404, "model_not_found")
        assert "the model 'other' does not exist" in str(info.value)


async def test_an_engine_error_reaches_the_client() -> None:
    async with served(FakeEngine(fail_at=2)) as url, TandemClient(url) as client:
        with pytest.raises(TandemError, match="the device fell over") as info:
            await client.complete("x", max_tokens=5)
        assert (info.value.status, info.value.type) == (500, "server_error")
        texts = []
        with pytest.raises(TandemError, match="the device fell over"):
            async for chunk in await client.complete("x", stream=True, max_tokens=5):
                texts.append(chunk["choices"][0]["text"])
        assert texts == ["a", "b"]
        assert (await client.complete("x", max_tokens=1))["choices"][0]["text"] == "a"


async def test_overload_and_auth_errors() -> None:
    engine = FakeEngine(delay=0.02, max_live=1)
    async with served(engine, api_key="k") as url:
        async with TandemClient(url, api_key="k") as client, TandemClient(url) as anonymous:
            with pytest.raises(TandemError) as info:
                await anonymous.models()
            assert (info.value.status, info.value.type) == (401, "authentication_error")
            stream = await client.complete("x", stream=True, max_tokens=50)
            with pytest.raises(TandemError) as info:
                await client.complete("y")
            assert (info.value.status, info.value.code) == (503, "server_overloaded")
            await anext(stream)
            await stream.aclose()  # leaving early closes the connection: the server aborts
            for _ in range(100):
                if not engine.live:
                    break
                await asyncio.sleep(0.02)
            assert not engine.live and len(engine.aborted) == 1
            assert "tandem_kv_pages_used 0" in await client.metrics()


async def test_timeout_is_clear_and_the_server_aborts() -> None:
    engine = FakeEngine(delay=0.05)
    aborts = spy_on_abort(engine)
    async with served(engine) as url, TandemClient(url, timeout=0.2) as client:
        start = time.monotonic()
        with pytest.raises(TandemTimeout, match="within 0.2 s"):
            await client.complete("x", max_tokens=60)
        assert time.monotonic() - start < 2
        for _ in range(100):
            if aborts:
                break
            await asyncio.sleep(0.02)
        assert len(aborts) == 1 and not engine.live
        assert (await client.health())["status"] == "ok"


async def test_needs_async_with() -> None:
    with pytest.raises(RuntimeError, match="async with"):
        await TandemClient("http://127.0.0.1:1").health()


async def test_load_bench_against_the_fake() -> None:
    from bench.load import parse_args, report, run_load

    args = parse_args("--clients 8 --disconnect-fraction 0.25 --max-tokens 10".split())
    async with served(FakeEngine(delay=0.005)) as url:
        results = await run_load(url, args)
    assert results["ok"], report(results)
    assert (results["completed"], results["stayed"], results["left_mid_stream"]) == (6, 6, 2)
    assert 60 <= results["output_tokens"] < 80 and results["itl_p50_s"] > 0
