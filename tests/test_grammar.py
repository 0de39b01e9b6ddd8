"""Structured output: the grammar's masks along drafts, outputs that validate against their
schemas with every drafter, greedy equality with and without speculation under a grammar, and
the sampled law of a small grammar (chi-square, against the law of p masked token by token).
(The openai client's response_format, tools and extra fields: tests/test_server.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import jsonschema
import pytest
import torch

import structured
from core.params import Grammar, InvalidRequest, SamplingParams, SamplingTensors
from core.request import FinishReason
from engine.grammar_compiler import Grammars
from models.attention import CausalAttention
from models.eagle import save_eagle3_head, save_eagle_head
from models.loader import load_model
from models.mtp import save_mtp_head
from models.tokenizer import Tokenizer
from stages.grammar import GrammarWalk, host_drafts, unpack
from stages.logits import process_logits
from tests.engine_util import make_config, ragged_prompts, running, token_ids
from tests.stats import assert_law, chi_square_p_value
from tests.tiny import random_eagle3_head, random_eagle_head, random_mtp_head, write_model

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
     "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}},
     "required": ["x"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": S},
     "required": ["q"]}}, "required": ["p"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, S]}},
     "required": ["v"]},
    {"type": "object", "properties": {"n": {"type": "null"}, "k": {"const": "fixed"}},
     "required": ["n", "k"]},
    {"type": "object", "properties": {"a": S, "b": S}, "required": ["a"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
     "maxItems": 4},
    {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array",
     "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2}}, "required": ["m"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 100,
     "maximum": 999}, "kind": {"enum": ["a", "b"]}}, "required": ["id", "kind"]},
    {"type": "object", "properties": {"u": {"anyOf": [{"type": "null"}, {"type": "object",
     "properties": {"w": {"type": "boolean"}}, "required": ["w"]}]}}, "required": ["u"]},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-c]{2,3}$"}},
     "required": ["s"]},
    {"type": "object", "properties": {"r": {"type": "number"}, "t": {"type": "integer"}},
     "required": ["r", "t"], "additionalProperties": False},
    {"type": "object", "properties": {"deep": {"type": "object", "properties": {"deeper": {
     "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 3}},
     "required": ["x"]}}, "required": ["deeper"]}}, "required": ["deep"]},
    {"type": "object", "properties": {"e": {"type": "array", "items": {"enum": [1, 2, 3]},
     "maxItems": 3}}, "required": ["e"]},
    {"type": "object", "properties": {"opt": S}, "additionalProperties": False},
    {"type": "object", "properties": {"z": {"type": "integer", "minimum": -3, "maximum": 3},
     "y": {"type": "boolean"}, "x": S}, "required": ["z", "y", "x"]},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"list": {"type": "array", "items": {"type": "object",
     "properties": {"k": S}, "required": ["k"], "additionalProperties": False},
     "maxItems": 2}}, "required": ["list"]},
    {"type": "object", "properties": {"b": {"type": "boolean"}, "n": {"type": "null"}},
     "required": ["b"], "additionalProperties": False},
    # every other keyword the grammar enforces (structured.py: KEYWORDS)
    {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 9, "multipleOf": 2},
    {"type": "object", "patternProperties": {"^[a-c]$": {"type": "boolean"}},
     "additionalProperties": False, "minProperties": 1, "maxProperties": 2},
    {"type": "object", "propertyNames": {"pattern": "^[ab]$"},
     "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 5}, "maxProperties": 1},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": 7}], "items": False,
     "minItems": 2},
    {"$defs": {"w": {"type": "string", "minLength": 2, "maxLength": 3}}, "title": "ref",
     "description": "a reference", "allOf": [{"$ref": "#/$defs/w"}]},
    {"definitions": {"n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
     "type": "object", "properties": {"n": {"$ref": "#/definitions/n"}}, "required": ["n"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
     "at": {"type": "string", "format": "date-time"}}, "required": ["id"]},
]  # fmt: skip
GRAMMARS = [Grammar("json_schema", json.dumps(s)) for s in SCHEMAS]
GREEDY = SamplingParams(max_tokens=96, temperature=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return Tokenizer(tiny_target)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, 320)


def matcher(grammars, grammar: Grammar):
    asyncio.run(grammars.compile(grammar))
    return grammars.matcher(grammar)


def allowed_ids(mask: torch.Tensor) -> set[int]:
    return set(mask.nonzero().flatten().tolist())


# ---------------------------------------------------------------- masks along drafts


def test_a_walk_masks_each_prefix_and_leaves_the_matcher_where_it_was(grammars, tokenizer):
    m = matcher(grammars, Grammar("choice", json.dumps(["ab", "abc", "b"])))
    walk = GrammarWalk([m])
    ids = tokenizer.encode("abc", add_special_tokens=False)
    before, _ = walk.mask(m, [])
    masks, walked = walk.mask(m, ids)
    assert walked == len(ids)
    assert torch.equal(masks[0], before[0])
    for j in range(len(ids)):  # each draft is allowed by the mask before it
        assert masks[j, ids[j]]
    assert allowed_ids(masks[-1]) == {tokenizer.eos_token_id}  # "abc" is complete
    assert torch.equal(walk.mask(m, [])[0], before)  # rolled back


def test_a_walk_stops_at_the_first_forbidden_draft(grammars, tokenizer):
    m = matcher(grammars, Grammar("regex", "[0-9]+"))
    walk = GrammarWalk([m, None])
    digit, letter = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "7x")
    masks = walk.chain([[digit, letter, digit], [letter, letter, letter]], width=4)
    assert masks.shape == (2, 4, 320)
    assert masks[0, 0, digit] and not masks[0, 0, letter]
    assert masks[0, 1, digit] and not masks[0, 1, letter]  # after "7"
    assert masks[0, 2].all() and masks[0, 3].all()  # past the forbidden "x": never read
    assert masks[1].all()  # no grammar


def test_tree_masks_follow_each_nodes_path(grammars, tokenizer):
    m = matcher(grammars, Grammar("choice", json.dumps(["ab", "ba"])))
    a, b = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    # root -> a -> b ; root -> b -> a ; root -> a -> a (forbidden)
    tokens, parents = [[a, b, b, a, a]], [[-1, -1, 0, 1, 0]]
    masks = GrammarWalk([m]).tree(tokens, parents)
    assert allowed_ids(masks[0, 0]) >= {a, b}
    assert allowed_ids(masks[0, 1]) == {b}  # after "a"
    assert allowed_ids(masks[0, 2]) == {a}  # after "b"
    eos = tokenizer.eos_token_id
    assert allowed_ids(masks[0, 3]) == {eos} and allowed_ids(masks[0, 4]) == {eos}
    assert masks[0, 5].all()  # "aa" is not in the grammar: nothing reads its row


def test_host_drafts_follow_the_proposal_then_what_the_grammar_forces(grammars, tokenizer):
    m = matcher(grammars, Grammar("regex", "x[0-9]!!!!"))
    x, seven, bang = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "x7!")
    assert host_drafts(m, [], 3) == [x]  # forced, then a digit: ten tokens allowed
    assert host_drafts(m, [x, seven], 6) == [x, seven, bang, bang, bang, bang]
    assert host_drafts(m, [x, bang], 6) == [x]  # "!" is forbidden after "x"
    assert host_drafts(m, [x, seven], 3) == [x, seven, bang]
    assert walk_mask_ids(m) == walk_mask_ids(matcher(grammars, Grammar("regex", "x[0-9]!!!!")))


def test_host_drafts_spell_the_string_the_grammar_forces(grammars, tokenizer):
    m = matcher(grammars, Grammar("choice", json.dumps(["def add(a, b):", "class Point"])))
    spell = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert host_drafts(m, [], 8) == []  # "d" or "c", "de", "def" ...: nothing forced
    assert host_drafts(m, [], 8, spell) == []  # nor a forced string: two choices
    d = tokenizer.encode("d", add_special_tokens=False)
    drafts = host_drafts(m, d, 32, spell)  # "d" proposed, then "ef add(a, b):" forced
    assert tokenizer.decode(drafts) == "def add(a, b):" and len(drafts) > 1
    assert host_drafts(m, d, 2, spell) == drafts[:2]


def walk_mask_ids(m) -> set[int]:
    return allowed_ids(GrammarWalk([m]).mask(m, [])[0][0])


def test_bitmasks_unpack_little_endian():
    bits = torch.tensor([[1 - 2**31, 2]], dtype=torch.int32)  # bits 0 and 31; bit 1
    assert allowed_ids(unpack(bits, 40)[0]) == {0, 31, 33}


def test_bad_grammars_are_refused_with_what_is_wrong(grammars):
    for grammar, words in [
        (Grammar("json_schema", "{not json"), "JSON"),
        (Grammar("regex", "(["), "Regex"),
        (Grammar("json_schema", json.dumps({"$ref": "#/missing"})), "missing"),
    ]:
        with pytest.raises(InvalidRequest, match=words):
            asyncio.run(grammars.compile(grammar))


def test_a_slow_compile_is_refused_at_its_time_limit(tiny_target, monkeypatch):
    grammars = Grammars(Tokenizer(tiny_target), 320, timeout_s=0.05)
    monkeypatch.setattr(grammars, "_compile", lambda g: __import__("time").sleep(1))
    with pytest.raises(InvalidRequest, match="longer than"):
        asyncio.run(grammars.compile(Grammar("regex", "a")))


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def heads(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar_heads")
    target = load_model(tiny_target)
    save_eagle_head(random_eagle_head(target, norms=True), root / "eagle")
    save_mtp_head(random_mtp_head(target), root / "mtp")
    return root


PROMPTS = ragged_prompts(len(GRAMMARS), 300, seed=23)


async def generate_all(config, params: SamplingParams = GREEDY) -> list[list]:
    async with running(config) as engine:
        return await asyncio.gather(
            *(
                engine.generate(p, dataclasses.replace(params, grammar=g))
                for p, g in zip(PROMPTS, GRAMMARS, strict=True)
            )
        )


@pytest.fixture(scope="module")
def plain(tiny_target):
    return asyncio.run(generate_all(make_config(tiny_target, max_running=32)))


def check_outputs(outs: list[list]) -> None:
    """Every output that ended parses and validates; most end (within max_tokens)."""
    ended = 0
    for deltas, schema in zip(outs, SCHEMAS, strict=True):
        if deltas[-1].finish_reason == FinishReason.STOP:
            jsonschema.validate(json.loads("".join(d.text for d in deltas)), schema)
            ended += 1
        else:
            assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert ended >= 0.75 * len(outs), f"{ended} of {len(outs)} outputs ended"


def plain_usage(outs: list[list]) -> list:
    return [o[-1].usage for o in outs]


def test_plain_outputs_validate(plain):
    check_outputs(plain)
    assert sum(u.forced_tokens for u in plain_usage(plain)) > 0  # counted without drafting


DRAFTERS = {
    "draft": lambda target, heads, draft: make_config(target, "draft", draft, k=3),
    "ngram": lambda target, heads, draft: make_config(target, "ngram", k=3),
    "eagle": lambda target, heads, draft: make_config(target, "eagle", heads / "eagle", k=3),
    "eagle-tree": lambda target, heads, draft: make_config(
        target,
        "eagle",
        heads / "eagle",
        spec_kw={"tree": "dynamic", "tree_nodes": 7, "tree_depth": 3, "tree_topk": 3},
    ),  # fmt: skip
    "eagle-fixed-tree": lambda target, heads, draft: make_config(
        target, "eagle", heads / "eagle", spec_kw={"tree": "fixed"}
    ),
    "mtp": lambda target, heads, draft: make_config(target, "mtp", heads / "mtp", k=3),
    "draft-unaware": lambda target, heads, draft: make_config(
        target, "draft", draft, k=3, spec_kw={"grammar_drafting": False}
    ),
    "grammar": lambda target, heads, draft: make_config(target, "grammar", k=4),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
async def test_greedy_speculation_under_a_grammar_equals_plain(
    tiny_target, tiny_draft, heads, plain, drafter
):
    config = DRAFTERS[drafter](tiny_target, heads, tiny_draft)
    outs = await generate_all(dataclasses.replace(config, max_running=32))
    assert [token_ids(o) for o in outs] == [token_ids(o) for o in plain]
    check_outputs(outs)
    usage = [o[-1].usage for o in outs]
    assert sum(u.forced_tokens for u in usage) == sum(u.forced_tokens for u in plain_usage(plain))
    assert sum(u.draft_tokens for u in usage) > 0


@pytest.mark.parametrize("drafter", ["none", *DRAFTERS])
async def test_sampled_outputs_under_a_grammar_validate(tiny_target, tiny_draft, heads, drafter):
    plain = make_config(tiny_target)
    config = DRAFTERS[drafter](tiny_target, heads, tiny_draft) if drafter != "none" else plain
    params = SamplingParams(max_tokens=96, temperature=1.0)
    check_outputs(await generate_all(dataclasses.replace(config, max_running=32), params))


async def test_a_dead_end_ends_with_stop(tmp_path):
    """A grammar no token of the vocabulary continues ends the output where it stands, with
    OpenAI's `stop`; one that no token can even start is refused before generating."""
    target = write_model(tmp_path / "t", layers=1, hidden=16, seed=3, model_vocab=8)
    async with running(make_config(target)) as engine:
        allowed = engine.tokenizer.decode([5])  # a byte the 8-token vocabulary spells
        dead_end = Grammar("regex", re.escape(allowed) + "z")
        params = SamplingParams(max_tokens=8, temperature=0, grammar=dead_end)
        deltas = await engine.generate([1, 2], params)
        assert deltas[-1].finish_reason == FinishReason.STOP
        assert "".join(d.text for d in deltas) == allowed  # the grammar's prefix, then nothing
        with pytest.raises(InvalidRequest, match="matches nothing"):
            await engine.generate(
                [1, 2], dataclasses.replace(params, grammar=Grammar("regex", "z+"))
            )


# ---------------------------------------------------------------- the sampled law

N = 3000
CHOICES = ['!"', '!"#', "#", "#!", "$$", '$"!']  # shared prefixes, over single-byte tokens
LAW_PROMPT = [1, 2]


def grammar_laws(target_dir, grammars: Grammars, grammar: Grammar) -> tuple[dict, dict]:
    """P(output ids) when each token is drawn from p masked by the grammar at its position,
    every path to eos enumerated; and, to tell them apart, the law of drawing whole outputs
    from p until one is in the grammar (p conditioned on the grammar: another law)."""
    model = load_model(target_dir)
    m = grammars.matcher(grammar)
    walk = GrammarWalk([m])
    st = SamplingTensors.build([SamplingParams(temperature=1.0)], [0], "cpu")
    masked: dict[tuple[int, ...], float] = {}
    whole: dict[tuple[int, ...], float] = {}

    def visit(path: list[int], mass: float, unmasked: float) -> None:
        ids = torch.tensor(LAW_PROMPT + path)
        with torch.no_grad():
            hidden, _ = model(ids, torch.arange(len(ids)), CausalAttention(1, len(ids)))
            logits = model.logits(hidden[-1:])[:, None].double()
        allowed, _ = walk.mask(m, [])
        probs = process_logits(logits, st, allowed=allowed[None])[0, 0]
        free = process_logits(logits, st)[0, 0]
        for token in probs.nonzero()[:, 0].tolist():
            p, q = mass * probs[token].item(), unmasked * free[token].item()
            if token == 0:  # eos: the output ends
                masked[(*path, token)], whole[(*path, token)] = p, q
                continue
            assert m.accept_token(token)
            visit(path + [token], p, q)
            m.rollback(1)

    visit([], 1.0, 1.0)
    total = sum(whole.values())
    return masked, {k: v / total for k, v in whole.items()}


@pytest.mark.parametrize("tree", ["fixed", "dynamic"])
async def test_grammar_aware_trees_waste_fewer_drafts(tiny_target, heads, plain, tree):
    """A tree drafted from the head's logits masked by the grammar along each node's path
    keeps more of its drafts than one drafted unaware of it (whose nodes the sampler masks),
    and both give plain decoding's output."""
    accepted = {}
    for aware in (True, False):
        spec = {"tree": tree, "grammar_drafting": aware}
        config = make_config(tiny_target, "eagle", heads / "eagle", spec_kw=spec)
        outs = await generate_all(dataclasses.replace(config, max_running=32))
        assert [token_ids(o) for o in outs] == [token_ids(o) for o in plain]
        accepted[aware] = sum(o[-1].usage.accepted_tokens for o in outs)
    assert accepted[True] > accepted[False]


@pytest.fixture(scope="module")
def law_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar_law")
    target = write_model(root / "t", layers=2, hidden=16, seed=3, scale=1.5, model_vocab=8)
    draft = write_model(root / "d", layers=1, hidden=16, seed=4, scale=1.5, model_vocab=8)
    # an EAGLE-3 head over eos, "!" and three tokens no choice holds: after "$" the grammar
    # allows none of them, and its drafts fall back to its own q, which the sampler rejects
    head = random_eagle3_head(load_model(target), (1, 2), draft_vocab=5, seed=6)
    head.set_draft_vocab(torch.tensor([0, 1, 5, 6, 7]))
    save_eagle3_head(head, root / "eagle3")
    return target, draft, root / "eagle3"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "method, seeded",
    [("none", False), ("draft", False), ("draft", True), ("eagle", False)],
)
def test_sampled_output_follows_the_masked_law(law_models, method, seeded):
    """Plain sampling, speculation by the rejection rule (a draft model; an EAGLE-3 head of a
    reduced vocabulary), and seeded requests' coupling."""
    target, draft, eagle3 = law_models
    grammar = Grammar("choice", json.dumps(CHOICES))
    grammars = Grammars(Tokenizer(target), 8)
    asyncio.run(grammars.compile(grammar))
    expected, conditioned = grammar_laws(target, grammars, grammar)
    assert abs(sum(expected.values()) - 1) < 1e-9
    assert len(expected) >= len(CHOICES)  # every choice reachable
    drafter = {"none": None, "draft": draft, "eagle": eagle3}[method]
    config = make_config(
        target,
        method,
        drafter,
        k=2,
        pages=4 * N,
        page_size=4,
        max_running=64,
        max_waiting=N,
        max_model_len=16,
    )

    async def draws() -> dict[tuple[int, ...], int]:
        params = SamplingParams(max_tokens=6, temperature=1.0, grammar=grammar)
        async with running(config) as engine:
            seeds = [i if seeded else None for i in range(N)]
            runs = [engine.generate(LAW_PROMPT, dataclasses.replace(params, seed=s)) for s in seeds]
            outs = await asyncio.gather(*runs)
        if method != "none":
            assert sum(o[-1].usage.draft_tokens for o in outs) > N
        counts: dict[tuple[int, ...], int] = {}
        for out in outs:
            key = tuple(token_ids(out))
            counts[key] = counts.get(key, 0) + 1
        return counts

    observed = asyncio.run(draws())
    assert_law(observed, expected, N)
    assert chi_square_p_value(observed, conditioned, N) < 1e-3  # whole outputs' law: refuted


def test_the_schemas_cover_every_keyword_the_server_takes():
    """Each keyword structured.py lets through is in a schema above, whose outputs the
    tests of this file validate; the schemas pass the server's check."""
    seen: set[str] = set()

    def keys(node) -> None:
        if isinstance(node, dict):
            seen.update(k for k in node if k in structured.KEYWORDS)
            for key, value in node.items():
                if key not in ("properties", "patternProperties", "$defs", "definitions"):
                    keys(value)
                elif isinstance(value, dict):
                    for sub in value.values():
                        keys(sub)
        elif isinstance(node, list):
            for sub in node:
                keys(sub)

    for schema in SCHEMAS:
        structured.check_schema(schema, "test")
        keys(schema)
    unused = set(structured.KEYWORDS) - seen - set(structured.ANNOTATIONS)
    assert not unused


CITY = {"type": "object", "properties": {"city": S}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": CITY}}
    for n in ("get_weather", "add")
]


def test_a_forced_call_writes_its_name_first(grammars):
    grammar, _ = structured.grammar_of({"tools": TOOLS, "tool_choice": "required"})
    assert grammar is not None
    assert matcher(grammars, grammar).accept_string('{"name": "add", "arguments": {')
    assert not matcher(grammars, grammar).accept_string('{"arguments"')


@pytest.mark.parametrize(
    "text, name, arguments",
    [
        ('{"name": "add", "arguments": {"city": "Par', "add", '{"city": "Par'),
        ('{"name": "add", "argum', "add", ""),
        ('{"name": "get_we', "get_weather", ""),  # the one tool whose name starts so
        ('{"na', "", ""),
        ('{"name": "add", "arguments": {"city": "x"}}', "add", '{"city": "x"}'),
    ],
)
def test_a_forced_call_cut_short_keeps_its_name(text, name, arguments):
    _, choice = structured.grammar_of({"tools": TOOLS, "tool_choice": "required"})
    assert choice is not None
    function = choice.calls(text)[0]["function"]
    assert (function["name"], function["arguments"]) == (name, arguments)
