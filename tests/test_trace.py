"""Step timeline: records in memory and in JSON lines, and the Chrome trace export and CLI."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.trace import Tracer, main, read_steps, to_chrome_trace


def test_disabled_tracer_records_nothing():
    tracer = Tracer()
    assert not tracer.enabled
    with tracer.span(1, "plan", batch_size=2) as fields:
        fields["accepted"] = 3
    tracer.record(1, "verify", 0.0, 1.0)
    assert tracer.records is None


def test_span_and_record_in_memory_are_bounded():
    tracer = Tracer(keep=3)
    before = time.perf_counter()
    with tracer.span(7, "plan", batch_size=4) as fields:
        fields["num_tokens"] = 9
    tracer.record(7, "verify", 10.0, 10.5, k=4, accepted=[1, 4])
    first = tracer.records[0]
    assert first["step"] == 7 and first["stage"] == "plan"
    assert before <= first["start"] <= first["end"] <= time.perf_counter()
    assert first["batch_size"] == 4 and first["num_tokens"] == 9
    assert tracer.records[1] == {
        "step": 7, "stage": "verify", "start": 10.0, "end": 10.5, "k": 4, "accepted": [1, 4]
    }  # fmt: skip
    for step in range(8, 11):
        tracer.record(step, "sample", 0.0, 0.0)
    assert [r["step"] for r in tracer.records] == [8, 9, 10]


def test_span_records_even_when_the_block_raises():
    tracer = Tracer(keep=2)
    with pytest.raises(RuntimeError), tracer.span(1, "draft"):
        raise RuntimeError("device lost")
    assert tracer.records[0]["stage"] == "draft"


def write_timeline(path: Path) -> None:
    with Tracer(path) as tracer:
        tracer.record(0, "plan", 100.0, 100.001, batch_size=2)
        tracer.record(0, "draft", 100.001, 100.003, k=3)
        tracer.record(0, "verify", 100.003, 100.007, num_tokens=8)
        tracer.record(0, "sample", 100.007, 100.0075, accepted=[2, 3])
        tracer.record(0, "refill", 100.0075, 100.009)
        tracer.record(1, "plan", 100.008, 100.0085, track="host")


def test_jsonl_file_holds_one_record_per_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    write_timeline(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 6
    records = [json.loads(line) for line in lines]
    assert [r["stage"] for r in records[:5]] == ["plan", "draft", "verify", "sample", "refill"]
    assert records[3]["accepted"] == [2, 3] and records[1]["k"] == 3
    assert read_steps(path) == records


def test_chrome_trace_has_complete_events_on_host_and_device_tracks(tmp_path):
    path = tmp_path / "steps.jsonl"
    write_timeline(path)
    trace = to_chrome_trace(read_steps(path))
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {1: "host", 2: "device"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["plan", "draft", "verify", "sample", "refill", "plan"]
    assert [names[e["tid"]] for e in spans] == ["host"] + ["device"] * 4 + ["host"]
    verify = spans[2]
    assert verify["ts"] == pytest.approx(3000) and verify["dur"] == pytest.approx(4000)
    assert verify["args"] == {"step": 0, "num_tokens": 8}
    assert spans[3]["args"] == {"step": 0, "accepted": [2, 3]}
    assert spans[0]["ts"] == 0 and all(e["pid"] == 1 for e in spans)


def test_cli_writes_the_trace(tmp_path, capsys):
    steps, out = tmp_path / "steps.jsonl", tmp_path / "trace.json"
    write_timeline(steps)
    assert main([str(steps), "-o", str(out)]) == 0
    assert "6 spans of 2 steps" in capsys.readouterr().out
    events = json.loads(out.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 6


def test_cli_names_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "t.json")])
    assert exit.value.code == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"step": 1, "stage": "plan", "start": 1.0}', "'end'"),
        ('{"step": 1, "stage": "plan", "start": 2.0, "end": 1.0}', "end before start"),
    ],
)
def test_cli_names_the_bad_line(tmp_path, capsys, bad, message):
    steps = tmp_path / "steps.jsonl"
    good = '{"step": 0, "stage": "plan", "start": 0.0, "end": 0.5}'
    steps.write_text(f"{good}\n\n{bad}\n")
    with pytest.raises(SystemExit) as exit:
        main([str(steps), "-o", str(tmp_path / "t.json")])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"{steps}, line 3:" in err and message in err


def test_module_runs_as_a_command(tmp_path):
    steps, out = tmp_path / "steps.jsonl", tmp_path / "trace.json"
    write_timeline(steps)
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "engine.trace", str(steps), "-o", str(out)]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["traceEvents"]
