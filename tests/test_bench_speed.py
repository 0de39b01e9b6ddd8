"""bench.speed and its parts: the arithmetic of ideal speedup and efficiency, the pieces that
read the engine's timeline and metrics (bench.runners), the outputs and aims (bench.report),
the command line, and one tiny run end to end."""

from __future__ import annotations

import json
import math

import pytest

from bench import report, runners, speed
from bench.common import request_groups, write_json
from engine.config import SpecConfig
from engine.metrics import EngineMetrics


def test_efficiency_is_forward_share_of_a_step():
    # tau 3, 10 ms of forwards (drafter and verify, in the step's order) in a 12.5 ms step; a
    # plain step takes 10 ms
    row = {"acceptance_length": 3.0, "forwards_ms": 10.0, "step_ms": 12.5,
           "paired_efficiency": 0.8, "paired_overhead_ms": 2.5, "warm_efficiency": 0.7}  # fmt: skip
    out = report.efficiency(row, base_step_ms=10.0)
    assert out["ideal_speedup"] == pytest.approx(3.0)  # 3 * 10 / 10
    assert out["decode_speedup"] == pytest.approx(2.4)  # 3 * 10 / 12.5
    assert out["efficiency"] == pytest.approx(0.8)  # 10 / 12.5
    assert out["overhead_ms"] == pytest.approx(2.5)
    assert out["cost_ratio"] == pytest.approx(1.0)


def test_efficiency_pairs_each_repeat_with_its_own_forwards():
    # the machine runs at half speed in the second repeat: steps and forwards both double
    samples = [
        runners.Sample(
            tokens=100,
            seconds=1.0,
            steps=[step],
            forwards_s=forwards,
            verify_s=forwards - 0.006,
            drafting_s=0.004,
        )
        for step, forwards in ((0.020, 0.016), (0.040, 0.032), (0.030, 0.020))
    ]
    row = report.summarize(samples)
    assert row["paired_efficiency"] == pytest.approx(0.8)  # 16/20, 32/40, 20/30
    assert row["efficiency_range"] == pytest.approx([2 / 3, 0.8])
    assert row["paired_overhead_ms"] == pytest.approx(8.0)  # 4, 8, 10
    assert row["warm_efficiency"] == pytest.approx(0.7)  # 14/20, 30/40, 18/30
    # the ratio of the medians would mix repeats: 20 / 30
    assert row["forwards_ms"] / row["step_ms"] == pytest.approx(2 / 3)


def test_summary_takes_medians_of_speeds_and_pools_acceptance():
    samples = [
        runners.Sample(tokens=100, seconds=s, ttfts=[0.1], gaps=[0.01, 0.03], steps=[0.02],
                     widths=[5.0], spec_steps=40, draft_tokens=160, accepted=60, drafts=40,
                     per_pos=[30.0, 20.0, 10.0, 0.0], verify_s=0.006, drafting_s=0.004)
        for s in (1.0, 2.0, 4.0)
    ]  # fmt: skip
    row = report.summarize(samples)
    assert row["tokens_per_s"] == pytest.approx(50.0)  # median of 100, 50, 25
    assert row["acceptance_length"] == pytest.approx((180 + 120) / 120)
    assert row["acceptance_per_position"] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    assert row["mean_k"] == pytest.approx(4.0)
    assert row["spec_token_share"] == pytest.approx(300 / 300)
    assert row["step_ms"] == pytest.approx(20.0)
    assert (row["verify_ms"], row["drafting_ms"]) == pytest.approx((6.0, 4.0))
    assert row["itl_p99_ms"] == pytest.approx(30.0)


def test_decode_steps_keep_only_consecutive_full_batch_decodes():
    kinds = ["prefill", "decode", "decode", "decode", "decode", "prefill", "decode", "decode"]
    sizes = [2, 2, 2, 2, 1, 2, 2, 2]
    ends = [1.0, 1.5, 2.25, 3.25, 3.5, 5.0, 5.5, 6.0]
    records = []
    for step, (kind, size, end) in enumerate(zip(kinds, sizes, ends, strict=True)):
        records.append(
            {
                "step": step,
                "stage": "plan",
                "kind": kind,
                "batch_size": size,
                "num_tokens": 5 * size if kind == "decode" else 40,
            }
        )
        records.append({"step": step, "stage": "refill", "end": end, "drafter_tokens": step})
    steps, widths, refills = runners.decode_steps(records, batch=2)
    assert steps == pytest.approx([0.75, 1.0, 0.5])  # steps 2, 3 and 7
    assert widths == [5.0, 5.0, 5.0]
    assert refills == [2, 3, 7]


def test_spec_counters_read_the_engine_metrics():
    metrics = EngineMetrics(num_speculative_tokens=3)
    metrics.observe_spec([3, 3, 0], [3, 1, 0])
    drafts, per_pos = runners.spec_counters(metrics.render())
    assert drafts == 2
    assert per_pos == [2.0, 1.0, 1.0]


def test_tree_levels_count_the_drafter_forwards():
    assert runners.tree_levels(SpecConfig("eagle", num_speculative_tokens=3)) is None
    fixed = SpecConfig("eagle", tree="fixed", tree_paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))
    # the nodes with children at depths 1 and 2 ((0,) and (0, 0)) are run
    assert runners.tree_levels(fixed) == [1, 1]
    dynamic = SpecConfig("eagle", tree="dynamic", tree_depth=3, tree_topk=4, tree_nodes=8)
    assert runners.tree_levels(dynamic) == [4, 4]


def test_step_forwards_in_the_engines_order():
    # a chain of k = 4: three one-token drafting forwards (the first draft is deferred)
    chain = [("draft", 1)] * 3 + [("verify", 5), ("refill", 3)]
    assert runners.step_forwards(5, 3, None) == chain
    assert runners.step_forwards(2, 2, None) == [("verify", 2), ("refill", 2)]  # k = 1
    assert runners.step_forwards(1, 1, None) == [("verify", 1), ("refill", 1)]  # no drafts
    tree = [("draft", 4), ("draft", 4), ("verify", 9), ("refill", 2)]
    assert runners.step_forwards(9, 2, [4, 4]) == tree
    assert runners.step_forwards(1, 1, [4, 4]) == [("verify", 1), ("refill", 1)]


def test_request_groups_wrap_over_the_prompts():
    prompts = [[1], [2], [3]]
    assert request_groups(prompts, 1, 2) == [[[1]], [[2]]]
    assert request_groups(prompts, 2, 3) == [[[1], [2]], [[3], [1]]]
    assert request_groups(prompts, 4, 1) == [[[1], [2], [3], [1]]]


def test_fixed_k_turns_the_cost_model_off():
    args = speed.parse_args(["--k", "3", "--k-mode", "fixed"])
    spec = speed.spec_config("draft", args)
    assert not spec.adaptive_k and spec.num_speculative_tokens == 3
    engine_k = speed.parse_args(["--k-mode", "engine"])
    assert speed.spec_config("draft", engine_k).adaptive_k
    assert not speed.spec_config("eagle-dynamic", engine_k).adaptive_k  # a tree keeps its k


def test_spec_configs_of_the_methods():
    args = speed.parse_args(["--k", "3"])
    assert speed.spec_config("none", args) == SpecConfig("none")
    assert speed.spec_config("draft", args).num_speculative_tokens == 3
    assert speed.spec_config("mtp-1", args).num_speculative_tokens == 1
    assert speed.spec_config("mtp-k", args).method == "mtp"


def test_cli_refuses_fewer_than_five_repeats(capsys):
    with pytest.raises(SystemExit):
        speed.parse_args(["--repeats", "4"])
    assert "at least 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        speed.parse_args(["--methods", "hf-generate", "--batches", "4"])


def test_table_and_json(tmp_path):
    rows = [
        {"method": m, "batch": b, "temperature": 0.0, "tokens_per_s": 10.0 * b,
         "speedup": 1.0, "acceptance_per_position": [0.5, 0.25], "step_ms": math.nan}
        for m in ("none", "draft") for b in (1, 4)
    ] + [{"method": "hf-generate", "batch": 1, "temperature": 0.0,
          "tokens_per_s": 9.0, "acceptance_per_position": []}]  # fmt: skip
    table = report.markdown_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[0].startswith("| method | batch | temp | tok/s | speedup |")
    assert "| 0.50 / 0.25 |" in table[2] and "| - |" in table[2]
    args = speed.parse_args(["--out", str(tmp_path / "s.json")])
    write_json(args.out, {"settings": vars(args), "rows": rows})
    document = json.loads(args.out.read_text())
    assert document["rows"][0]["tokens_per_s"] == 10.0 and document["settings"]["k"] == 4
    assert document["rows"][0]["step_ms"] is None  # NaN is written as null: standard JSON


def test_a_method_that_cannot_run_fails_loudly(tmp_path, tiny_target):
    argv = ["--model", str(tiny_target), "--draft-model", str(tmp_path / "missing"),
            "--methods", "draft", "--batches", "1", "--repeats", "5"]  # fmt: skip
    args = speed.parse_args(argv)
    with pytest.raises(runners.MethodUnavailable, match="^draft: "):
        speed.build_runners(args, max_len=64)


def test_tiny_run_end_to_end(tmp_path, tiny_target, capsys):
    # the target drafts for itself: every draft is accepted (wide-gap greedy), for us and for
    # transformers' assisted generation alike
    argv = ["--model", str(tiny_target), "--draft-model", str(tiny_target),
            "--methods", "none", "draft", "hf-generate", "hf-assisted", "--batches", "1", "2",
            "--temperatures", "0", "--repeats", "1", "--max-tokens", "13", "--prompts", "1",
            "--k", "2", "--out", str(tmp_path / "speed.json")]  # fmt: skip
    rows = speed.run(speed.parse_args(argv, min_repeats=1))
    by = {(r["method"], r["batch"]): r for r in rows}
    assert set(by) == {("none", 1), ("draft", 1), ("none", 2), ("draft", 2), ("hf-generate", 1),
                       ("hf-assisted", 1)}  # fmt: skip
    assert by[("none", 1)]["speedup"] == 1.0
    assert by[("none", 2)]["step_ms"] > 0 and by[("none", 2)]["verify_ms"] > 0
    assert by[("none", 2)]["verify_width"] == 1.0
    draft = by[("draft", 2)]
    assert draft["acceptance_length"] == 3.0  # 12 tokens after the prefill's, 4 steps of 3
    assert draft["acceptance_per_position"] == [1.0, 1.0]
    assert draft["verify_width"] == 3.0 and draft["mean_k"] == 2.0
    assert 0 < draft["efficiency"] and draft["forwards_ms"] > draft["verify_ms"] > 0
    assert by[("hf-assisted", 1)]["acceptance_length"] == 3.0
    assert by[("hf-generate", 1)]["acceptance_length"] == 1.0
    document = json.loads((tmp_path / "speed.json").read_text())
    assert len(document["rows"]) == len(rows)
    assert "| draft | 2 | 0 |" in capsys.readouterr().out


def test_aims_compare_the_right_rows():
    def row(method, tok_s, speedup=1.0, **extra):
        return {"method": method, "batch": 1, "temperature": 0.0,
                "tokens_per_s": tok_s, "speedup": speedup, **extra}  # fmt: skip

    rows = [
        row("none", 20.0),
        row("hf-generate", 25.0),
        row("hf-assisted", 30.0),
        row("draft", 34.0, 1.7, efficiency=0.9, acceptance_length=3.0),
        row("ngram", 46.0, 2.3, efficiency=0.8, efficiency_range=[0.75, 0.875]),
        {**row("ngram", 400.0, 2.3), "batch": 16},  # not batch 1: never the best
    ]
    goals = report.aims(rows)
    got = {a["aim"]: (a["value"], a["met"]) for a in goals}
    assert got == {
        "efficiency of draft at t=0": (0.9, True),
        "efficiency of ngram at t=0": (0.8, False),
        "none / hf-generate at t=0": (pytest.approx(0.8), False),
        "best drafter (ngram) / none at t=0": (2.3, True),
        "best drafter (ngram) / hf-assisted at t=0": (pytest.approx(46 / 30), True),
        "draft / none at t=0": (1.7, True),
    }
    lines = [report.aim_line(a) for a in goals]
    assert "NOT met: efficiency of ngram at t=0: 0.80 (aim 0.85, repeats 0.75-0.88)" in lines
    assert "met: efficiency of draft at t=0: 0.90 (aim 0.85)" in lines  # no range given


def test_eos_mode_lets_requests_end_at_their_end_of_sequence():
    from bench import runners

    assert runners.params(1.0, None, 8, eos=True).ignore_eos is False
    assert runners.params(1.0, None, 8, eos=False).ignore_eos is True
    hf = runners.HFRunner.__new__(runners.HFRunner)
    hf.method, hf.k, hf.eos = "hf-generate", 2, 0
    for stop, pinned in ((True, False), (False, True)):
        hf.ends_at_eos = stop
        assert ("min_new_tokens" in hf.kwargs(0.0, 16)) is pinned
    assert speed.parse_args(["--eos"]).eos and not speed.parse_args([]).eos
