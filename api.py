"""The OpenAI API's shapes: validation and response bodies; no I/O.

Every request is checked here, in one table-driven pass, before it reaches the engine; a refusal
is an ApiError, which server.py answers in OpenAI's error shape. The Reply classes turn what a
request has produced into the completions and the chat bodies, whole or as stream chunks.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

from core.params import INT32_MAX, MAX_LOGIT_BIAS, Grammar, SamplingParams
from core.request import Delta, FinishReason, TokenLogprob, Usage
from structured import (
    StructuredError,
    ToolChoice,
    call_body,
    grammar_of,
    valid_response_format,
    valid_tool,
    valid_tool_choice,
)

JSON = dict[str, Any]


class Tokenizer(Protocol):
    @property
    def max_token_chars(self) -> int: ...  # a text of n characters has >= n / this tokens
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def encode_chat(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def fim_ids(self) -> tuple[int, int, int] | None: ...
    @property
    def fim_stop_ids(self) -> tuple[int, ...]: ...
    def encode_fill(self, prefix: str, suffix: str) -> list[int]: ...
    def encode_text(self, text: str) -> list[int]: ...  # special-token spellings as text
    @property
    def fim_repo_ids(self) -> tuple[int | None, int | None]: ...
    @property
    def adds_bos(self) -> bool: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_id(self) -> int | None: ...


class Metrics(Protocol):
    def render(self) -> str: ...


class Engine(Protocol):
    """What the server needs of engine.engine.AsyncEngine (tests pass a fake)."""

    @property
    def model_name(self) -> str: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def metrics(self) -> Metrics: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def compile_grammar(self, grammar: Grammar) -> None: ...
    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterable[Delta]: ...
    def abort(self, request_id: str) -> None: ...
    @property
    def failure(self) -> str | None: ...  # why the engine stopped serving; None while it serves
    @property
    def failed(self) -> asyncio.Event: ...  # set once failure is


# ---------------------------------------------------------------------------------------------
# Errors


class ApiError(Exception):
    """A refusal, answered with an HTTP status and OpenAI's error body
    `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.param, self.headers = param, headers

    @property
    def body(self) -> JSON:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": error | {"code": self.code}}


# ---------------------------------------------------------------------------------------------
# Validation: one table per route, checked in one pass. null counts as absent, as in OpenAI's API.

Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return type(v) is int  # bool is an int to Python, not to JSON


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _bool(v: Any) -> bool:
    return type(v) is bool


def _str(v: Any) -> bool:
    return type(v) is str


def _ids(v: Any) -> TypeGuard[list[int]]:
    return type(v) is list and all(_int(t) for t in v)


def _stop(v: Any) -> bool:
    short = lambda s: _str(s) and len(s) <= MAX_STOP_CHARS  # noqa: E731
    return short(v) or (type(v) is list and len(v) <= 16 and all(short(s) for s in v))


def _stream_options(v: Any) -> bool:
    keys = ("include_usage", "continuous_usage_stats")
    return type(v) is dict and all(k in keys and _bool(x) for k, x in v.items())


def _text_part(p: Any) -> bool:
    return type(p) is dict and p.get("type") == "text" and _str(p.get("text"))


def _content(v: Any) -> bool:
    return _str(v) or (type(v) is list and all(_text_part(p) for p in v))


def _tool_call(c: Any) -> bool:
    function = c.get("function") if type(c) is dict else None
    return (
        type(function) is dict
        and c.get("type", "function") == "function"
        and _str(function.get("name"))
        and _str(function.get("arguments"))
    )


def _message(m: Any) -> bool:
    if type(m) is not dict or m.get("role") not in ROLES:
        return False
    calls = m.get("tool_calls")
    if calls is not None:  # an assistant's calls; its content may then be null
        calls_ok = m["role"] == "assistant" and type(calls) is list and all(map(_tool_call, calls))
        return calls_ok and (m.get("content") is None or _content(m["content"]))
    if m["role"] == "tool" and not _str(m.get("tool_call_id")):
        return False
    return _content(m.get("content"))


def _messages(v: Any) -> bool:
    return type(v) is list and len(v) > 0 and all(_message(m) for m in v)


def _in(lo: int, hi: int) -> Check:
    return lambda v: _int(v) and lo <= v <= hi


def _within(lo: float, hi: float) -> Check:
    return lambda v: _number(v) and lo <= v <= hi


def _is(value: Any) -> Check:
    return lambda v: v == value and type(v) is type(value)


def _logit_bias(v: Any) -> bool:
    """{"token id": bias}: ids as JSON keys are strings, biases in OpenAI's [-100, 100]."""
    return (
        type(v) is dict
        and len(v) <= MAX_LOGIT_BIAS_ENTRIES
        and all(k.isascii() and k.isdigit() and len(k) <= 10 for k in v)
        and all(_within(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)(x) for x in v.values())
    )


# "developer" is the newer name of "system"; tool messages and calls need a template for them
ROLES = ("system", "developer", "user", "assistant", "tool")
NONE = lambda v: False  # noqa: E731 - only null (absent) passes
INT32 = INT32_MAX
MAX_STOP_CHARS = 256  # a stop string is matched against each new token's text
MAX_LOGIT_BIAS_ENTRIES = 1024

# name: (check, what the value must be). Every field a route knows is here; a field that would
# change the output in a way the engine does not support passes only at its no-op value (n: 1,
# echo: false, tools: [] ...), so that asking for it is a 400 that names it.
COMMON_FIELDS: dict[str, tuple[Check, str]] = {
    "model": (_str, "a string"),
    "stream": (_bool, "a boolean"),
    "stream_options": (
        _stream_options,
        "an object of booleans: include_usage, continuous_usage_stats",
    ),
    "max_tokens": (_in(1, INT32), f"an integer in [1, {INT32}]"),
    "temperature": (_within(0, 100), "a number in [0, 100]"),
    "top_p": (lambda v: _within(0, 1)(v) and v > 0, "a number in (0, 1]"),
    "top_k": (_in(-1, INT32), f"an integer in [-1, {INT32}] (0 or -1: off)"),
    "min_p": (_within(0, 1), "a number in [0, 1]"),
    "presence_penalty": (_within(-2, 2), "a number in [-2, 2]"),
    "frequency_penalty": (_within(-2, 2), "a number in [-2, 2]"),
    "repetition_penalty": (_within(0.01, 100), "a number in [0.01, 100]"),
    "seed": (_in(0, 2**63 - 1), "an integer in [0, 2^63)"),
    "stop": (_stop, f"a string or a list of at most 16 strings of at most {MAX_STOP_CHARS}"),
    "stop_token_ids": (
        lambda v: _ids(v) and len(v) <= 1024,
        "a list of at most 1024 token ids",
    ),
    "ignore_eos": (_bool, "a boolean"),
    "num_speculative_tokens": (_in(0, INT32), f"an integer in [0, {INT32}]"),
    "speculative_method": (_str, "a string: none or a drafter the server loaded"),
    # ours: each streamed chunk tells who proposed each of its tokens (the page at / reads it)
    "show_speculation": (_bool, "a boolean"),
    "logit_bias": (
        _logit_bias,
        f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids to numbers in [-100, 100]",
    ),
    "n": (_is(1), "1 (one choice per request is supported)"),
    "user": (_str, "a string"),  # an end-user id: changes nothing here
    # structured output (structured.py checks what these hold)
    "structured_outputs": (lambda v: type(v) is dict, "an object"),
    "guided_json": (lambda v: type(v) is dict or _str(v), "a JSON schema"),
    "guided_regex": (_str, "a string"),
    "guided_choice": (lambda v: type(v) is list, "a list of strings"),
    "guided_grammar": (_str, "a string"),
}
COMPLETION_FIELDS = COMMON_FIELDS | {
    "prompt": (lambda v: _str(v) or type(v) is list, "a string or a list of token ids"),
    "logprobs": (_in(0, 5), "an integer in 0..5"),
    "echo": (_is(False), "false (echo is not supported)"),
    "best_of": (_is(1), "1 (best_of is not supported)"),
    "suffix": (lambda v: v is None or _str(v), "a string: the text after the completion"),
}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages": (
        _messages,
        "a non-empty list of {role, content}: role one of "
        + ", ".join(ROLES)
        + ", content a string or a list of text parts (a tool message with its tool_call_id)",
    ),
    "logprobs": (_bool, "a boolean"),
    "top_logprobs": (_in(0, 20), "an integer in 0..20"),
    "max_completion_tokens": (_in(1, INT32), f"an integer in [1, {INT32}]"),
    "response_format": (
        valid_response_format,
        "an object whose type is text, json_object or json_schema",
    ),
    "tools": (
        lambda v: type(v) is list and all(map(valid_tool, v)),
        'a list of {"type": "function", "function": {"name", "parameters"}}',
    ),
    "tool_choice": (
        valid_tool_choice,
        '"none", "auto", "required" or {"type": "function", "function": {"name"}}',
    ),
    "parallel_tool_calls": (_bool, "a boolean"),
    "functions": (_is([]), "empty (functions are not supported)"),
    "function_call": (_is("none"), '"none" (functions are not supported)'),
    "modalities": (_is(["text"]), '["text"] (only text is supported)'),
    "audio": (NONE, "null (audio is not supported)"),
    "metadata": (
        lambda v: type(v) is dict and all(_str(x) for x in v.values()),
        "an object of strings",
    ),
    "store": (_bool, "a boolean"),
    "service_tier": (_str, "a string"),
}
ROUTES = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS}
# fields that SamplingParams takes as they are (it checks their ranges again itself)
PASSED_THROUGH = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "num_speculative_tokens",
    "speculative_method",
)
MAX_JSON_DEPTH = 16  # a chat body nests 4 deep; the limit keeps a hostile body's walk short


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validate(body: Any, route: str, required: str) -> JSON:
    """The body's fields that are not null, each checked against the route's table; a field
    the route does not know is refused, naming the route it belongs to if any."""
    table = ROUTES[route]
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in table:
            other = [r for r, fields in ROUTES.items() if name in fields]
            where = f"a field of {other[0]}, not of {route}" if other else "not a known field"
            raise ApiError(400, f"'{name}' is {where}", param=name)
    if body.get(required) is None:
        raise ApiError(400, f"'{required}' is required", param=required)
    fields = {}
    for name, (check, what) in table.items():
        value = body.get(name)
        if value is None:
            continue
        if not check(value):
            raise ApiError(400, f"'{name}' must be {what}, got {_short(value)}", param=name)
        fields[name] = value
    if "stream_options" in fields and not fields.get("stream"):
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true")
    return fields


def check_model(fields: JSON, served: str) -> None:
    model = fields.get("model")
    if model is not None and model != served:
        raise ApiError(
            404, f"the model '{model}' does not exist", code="model_not_found", param="model"
        )


def check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(
            400, f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size})"
        )


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    if prompt_len + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} and max_tokens asks for {max_tokens}",
            code="context_length_exceeded",
        )


def rest_of_context(prompt_len: int, max_model_len: int) -> int:
    """What a chat that sets no limit may generate: the rest of the context (as in OpenAI's
    API)."""
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len}, which leaves no room for an answer",
            code="context_length_exceeded",
        )
    return max_model_len - prompt_len


# Normalisers can shorten a text before it is split (NFKC composes characters), so the bound
# on a text's tokens is taken with this margin.
TEXT_BOUND_MARGIN = 4


def check_text_length(num_chars: int, engine: Engine) -> None:
    """Refuse, before tokenizing it, a text that cannot fit the context whatever its tokens."""
    fewest_tokens = num_chars // (TEXT_BOUND_MARGIN * engine.tokenizer.max_token_chars)
    if fewest_tokens > engine.max_model_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {engine.max_model_len} tokens; the prompt's "
            f"{num_chars} characters are more than {fewest_tokens} tokens",
            code="context_length_exceeded",
        )


def completion_prompt(
    value: str | list[Any], engine: Engine, suffix: str | None = None
) -> list[int]:
    """A string, a list of token ids, or a list holding exactly one of those: its ids. With a
    `suffix`, the prompt of a fill in the middle: the model's markers around the string
    prompt and the suffix (prefix, suffix, middle: the completion is what goes between)."""
    if suffix is not None:
        return fill_in_the_middle(value, suffix, engine)
    if value and type(value) is list and type(value[0]) in (str, list):
        if len(value) != 1:
            raise ApiError(400, f"only one prompt per request is supported, got {len(value)}")
        value = value[0]
    if not value:
        raise ApiError(400, "'prompt' must not be empty")
    if isinstance(value, str):
        check_text_length(len(value), engine)
        return engine.tokenizer.encode(value, add_special_tokens=True)
    if not _ids(value):
        raise ApiError(400, "'prompt' must be a string or a list of token ids")
    check_ids(value, engine.vocab_size, "'prompt'")
    return value


def fill_in_the_middle(prefix: Any, suffix: str, engine: Engine) -> list[int]:
    """The model's markers around prefix and suffix (Qwen2.5-Coder's, StarCoder's); a 400
    where the vocabulary has no such markers."""
    if engine.tokenizer.fim_ids is None:
        raise ApiError(400, "'suffix': this model has no fill-in-the-middle tokens")
    if not isinstance(prefix, str):
        raise ApiError(400, "'prompt' must be a string with a 'suffix'")
    check_text_length(len(prefix) + len(suffix), engine)
    return engine.tokenizer.encode_fill(prefix, suffix)


def chat_prompt(
    messages: list[dict[str, Any]], engine: Engine, tools: list[JSON] | None = None
) -> list[int]:
    """The conversation's ids through the model's chat template (tokenizer.encode_chat), which
    sees the request's tools where it has a form for them."""
    flat = [_template_message(m) for m in messages]
    check_text_length(sum(len(m["content"]) for m in flat), engine)
    tools = [m["role"] for m in flat if m["role"] == "tool" or "tool_calls" in m]
    template = engine.tokenizer.chat_template or ""
    if tools and "tool" not in template:
        what = "tool messages" if "tool" in tools else "an assistant's tool_calls"
        raise ApiError(
            400,
            f"the model's chat template has no form for {what} (it never mentions tools)",
            param="messages",
        )
    try:
        return engine.tokenizer.encode_chat(flat, **({"tools": tools} if tools else {}))
    except ValueError as e:  # no template, or the template refused the conversation
        raise ApiError(400, str(e)) from e


def _template_message(message: JSON) -> JSON:
    """A checked message in the form chat templates read: text parts joined, "developer" as
    "system", a call's JSON arguments as the object they spell (templates write them with
    tojson)."""
    role = "system" if message["role"] == "developer" else message["role"]
    flat = message | {"role": role, "content": _content_text(message.get("content"))}
    if "tool_calls" in message:
        flat["tool_calls"] = [_template_call(c) for c in message["tool_calls"]]
    return flat


def _template_call(call: JSON) -> JSON:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = function["arguments"]
    return call | {"type": "function", "function": function | {"arguments": arguments}}


def _content_text(content: str | list[JSON] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def check_json(body: Any) -> None:
    """Refuse a body nested deeper than MAX_JSON_DEPTH or holding a string that is not
    Unicode text (a lone surrogate, which JSON's escapes can spell)."""
    todo = [(body, 1)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            todo.extend((k, depth) for k in value)
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as e:
                raise ApiError(400, "the request body holds a lone surrogate (not text)") from e


def sampling_params(
    fields: JSON, max_tokens: int, logprobs: int | None, engine: Engine
) -> SamplingParams:
    """SamplingParams from checked fields; its own range checks raise InvalidRequest (a 400)."""
    stop = fields.get("stop", ())
    stop_ids = fields.get("stop_token_ids", [])
    check_ids(stop_ids, engine.vocab_size, "'stop_token_ids'")
    if fields.get("suffix") is not None:  # a fill in the middle ends where the model says
        stop_ids = [*stop_ids, *engine.tokenizer.fim_stop_ids]
    bias = [(int(k), float(v)) for k, v in fields.get("logit_bias", {}).items()]
    check_ids([t for t, _ in bias], engine.vocab_size, "'logit_bias'")
    return SamplingParams(
        grammar=structured_output(fields)[0],
        max_tokens=max_tokens,
        top_k=max(fields.get("top_k", 0), 0),  # -1 is off too, as in other servers
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(stop_ids),
        logprobs=logprobs,
        logit_bias=tuple(bias),
        **{name: fields[name] for name in PASSED_THROUGH if name in fields},
    )


def structured_output(fields: JSON) -> tuple[Grammar | None, ToolChoice | None]:
    """What the output must match, and the forced tool call; a 400 naming the field."""
    try:
        return grammar_of(fields)
    except StructuredError as e:
        raise ApiError(400, str(e), param=e.param) from None


# ---------------------------------------------------------------------------------------------
# Replies: what a request has produced, in OpenAI's shapes


@dataclass
class Job:
    """A checked request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage on every chunk
    tool: ToolChoice | None = None  # a forced tool call: the output is its arguments
    show_speculation: bool = False  # a "speculation" field on each chunk


def make_job(
    prefix: str, prompt_ids: list[int], params: SamplingParams, fields: JSON, engine: Engine
) -> Job:
    check_context(len(prompt_ids), params.max_tokens, engine.max_model_len)
    options = fields.get("stream_options", {})
    return Job(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_ids=prompt_ids,
        params=params,
        stream=fields.get("stream", False),
        include_usage=options.get("include_usage", False),
        continuous_usage=options.get("continuous_usage_stats", False),
        tool=structured_output(fields)[1],
        show_speculation=fields.get("show_speculation", False),
    )


def usage_body(u: Usage) -> JSON:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "speculative": {
            "draft_tokens": u.draft_tokens,
            "accepted_tokens": u.accepted_tokens,
            "steps": u.spec_steps,
            "forced_tokens": u.forced_tokens,
            **(
                {
                    "by_drafter": {
                        name: {"draft_tokens": drafted, "accepted_tokens": accepted}
                        for name, (drafted, accepted) in u.by_drafter.items()
                    }
                }
                if u.by_drafter
                else {}
            ),
        },
    }


class Reply(ABC):
    """A request's output so far; subclasses give the completions and the chat shapes."""

    object_full = ""
    object_chunk = ""

    def __init__(self, job: Job, model: str, tokenizer: Tokenizer):
        self.job, self.model, self.tokenizer = job, model, tokenizer
        self.created = int(time.time())
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.num_tokens = 0
        self.finish: FinishReason | None = None
        self.error: str | None = None
        self.unavailable = False  # the error is worth a retry (Delta.unavailable)
        self.final_usage: Usage | None = None
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # the spans' text

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs or [])
        self.num_tokens += len(delta.token_ids)
        self.finish = delta.finish_reason or self.finish
        self.error = delta.error or self.error
        self.unavailable = delta.unavailable or self.unavailable
        self.final_usage = delta.usage or self.final_usage

    @property
    def usage(self) -> Usage:
        counted = Usage(len(self.job.prompt_ids), self.num_tokens)
        return self.final_usage or counted

    def envelope(self, obj: str, choices: list[JSON]) -> JSON:
        return {
            "id": self.job.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, delta: Delta) -> JSON:
        finish = delta.finish_reason.value if delta.finish_reason else None
        body = self.envelope(self.object_chunk, [self.chunk_choice(delta, finish)])
        if self.job.continuous_usage:
            body["usage"] = usage_body(self.usage)
        if self.job.show_speculation:
            body["speculation"] = self.speculation(delta)
        return body

    def speculation(self, delta: Delta) -> JSON:
        """Who proposed each of the chunk's tokens (a drafter's name where the target accepted
        its draft, null for the target's own), how many were accepted drafts (a chunk is one
        step's output), and the chunk's text as spans marked so."""
        drafted = delta.drafted or [None] * len(delta.token_ids)
        accepted = sum(d is not None for d in drafted)
        return {"drafted": drafted, "accepted": accepted, "spans": self.spans(delta, drafted)}

    def spans(self, delta: Delta, drafted: list[str | None]) -> list[JSON]:
        """The text, token by token (a character split across tokens goes with the token that
        completes it); where that is not the text sent (a stop string held back, a special
        token), the whole text, marked only if all its tokens were one drafter's."""
        pieces = [self.utf8.decode(self.tokenizer.token_bytes(t)) for t in delta.token_ids]
        if "".join(pieces) == delta.text:
            return [{"text": p, "drafter": d} for p, d in zip(pieces, drafted, strict=True) if p]
        self.utf8.reset()
        same = drafted[0] if len(set(drafted)) == 1 else None
        return [{"text": delta.text, "drafter": same}] if delta.text else []

    def usage_chunk(self) -> JSON:
        return self.envelope(self.object_chunk, []) | {"usage": usage_body(self.usage)}

    def full(self) -> JSON:
        finish = self.finish.value if self.finish else None
        return self.envelope(self.object_full, [self.full_choice(finish)]) | {
            "usage": usage_body(self.usage)
        }

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def opening(self) -> list[JSON]:
        return []

    @abstractmethod
    def chunk_choice(self, delta: Delta, finish: str | None) -> JSON:
        """The choice of a streamed chunk that carries `delta`."""

    @abstractmethod
    def full_choice(self, finish: str | None) -> JSON:
        """The choice of the whole, non-streamed response."""


class CompletionReply(Reply):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, job: Job, model: str, tokenizer: Tokenizer):
        super().__init__(job, model, tokenizer)
        self.text_offset = 0  # of the next token's text in the completion

    def logprobs_body(self, lps: list[TokenLogprob]) -> JSON | None:
        """OpenAI's completions form; text_offset counts from the start of the completion."""
        if self.job.params.logprobs is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chunk_choice(self, delta: Delta, finish: str | None) -> JSON:
        logprobs = self.logprobs_body(delta.logprobs or [])
        return {"index": 0, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}

    def full_choice(self, finish: str | None) -> JSON:
        logprobs = self.logprobs_body(self.logprobs)
        return {
            "index": 0,
            "text": "".join(self.text),
            "logprobs": logprobs,
            "finish_reason": finish,
        }


class ChatReply(Reply):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, job: Job, model: str, tokenizer: Tokenizer):
        super().__init__(job, model, tokenizer)
        self.call_started = False  # a streamed forced call has sent its id and name

    def logprob_entry(self, token_id: int, logprob: float) -> JSON:
        token_bytes = list(self.tokenizer.token_bytes(token_id))  # a character's piece, maybe
        return {"token": self.token_text(token_id), "logprob": logprob, "bytes": token_bytes}

    def logprobs_body(self, lps: list[TokenLogprob]) -> JSON | None:
        """OpenAI's chat form: per token its entry and its top alternatives."""
        if self.job.params.logprobs is None:
            return None
        content = [
            self.logprob_entry(lp.token_id, lp.logprob)
            | {"top_logprobs": [self.logprob_entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
        return {"content": content}

    def opening(self) -> list[JSON]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return [self.envelope(self.object_chunk, [choice | {"logprobs": None}])]

    def chunk_choice(self, delta: Delta, finish: str | None) -> JSON:
        body = {"content": delta.text} if self.job.tool is None else self.tool_delta(delta)
        return {
            "index": 0,
            "delta": body,
            "logprobs": self.logprobs_body(delta.logprobs or []),
            "finish_reason": self.tool_finish(finish),
        }

    def full_choice(self, finish: str | None) -> JSON:
        text = "".join(self.text)
        message: JSON = {"role": "assistant", "content": text}
        if self.job.tool is not None:
            calls = self.job.tool.calls(text)
            message = {"role": "assistant", "content": None, "tool_calls": calls}
        return {
            "index": 0,
            "message": message,
            "logprobs": self.logprobs_body(self.logprobs),
            "finish_reason": self.tool_finish(finish),
        }

    def tool_delta(self, delta: Delta) -> JSON:
        """A forced call streamed: a named function's arguments as they come (its id and name
        first); a "required" call, whose name is inside the output, whole at the end."""
        assert self.job.tool is not None
        if self.job.tool.name is None:
            if delta.finish_reason is None:
                return {}
            return {"tool_calls": [self.job.tool.calls("".join(self.text))[0] | {"index": 0}]}
        if self.call_started:
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]}
        self.call_started = True
        return {"tool_calls": [call_body(self.job.tool.name, delta.text) | {"index": 0}]}

    def tool_finish(self, finish: str | None) -> str | None:
        """A forced call that completed ends with "tool_calls", as OpenAI's calls do."""
        complete = self.job.tool is not None and finish == FinishReason.STOP.value
        return "tool_calls" if complete else finish
