"""The draft-length cost model: its curves, acceptance estimates and choices, and the engine
using it."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import replace

import pytest

from core.params import SamplerLoad, SamplingParams
from core.request import PRIOR_RATE, AcceptanceRate, expected_tokens
from engine.cost import (
    Calibration,
    CostModel,
    Curve,
    calibration_sizes,
    measure_curve,
)
from tests.engine_util import make_config, ragged_prompts, running, staggered


def test_curve_interpolates_and_extrapolates_linearly():
    curve = Curve([1, 4, 8], [1.0, 2.5, 4.5])
    assert curve(1) == 1.0 and curve(4) == 2.5
    assert curve(2) == pytest.approx(1.5)
    assert curve(6) == pytest.approx(3.5)
    assert curve(16) == pytest.approx(8.5)  # the last segment's slope goes on
    assert Curve([2], [0.5])(8) == pytest.approx(2.0)


def test_calibration_sizes():
    assert calibration_sizes(1) == [1]
    assert calibration_sizes(8) == [1, 2, 4, 8]
    assert calibration_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert calibration_sizes(320) == [1, 2, 4, 8, 16, 32, 64, 320]  # linear past 64


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.9, 0) == pytest.approx(1.0)


def test_acceptance_rate_follows_what_it_sees():
    rate = AcceptanceRate()
    for _ in range(40):
        rate.observe(4, 4)  # all accepted: no rejection seen
    assert rate.rate > 0.95
    for _ in range(150):
        rate.observe(4, 1)  # one accepted, then a rejection: 1 / 2 trials
    assert rate.rate == pytest.approx(0.5, abs=0.02)
    before = rate.rate
    rate.observe(0, 0)  # a step without drafts says nothing
    assert rate.rate == before


def model(verify: Curve, draft_seconds: float = 0.0, k_max: int = 6) -> CostModel:
    return CostModel(Calibration(verify, Curve([1], [draft_seconds])), k_max)


def test_a_lazy_drafters_idle_steps_cost_the_target_alone():
    """A drafter that runs no forward in a step it drafts nothing in (the hybrid's draft
    model) makes k = 0 cheaper than a drafter that refills every step: at the same poor
    acceptance the one drafts a token, the other nothing."""
    flat = Curve([1, 1024], [0.01, 0.01])
    eager = model(flat, draft_seconds=0.01)
    lazy = replace(eager, lazy_refill=True)
    assert eager.step_seconds(1, 0) == pytest.approx(0.02)
    assert lazy.step_seconds(1, 0) == pytest.approx(0.01)
    assert eager.choose([0.3], [6]) == 1
    assert lazy.choose([0.3], [6]) == 0


def test_free_verification_and_good_acceptance_draft_the_most():
    flat = Curve([1, 1024], [0.01, 0.01])
    assert model(flat).choose([0.8] * 4, [6] * 4) == 6


def test_verification_that_costs_per_token_turns_speculation_off():
    linear = Curve([1, 1024], [0.01, 10.24])  # k + 1 tokens cost k + 1 steps
    assert model(linear).choose([0.8] * 4, [6] * 4) == 0


def test_the_choice_weighs_acceptance_against_cost():
    # verify(n) = 10 + n ms, draft 2 ms a token: k = 3 at rate 0.8 beats both ends
    curve = Curve([1, 1024], [0.011, 1.034])
    chosen = model(curve, 0.002).choose([0.8], [6])
    best = max(
        range(7),
        key=lambda k: expected_tokens(0.8, k) / (0.010 + (k + 1) * 0.001 + max(k, 1) * 0.002),
    )
    assert chosen == best and 0 < chosen < 6
    assert model(curve, 0.002).choose([0.05], [6]) == 0  # drafts are never accepted
    assert model(curve, 0.002).choose([0.8], [0]) == 0  # nothing may be drafted


def test_measured_steps_correct_the_curves():
    cm = model(Curve([1, 1024], [0.011, 1.034]), 0.002)
    before = [cm.step_seconds(4, k) for k in range(4)]
    for _ in range(60):
        cm.observe(4, 3, 3 * before[3])
    # a k not seen yet takes the batch size's factor: its ratio to k = 3 stays the curves'
    for k in range(4):
        assert cm.step_seconds(4, k) == pytest.approx(3 * before[k], rel=0.01)
    assert cm.step_seconds(64, 3) == cm.forwards_seconds(64, 3)  # other batch sizes keep theirs
    # a k seen keeps its own: one-row steps measured as the curves say, k = 3 stays 3x
    for _ in range(60):
        cm.observe(4, 0, before[0])
    assert cm.step_seconds(4, 0) == pytest.approx(before[0], rel=0.01)
    assert cm.step_seconds(4, 3) == pytest.approx(3 * before[3], rel=0.01)


def test_a_request_not_drafted_for_is_tried_again_after_a_while():
    cm = model(Curve([1, 1024], [0.011, 1.034]), 0.002)
    rate = AcceptanceRate()
    for _ in range(100):
        rate.observe(4, 0)  # every draft rejected: the text turned unpredictable
    assert cm.choose([rate.rate], [6]) == 0
    plain_steps = 0
    while cm.choose([rate.rate], [6]) == 0:
        rate.idle()  # a step at k = 0 (no evidence either way)
        plain_steps += 1
    assert 10 < plain_steps < 100, plain_steps
    for _ in range(500):
        rate.idle()
    assert rate.rate == pytest.approx(PRIOR_RATE, abs=0.01)  # back to the prior, no further


def test_sampled_rows_are_priced():
    """At temperature 1 each verified row costs the sampler too (its distribution and draw, a
    seeded request's coupling noise more): a draft length that pays for greedy rows, whose
    argmax is left out, does not pay for sampled ones at the same acceptance; the measured
    steps' correction compares like with like."""
    verify = Curve([1, 1024], [0.010, 0.1123])  # 0.1 ms a row
    cal = Calibration(verify, Curve([1], [0.0]), Curve([1], [0.001]), Curve([1], [0.004]))
    cm = CostModel(cal, 6)
    drawn, coupled = SamplerLoad(drawn=1), SamplerLoad(coupled=1)
    assert cm.step_seconds(1, 2, load=drawn) == pytest.approx(verify(3) + 0.003)
    assert cm.step_seconds(1, 2, load=coupled) == pytest.approx(verify(3) + 0.012)
    assert cm.step_seconds(2, 1, load=SamplerLoad(1, 1)) == pytest.approx(verify(4) + 0.010)
    assert cm.choose([0.25], [6]) > 0
    assert cm.choose([0.25], [6], coupled) == 0
    assert 0 < cm.choose([0.6], [6], coupled) < cm.choose([0.6], [6])
    for _ in range(60):  # sampled steps as the curves say: nothing to correct
        cm.observe(1, 2, cm.forwards_seconds(1, 2, load=coupled), coupled)
    assert cm.factors[(0, 2)] == pytest.approx(1.0)


def test_calibration_file_round_trip(tmp_path):
    cal = Calibration(*(Curve([1, 2], [0.1 * i, 0.2 * i]) for i in range(1, 5)))
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal
    # a file written before the sampler's curves were measured is measured again
    old = json.loads((tmp_path / "c.json").read_text())
    del old["sample"], old["couple"]
    (tmp_path / "c.json").write_text(json.dumps(old))
    assert Calibration.read(tmp_path / "c.json") is None


GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_engine_calibrates_saves_and_reloads(tiny_target, tiny_draft, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tandem.cost")
    path = tmp_path / "calibration.json"
    config = make_config(
        tiny_target,
        "draft",
        tiny_draft,
        k=4,
        spec_kw={"adaptive_k": True, "calibration": str(path)},
    )

    async def main():
        async with running(config) as engine:
            first = engine.cost.calibration
        # the first start says, in a log, that it measures and when it is done
        measuring = [r.message for r in caplog.records if r.name == "tandem.cost"]
        assert measuring[0].startswith("measuring the cost model's curves")
        assert re.fullmatch(r"measured the cost model's curves in [\d.]+ s", measuring[1])
        async with running(config) as engine:
            assert engine.cost.calibration == first  # loaded, not measured again
        assert len([r for r in caplog.records if r.name == "tandem.cost"]) == 2

    asyncio.run(main())
    saved = json.loads(path.read_text())
    assert saved["verify"]["tokens"][-1] == 64 * 5  # max_running rows of k + 1 tokens
    # the sampler's rows measured up to LINEAR_FROM; a coupled row costs more than a drawn one
    assert saved["sample"]["tokens"][-1] == saved["couple"]["tokens"][-1] == 64
    curves = Calibration.load(path)
    assert 0 < curves.sample(64) < curves.couple(64)


def calibration_at_start(config) -> Calibration:
    """The cost model's curves of an engine started on `config` (and stopped)."""

    async def start() -> Calibration:
        async with running(config) as engine:
            return engine.cost.calibration

    return asyncio.run(start())


def test_saved_curves_a_forward_now_contradicts_are_measured_again(
    tiny_target, tiny_draft, tmp_path, caplog
):
    """A calibration saved while the CPU was busy (here: every time 50x and 0.1 s more) is
    caught by the one-token forwards timed at start, measured again and saved again."""
    path = tmp_path / "calibration.json"
    spec = {"adaptive_k": True, "calibration": str(path)}
    config = make_config(tiny_target, "draft", tiny_draft, k=4, spec_kw=spec)
    calibration_at_start(config)
    busy = json.loads(path.read_text())
    for curve in ("verify", "draft"):
        busy[curve]["seconds"] = [50 * s + 0.1 for s in busy[curve]["seconds"]]
    path.write_text(json.dumps(busy))
    caplog.set_level(logging.WARNING, logger="tandem.cost")
    again = calibration_at_start(config)
    assert again.verify(1) < 0.1 and json.loads(path.read_text())["verify"]["seconds"][0] < 0.1
    assert any("disagree" in r.message for r in caplog.records)


def test_without_a_path_the_curves_are_cached_for_the_next_start(
    tiny_target, tiny_draft, tmp_path, monkeypatch
):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    config = make_config(tiny_target, "draft", tiny_draft, k=4, spec_kw={"adaptive_k": True})

    first = calibration_at_start(config)
    files = list(tmp_path.glob("calibration-*.json"))
    assert len(files) == 1
    assert calibration_at_start(config) == first  # loaded, not measured again
    files[0].write_text("{not json")  # a damaged cache is measured again and rewritten
    remeasured = calibration_at_start(config)
    assert Calibration.load(files[0]) == remeasured


def test_engine_drafts_less_when_drafts_are_rejected(tiny_target, tiny_draft, monkeypatch):
    """The tiny draft is unrelated to the tiny target (acceptance near 1 / vocab). With fixed
    curves (verify(n) = 10 + 3n ms, a draft token 2 ms) the prior's acceptance makes k = 1 the
    best; once the estimates have seen the rejections, k = 0 is, and its steps fade the
    estimates back toward the prior. A k = 0 step runs no draft-model forward (its refill
    skipped). Output stays lossless."""
    prompts = ragged_prompts(4, 50, seed=1)
    idle = AcceptanceRate.idle
    idled = []
    monkeypatch.setattr(AcceptanceRate, "idle", lambda rate: idled.append(rate) or idle(rate))
    steps: list[tuple[int, bool]] = []  # each decode step's (k, drafter_refill)

    def watch(stage, plan, dev):
        if stage == "verify" and plan.kind == "decode":
            steps.append((plan.k, plan.drafter_refill))

    async def main(method):
        spec_kw = {"adaptive_k": True}
        config = make_config(tiny_target, method, tiny_draft, k=4, spec_kw=spec_kw, fault=watch)
        async with running(config) as engine:
            if engine.cost is not None:
                engine.cost.calibration = Calibration(
                    Curve([1, 1001], [0.013, 3.013]), Curve([1], [0.002])
                )
                engine.cost.observe = lambda *args: None  # no timing noise in the choice
            outs = await staggered(engine, prompts, GREEDY)
            value = engine.metrics.registry.value
            return outs, {k: value("tandem_spec_decode_steps_total", k=k) for k in range(5)}

    plain, _ = asyncio.run(main("none"))
    assert not idled  # no cost model, nothing to fade
    steps.clear()
    spec, by_k = asyncio.run(main("draft"))
    assert spec == plain
    # k = 1 at the prior, never more; k = 0 once rejections are seen, for a share of the
    # steps that depends on when the staggered requests arrive (new ones start at the prior)
    assert by_k[1] > 0 and by_k[2] + by_k[3] + by_k[4] == 0 and by_k[0] > by_k[1] / 2, by_k
    assert len(idled) >= by_k[0]  # every sequence of every k = 0 decode step
    assert all(refill == (k > 0) for k, refill in steps)


def test_measured_curves_never_fall():
    durations = {1: 0.002, 2: 0.008, 4: 0.003}  # 4 tokens seemingly cheaper than 2
    measured: list[int] = []
    curve = measure_curve(
        lambda n: time.sleep(durations[n]),
        [1, 2, 4],
        repeats=2,
        progress=lambda: measured.append(1),
    )
    assert len(measured) == 3  # a progress bar's tick per size
    assert curve.tokens == [1, 2, 4]
    assert curve.seconds[0] >= 0.002 and curve.seconds[2] >= curve.seconds[1] >= 0.008
