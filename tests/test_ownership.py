"""Each field of a Sequence or Request has one writer: a module other than its owner that
assigns it (or mutates it in place) fails here."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from core.request import Request
from core.step import Sequence

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["core", "engine", "stages", "kv", "models", "server.py", "api.py", "client.py"]
SCHEDULER, OUTPUT = "engine/scheduler.py", "engine/output.py"
# field -> the module that writes it; a field not named here is set when built, never after
OWNERS = {
    "num_prefilled": SCHEDULER,
    "num_tokens": SCHEDULER,
    "num_pending": SCHEDULER,
    "last_step": SCHEDULER,
    "draft_from": SCHEDULER,
    "prefill_ids": SCHEDULER,
    "inflight": SCHEDULER,
    "acceptance": SCHEDULER,
    "output_ids": OUTPUT,
    "finish_reason": OUTPUT,
}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "observe", "idle"}
FIELDS = {f.name for cls in (Sequence, Request) for f in dataclasses.fields(cls)}


def writes(source: str) -> list[tuple[str, int]]:
    """(field, line) of each assignment to, or in-place change of, a Sequence or Request
    field of an object other than `self` (a class's own attributes are its business)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS:
                targets = [node.func.value]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Subscript):
                    t = t.value
                if isinstance(t, ast.Attribute) and t.attr in FIELDS:
                    if not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                        found.append((t.attr, node.lineno))
    return found


def test_every_field_is_written_by_its_owner_alone():
    files = [
        p for s in SOURCES for p in ([ROOT / s] if s.endswith(".py") else (ROOT / s).rglob("*.py"))
    ]
    strays = [
        f"{path.relative_to(ROOT)}:{line} writes {field} (owner: {OWNERS.get(field, 'none')})"
        for path in files
        for field, line in writes(path.read_text())
        if OWNERS.get(field) != str(path.relative_to(ROOT))
    ]
    assert not strays, "\n".join(strays)


def test_the_check_sees_each_kind_of_write():
    source = """
seq.num_tokens += 1
seq.last_step = 3
request.output_ids.append(7)
a, seq.request.inflight = 1, 2
request.acceptance.observe(4, 2)
seq.prefill_ids[0] = 1
self.num_tokens = 0
"""
    assert [field for field, _ in sorted(writes(source), key=lambda w: w[1])] == [
        "num_tokens", "last_step", "output_ids", "inflight", "acceptance", "prefill_ids"
    ]  # fmt: skip
