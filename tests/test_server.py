"""The HTTP server, seen from outside: the official `openai` client, bad input, auth, limits,
disconnects, overload and shutdown.

Most tests run twice: against a fake engine (the AsyncEngine contract with deterministic
output, so that the server is tested alone) and against the real engine on a tiny random
checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import AsyncOpenAI

import server
from client import TandemClient
from engine.config import DebugConfig, EngineConfig, KVConfig, ReplicasConfig, SpecConfig
from engine.engine import AsyncEngine
from server import ServerOptions, build_parser, config_from_args, serve
from tests.fakes import FakeEngine, FakeTokenizer, served, spy_on_abort

# ---------------------------------------------------------------------------------------------
# A fake engine: the AsyncEngine contract, deterministic


# ---------------------------------------------------------------------------------------------
# The real engine on the tiny random checkpoint of tests/conftest.py, drafting for itself (so
# that drafts are accepted and the speculation counts are not zero)


def real_config(checkpoint: Path, **overrides: Any) -> EngineConfig:
    # a fixed k: a drafter as costly as its target never pays, so the cost model would not draft
    spec = SpecConfig(
        method="draft", draft=str(checkpoint), num_speculative_tokens=3, adaptive_k=False
    )
    settings: dict[str, Any] = dict(
        model=str(checkpoint),
        spec=spec,
        kv=KVConfig(page_size=4, num_pages=256),
        max_model_len=128,
        max_running=8,
        max_waiting=8,
    )
    return EngineConfig(**(settings | overrides))


def real_engine(checkpoint: Path, **overrides: Any) -> AsyncEngine:
    return AsyncEngine(real_config(checkpoint, **overrides))


@pytest.fixture(params=["fake", "real"])
def engine_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def engine(engine_kind: str, request: pytest.FixtureRequest) -> Any:
    if engine_kind == "fake":
        return FakeEngine()
    return real_engine(request.getfixturevalue("tiny_target"))


# ---------------------------------------------------------------------------------------------
# Helpers


def openai_client(url: str, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text."""
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


async def wait_until_idle(url: str, timeout: float = 10.0) -> str:
    """/metrics once no page is in use (pages return once the steps that write them end)."""
    async with TandemClient(url) as client:
        deadline = time.monotonic() + timeout
        while True:
            text = await client.metrics()
            if metric(text, "tandem_kv_pages_used") == 0 or time.monotonic() > deadline:
                return text
            await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# The openai client


async def test_openai_streams_completions_with_usage(engine: Any) -> None:
    async with served(engine) as url:
        client = openai_client(url)
        request = dict(
            model=engine.model_name,
            prompt="the quick brown",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        stream = await client.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        full = await client.completions.create(**request)
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text  # greedy: the stream and the whole answer agree
    usage = chunks[-1].usage
    assert usage.completion_tokens == full.usage.completion_tokens == 12
    assert usage.prompt_tokens == full.usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 12
    spec = full.usage.model_extra["speculative"]
    assert spec["steps"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]


async def test_a_second_turn_reports_its_cached_prompt_tokens(tiny_target: Path) -> None:
    """The second turn of a chat resends the first: its prompt's pages come from the prefix
    cache (usage.prompt_tokens_details.cached_tokens, as OpenAI reports it; /metrics)."""
    engine = real_engine(tiny_target)
    async with served(engine) as url:
        client = openai_client(url)
        messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]
        request = dict(model=engine.model_name, max_tokens=8, temperature=0)
        first = await client.chat.completions.create(messages=messages, **request)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "and then?"},
        ]
        second = await client.chat.completions.create(messages=messages, **request)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens
        assert cached % engine.config.kv.page_size == 0
        text = await wait_until_idle(url)
    assert metric(text, "tandem_prefix_cache_pages") > 0
    assert 0 < metric(text, "tandem_prefix_cache_hit_rate") < 1
    assert metric(text, "tandem_kv_pages_used") == 0


async def test_openai_streams_chat(engine: Any) -> None:
    async with served(engine) as url:
        client = openai_client(url)
        request = dict(
            model=engine.model_name,
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "the lazy dog"},
            ],
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        stream = await client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        full = await client.chat.completions.create(**request)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 10


async def test_completion_logprobs(engine: Any) -> None:
    async with served(engine) as url:
        full = await openai_client(url).completions.create(
            model=engine.model_name,
            prompt="the quick",
            max_tokens=6,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
    logprobs = full.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


async def test_chat_logprobs(engine: Any) -> None:
    async with served(engine) as url:
        full = await openai_client(url).chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
    content = full.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


async def test_stop_and_sampling_fields_reach_the_engine() -> None:
    engine = FakeEngine()
    async with served(engine) as url, TandemClient(url) as client:
        body = dict(max_tokens=3, temperature=0.5, top_k=5, seed=7, stop="x", ignore_eos=True)
        await client.complete([1, 2, 3], **body)
        await client.complete([[4, 5]], stop=["y", "z"], stop_token_ids=[9], top_p=0.5)
        await client.chat(USER, max_completion_tokens=3, logprobs=True, top_logprobs=2)
        await client.complete(["hi"], logprobs=0)
    (ids, params), (ids2, params2), (chat_ids, chat), (ids4, params4) = engine.submitted
    assert ids == [1, 2, 3] and ids2 == [4, 5]
    assert (params.temperature, params.top_k, params.seed, params.stop) == (0.5, 5, 7, ("x",))
    assert params.ignore_eos and params2.stop == ("y", "z") and params2.stop_token_ids == (9,)
    assert chat_ids == FakeTokenizer().encode("<user>hi<assistant>")
    assert (chat.max_tokens, chat.logprobs, params.logprobs) == (3, 2, None)
    assert ids4 == [72, 73] and params4.logprobs == 0 and params4.max_tokens == 16


# ---------------------------------------------------------------------------------------------
# Bad input: each refused with its status and message, and the server goes on serving

C, CHAT = "/v1/completions", "/v1/chat/completions"
JSON_TYPE = {"Content-Type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS: list[tuple[str, Any, int, str]] = [
    (C, b"{not json", 400, "not valid JSON"),
    (C, b'{"prompt": "a", "temperature": NaN}', 400, "'temperature' must be a number"),
    (C, b"[1, 2]", 400, "must be a JSON object"),
    (C, {}, 400, "'prompt' is required"),
    (C, {"prompt": "a", "temperature": "hot"}, 400, "'temperature' must be a number"),
    (C, {"prompt": "a", "max_tokens": 1.5}, 400, "'max_tokens' must be an integer"),
    (C, {"prompt": "a", "max_tokens": True}, 400, "'max_tokens' must be an integer"),
    (C, {"prompt": "a", "ignore_eos": 1}, 400, "'ignore_eos' must be a boolean"),
    (C, {"prompt": "a", "temperature": -1}, 400, "'temperature' must be a number in [0, 100]"),
    (C, {"prompt": "a", "top_p": 0}, 400, "'top_p' must be a number in (0, 1]"),
    (C, {"prompt": "a", "top_p": 1.5}, 400, "'top_p' must be a number in (0, 1]"),
    (C, {"prompt": "a", "max_tokens": 0}, 400, "'max_tokens' must be an integer in [1,"),
    (C, {"prompt": "a", "max_tokens": 10**6}, 400, "maximum context length"),
    (C, {"prompt": "a " * 5000}, 400, "maximum context length"),
    (C, {"prompt": [1, 10**6]}, 400, "outside the vocabulary"),
    (C, {"prompt": [-1]}, 400, "outside the vocabulary"),
    (C, {"prompt": [1, "a"]}, 400, "list of token ids"),
    (C, {"prompt": ""}, 400, "must not be empty"),
    (C, {"prompt": []}, 400, "must not be empty"),
    (C, {"prompt": ["a", "b"]}, 400, "only one prompt"),
    (C, {"prompt": 5}, 400, "'prompt' must be"),
    (C, {"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
    (C, {"prompt": "a", "n": 2}, 400, "one choice per request"),
    (C, {"prompt": "a", "echo": True}, 400, "echo is not supported"),
    (C, {"prompt": "a", "logprobs": 6}, 400, "'logprobs' must be an integer in 0..5"),
    (C, {"prompt": "a", "stop": 5}, 400, "'stop' must be"),
    (C, {"prompt": "a", "stop": [""]}, 400, "stop strings must not be empty"),
    (C, {"prompt": "a", "stop_token_ids": [10**6]}, 400, "outside the vocabulary"),
    (C, {"prompt": "a", "seed": -1}, 400, "'seed' must be"),
    (C, {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "only allowed when"),
    (C, {"prompt": "a", "stream": True, "stream_options": {"x": 1}}, 400, "'stream_options'"),
    (CHAT, {"messages": []}, 400, "'messages' must be a non-empty list"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "'messages' must be"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "'messages' must be"),
    (CHAT, {"messages": "hi"}, 400, "'messages' must be"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "needs 'logprobs'"),
    (CHAT, {"messages": USER, "logprobs": 1}, 400, "'logprobs' must be a boolean"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "'max_completion_tokens' must"),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "does not exist"),
    ("/v1/nothing", {}, 404, "Not Found"),
    (C, {"prompt": "a", "speculative_method": 3}, 400, "'speculative_method' must be a string"),
]


async def test_a_drafter_the_server_did_not_load_is_a_400(tiny_target: Path) -> None:
    async with served(real_engine(tiny_target)) as url, TandemClient(url) as client:
        body = {"prompt": "a", "speculative_method": "suffix"}
        async with client.session.post(url + C, json=body) as response:
            answer = await response.json()
        assert response.status == 400
        assert (
            "speculative_method 'suffix' is not loaded: choose from none, draft"
            in (answer["error"]["message"])
        )
        reply = await client.complete("b c d e", max_tokens=6, speculative_method="none")
        assert reply["usage"]["speculative"]["draft_tokens"] == 0
        reply = await client.complete("b c d e", max_tokens=6, speculative_method="draft")
        assert reply["usage"]["speculative"]["draft_tokens"] > 0


async def test_bad_requests_are_refused_and_the_server_goes_on(engine: Any) -> None:
    async with served(engine) as url, TandemClient(url) as client:
        for path, body, status, message in BAD_REQUESTS:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with client.session.post(url + path, data=data, headers=JSON_TYPE) as response:
                answer = await response.json()
            case = f"{path} {body!r:.60}"
            assert response.status == status, (case, answer)
            error = answer["error"]
            assert message in error["message"], (case, error)
            assert set(error) >= {"message", "type", "code"}
            assert error["type"] == "invalid_request_error"
            if status == 404 and path != "/v1/nothing":
                assert error["code"] == "model_not_found"
        async with client.session.get(url + C) as response:
            assert response.status == 405
        reply = await client.complete("still serving", max_tokens=2, ignore_eos=True)
    assert reply["usage"]["completion_tokens"] == 2


async def test_body_size_limit() -> None:
    async with served(FakeEngine(), max_body_bytes=4096) as url, TandemClient(url) as client:
        data = json.dumps({"prompt": "a" * 5000}).encode()
        async with client.session.post(url + C, data=data, headers=JSON_TYPE) as response:
            assert response.status == 413
            error = (await response.json())["error"]
        assert "4096" in error["message"] and error["type"] == "invalid_request_error"
        assert (await client.complete("a", max_tokens=1))["choices"][0]["text"] == "a"


async def test_api_key() -> None:
    async with served(FakeEngine(), api_key="sesame") as url:
        async with TandemClient(url) as anonymous, TandemClient(url, "wrong") as wrong:
            assert (await anonymous.health())["status"] == "ok"  # /health stays open
            routes = [("POST", C), ("POST", CHAT), ("GET", "/v1/models"), ("GET", "/metrics")]
            for client in (anonymous, wrong):
                for method, path in routes:
                    async with client.session.request(method, url + path) as response:
                        assert response.status == 401
                        error = (await response.json())["error"]
                        assert error["type"] == "authentication_error"
        reply = await openai_client(url, "sesame").completions.create(
            model="fake-model", prompt="a", max_tokens=2
        )
        assert reply.choices[0].text == "ab"


async def test_health_models_metrics(engine: Any) -> None:
    async with served(engine, served_model_name="tiny") as url, TandemClient(url) as client:
        assert await client.health() == {"status": "ok"}
        models = await client.models()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["max_model_len"] == engine.max_model_len
        async with client.session.get(url + "/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await response.text()
        assert metric(text, "tandem_kv_pages_used") == 0
        await client.complete("a", model="tiny", max_tokens=1)


async def test_disconnect_mid_stream_aborts(
    engine_kind: str, request: pytest.FixtureRequest
) -> None:
    if engine_kind == "fake":
        engine: Any = FakeEngine(delay=0.02)
    else:  # device work slowed down, so that the request outlives the client
        checkpoint = request.getfixturevalue("tiny_target")
        engine = real_engine(checkpoint, debug=DebugConfig(device_delay=0.005))
    aborts = spy_on_abort(engine)
    async with served(engine) as url:
        stream = await openai_client(url).completions.create(
            model=engine.model_name,
            prompt="the quick",
            max_tokens=100,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        received = 0
        async for chunk in stream:
            received += len(chunk.choices[0].text) > 0
            if received == 2:
                break
        await stream.close()
        deadline = time.monotonic() + 10
        while not aborts and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(aborts) == 1 and aborts[0].startswith("cmpl-")
        text = await wait_until_idle(url)
        assert metric(text, "tandem_kv_pages_used") == 0  # every page free once it is gone
        assert metric(text, "tandem_requests_running") == 0


async def test_overload_is_a_503_with_retry_after(
    engine_kind: str, request: pytest.FixtureRequest
) -> None:
    if engine_kind == "fake":
        engine: Any = FakeEngine(delay=0.02, max_live=1)
    else:  # one runs, one waits, the next is refused
        checkpoint = request.getfixturevalue("tiny_target")
        engine = real_engine(
            checkpoint, max_running=1, max_waiting=1, debug=DebugConfig(device_delay=0.005)
        )
    body = {"prompt": "the quick", "max_tokens": 100, "ignore_eos": True}
    async with served(engine) as url, TandemClient(url) as client:
        running = await client.complete(**body, stream=True)
        await anext(running)
        waiting = None
        if not isinstance(engine, FakeEngine):
            waiting = await client.complete(**body, stream=True)
        async with client.session.post(url + C, json=body) as response:
            assert response.status == 503
            assert int(response.headers["Retry-After"]) >= 1
            error = (await response.json())["error"]
        assert error["code"] == "server_overloaded"
        await running.aclose()
        if waiting is not None:
            await waiting.aclose()
        await wait_until_idle(url)
        reply = await client.complete("a", max_tokens=2, ignore_eos=True)
        assert reply["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------
# Command line and shutdown


def test_config_from_args() -> None:
    config, options = config_from_args([])
    # auto with no model: the policy over n-gram and suffix decoding
    assert config.model == "smollm2" and config.spec.method == "auto" and config.spec.adaptive_k
    assert config.spec.drafting_model == "none"
    demo, _ = config_from_args(["--model", "demo"])
    assert demo.model == "demo" and demo.spec.drafting_model == "draft"
    assert (options.host, options.port, options.api_key) == ("127.0.0.1", 8000, None)
    config, options = config_from_args(
        "--model m --draft d --speculative eagle --num-speculative-tokens 6 --port 0 "
        "--api-key k --page-size 8 --num-pages 100 --max-running 4 --max-waiting 9 "
        "--max-model-len 512 --served-model-name x --seed 3 --trace-file t.jsonl "
        "--fixed-k --calibration c.json".split()
    )
    assert not config.spec.adaptive_k and config.spec.calibration == "c.json"
    assert (config.model, config.spec.draft, config.spec.method) == ("m", "d", "eagle")
    assert config.spec.num_speculative_tokens == 6 and config.kv == KVConfig(8, 100)
    assert (config.max_running, config.max_waiting, config.max_model_len) == (4, 9, 512)
    assert (config.seed, config.trace_file) == (3, "t.jsonl")
    assert (options.port, options.api_key, options.served_model_name) == (0, "k", "x")


CONFIGS = (EngineConfig, SpecConfig, KVConfig, ServerOptions, ReplicasConfig)


def test_every_flag_defaults_to_its_fields_default() -> None:
    """The command line is made from the configs' fields: a flag whose default differs from
    its field's (a hand-written flag, or a field without one) fails here."""
    parsed = vars(build_parser().parse_args([]))
    nested = {"spec", "kv", "debug", "cluster"}
    for config in CONFIGS:
        for f in dataclasses.fields(config):
            if f.name in nested:
                continue
            assert f.metadata.get("help"), f"{config.__name__}.{f.name} has no flag"
            value = parsed.pop(f"{config.__name__}.{f.name}")
            assert (tuple(value) if f.metadata["many"] else value) == f.default, f.name
    assert parsed == {}, "flags without a field"
    config, options = config_from_args([])
    resolved = SpecConfig(hybrid_head="none")  # auto on SmolLM2: no model
    assert (config.spec, config.kv, options) == (resolved, KVConfig(), ServerOptions())


def test_list_flags() -> None:
    config, options = config_from_args(
        "--speculative eagle --tree fixed --tree-paths 0 1 0.0 0.0.1 --allowed-origins "
        "https://a.example".split()
    )
    assert config.spec.tree_paths == ((0,), (1,), (0, 0), (0, 0, 1))
    assert options.allowed_origins == ("https://a.example",)


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--page-size 0", "page_size must be at least 1"),
        ("--num-speculative-tokens 99", "num_speculative_tokens must be in 1..16"),
        ("--speculative ngram --draft d", "--draft is not used"),
        ("--port 70000", "port must be in 0..65535"),
        ("--speculative magic", "invalid choice"),
        ("--max-running zero", "invalid int value"),
    ],
)
def test_bad_flags_are_a_usage_error(
    argv: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(argv.split())
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args(["--help"])
    out = capsys.readouterr().out
    flags = "model draft speculative num-speculative-tokens host port api-key trace-file"
    flags += " max-running max-waiting page-size num-pages max-model-len served-model-name seed"
    for flag in flags.split():
        assert f"--{flag}" in out


async def serving(engine: FakeEngine, capsys: pytest.CaptureFixture) -> tuple[asyncio.Task, str]:
    """serve() started as a task, and the URL it says it listens on."""
    task = asyncio.create_task(serve(engine, ServerOptions(port=0)))
    for _ in range(200):
        if found := re.search(r"http://\S+", capsys.readouterr().out):
            return task, found.group(0)
        await asyncio.sleep(0.01)
    raise AssertionError("serve() did not say where it listens")


async def test_sigterm_stops_accepting_aborts_and_returns(capsys: pytest.CaptureFixture) -> None:
    engine = FakeEngine(delay=0.02)
    task, url = await serving(engine, capsys)
    async with TandemClient(url) as client:
        stream = await client.complete("a", max_tokens=50, stream=True)
        await anext(stream)
        os.kill(os.getpid(), signal.SIGTERM)
        chunks = [chunk async for chunk in stream]
    await asyncio.wait_for(task, 10)
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert engine.stopped and not engine.live


async def test_a_failed_engine_turns_health_to_503_and_serve_returns_1(
    capsys: pytest.CaptureFixture,
) -> None:
    """A supervisor sees the failure: /health answers 503 with the cause, and serve() ends
    with status 1 (main's exit status) without waiting for a signal."""
    engine = FakeEngine()
    task, url = await serving(engine, capsys)
    async with TandemClient(url) as client:
        assert (await client.health())["status"] == "ok"
        engine.failure = "the plan loop failed: AssertionError: boom"
        async with client.session.get(url + "/health") as response:
            assert response.status == 503
            assert (await response.json())["cause"] == engine.failure
        engine.failed.set()
        assert await asyncio.wait_for(task, 10) == 1


def test_main_returns_0_on_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python server.py` end to end, in this process: flags, engine, serving, SIGTERM, exit 0."""
    engines: list[FakeEngine] = []

    def fake_engine(config: EngineConfig) -> FakeEngine:
        engines.append(FakeEngine())
        return engines[-1]

    monkeypatch.setattr("engine.engine.AsyncEngine", fake_engine)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def stop_once_serving() -> None:
        # signal only a server that listens: its handlers are set by then
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_serving, daemon=True).start()
    assert server.main(["--speculative", "none", "--port", str(port)]) == 0
    assert engines[0].stopped


# ---------------------------------------------------------------------------------------------
# Structured output through the openai client, unmodified (the engine's side: test_grammar.py)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": PERSON}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object",
     "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}},
]  # fmt: skip
GRAMMAR_CHAT = dict(
    messages=[{"role": "user", "content": "a person"}], max_tokens=64, temperature=0
)


async def test_openai_response_format_and_tools_work_unmodified(tiny_target: Path) -> None:
    async with served(real_engine(tiny_target)) as url:
        client = openai_client(url)
        model = (await client.models.list()).data[0].id
        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        full = await client.chat.completions.create(
            model=model, response_format=schema, **GRAMMAR_CHAT
        )
        jsonschema.validate(json.loads(full.choices[0].message.content), PERSON)
        stream = await client.chat.completions.create(
            model=model, response_format=schema, stream=True, **GRAMMAR_CHAT
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == full.choices[0].message.content  # greedy: the same either way
        obj = await client.chat.completions.create(
            model=model, response_format={"type": "json_object"}, **GRAMMAR_CHAT
        )
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content), dict)

        named = {"type": "function", "function": {"name": "lookup"}}
        call = await client.chat.completions.create(
            model=model, tools=TOOLS, tool_choice=named, **GRAMMAR_CHAT
        )
        assert call.choices[0].finish_reason == "tool_calls"
        (tool_call,) = call.choices[0].message.tool_calls
        assert tool_call.function.name == "lookup" and tool_call.id.startswith("call_")
        jsonschema.validate(json.loads(tool_call.function.arguments), PERSON)
        stream = await client.chat.completions.create(
            model=model, tools=TOOLS, tool_choice=named, stream=True, **GRAMMAR_CHAT
        )
        chunks = [c async for c in stream if c.choices]
        deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function.name == "lookup" and deltas[0].id
        assert "".join(d.function.arguments or "" for d in deltas) == tool_call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        required = await client.chat.completions.create(
            model=model, tools=TOOLS, tool_choice="required", **GRAMMAR_CHAT
        )
        (tool_call,) = required.choices[0].message.tool_calls
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        jsonschema.validate(
            json.loads(tool_call.function.arguments), parameters[tool_call.function.name]
        )

        completion = await client.completions.create(
            model=model,
            prompt="the answer:",
            max_tokens=8,
            temperature=0,
            extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
        )
        assert completion.choices[0].text in ("alpha", "beta")
        regex = await client.completions.create(
            model=model,
            prompt="a number:",
            max_tokens=8,
            temperature=0,
            extra_body={"guided_regex": "[0-9]{2,4}"},
        )
        assert re.fullmatch("[0-9]{2,4}", regex.choices[0].text)
