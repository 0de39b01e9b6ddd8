"""The step timeline: one JSON line per stage per step, written with structlog, and its export
to a Chrome trace that Perfetto opens.

    python -m engine.trace STEPS.jsonl -o trace.json

A record holds `step`, `stage` (plan/draft/verify/sample/refill; `step`: a whole step run as
one graph, engine/step_graph.py), `start` and `end` in `time.perf_counter()` seconds, and
whatever the engine adds (`batch_size`, `num_tokens`, `accepted`, `k`, the refill's
`drafter_tokens`: tokens per sequence the drafter's refill forward ran over, ...). In the
Chrome trace, host stages and device stages sit on two tracks, so a plan hidden behind device
work shows as overlap.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import IO, Any

import structlog

HOST_STAGES = frozenset({"plan"})  # the other stages are device work
TRACKS = ("host", "device")  # thread ids 1 and 2 in the Chrome trace


class Tracer:
    """Records stage spans to a JSON-lines file and/or a bounded in-memory list (`keep` most
    recent, for tests). With neither it is disabled and a span costs next to nothing.

    A record may carry `track` ("host" or "device") to override the stage's usual track."""

    def __init__(
        self, path: str | os.PathLike[str] | None = None, keep: int = 0, rank: int | None = None
    ) -> None:
        """`rank`: the tensor-parallel rank every record names (None: one process)."""
        self.rank = rank
        self._file: IO[str] | None = None
        self._log: Any = None
        if path is not None:
            self._file = open(path, "w", encoding="utf-8")  # closed by close()
            self._log = structlog.wrap_logger(
                structlog.WriteLogger(self._file),
                processors=[structlog.processors.JSONRenderer()],
                wrapper_class=structlog.BoundLogger,
            )
        self.records: deque[dict[str, Any]] | None = deque(maxlen=keep) if keep else None
        self.enabled = self._log is not None or self.records is not None

    def span(
        self, step: int, stage: str, **fields: Any
    ) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """Time the block as one span; it yields the fields dict, so the block can add what it
        learns (`fields["accepted"] = ...`) before the record is written."""
        if not self.enabled:
            return contextlib.nullcontext(fields)
        return self._timed(step, stage, fields)

    @contextlib.contextmanager
    def _timed(self, step: int, stage: str, fields: dict[str, Any]) -> Iterator[dict[str, Any]]:
        start = time.perf_counter()
        try:
            yield fields
        finally:
            self.record(step, stage, start, time.perf_counter(), **fields)

    def record(self, step: int, stage: str, start: float, end: float, **fields: Any) -> None:
        """A span measured elsewhere (device work timed by events), on the perf_counter clock."""
        if not self.enabled:
            return
        event = {"step": step, "stage": stage, "start": start, "end": end, **fields}
        if self.rank is not None:
            event["rank"] = self.rank
        if self._log is not None:
            self._log.info("span", **event)
        if self.records is not None:
            self.records.append(event)

    def keep(self, count: int) -> None:
        """From now on, also keep the `count` most recent records in memory (`records`)."""
        self.records = deque(maxlen=count)
        self.enabled = True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._log = None
            self.enabled = self.records is not None

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TraceFormatError(ValueError):
    """A step timeline line that is not a span record; the message names the line."""


def read_steps(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The span records of a JSON-lines timeline (blank lines skipped)."""
    records = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                records.append(_parse_record(line, f"{os.fspath(path)}, line {number}"))
    return records


def _parse_record(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    for key, kinds in (("step", (int,)), ("stage", (str,)), ("start", (int, float)),
                       ("end", (int, float))):  # fmt: skip
        if not isinstance(record.get(key), kinds) or isinstance(record.get(key), bool):
            raise TraceFormatError(f"{where}: missing or bad {key!r}")
    if record["end"] < record["start"]:
        raise TraceFormatError(f"{where}: end before start")
    return record


def to_chrome_trace(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace JSON: a complete event ("ph": "X") per span, microseconds from the first
    start, one thread per track, `args` holding the step and the other fields."""
    records = list(records)
    origin = min((r["start"] for r in records), default=0.0)
    tracks = list(TRACKS) + sorted({r["track"] for r in records if "track" in r} - set(TRACKS))
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}}
        for tid, track in enumerate(tracks, 1)
    ]
    for r in records:
        track = r.get("track", "host" if r["stage"] in HOST_STAGES else "device")
        args = {k: v for k, v in r.items() if k not in ("event", "stage", "start", "end", "track")}
        events.append(
            {
                "name": r["stage"],
                "ph": "X",
                "ts": (r["start"] - origin) * 1e6,
                "dur": (r["end"] - r["start"]) * 1e6,
                "pid": 1,
                "tid": tracks.index(track) + 1,
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.trace",
        description="Turn a step timeline (JSON lines, from --trace-file) into a Chrome trace "
        "JSON that Perfetto (ui.perfetto.dev) or chrome://tracing opens.",
    )
    parser.add_argument("steps", help="the JSON-lines step timeline")
    parser.add_argument("-o", "--output", required=True, help="the Chrome trace JSON to write")
    args = parser.parse_args(argv)
    try:
        records = read_steps(args.steps)
    except FileNotFoundError:
        parser.error(f"no such file: {args.steps}")
    except OSError as e:
        parser.error(f"cannot read {args.steps}: {e.strerror}")
    except (TraceFormatError, UnicodeDecodeError) as e:
        parser.error(str(e))
    with open(args.output, "w", encoding="utf-8") as out:
        json.dump(to_chrome_trace(records), out)
    steps = len({r["step"] for r in records})
    print(f"wrote {len(records)} spans of {steps} steps to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
