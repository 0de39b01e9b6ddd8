"""What bench.speed makes of its samples: one row per cell (medians and pooled acceptance),
the speedup over `none`, the ideal speedup and efficiency, issue 11's aims, and the Markdown
table. With a step's forwards timed alone at the cell's shapes, in the step's order
(bench/runners.py):

    ideal      = tau * step time without speculation / forwards
    efficiency = decode speedup / ideal = forwards / step time
    overhead   = step time - forwards

where tau is the mean acceptance length (tokens emitted per verify step). Plain decoding (no
drafter, one token) gets the same columns for `none`. Efficiency and overhead are medians of
each repeat's own ratio and difference (its forwards are timed right after its cell, so a
machine whose speed drifts during the run shifts both sides alike); the ideal speedup shown
is the decode speedup over that efficiency. The lowest and highest repeat's efficiency are
kept beside it (`efficiency_range`) and printed with the efficiency aims. "Warm efficiency"
is the same ratio with each forward timed on its own, repeated, its weights in the cache (the
sum of the warm forwards).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from bench.common import percentile, text_table
from bench.runners import HF_METHODS, Sample


def med(values: Iterable[float]) -> float:
    """The median of the values that are not NaN; NaN if none is."""
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """Speeds: medians over the repeats; acceptance: counts pooled over the repeats."""
    spec, tokens = sum(s.spec_steps for s in samples), sum(s.tokens for s in samples)
    accepted, drafts = sum(s.accepted for s in samples), sum(s.drafts for s in samples)
    emitted = accepted + spec
    per_pos = [sum(p) for p in zip(*(s.per_pos for s in samples), strict=False)]
    widths = [w for s in samples for w in s.widths]
    paired = [r for r in (s.forwards_s / s.step_s for s in samples) if not math.isnan(r)]
    return {
        "tokens_per_s": med(s.tokens / s.seconds for s in samples),
        "run_s": med(s.seconds for s in samples),
        "ttft_ms": med(percentile(s.ttfts, 50) for s in samples) * 1e3,
        "itl_p50_ms": med(percentile(s.gaps, 50) for s in samples) * 1e3,
        "itl_p99_ms": med(percentile(s.gaps, 99) for s in samples) * 1e3,
        "step_ms": med(s.step_s for s in samples) * 1e3,
        "verify_width": statistics.fmean(widths) if widths else math.nan,
        "acceptance_length": emitted / spec if spec else 1.0,
        "acceptance_per_position": [p / drafts for p in per_pos] if drafts else [],
        "spec_token_share": emitted / tokens if tokens else 0.0,
        "mean_k": sum(s.draft_tokens for s in samples) / spec if spec else 0.0,
        "verify_ms": med(s.verify_s for s in samples) * 1e3,
        "drafting_ms": med(s.drafting_s for s in samples) * 1e3,
        "forwards_ms": med(s.forwards_s for s in samples) * 1e3,
        "paired_efficiency": med(paired),
        "efficiency_range": [min(paired), max(paired)] if paired else [],
        "warm_efficiency": med((s.verify_s + s.drafting_s) / s.step_s for s in samples),
        "paired_overhead_ms": med(s.step_s - s.forwards_s for s in samples) * 1e3,
    }


def efficiency(row: dict[str, Any], base_step_ms: float) -> dict[str, float]:
    """Ideal speedup, efficiency and per-step overhead (see the module docstring)."""
    forwards = row["forwards_ms"]
    decode_speedup = row["acceptance_length"] * base_step_ms / row["step_ms"]
    return {
        "overhead_ms": row["paired_overhead_ms"],
        "cost_ratio": forwards / base_step_ms,  # a speculative step's forwards / a plain step
        "ideal_speedup": decode_speedup / row["paired_efficiency"],
        "decode_speedup": decode_speedup,
        "efficiency": row["paired_efficiency"],
        "warm_efficiency": row["warm_efficiency"],
    }


def build_rows(samples: dict[tuple, list[Sample]]) -> list[dict[str, Any]]:
    """One row per cell: the summary, the speedup over `none` at the same batch size and
    temperature, and for engine methods the ideal speedup and efficiency."""
    rows = {cell: summarize(s) for cell, s in samples.items()}
    base = {(b, t): r for (m, b, t), r in rows.items() if m == "none"}
    out = []
    for (method, batch, temp), summary in rows.items():
        row = {"method": method, "batch": batch, "temperature": temp, **summary}
        none = base.get((batch, temp))
        row["speedup"] = row["tokens_per_s"] / none["tokens_per_s"] if none else math.nan
        if none and method not in HF_METHODS and not math.isnan(row["step_ms"] + none["step_ms"]):
            row |= efficiency(row, none["step_ms"])
        out.append(row)
    return out


# ---- the aims ----


def find(rows: list[dict], method: str, batch: int, temp: float) -> dict | None:
    cell = (method, batch, temp)
    return next((r for r in rows if (r["method"], r["batch"], r["temperature"]) == cell), None)


def aims(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 11's requirements and aims at batch 1, each with its measured value, whether it
    is met, and what limits the row (tau, cost ratio, overhead, efficiency). A drafter whose
    efficiency could not be measured shows as not met (NaN)."""
    drafters = [r for r in rows if r["batch"] == 1 and r["method"] not in ("none", *HF_METHODS)]
    out = []
    for r in drafters:
        name = f"efficiency of {r['method']} at t={r['temperature']:g}"
        out.append(aim(name, r, r.get("efficiency", math.nan), 0.85, r.get("efficiency_range")))
    for temp in sorted({r["temperature"] for r in rows}):
        compared = ("none", "hf-generate", "hf-assisted")
        none, plain, assisted = (find(rows, m, 1, temp) for m in compared)
        mine = [r for r in drafters if r["temperature"] == temp]
        best = max(mine, key=lambda r: r["tokens_per_s"], default=None)
        if none and plain:
            ratio = none["tokens_per_s"] / plain["tokens_per_s"]
            out.append(aim(f"none / hf-generate at t={temp:g}", none, ratio, 1.0))
        if best:
            name = f"best drafter ({best['method']}) / none at t={temp:g}"
            out.append(aim(name, best, best["speedup"], 2.0 if temp == 0 else 1.5))
        if best and assisted and temp == 0:
            ratio = best["tokens_per_s"] / assisted["tokens_per_s"]
            name = f"best drafter ({best['method']}) / hf-assisted at t=0"
            out.append(aim(name, best, ratio, 1.5))
    draft = find(rows, "draft", 1, 0.0)
    if draft:
        out.append(aim("draft / none at t=0", draft, draft["speedup"], 1.6))
    return out


def aim(
    name: str, row: dict[str, Any], value: float, target: float, spread: list | None = None
) -> dict[str, Any]:
    """One aim; `spread`, where given, is the lowest and highest value over the repeats."""
    limits = ("acceptance_length", "cost_ratio", "overhead_ms", "efficiency")
    out = {
        "aim": name,
        "target": target,
        "value": value,
        "met": value >= target,
        "row": {k: row[k] for k in ("method", "batch", "temperature")},
        "limits": {k: row.get(k) for k in limits},
    }
    return out | ({"repeats": spread} if spread else {})


def aim_line(goal: dict[str, Any]) -> str:
    """`met: <aim>: <value> (aim <target>[, repeats <low>-<high>])`, as bench.speed prints it."""
    verdict = "met" if goal["met"] else "NOT met"
    spread = goal.get("repeats")
    extra = f", repeats {spread[0]:.2f}-{spread[1]:.2f}" if spread else ""
    return f"{verdict}: {goal['aim']}: {goal['value']:.2f} (aim {goal['target']:g}{extra})"


# ---- the outputs ----

COLUMNS = (
    ("method", "method", "{}"),
    ("batch", "batch", "{}"),
    ("temp", "temperature", "{:g}"),
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("TTFT ms", "ttft_ms", "{:.0f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
    ("tau", "acceptance_length", "{:.2f}"),
    ("accepted by position", "acceptance_per_position", None),
    ("spec share", "spec_token_share", "{:.0%}"),
    ("step ms", "step_ms", "{:.1f}"),
    ("forwards ms", "forwards_ms", "{:.1f}"),
    ("overhead ms", "overhead_ms", "{:.1f}"),
    ("ideal", "ideal_speedup", "{:.2f}x"),
    ("efficiency", "efficiency", "{:.2f}"),
    ("warm efficiency", "warm_efficiency", "{:.2f}"),
)


def cell_text(value: Any, fmt: str | None) -> str:
    if value is None or isinstance(value, float) and math.isnan(value):
        return "-"
    if fmt is None:  # a list of rates
        return " / ".join(f"{v:.2f}" for v in value) or "-"
    return fmt.format(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    order = sorted(rows, key=lambda r: (r["temperature"], r["batch"]))
    cells = [[cell_text(r.get(key), fmt) for _, key, fmt in COLUMNS] for r in order]
    return text_table([name for name, _, _ in COLUMNS], cells)
