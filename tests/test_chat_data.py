"""Self-distillation data: the prompt pool's rules (distinct, not degenerate, never near a
held-out benchmark prompt), shards that round-trip, and a generation that resumes."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from train import chat_data, prompts
from train.chat_data import Shard, read_shards
from train.prompts import Pool, degenerate, near_heldout, read_pool, trigrams


def test_degenerate_turns_are_recognised():
    assert degenerate("hi")  # too short
    assert degenerate("1234 5678 !!!! ???? 0000 ----")  # few letters
    assert degenerate("tell me more tell me more tell me more about it")  # repeats itself
    assert not degenerate("How do I sort a list of tuples by their second item in Python?")


def test_prompts_near_a_heldout_one_are_dropped():
    heldout = [trigrams("Why do we have leap years?")]
    assert near_heldout("why do we have leap years", heldout)
    assert near_heldout("Please tell me: why do we have leap years? Thanks.", heldout)
    assert not near_heldout("How many days does a leap year have in February?", heldout)


def test_the_pool_is_distinct_appendable_and_clean(tmp_path):
    path = tmp_path / prompts.POOL
    pool = Pool(path)
    held = json.loads(prompts.HELDOUT.read_text())[0]
    assert pool.add("given", "What is a closure in Python?")
    assert not pool.add("given", "what is a closure in python")  # the same words
    assert not pool.add("self", held)  # a benchmark prompt
    assert not pool.add("self", "again again again again again", check_degenerate=True)
    assert pool.add("text", "Summarise this text:\n\nThe module reads files.")
    assert pool.dropped == {"duplicate": 1, "near held-out": 1, "degenerate": 1}
    reopened = Pool(path)  # what is there survives, and is still checked against
    assert [p["text"] for p in reopened.prompts] == [p["text"] for p in read_pool(path)]
    assert len(reopened.prompts) == 2 and not reopened.add("given", "What is a closure in Python?")


def test_text_tasks_hold_a_snippet_of_the_corpus():
    tasks = prompts.text_tasks(seed=3)
    for _ in range(20):
        task = next(tasks)
        ask, _, body = task.partition("\n\n")
        assert any(ask == t for t, _ in prompts.TASKS) and len(body) > 40


def test_shards_round_trip(tmp_path):
    shard = Shard()
    shard.add(3, 0.7, [1, 2, 3, 65535], 2)
    shard.add(8, 0.0, [4, 5], 1)
    shard.save(tmp_path / "answers-00000.npz")
    got = read_shards(tmp_path)
    assert [(c["prompt"], c["temperature"], c["ids"], c["answer_start"]) for c in got] == [
        (3, 0.7, [1, 2, 3, 65535], 2),
        (8, 0.0, [4, 5], 1),
    ]
    with np.load(tmp_path / "answers-00000.npz") as f:
        assert f["tokens"].dtype == np.uint16


async def test_generation_fills_shards_and_resumes(tiny_target, tmp_path):
    pool = Pool(tmp_path / prompts.POOL)
    for text in ["the quick brown fox", "def add(a, b):", "import os and sys", "class Stack"]:
        pool.add("given", text)
    args = argparse.Namespace(
        data=tmp_path,
        model=str(tiny_target),
        temperatures=[1.0],
        max_tokens=6,
        batch=3,
        shard_size=3,
        kv_gib=0.01,
        minutes=0,
    )
    await chat_data.generate(args)
    first = read_shards(tmp_path)
    assert sorted((c["prompt"], c["temperature"]) for c in first) == [
        (i, t) for i in range(4) for t in (0.0, 1.0)
    ]
    assert all(0 < len(c["ids"]) - c["answer_start"] <= 6 for c in first)
    shards = sorted(p.name for p in tmp_path.glob("answers-*.npz"))
    assert len(shards) == 3  # 8 conversations, 3 a shard
    pool.add("given", "one more prompt here")
    await chat_data.generate(args)  # only the new prompt's two answers, in a new shard
    assert len(read_shards(tmp_path)) == 10
    assert sorted(p.name for p in tmp_path.glob("answers-*.npz"))[:3] == shards


@pytest.mark.slow
def test_one_command_makes_a_head_and_resumes(tiny_target, tmp_path, monkeypatch):
    """train.auto on the tiny model with a budget of seconds: every stage runs, the head
    loads as a drafter, and a second run finds every stage done."""
    from models.eagle import load_eagle_head
    from models.loader import load_model
    from train import auto

    out = tmp_path / "head"
    argv = ["--model", str(tiny_target), "--hours", "0.004", "--out", str(out),
            "--self-written", "8", "--text-tasks", "8", "--validate-prompts", "2",
            "--window", "32", "--kind", "eagle-original"]  # fmt: skip
    auto.main(argv)
    state = json.loads((tmp_path / "head.run" / auto.STATE).read_text())
    assert state["done"] == [s.name for s in auto.STAGES]
    assert json.loads((out / "validate.json").read_text())["acceptance_length"] >= 1.0
    load_eagle_head(out, load_model(tiny_target))
    calls = []
    monkeypatch.setattr(
        auto, "STAGES", [auto.Stage(s.name, s.share, calls.append) for s in auto.STAGES]
    )
    auto.main(argv)
    assert calls == []


def test_a_user_turn_opens_and_ends_as_the_template_says(tiny_target):
    """SmolLM2's ChatML turn ends with its <|im_end|> token; the tiny template's with a line
    break, a stop string."""
    from models.gguf import packaged_smollm2
    from models.tokenizer import Tokenizer

    smollm2 = Tokenizer(packaged_smollm2())
    opening, end = prompts.user_turn(smollm2)
    assert smollm2.decode(opening, False).endswith("<|im_start|>user\n")
    assert end.stop_token_ids == (smollm2.specials["<|im_end|>"],)
    tiny = Tokenizer(tiny_target)
    opening, end = prompts.user_turn(tiny)
    assert end.stop == ("\n",) and not end.stop_token_ids
    assert tiny.decode(opening, False) + "hi" + "\n" in tiny.apply_chat_template(
        [{"role": "user", "content": "hi"}], False
    )
