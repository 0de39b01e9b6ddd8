"""bench.peer's merging of rounds: the sides take turns, a launch's cells gather every round."""

from __future__ import annotations

import pytest

from bench.peer import (
    LLAMA,
    TANDEM,
    Cell,
    FillPrompt,
    bench_prompts,
    llama_spec_flags,
    merged,
    parse_args,
)
from models.tokenizer import Tokenizer


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


def test_a_fill_goes_to_each_server_in_its_own_form(tiny_target):
    """Ours gets the text and a suffix (the server builds the ids), llama.cpp those very ids."""
    tokenizer = Tokenizer(tiny_target)
    prompts, timed = bench_prompts(tokenizer, 2, 1, "complete")
    assert timed == prompts and all(isinstance(p, FillPrompt) for p in prompts)
    fill = prompts[0]
    assert isinstance(fill, FillPrompt)
    assert fill.ids == tokenizer.encode_fill(fill.fill.prefix, fill.fill.suffix)
    ours, theirs = TANDEM.body(fill, 64, 0.0, 1), LLAMA.body(fill, 64, 0.0, 1)
    assert (ours["prompt"], ours["suffix"]) == (fill.fill.prefix, fill.fill.suffix)
    assert theirs["prompt"] == fill.ids and "ignore_eos" not in theirs | ours


@pytest.mark.parametrize("workload", ["code-chat", "edits"])
def test_the_code_chats_are_chats(tiny_target, workload):
    prompts, _ = bench_prompts(Tokenizer(tiny_target), 6, 0, workload)
    assert len(prompts) == 6 and all(p[0]["role"] == "user" for p in prompts)  # type: ignore


def test_llama_cpps_draft_length_is_capped_as_asked():
    assert llama_spec_flags("draft-simple", 4, None)[-2:] == ["--spec-draft-n-max", "4"]
    assert llama_spec_flags("draft-simple@8", 4, None)[-2:] == ["--spec-draft-n-max", "8"]
    assert "--spec-draft-n-max" not in llama_spec_flags("draft-simple@default", 4, None)
