"""bench.peer's tables: each side's speed and acceptance per cell, and time to first token."""

from __future__ import annotations

from typing import Any

from bench.common import text_table

JSON = dict[str, Any]
SIDES = ("tandem", "llama.cpp")  # the names of bench.peer's two sides, ours first


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def cell_texts(cell: JSON | None) -> list[str]:
    """tokens/s and accepted/drafted (share) of one side's cell, or dashes."""
    if not cell:
        return ["-", "-"]
    if not cell["drafted"]:
        return [f"{cell['tokens_per_s']:.1f}", "-"]
    drafts = f"{cell['accepted']}/{cell['drafted']} ({cell['acceptance']:.0%})"
    return [f"{cell['tokens_per_s']:.1f}", drafts]


def speed_table(rows: list[JSON], floor_ms: dict[str, float]) -> str:
    floor = " / ".join(f"{floor_ms.get(side, 0):.1f}" for side in SIDES)
    lines = []
    for row in rows:
        ours, theirs = row.get(SIDES[0]), row.get(SIDES[1])
        speeds = [c["tokens_per_s"] if c else None for c in (ours, theirs)]
        head = [row["method"], str(row["batch"]), f"{row['temperature']:g}"]
        lines.append(head + cell_texts(ours) + cell_texts(theirs) + [ratio(*speeds), floor])
    header = ["method", "batch", "T", "tandem tok/s", "accepted", "llama.cpp tok/s", "accepted"]
    return text_table(header + ["tandem / llama.cpp", "floor ms (tandem / llama.cpp)"], lines)


def ttft_table(rows: dict[str, JSON], tokens: int) -> str:
    lines = []
    for method, row in rows.items():
        ours, theirs = row.get(SIDES[0]), row.get(SIDES[1])
        ms = [f"{1000 * s:.0f}" if s else "-" for s in (ours, theirs)]
        lines.append([method, *ms, ratio(theirs, ours)])  # shorter is better: theirs over ours
    header = [f"method ({tokens}-token prompt)", "tandem TTFT ms", "llama.cpp TTFT ms"]
    header.append("llama.cpp / tandem")
    return text_table(header, lines)
