"""Engine replicas on Ray Serve behind one endpoint (engine/replicas.py): two replicas of the
demo model on this machine, one Ray start for the module. The `cluster` tier: with CI=true a
missing Ray fails these tests instead of skipping them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from api import chat_prompt
from core.params import SamplingParams
from engine.config import EngineConfig, KVConfig, ReplicasConfig
from server import ServerOptions, config_from_args, start_server
from tests.fakes import served

ROOT = Path(__file__).resolve().parent.parent
MODULE = pytest.mark.asyncio(loop_scope="module")
# the demo's KV for a few thousand tokens: three engines run beside each other here
CONFIG = EngineConfig(model="demo", kv=KVConfig(memory_bytes=64 << 20))
READ_TIMEOUT_S = 30.0


def cluster(test: Any) -> Any:
    """The cluster tier, part of the full tier (slow: a Ray start)."""
    return pytest.mark.slow(pytest.mark.cluster(test))


def need_ray() -> None:
    """Ray Serve, the cluster extra: CI installs it, so there its absence is a failure."""
    if os.environ.get("CI") == "true":
        import ray.serve  # noqa: F401
    else:
        pytest.importorskip("ray.serve", reason="the cluster extra: pip install -e '.[cluster]'")


# ---------------------------------------------------------------------------------------------
# The flags (no Ray started)


def test_replicas_with_tensor_parallelism_are_refused(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--replicas", "2", "--tensor-parallel-size", "2"])
    assert "--replicas with --tensor-parallel-size" in capsys.readouterr().err


def test_a_missing_ray_is_named_by_its_extra(monkeypatch, capsys):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "ray" else find(n))
    with pytest.raises(SystemExit):
        config_from_args(["--replicas", "2"])
    assert ".[cluster]" in capsys.readouterr().err


def test_without_replicas_nothing_imports_ray():
    code = "import server, sys; server.config_from_args([]); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# ---------------------------------------------------------------------------------------------
# Two replicas behind one endpoint


@pytest.fixture(scope="module")
def deployment() -> Iterator[Any]:
    """The replicas deployed (outside an event loop: Ray's start blocks)."""
    need_ray()
    from engine.replicas import Replicas

    deployed = Replicas(CONFIG, ReplicasConfig(replicas=2), shutdown_s=5.0)
    try:
        yield deployed
    finally:
        deployed.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas(deployment: Any) -> AsyncIterator[Any]:
    await deployment.start()
    try:
        yield deployment
    finally:
        await deployment.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def url(replicas: Any) -> AsyncIterator[str]:
    runner = await start_server(replicas, ServerOptions(port=0))
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def one_server() -> AsyncIterator[str]:
    """One engine in this process, served alone: what the replicas' answers must equal."""
    from engine.engine import AsyncEngine

    async with served(AsyncEngine(CONFIG)) as url:
        yield url


def openai(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def answers(url: str, stream: bool) -> list[str]:
    """Greedy completions and chats, one at a time (a batch's rows may round differently)."""
    client, texts = openai(url), []
    for prompt in ("Once upon a time", "The king said", "def add(a, b):"):
        if stream:
            chunks = await client.completions.create(
                model="tandem-demo", prompt=prompt, max_tokens=24, temperature=0, stream=True
            )
            texts.append("".join([c.choices[0].text async for c in chunks]))
        else:
            done = await client.completions.create(
                model="tandem-demo", prompt=prompt, max_tokens=24, temperature=0
            )
            texts.append(done.choices[0].text)
        chat = await client.chat.completions.create(
            model="tandem-demo",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
        )
        texts.append(chat.choices[0].message.content or "")
    return texts


@MODULE
@cluster
@pytest.mark.parametrize("stream", [False, True])
async def test_greedy_output_equals_one_servers(url: str, one_server: str, stream: bool):
    assert await answers(url, stream) == await answers(one_server, stream)


def samples(text: str, name: str) -> dict[str, float]:
    """A metric's value per replica."""
    pattern = rf'^{name}{{(?:[^}}]*,)?replica="([^"]+)"[^}}]*}} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return await response.text()


async def served_by(url: str, replicas: Any, request: Any) -> tuple[str, Any]:
    """Which replica's prompt-token count a request raised (seen in /metrics), and its result."""
    await replicas.refresh()
    before = samples(await metrics(url), "tandem_prompt_tokens_total")
    result = await request
    await replicas.refresh()
    after = samples(await metrics(url), "tandem_prompt_tokens_total")
    grew = [r for r in after if after[r] > before.get(r, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0], result


def system_prompt(chat: int) -> str:
    """A long system prompt of its own for each chat (about 1,650 tokens)."""
    words = ["castle", "river", "king", "stone", "green", "light", "forest", "gate", "song"]
    return f"Chat {chat}. " + " ".join(words[(chat + i * i) % len(words)] for i in range(650))


async def routed_first_token_s(url: str, messages: list[dict[str, str]]) -> float:
    """A chat request through the endpoint: the seconds to its first token."""
    start, first = time.monotonic(), None
    stream = await openai(url).chat.completions.create(
        model="tandem-demo", messages=messages, max_tokens=4, temperature=0, stream=True
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - start
    assert first is not None
    return first


async def forced_first_token_s(replicas: Any, ids: list[int], replica: str, name: str) -> float:
    """The same prompt sent to `replica` through the router's pin: seconds to its first token."""
    params = SamplingParams(max_tokens=4, temperature=0)
    start, first = time.monotonic(), None
    call = replicas.handle.options(stream=True).generate
    async for item in call.remote(ids, params, name, pin=replica):
        if isinstance(item, list) and first is None:
            first = time.monotonic() - start
            assert item[0].token_ids
    assert first is not None
    return first


@MODULE
@cluster
async def test_a_chats_second_turn_goes_to_its_first_turns_replica_and_starts_sooner(
    url: str, replicas: Any
):
    ratios = []
    for chat in range(3):
        messages = [
            {"role": "system", "content": system_prompt(chat)},
            {"role": "user", "content": "Tell me a story."},
        ]
        first = openai(url).chat.completions.create(
            model="tandem-demo", messages=messages, max_tokens=16, temperature=0
        )
        where, done = await served_by(url, replicas, first)
        messages += [
            {"role": "assistant", "content": done.choices[0].message.content},
            {"role": "user", "content": "And then?"},
        ]
        again, routed = await served_by(url, replicas, routed_first_token_s(url, messages))
        assert again == where
        (other,) = set(replicas.statuses) - {where}
        ids = chat_prompt(messages, replicas)
        forced = await forced_first_token_s(replicas, ids, other, f"forced-{chat}")
        ratios.append(forced / routed)
    assert statistics.median(ratios) >= 5, ratios


def running(status: Any) -> float:
    found = re.search(r"^tandem_requests_running (\S+)$", status.metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def kill_a_busy_replica(replicas: Any) -> str:
    """SIGKILL the process of a replica that runs a request; returns the replica's id."""
    for _ in range(200):
        await replicas.refresh()
        busy = [s for s in replicas.statuses.values() if running(s) > 0]
        if busy:
            os.kill(busy[0].pid, signal.SIGKILL)
            return busy[0].replica
        await asyncio.sleep(0.02)
    raise AssertionError("no replica ran a request")


async def until_replaced(replicas: Any, killed: str, timeout_s: float = 90.0) -> None:
    """Until Ray has started a replica in the killed one's place and both serve."""
    deadline = time.monotonic() + timeout_s
    while True:
        await replicas.refresh()
        if len(replicas.statuses) == 2 and killed not in replicas.statuses:
            return
        assert time.monotonic() < deadline, f"no replica replaced {killed}"
        await asyncio.sleep(0.5)


async def events(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    async for line in response.content:
        if line.startswith(b"data: "):
            yield line[6:].strip()


STREAM = {"model": "tandem-demo", "temperature": 0, "ignore_eos": True, "stream": True}


@MODULE
@cluster
async def test_a_replica_killed_mid_stream(url: str, replicas: Any):
    timeout = aiohttp.ClientTimeout(sock_read=READ_TIMEOUT_S)
    body = STREAM | {"prompt": "Once upon a time", "max_tokens": 1000}
    received, killed = [], None
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            async for event in events(response):
                received.append(event)
                if len(received) == 3:
                    killed = await kill_a_busy_replica(replicas)
        assert killed is not None and received[-1] == b"[DONE]"
        error = json.loads(received[-2])["error"]
        assert killed in error["message"] and error["type"] == "server_error"
        for _ in range(4):  # at once, on the replica that lives
            answer = {"model": "tandem-demo", "prompt": "The king", "max_tokens": 8}
            async with session.post(url + "/v1/completions", json=answer) as response:
                assert response.status == 200, await response.text()
    await until_replaced(replicas, killed)


@MODULE
@cluster
async def test_a_non_streamed_request_whose_replica_dies_is_a_503(url: str, replicas: Any):
    """Its tokens never reached the client: the answer is a retryable 503, not a 500."""
    timeout = aiohttp.ClientTimeout(sock_read=READ_TIMEOUT_S)
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        answer = asyncio.ensure_future(session.post(url + "/v1/completions", json=body))
        await asyncio.sleep(1.0)  # past its first tokens
        killed = await kill_a_busy_replica(replicas)
        async with await answer as response:
            assert response.status == 503, await response.text()
            assert killed in (await response.json())["error"]["message"]
    await until_replaced(replicas, killed)


async def one_request(session: aiohttp.ClientSession, url: str, n: int) -> str:
    """A request's outcome, streamed where n is even: ok (finished), error (an error event),
    or its status."""
    body = {"prompt": f"Story {n}: once upon a time", "max_tokens": 24}
    if n % 2:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return str(response.status)
            finish = (await response.json())["choices"][0]["finish_reason"]
            return "ok" if finish == "length" else finish
    async with session.post(url + "/v1/completions", json=STREAM | body) as response:
        if response.status != 200:
            return str(response.status)
        received = [event async for event in events(response)]
    assert received[-1] == b"[DONE]", received
    last = json.loads(received[-2])
    if "error" in last:
        return "error"
    assert last["choices"][0]["finish_reason"] == "length"
    return "ok"


@MODULE
@cluster
async def test_64_requests_over_8_clients_with_a_replica_killed_halfway(url: str, replicas: Any):
    outcomes: list[str] = []
    killed: list[str] = []
    timeout = aiohttp.ClientTimeout(sock_read=READ_TIMEOUT_S)

    async def client(c: int) -> None:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for i in range(8):
                async with asyncio.timeout(2 * READ_TIMEOUT_S):  # no request hangs
                    outcomes.append(await one_request(session, url, 8 * c + i))
                if len(outcomes) >= 32 and not killed:
                    killed.append("")
                    killed[0] = await kill_a_busy_replica(replicas)

    await asyncio.gather(*(client(c) for c in range(8)))
    assert len(outcomes) == 64 and set(outcomes) <= {"ok", "error", "503"}, outcomes
    assert outcomes.count("ok") >= 48, outcomes
    await until_replaced(replicas, killed[0])
    deadline = time.monotonic() + 10
    while any(samples(await metrics(url), "tandem_kv_pages_used").values()):
        assert time.monotonic() < deadline, await metrics(url)
        await asyncio.sleep(0.2)


@MODULE
@cluster
async def test_stopping_lets_a_running_stream_finish(url: str, replicas: Any):
    """The deployment's last test: its shutdown drains what runs (within its 5 s bound)."""
    timeout = aiohttp.ClientTimeout(sock_read=READ_TIMEOUT_S)
    body = STREAM | {"prompt": "Once upon a time", "max_tokens": 64}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            received = events(response)
            first = [await anext(received)]
            stopping = asyncio.ensure_future(replicas.stop())
            rest = [event async for event in received]
    await stopping
    assert rest[-1] == b"[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length", first + rest


class FullReplicaA:
    """Serve's handle over two replicas, "a" full (its engine refuses: Overloaded) and "b"
    serving: the calls' `avoid` hints, as the router gets them."""

    def __init__(self):
        self.avoided: list[tuple[str, ...]] = []
        self.generate = self

    def options(self, **_: Any) -> FullReplicaA:
        return self

    def remote(self, ids: list[int], params: SamplingParams, request_id: str, avoid=()):
        from core.request import Delta, FinishReason, Overloaded

        self.avoided.append(avoid)

        async def items() -> AsyncIterator[Any]:
            replica = "b" if "a" in avoid else "a"
            yield replica
            if replica == "a":
                raise Overloaded("2 requests are already running or waiting")
            yield [Delta(request_id, [7], "x", finish_reason=FinishReason.LENGTH)]

        return items()


@cluster
async def test_a_request_a_full_replica_refuses_is_sent_to_another():
    need_ray()
    from engine.replicas import Replicas

    replicas = Replicas.__new__(Replicas)  # its calls alone, over a handle that stands for Serve's
    replicas.handle, replicas.replicas = FullReplicaA(), ReplicasConfig(replicas=2)
    deltas: list[Any] = []
    await replicas._call([1, 2], SamplingParams(max_tokens=1), "req-0", deltas.append)
    assert replicas.handle.avoided == [(), ("a",)]
    assert [(d.token_ids, d.finish_reason, d.error) for d in deltas] == [([7], "length", None)]


@cluster
def test_the_prefix_index_follows_a_prompt_down_its_blocks():
    need_ray()
    from engine.router import PrefixIndex

    index = PrefixIndex(block=4, capacity=6)
    index.add(list(range(10)), "a")  # two full blocks
    index.add([0, 1, 2, 3, 9, 9, 9, 9], "b")
    assert index.depths(list(range(12))) == {"a": 2, "b": 1}
    assert index.depths([0, 1, 2]) == {}  # no full block
    assert index.depths([7, 1, 2, 3]) == {}
    index.drop("a")
    assert index.depths(list(range(12))) == {"b": 1}
    index.add(list(range(100, 120)), "c")  # five keys more: the oldest go
    assert len(index.holders) == 6 and index.depths(list(range(8))) == {}
