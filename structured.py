"""Structured output in OpenAI's API: what a request's fields ask the output to match (a
Grammar, compiled by the engine), and forced tool calls in OpenAI's shapes.

- `response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (chat).
- `structured_outputs` (as vLLM names it): one of `{"json": schema}`, `{"regex": str}`,
  `{"choice": [str, ...]}`, `{"grammar": EBNF}`; and vLLM's older `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar` (both routes).
- `tools` with `tool_choice` naming a function (the output is its arguments, an object of its
  `parameters` schema) or `"required"` (the output is `{"name", "arguments"}` for one of the
  tools); the reply carries them as `tool_calls`. `"auto"` is refused: it needs the model's own
  format for free tool calls, which no served model's template defines here.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from core.params import Grammar

JSON = dict[str, Any]
MAX_CHOICES = 1024
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip
KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf"}


class StructuredError(ValueError):
    """A structured-output field that cannot be served (a 400 naming it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """A forced tool call: `name` the function called, or None for "required" (any of the
    request's tools: the output names it)."""

    name: str | None

    def calls(self, text: str) -> list[JSON]:
        """OpenAI's `tool_calls` for the whole output (its arguments as the JSON text)."""
        name, arguments = self.name, text
        if name is None:
            try:
                call = json.loads(text)
                name, arguments = call["name"], json.dumps(call["arguments"])
            except (ValueError, KeyError, TypeError):  # cut short by max_tokens
                name, arguments = "", text
        return [call_body(name, arguments)]


def call_body(name: str, arguments: str) -> JSON:
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def grammar_of(fields: JSON) -> tuple[Grammar | None, ToolChoice | None]:
    """The grammar the checked fields ask for (None: free text), and the forced tool call."""
    asked: list[tuple[str, Grammar]] = []
    tool = None
    if "response_format" in fields:
        grammar = _response_format(fields["response_format"])
        if grammar is not None:
            asked.append(("response_format", grammar))
    if "structured_outputs" in fields:
        asked.append(("structured_outputs", _structured(fields["structured_outputs"])))
    for name, kind in GUIDED.items():
        if name in fields:
            asked.append((name, _structured({kind: fields[name]}, name)))
    if fields.get("tools"):
        grammar, tool = _tools(fields["tools"], fields.get("tool_choice", "auto"))
        if grammar is not None:
            asked.append(("tool_choice", grammar))
    elif fields.get("tool_choice", "none") != "none":
        raise StructuredError("tool_choice", "'tool_choice' needs 'tools'")
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise StructuredError(asked[1][0], f"only one of {names} may constrain the output")
    return (asked[0][1] if asked else None), tool


def _response_format(value: JSON) -> Grammar | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if type(spec) is not dict or type(spec.get("schema", {})) is not dict:
            raise StructuredError(
                "response_format", "json_schema must be an object with a 'schema' object"
            )
        return Grammar("json_schema", _dump(spec.get("schema", {})))
    raise StructuredError(
        "response_format", "response_format's type must be text, json_object or json_schema"
    )


def _structured(value: Any, param: str = "structured_outputs") -> Grammar:
    if type(value) is not dict or len(value) != 1 or next(iter(value)) not in KINDS:
        raise StructuredError(param, f"{param} must hold one of {', '.join(KINDS)}")
    ((key, source),) = value.items()
    if key == "json":
        if type(source) is not dict and not isinstance(source, str):
            raise StructuredError(param, "a JSON schema must be an object (or its text)")
        return Grammar("json_schema", source if isinstance(source, str) else _dump(source))
    if key == "choice":
        ok = type(source) is list and 0 < len(source) <= MAX_CHOICES
        if not ok or not all(isinstance(c, str) and c for c in source):
            raise StructuredError(
                param, f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings"
            )
        return Grammar("choice", json.dumps(source))
    if not isinstance(source, str) or not source:
        raise StructuredError(param, f"{key} must be a non-empty string")
    return Grammar(KINDS[key], source)


def _tools(tools: list[JSON], choice: Any) -> tuple[Grammar | None, ToolChoice | None]:
    """The grammar of a forced call among `tools` (checked by the route's table)."""
    by_name = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    if choice == "none":
        return None, None
    if choice == "auto":
        raise StructuredError(
            "tool_choice",
            "tool_choice 'auto' is not supported (the model has no format for free tool "
            "calls): name a function, or use 'required'",
        )
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, parameters in by_name.items()
        ]
        return Grammar("json_schema", _dump({"anyOf": calls})), ToolChoice(None)
    name = choice["function"]["name"]
    if name not in by_name:
        raise StructuredError("tool_choice", f"tool_choice names {name!r}, which is not a tool")
    return Grammar("json_schema", _dump(by_name[name] or {"type": "object"})), ToolChoice(name)


def _dump(value: Any) -> str:
    """A stable text of a JSON value: equal schemas hit the same compiled grammar."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# ---- the route table's checks ----


def valid_tool(t: Any) -> bool:
    function = t.get("function") if type(t) is dict else None
    return (
        type(function) is dict
        and t.get("type") == "function"
        and isinstance(function.get("name"), str)
        and bool(function["name"])
        and type(function.get("parameters", {})) is dict
    )


def valid_tool_choice(v: Any) -> bool:
    if v in ("none", "auto", "required"):
        return True
    function = v.get("function") if type(v) is dict else None
    return type(function) is dict and isinstance(function.get("name"), str)


def valid_response_format(v: Any) -> bool:
    return type(v) is dict and isinstance(v.get("type"), str)
