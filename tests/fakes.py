"""Fakes of the engine for the server and client tests, and a served app around an engine."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from core.params import InvalidRequest, SamplingParams
from core.request import Delta, FinishReason, Overloaded, TokenLogprob, Usage
from server import ServerOptions, start_server


class FakeTokenizer:
    """One character a token: printable ASCII c is id ord(c) - 32; id 95 is eos."""

    vocab_size = 96
    eos_token_id = 95
    max_token_chars = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(max(ord(c) - 32, 0), 94) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + 32) for i in ids if i < 95)

    chat_template = "<{role}>{content}...<assistant>"

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + "<assistant>")


class FakeMetrics:
    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def render(self) -> str:
        live = len(self.engine.live)
        return (
            "# TYPE tandem_kv_pages_used gauge\n"
            f"tandem_kv_pages_used {live}\n"
            f"tandem_requests_running {live}\n"
        )


class FakeStream:
    """Letters a, b, c, ... after the prompt, one token a delta, `engine.delay` s apart."""

    def __init__(self, engine: FakeEngine, request_id: str, prompt_ids: list[int], params):
        self.engine, self.request_id, self.params = engine, request_id, params
        self.prompt_len = len(prompt_ids)
        self.next = 65  # 'a'
        self.count = 0
        self.aborted = False
        self.done = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        await asyncio.sleep(self.engine.delay)
        if self.aborted:
            return self.last([], FinishReason.ABORT)
        if self.count == self.engine.fail_at:
            return self.last([], FinishReason.ERROR, error="RuntimeError: the device fell over")
        token, self.next = self.next, 65 + (self.next - 64) % 26
        self.count += 1
        logprobs = None
        if self.params.logprobs is not None:
            top = [(token, -0.25), (token + 1, -1.5), (token + 2, -3.0)]
            logprobs = [TokenLogprob(token, -0.25, top[: self.params.logprobs])]
        if self.count >= self.params.max_tokens:
            return self.last([token], FinishReason.LENGTH, logprobs)
        return Delta(self.request_id, [token], chr(token + 32), logprobs)

    def last(self, tokens: list[int], reason: FinishReason, logprobs=None, error=None) -> Delta:
        self.done = True
        self.engine.live.pop(self.request_id, None)
        n = self.count
        usage = Usage(self.prompt_len, n, draft_tokens=3 * n, accepted_tokens=2 * n, spec_steps=n)
        text = "".join(chr(t + 32) for t in tokens)
        return Delta(self.request_id, tokens, text, logprobs, reason, error, usage)

    async def aclose(self) -> None:
        if not self.done:
            self.engine.abort(self.request_id)


class FakeEngine:
    """Validates like the real one, refuses past `max_live` requests, records aborts."""

    model_name = "fake-model"
    max_model_len = 128
    vocab_size = 96

    def __init__(self, delay: float = 0.0, max_live: int = 16, fail_at: int | None = None):
        self.delay, self.max_live = delay, max_live
        self.fail_at = fail_at  # the stream fails (FinishReason.ERROR) after this many tokens
        self.tokenizer = FakeTokenizer()
        self.metrics = FakeMetrics(self)
        self.live: dict[str, FakeStream] = {}
        self.submitted: list[tuple[list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.stopped = False
        self.failure: str | None = None
        self.failed = asyncio.Event()

    async def start(self) -> None:
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True
        for request_id in list(self.live):
            self.abort(request_id)

    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> FakeStream:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or not all(0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest("bad prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest("past the context")
        if len(self.live) >= self.max_live:
            raise Overloaded("the waiting queue is full")
        request_id = request_id or uuid.uuid4().hex
        self.submitted.append((ids, params))
        stream = self.live[request_id] = FakeStream(self, request_id, ids, params)
        return stream

    def abort(self, request_id: str) -> None:
        stream = self.live.pop(request_id, None)
        if stream is not None:
            self.aborted.append(request_id)
            stream.aborted = True


@contextlib.asynccontextmanager
async def served(engine: Any, **options: Any) -> AsyncIterator[str]:
    """The engine started and served on a free loopback port; yields the base URL."""
    await engine.start()
    runner = await start_server(engine, ServerOptions(host="127.0.0.1", port=0, **options))
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
        await engine.stop()


def spy_on_abort(engine: Any) -> list[str]:
    calls: list[str] = []
    abort = engine.abort

    def recording(request_id: str) -> None:
        calls.append(request_id)
        abort(request_id)

    engine.abort = recording
    return calls
