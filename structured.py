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
import re
import uuid
from dataclasses import dataclass
from typing import Any

from core.params import Grammar

JSON = dict[str, Any]
MAX_CHOICES = 1024
# a "required" call's text cut short: its name (closed or not), then its arguments so far
PARTIAL_NAME = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?')
PARTIAL_ARGUMENTS = re.compile(r'"\s*,\s*"arguments"\s*:\s*(?P<arguments>.*)\Z', re.S)
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
    request's tools, `names`: the output names it)."""

    name: str | None
    names: tuple[str, ...] = ()

    def calls(self, text: str) -> list[JSON]:
        """OpenAI's `tool_calls` for the whole output (its arguments as the JSON text). A
        "required" call cut short by max_tokens keeps the name it got to and its partial
        arguments."""
        name, arguments = self.name, text
        if name is None:
            try:
                call = json.loads(text)
                name, arguments = call["name"], json.dumps(call["arguments"])
            except (ValueError, KeyError, TypeError):  # cut short: {"name": "f", "argum...
                cut, rest = PARTIAL_NAME.match(text), PARTIAL_ARGUMENTS.search(text)
                name = ""
                if cut:
                    name = (
                        json.loads(f'"{cut["name"]}"')
                        if cut["closed"]
                        else self._named(cut["name"])
                    )
                arguments = rest["arguments"] if rest else ""
        return [call_body(name, arguments)]

    def _named(self, prefix: str) -> str:
        """The tool a name cut short was naming, where only one starts so."""
        named = [n for n in self.names if n.startswith(prefix)]
        return named[0] if len(named) == 1 else prefix


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
        check_schema(spec.get("schema", {}), "response_format")
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
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except ValueError:
                raise StructuredError(param, "a JSON schema's text must be JSON") from None
        check_schema(source, param)
        return Grammar("json_schema", _dump(source))
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
    for parameters in by_name.values():
        check_schema(parameters, "tools")
    if choice == "none":
        return None, None
    if choice == "auto":
        raise StructuredError(
            "tool_choice",
            "tool_choice 'auto' is not supported (the model has no format for free tool "
            "calls): name a function, or use 'required'",
        )
    if choice == "required":  # the name first: a call cut short still names its function
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, parameters in by_name.items()
        ]
        grammar = Grammar("json_schema", _dump({"anyOf": calls}, ordered=True))
        return grammar, ToolChoice(None, tuple(by_name))
    name = choice["function"]["name"]
    if name not in by_name:
        raise StructuredError("tool_choice", f"tool_choice names {name!r}, which is not a tool")
    return Grammar("json_schema", _dump(by_name[name] or {"type": "object"})), ToolChoice(name)


# JSON Schema keywords the grammar enforces exactly (each tested: outputs validate), by what
# their values hold; every other keyword is refused by name, since xgrammar would drop it
# silently. Annotations change nothing and pass.
SUBSCHEMA = ("additionalProperties", "items", "propertyNames")  # a schema (or a boolean)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
SCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")  # a list of schemas
CHECKS = (
    "type",
    "enum",
    "const",
    "required",
    "multipleOf",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "$ref",
    "format",
)
ANNOTATIONS = (
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$schema",
    "$id",
    "$comment",
    "strict",
)
FORMATS = ("date-time", "uuid", "ipv6")  # formats whose every output validates (tested)
KEYWORDS = frozenset(SUBSCHEMA + SCHEMA_MAPS + SCHEMA_LISTS + CHECKS + ANNOTATIONS)


def check_schema(schema: Any, param: str, at: str = "#") -> None:
    """A StructuredError naming the first keyword the grammar would not enforce (or the
    reason the schema is unsatisfiable), found before any token is generated."""
    if isinstance(schema, bool):  # false below the root: no extra items, no such property
        if not schema and at == "#":
            raise StructuredError(param, "the schema is false: nothing satisfies it")
        return
    if type(schema) is not dict:
        raise StructuredError(param, f"the schema at {at} must be an object or a boolean")
    absent = [n for n, sub in (schema.get("properties") or {}).items() if sub is False]
    if set(absent) & set(schema.get("required") or []):
        raise StructuredError(
            param, f"the schema at {at} requires a property it forbids: nothing satisfies it"
        )
    for key, value in schema.items():
        if key not in KEYWORDS and not key.startswith("x-"):
            raise StructuredError(
                param, f"the JSON Schema keyword {key!r} (at {at}) is not supported"
            )
        where = f"{at}/{key}"
        if key in SUBSCHEMA:
            check_schema(value, param, where)
        elif key in SCHEMA_MAPS:
            if type(value) is not dict:
                raise StructuredError(param, f"{where} must be an object of schemas")
            for name, sub in value.items():
                check_schema(sub, param, f"{where}/{name}")
        elif key in SCHEMA_LISTS:
            if type(value) is not list or (key != "prefixItems" and not value):
                raise StructuredError(param, f"{where} must be a non-empty list of schemas")
            if key == "allOf" and len(value) > 1:
                raise StructuredError(
                    param,
                    f"'allOf' of {len(value)} schemas (at {at}) is not supported: one at most",
                )
            for n, sub in enumerate(value):
                check_schema(sub, param, f"{where}/{n}")
        elif key == "format" and value not in FORMATS:
            raise StructuredError(
                param, f"the format {value!r} (at {at}) is not supported: {', '.join(FORMATS)}"
            )


def _dump(value: Any, ordered: bool = False) -> str:
    """A stable text of a JSON value: equal schemas hit the same compiled grammar. `ordered`:
    objects keep their keys' order (a grammar writes properties in the schema's order)."""
    return json.dumps(value, sort_keys=not ordered, separators=(",", ":"))


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
