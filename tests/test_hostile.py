"""Hostile input against a real server on the tiny checkpoint: every refusal is a 4xx with a
message, the server keeps serving, and no KV page is left in use.

The property test sends bodies drawn from a grammar of the API's field names and the extreme
values that broke servers before (2^63, lone surrogates, NaN, deep nesting, wrong types).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infill
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from server import ServerOptions, start_server

C, CHAT, INFILL = "/v1/completions", "/v1/chat/completions", "/infill"
USER = [{"role": "user", "content": "hi"}]
NEAR_VALID: dict[str, dict[str, Any]] = {
    C: {"prompt": [1, 2]},
    CHAT: {"messages": USER},
    INFILL: {"input_prefix": "def f(", "input_suffix": ")"},
}


class Served:
    """A real engine and server on their own event loop thread; requests are plain blocking
    HTTP, as an outside client's would be (and as hypothesis, which is synchronous, needs)."""

    def __init__(self, checkpoint: Path, **options: Any):
        spec = SpecConfig(method="draft", draft=str(checkpoint), num_speculative_tokens=3)
        config = EngineConfig(
            model=str(checkpoint),
            spec=spec,
            kv=KVConfig(page_size=4, num_pages=256),
            max_model_len=128,
            max_running=8,
        )
        self.engine = AsyncEngine(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = self.call(self._start(ServerOptions(port=0, **options)))
        self.port = self.runner.addresses[0][1]

    async def _start(self, options: ServerOptions):
        await self.engine.start()
        return await start_server(self.engine, options)

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def close(self) -> None:
        self.call(self.runner.cleanup())
        self.call(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def request(
        self, path: str, body: Any = None, headers: dict[str, str] | None = None, method="POST"
    ) -> tuple[int, dict[str, str], Any]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} | (headers or {})
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, body=data, headers=sent)
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        answer = json.loads(raw) if raw and raw[:1] in b"{[" else raw
        return response.status, dict(response.headers), answer

    def raw(self, head: bytes, body: bytes = b"") -> bytes:
        """A request written byte for byte (headers http.client would refuse to send)."""

        async def send() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(head + b"\r\n\r\n" + body)
            await writer.drain()
            answer = await reader.read()
            writer.close()
            return answer

        return self.call(send())

    def serves(self) -> bool:
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}  # exactly 3 tokens
        status, _, answer = self.request(C, body, KEY)
        return status == 200 and answer["usage"]["completion_tokens"] == 3

    def pages_free(self) -> bool:
        async def idle() -> bool:
            await asyncio.wait_for(self.engine.wait_idle(), 30)
            allocator = self.engine.allocator
            return allocator.num_free == allocator.num_pages

        return self.call(idle())


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    from tests.tiny import write_model

    server = Served(write_model(tmp_path_factory.mktemp("hostile"), seed=0), api_key="sesame")
    yield server
    server.close()


KEY = {"Authorization": "Bearer sesame"}

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# fmt: off
HOSTILE: list[tuple[str, str, Any, int, str]] = [
    # (what, route, body, status, message)
    ("top_k 2^63", C, {"prompt": "a", "top_k": 2**63}, 400, "'top_k' must be an integer in"),
    ("max_tokens 2^63", C, {"prompt": "a", "max_tokens": 2**63}, 400, "'max_tokens'"),
    ("seed 2^64", C, {"prompt": "a", "seed": 2**64}, 400, "'seed'"),
    ("prompt id 2^63", C, {"prompt": [2**63]}, 400, "outside the vocabulary"),
    ("stop id 2^63", C, {"prompt": "a", "stop_token_ids": [2**63]}, 400, "outside the vocab"),
    ("num_speculative_tokens 2^40", C, {"prompt": "a", "num_speculative_tokens": 2**40}, 400, ""),
    ("temperature 1e308", C, {"prompt": "a", "temperature": 1e308}, 400, "'temperature'"),
    ("temperature inf", C, b'{"prompt": "a", "temperature": Infinity}', 400, "'temperature'"),
    ("top_p NaN", C, b'{"prompt": "a", "top_p": NaN}', 400, "'top_p'"),
    ("repetition_penalty 1e-300", C, {"prompt": "a", "repetition_penalty": 1e-300}, 400, ""),
    ("min_p -0.5", C, {"prompt": "a", "min_p": -0.5}, 400, "'min_p'"),
    ("logit_bias 1e9", C, {"prompt": "a", "logit_bias": {"5": 1e9}}, 400, "'logit_bias'"),
    ("logit_bias id 2^63", C, {"prompt": "a", "logit_bias": {str(2**63): 1}}, 400, "'logit_b"),
    ("logit_bias bad key", C, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "'logit_bias'"),
    ("logit_bias outside", C, {"prompt": "a", "logit_bias": {"99999": 1}}, 400, "outside the"),
    ("stop of 10k chars", C, {"prompt": "a", "stop": "x" * 10_000}, 400, "'stop'"),
    ("deep JSON", C, b'{"prompt": "a", "user": ' + b"[" * 50 + b"]" * 50 + b"}", 400, "deeper"),
    ("very deep JSON", C, b"[" * 100_000 + b"]" * 100_000, 400, "nest"),
    ("lone surrogate", C, b'{"prompt": "a\\ud800b"}', 400, "lone surrogate"),
    ("surrogate in a key", C, b'{"prompt": "a", "\\udfff": 1}', 400, "lone surrogate"),
    ("non-UTF-8 body", C, b'{"prompt": "\xff\xfe"}', 400, "not valid JSON"),
    ("response_format xml", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400,
     "response_format's type must be"),
    ("response_format 7", CHAT, {"messages": USER, "response_format": 7}, 400,
     "'response_format' must be"),
    ("schema not a schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref":
     "#/nowhere"}}}}}}, 400, "invalid json_schema"),
    ("schema not an object", CHAT, {"messages": USER, "response_format": {"type": "json_schema",
     "json_schema": {"schema": [1]}}}, 400, "'schema' object"),
    ("regex unclosed", C, {"prompt": "a", "structured_outputs": {"regex": "(["}}, 400,
     "invalid regex"),
    ("two constraints", C, {"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "only one of"),
    ("choice empty", C, {"prompt": "a", "guided_choice": []}, 400, "non-empty strings"),
    ("grammar bad", C, {"prompt": "a", "guided_grammar": "root ::= ("}, 400, "invalid ebnf"),
    ("structured two keys", C, {"prompt": "a", "structured_outputs": {"regex": "a",
     "choice": ["a"]}}, 400, "must hold one of"),
    ("grammar with ignore_eos", C, {"prompt": "a", "guided_regex": "a+", "ignore_eos": True},
     400, "ignore_eos"),
    # a keyword the grammar would not enforce, or an unsatisfiable schema: refused by name,
    # on both routes, streaming or not
    ("schema not", CHAT, {"messages": USER, "response_format": {"type": "json_schema",
     "json_schema": {"schema": {"not": {}}}}}, 400, "keyword 'not'"),
    ("integer not integer", C, {"prompt": "a", "stream": True, "guided_json": {"type":
     "integer", "not": {"type": "integer"}}}, 400, "keyword 'not'"),
    ("allOf of two", C, {"prompt": "a", "guided_json": {"allOf": [{"type": "string"},
     {"type": "integer"}]}}, 400, "'allOf' of 2"),
    ("anyOf empty", C, {"prompt": "a", "structured_outputs": {"json": {"anyOf": []}}}, 400,
     "non-empty list"),
    ("oneOf", CHAT, {"messages": USER, "stream": True, "response_format": {"type":
     "json_schema", "json_schema": {"schema": {"oneOf": [{"type": "integer"}]}}}}, 400,
     "keyword 'oneOf'"),
    ("uniqueItems", C, {"prompt": "a", "guided_json": {"type": "array", "uniqueItems": True}},
     400, "keyword 'uniqueItems'"),
    ("contains in tool", CHAT, {"messages": USER, "tool_choice": "required", "tools": [{"type":
     "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"l":
     {"type": "array", "contains": {"const": 1}}}}}}]}, 400, "keyword 'contains'"),
    ("format date", C, {"prompt": "a", "guided_json": {"type": "string", "format": "date"}},
     400, "format 'date'"),
    ("false schema", C, {"prompt": "a", "guided_json": {"type": "object", "properties": {"a":
     False}, "required": ["a"]}}, 400, "nothing satisfies it"),
    ("regex matching nothing", C, {"prompt": "a", "guided_regex": "[^\\s\\S]"}, 400,
     "matches nothing"),
    ("regex matching nothing, chat, streaming", CHAT, {"messages": USER, "stream": True,
     "structured_outputs": {"regex": "[^\\s\\S]"}}, 400, "matches nothing"),
    ("tools", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "'tools'"),
    ("tool_choice no tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400,
     "'tool_choice' needs 'tools'"),
    ("tool_choice auto", CHAT, {"messages": USER, "tools": [TOOL]}, 400, "'auto' is not"),
    ("tool_choice unknown", CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": {
     "type": "function", "function": {"name": "nope"}}}, 400, "not a tool"),
    ("n 2", CHAT, {"messages": USER, "n": 2}, 400, "'n' must be 1"),
    ("best_of 2", C, {"prompt": "a", "best_of": 2}, 400, "'best_of'"),
    ("echo", C, {"prompt": "a", "echo": True}, 400, "'echo'"),
    ("suffix 7", C, {"prompt": "a", "suffix": 7}, 400, "'suffix'"),
    ("suffix with token ids", C, {"prompt": [1, 2], "suffix": "b"}, 400, "must be a string"),
    (
        "echo on chat",
        CHAT,
        {"messages": USER, "echo": False},
        400,
        "'echo' is a field of /v1/completions",
    ),
    (
        "messages on completions",
        C,
        {"prompt": "a", "messages": USER},
        400,
        "'messages' is a field of /v1/chat/completions",
    ),
    ("unknown field", C, {"prompt": "a", "frobnicate": 1}, 400, "not a known field"),
]
# fmt: on


@pytest.mark.parametrize("what, route, body, status, message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_refused_and_the_server_goes_on(
    served, what, route, body, status, message
):
    got, _, answer = served.request(route, body, KEY)
    assert got == status, answer
    assert message in answer["error"]["message"]
    assert served.serves() and served.pages_free()


def test_a_completion_with_a_suffix_fills_the_middle(served):
    """/v1/completions with `suffix`: the same middle streamed or not."""
    body = {
        "prompt": "def add(a, b):\n",
        "suffix": "\nprint(add(1, 2))\n",
        "max_tokens": 8,
        "temperature": 0,
    }
    status, _, answer = served.request(C, body, KEY)
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    status, _, stream = served.request(C, body | {"stream": True}, KEY)
    assert status == 200
    chunks = [
        json.loads(line[6:]) for line in stream.decode().splitlines() if line.startswith("data: {")
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]


def test_fields_that_change_nothing_pass(served):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 2,
        "ignore_eos": True,
        "user": "u-1",
        "metadata": {"team": "x"},
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "tools": [],
        "n": 1,
        "store": False,
    }
    status, _, answer = served.request(CHAT, body, KEY)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 2


def test_a_tiny_temperature_is_greedy(served):
    """1e-30 rounds to 0 in float32: it is served as greedy, by SamplingParams.greedy's rule."""
    body = {"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}
    greedy = served.request(C, body | {"temperature": 0}, KEY)[2]["choices"][0]["text"]
    for tiny in (1e-30, 5e-324):
        status, _, answer = served.request(C, body | {"temperature": tiny}, KEY)
        assert status == 200 and answer["choices"][0]["text"] == greedy


def test_logit_bias_steers_the_output(served):
    body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    forced = served.request(C, body | {"logprobs": 0, "logit_bias": {"7": 100}}, KEY)[2]
    assert forced["choices"][0]["logprobs"]["tokens"] == [forced_text(served, 7)] * 6


def forced_text(served: Served, token_id: int) -> str:
    return served.engine.tokenizer.decode([token_id])


def test_headers_and_browsers(served):
    body = {"prompt": [1], "max_tokens": 1}
    # the auth scheme is case-insensitive; a 401 says which scheme it wants
    assert served.request(C, body, {"Authorization": "bearer sesame"})[0] == 200
    status, headers, _ = served.request(C, body, {"Authorization": "Basic c2VzYW1l"})
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    # a body that is not JSON by its type
    assert served.request(C, body, KEY | {"Content-Type": "text/plain"})[0] == 415
    # a page of another origin may not call a loopback server; DNS rebinding neither
    status, _, answer = served.request(C, body, KEY | {"Origin": "https://evil.example"})
    assert status == 403 and "origin" in answer["error"]["message"]
    status, _, answer = served.request(C, body, KEY | {"Host": "evil.example:8000"})
    assert status == 403 and "Host" in answer["error"]["message"]
    assert served.request("/health", None, {"Host": f"localhost:{served.port}"}, "GET")[0] == 200
    # a header that is not UTF-8 (it gave a 500 in the API key check)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nAuthorization: Bearer \xff\xfe\r\nContent-Length: 2\r\nConnection: close"
    )
    assert served.raw(head, b"{}").startswith(b"HTTP/1.1 400")
    assert served.serves() and served.pages_free()


def test_allowed_origins_get_cors_answers(tmp_path):
    from tests.tiny import write_model

    origin = "https://app.example"
    server = Served(write_model(tmp_path, seed=0), allowed_origins=(origin,))
    try:
        status, headers, _ = server.request(C, None, {"Origin": origin}, "OPTIONS")
        assert status == 204 and headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in headers["Access-Control-Allow-Methods"]
        body = {"prompt": [1], "max_tokens": 1}
        status, headers, _ = server.request(C, body, {"Origin": origin})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
        status, headers, _ = server.request(C, {"prompt": 5}, {"Origin": origin})
        assert status == 400 and headers["Access-Control-Allow-Origin"] == origin
        assert server.request(C, {"prompt": [1]}, {"Origin": "https://other.example"})[0] == 403
    finally:
        server.close()


# ---- the property test ----

FIELDS = sorted(
    {"prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"}
    | {"stop", "stop_token_ids", "logit_bias", "logprobs", "top_logprobs", "n", "echo", "stream"}
    | {"presence_penalty", "repetition_penalty", "num_speculative_tokens", "ignore_eos"}
    | {"max_completion_tokens", "response_format", "tools", "user", "stream_options", "suffix"}
    | {"show_speculation", *infill.FIELDS}
)
EXTREME_INTS = [
    0,
    1,
    -1,
    2,
    5,
    127,
    128,
    2**31 - 1,
    2**31,
    2**53,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
]
EXTREME_FLOATS = [0.0, 1e-45, 1e-30, 0.5, 1.0, 2.0, 1e38, 1e308, -1e308, -0.0]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EXTREME_INTS),
    st.integers(-(2**70), 2**70),
    st.sampled_from(EXTREME_FLOATS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["\ud800", "a\udfffb", "", " ", "text", "json_object", "none"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "5"]), inner, max_size=3
        ),
    ),
    max_leaves=8,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]), "content": values}
)
bodies = st.dictionaries(
    st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)),
    st.one_of(values, st.lists(message, max_size=3), st.lists(st.integers(-5, 300), max_size=8)),
    max_size=6,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(body=bodies, route=st.sampled_from([C, CHAT, INFILL]), keep=st.booleans())
def test_generated_bodies_never_break_the_server(served, body, route, keep):
    if keep:  # half the bodies are near-valid: the route's required field present and sane
        body = NEAR_VALID[route] | body
        body["n_predict" if route == INFILL else "max_tokens"] = 4
        body.pop("stream", None)
    text = json.dumps(body, allow_nan=True).encode(errors="surrogatepass")
    status, _, answer = served.request(route, text, KEY)
    assert status < 500, (body, answer)


def test_after_the_property_test_the_server_serves_and_pages_are_free(served):
    assert served.serves() and served.pages_free()
    status, _, answer = served.request("/health", None, None, "GET")
    assert status == 200 and answer["status"] == "ok"
