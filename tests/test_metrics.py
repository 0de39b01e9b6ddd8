"""Prometheus text: the render parses, and the engine's calls move the right numbers."""

import math
import re

import pytest

from engine.metrics import EngineMetrics, Registry

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


def test_registry_renders_each_kind():
    r = Registry()
    hits = r.counter("hits_total", "Hits,\nby path \\ kind.", ["path"])
    temp = r.gauge("temp", "A gauge.")
    latency = r.histogram("latency_seconds", "A histogram.", [0.1, 1.0], ["route"])
    hits.labels(path='/a"b').inc()
    hits.labels(path='/a"b').inc(2)
    temp.set(3.5)
    temp.inc(-1)
    for value in (0.05, 0.1, 0.5, 7.0):
        latency.labels(route="x").observe(value)
    text = r.render()
    assert "# HELP hits_total Hits,\\nby path \\\\ kind.\n" in text
    assert 'hits_total{path="/a\\"b"} 3.0\n' in text
    types, samples = parse(text)
    assert types == {"hits_total": "counter", "temp": "gauge", "latency_seconds": "histogram"}
    assert samples["temp", frozenset()] == 2.5
    route = ("route", "x")
    buckets = {le: samples["latency_seconds_bucket", frozenset({route, ("le", le)})] for le in
               ("0.1", "1.0", "+Inf")}  # fmt: skip
    assert buckets == {"0.1": 2.0, "1.0": 3.0, "+Inf": 4.0}  # cumulative; 0.1 is in le="0.1"
    assert samples["latency_seconds_count", frozenset({route})] == 4.0
    assert math.isclose(samples["latency_seconds_sum", frozenset({route})], 7.65)


def test_registry_refuses_mistakes():
    r = Registry()
    counter = r.counter("c_total", "c", ["reason"])
    with pytest.raises(ValueError):
        r.counter("c_total", "again")
    with pytest.raises(ValueError):
        counter.inc()  # needs its label
    with pytest.raises(ValueError):
        counter.labels(reason="x", other="y")
    with pytest.raises(ValueError):
        counter.labels(reason="x").inc(-1)
    with pytest.raises(ValueError):
        r.gauge("bad-name", "g")
    with pytest.raises(ValueError):
        r.histogram("h", "h", [1.0, 0.5])


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
