"""bench.peer's merging of rounds: the sides take turns, a launch's cells gather every round."""

from __future__ import annotations

import pytest

from bench.peer import Cell, merged, parse_args


def test_rounds_pool_every_repeat_and_count():
    first = {"cells": {(1, 0.0): Cell([10.0, 12.0], 8, 5)}, "ttft": 2.0}
    second = {"cells": {(1, 0.0): Cell([14.0, 16.0], 4, 1)}, "ttft": 4.0}
    third = {"cells": {(1, 0.0): Cell([18.0, 20.0], 0, 0)}, "ttft": 6.0}
    out = merged(merged(first, second), third)
    cell = out["cells"][(1, 0.0)]
    assert cell.rates == [10.0, 12.0, 14.0, 16.0, 18.0, 20.0]
    assert (cell.drafted, cell.accepted) == (12, 6)
    assert out["ttft"] == 4.0 and out["rounds"] == 3


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--llama-server", "x", "--gguf", "y", "--methods", "plain", "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err
