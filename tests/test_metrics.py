"""Prometheus text: the render parses, and the engine's calls move the right numbers."""

import re

import pytest

from engine.metrics import EngineMetrics

SAMPLE = re.compile(
    r'(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*)\})?'
    r" (?P<value>\S+)\Z"
)
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """(type of each family, value of each (sample name, labels)). Asserts the format: HELP
    then TYPE before a family's samples, each sample belonging to the family just declared."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    family = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            family = line.split(" ")[2]
            assert family not in types
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name == family and kind in ("counter", "gauge", "histogram")
            types[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match, line
            name = match["name"]
            assert family is not None and family in types
            suffixes = ("_bucket", "_sum", "_count") if types[family] == "histogram" else ("",)
            assert name in [family + s for s in suffixes], line
            labels = frozenset(LABEL.findall(match["labels"] or ""))
            assert (name, labels) not in samples
            samples[name, labels] = float(match["value"])
    return types, samples


def test_a_sample_reads_back():
    m = EngineMetrics(num_speculative_tokens=2)
    m.observe_step(0.01, k=2)
    assert m.registry.value("tandem_spec_decode_steps_total", k=2) == 1
    assert m.registry.value("tandem_spec_decode_steps_total", k=1) == 0


def test_unlabelled_metrics_show_zero_and_labelled_ones_their_children():
    _, samples = parse(EngineMetrics(num_speculative_tokens=2).render())
    assert samples["tandem_prompt_tokens_total", frozenset()] == 0.0
    reasons = {("reason", r) for r in ("stop", "length", "abort", "error")}
    for reason in reasons:
        assert samples["tandem_requests_finished_total", frozenset({reason})] == 0.0
    per_pos = "tandem_spec_decode_num_accepted_tokens_per_pos_total"
    assert {labels for name, labels in samples if name == per_pos} == {
        frozenset({("position", "0")}),
        frozenset({("position", "1")}),
    }


def test_engine_metrics_values():
    m = EngineMetrics(num_speculative_tokens=3)
    m.set_requests(running=4, waiting=2)
    m.set_kv_pages(used=10, total=64)
    m.add_tokens(prompt=100, generated=7)
    m.add_tokens(generated=5)
    m.finish("stop")
    m.finish("length")
    m.finish("stop")
    m.observe_ttft(0.03)
    m.observe_inter_token(0.012)
    m.observe_step(0.02, k=3)
    # four requests: all 3 accepted, 1 of 3, none of 2, and one that did not speculate
    m.observe_spec(num_drafts=[3, 3, 2, 0], accepted=[3, 1, 0, 0])
    m.observe_spec(num_drafts=[4], accepted=[4])  # a longer draft than at start
    types, samples = parse(m.render())
    value = lambda name, **labels: samples[name, frozenset(labels.items())]
    assert value("tandem_requests_running") == 4 and value("tandem_requests_waiting") == 2
    assert value("tandem_kv_pages_used") == 10 and value("tandem_kv_pages_free") == 54
    assert value("tandem_kv_pages_total") == 64
    assert value("tandem_prompt_tokens_total") == 100
    assert value("tandem_generation_tokens_total") == 12
    assert value("tandem_requests_finished_total", reason="stop") == 2
    assert value("tandem_requests_finished_total", reason="length") == 1
    assert value("tandem_spec_decode_num_drafts_total") == 4
    assert value("tandem_spec_decode_num_draft_tokens_total") == 12
    assert value("tandem_spec_decode_num_accepted_tokens_total") == 8
    per_pos = "tandem_spec_decode_num_accepted_tokens_per_pos_total"
    counts = [value(per_pos, position=str(i)) for i in range(4)]
    assert counts == [3, 2, 2, 1]
    assert value("tandem_spec_num_speculative_tokens") == 3
    assert value("tandem_time_to_first_token_seconds_bucket", le="0.02") == 0
    assert value("tandem_time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value("tandem_inter_token_latency_seconds_count") == 1
    assert value("tandem_step_seconds_bucket", le="+Inf") == 1
    for name in ("tandem_time_to_first_token_seconds", "tandem_step_seconds"):
        assert types[name] == "histogram"


def test_observe_spec_refuses_more_accepted_than_drafted():
    with pytest.raises(ValueError):
        EngineMetrics().observe_spec([2], [3])
