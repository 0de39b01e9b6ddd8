"""The demo-model training code on tiny models: it learns, exports, loads and evaluates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from models.llama import LlamaConfig, LlamaModel
from models.loader import load_model
from models.tokenizer import Tokenizer
from train import bpe, corpus, data, evaluate, lm, objectives
from train.loop import CHECKPOINT, TrainConfig, train

REPO = Path(__file__).resolve().parent.parent
SEQ = 64


def tiny_config(vocab: int, eos: int, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        bos_token_id=eos,
        eos_token_id=eos,
    )


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [p.read_text() for p in sorted((REPO / "train").glob("*.py"))]


@pytest.fixture(scope="module")
def tok(texts):
    return bpe.train_tokenizer(texts, vocab_size=300)


@pytest.fixture(scope="module")
def tokens(tok, texts):
    return data.tokenize_documents(tok, texts)


@pytest.fixture(scope="module")
def trained(tok, tokens, tmp_path_factory):
    """A tiny target, with its loss on fixed windows before and after 30 steps."""
    torch.manual_seed(0)
    model = LlamaModel(tiny_config(tok.get_vocab_size(), bpe.eos_id(tok)))
    objectives.init_weights(model)
    windows = data.fixed_windows(tokens, 8, SEQ)
    before = objectives.heldout_loss(model, windows)
    cfg = TrainConfig(minutes=60, lr=3e-3, warmup_steps=5, batch=4, seq=SEQ, max_steps=30)
    sampler = data.WindowSampler(tokens, cfg.batch, cfg.seq, seed=0)
    run = tmp_path_factory.mktemp("run")
    state = train(model, lambda b: objectives.lm_loss(model, b), sampler, cfg, run)
    return model, before, objectives.heldout_loss(model, windows), state, run


def test_tokenizer_round_trips_and_separates_documents(tok, tokens, texts):
    assert tok.get_vocab_size() == 300
    assert tok.decode(tok.encode(texts[0]).ids) == texts[0]
    literal = sum(t.count(bpe.EOS) for t in texts)  # bpe.py spells the token out
    assert int((tokens == bpe.eos_id(tok)).sum()) == len(texts) + literal


def test_loss_falls_and_checkpoint_is_written(trained):
    _, before, after, state, run = trained
    assert state.step == 30
    assert after < before - 1.0
    assert (run / CHECKPOINT).exists()


def test_resume_continues_from_the_checkpoint(trained, tokens):
    model, *_, run = trained
    cfg = TrainConfig(minutes=60, batch=4, seq=SEQ, max_steps=32)
    sampler = data.WindowSampler(tokens, cfg.batch, cfg.seq, seed=0)
    state = train(model, lambda b: objectives.lm_loss(model, b), sampler, cfg, run, resume=True)
    assert state.step == 32


def test_exported_directory_loads_with_our_loader(trained, tok, tmp_path):
    model = trained[0]
    lm.export(model, tok, tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        expected = tensor.to(torch.bfloat16).float()
        torch.testing.assert_close(loaded.state_dict()[name], expected, rtol=0, atol=0)
    text = Tokenizer(tmp_path)
    assert text.eos_token_id == bpe.eos_id(tok)
    assert text.encode("def f():") == tok.encode("def f():").ids  # no bos added
    prompt = text.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|user|>\nhi\n<|assistant|>\n"


def test_distillation_moves_the_draft_towards_the_target(trained, tok, tokens):
    target = trained[0].eval().requires_grad_(False)
    torch.manual_seed(1)
    draft = LlamaModel(tiny_config(tok.get_vocab_size(), bpe.eos_id(tok), layers=1))
    objectives.init_weights(draft)
    batch = data.fixed_windows(tokens, 4, SEQ)
    before = objectives.distill_loss(draft, target, batch, hard_weight=0.0).item()
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for _ in range(12):
        loss = objectives.distill_loss(draft, target, batch, hard_weight=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = objectives.distill_loss(draft, target, batch, hard_weight=0.0).item()
    assert after < before * 0.7
    stats, matches = evaluate.heldout_stats(target, draft, batch[:2])
    assert len(matches) == 2 and len(matches[0]) == SEQ
    assert stats["agreement"] == pytest.approx(sum(map(sum, matches)) / (2 * SEQ))
    accept, agreement = evaluate.simulate(target, draft, [[1, 2, 3], [4, 5, 6, 7, 8]], 12)
    assert 0 <= agreement <= 1
    assert all(1 <= accept[k] <= k + 1 for k in evaluate.DRAFT_LENGTHS)


def test_acceptance_on_hand_built_matches():
    assert evaluate.acceptance([[True] * 6], k=2) == 3  # two steps of 2 accepted + bonus
    assert evaluate.acceptance([[False] * 4], k=4) == 1
    # step 1 accepts 1 then stops at the miss at index 1 (emits 2); step 2 accepts 2 (emits 3)
    assert evaluate.acceptance([[True, False, True, True, False]], k=4) == 2.5


def test_cached_batched_greedy_equals_uncached_greedy():
    torch.manual_seed(0)
    model = LlamaModel(tiny_config(50, 0)).eval()
    objectives.init_weights(model, std=0.5)  # wide top-2 gaps: no flips from rounding
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    batched = evaluate.greedy_continue(model, prompts, 6)
    for prompt, row in zip(prompts, batched, strict=True):
        ids = list(prompt)
        for _ in range(6):
            logits = objectives.forward_logits(model, torch.tensor([ids]))
            ids.append(int(logits[-1].argmax()))
        assert row.tolist() == ids[len(prompt) :]


def test_corpus_scan_split_and_prompts(tmp_path):
    root = tmp_path / "lib"
    (root / "site-packages").mkdir(parents=True)
    (root / "site-packages" / "skip.py").write_text("x = 1\n")
    (root / "big.py").write_text("#" * (corpus.MAX_FILE_BYTES + 1))
    for i in range(5):
        (root / f"m{i}.py").write_text("".join(f"line_{i}_{j} = {j}\n" for j in range(40)))
    assert corpus.scan_stdlib(root) == [f"m{i}.py" for i in range(5)]
    found = corpus.Corpus(root, ["m0.py"], ["m1.py", "m2.py"])
    prompts = corpus.choose_prompts(found, count=4, chars=50, seed=0)
    assert prompts == corpus.choose_prompts(found, count=4, chars=50, seed=0)
    for p in prompts:
        assert len(p["text"]) == 50 and p["text"].startswith("line_")
    (tmp_path / "corpus_files.txt").write_text("m0.py\nmissing.py\n")
    (tmp_path / "heldout_files.txt").write_text("m1.py\n")
    with pytest.raises(FileNotFoundError, match="standard library differs"):
        corpus.load_corpus(tmp_path, root)


def test_recorded_corpus_matches_this_interpreter():
    found = corpus.load_corpus()
    assert not set(found.train) & set(found.heldout)
    assert all(corpus.is_heldout(p) for p in found.heldout)
    prompts = corpus.load_prompts()
    assert len(prompts) == corpus.NUM_PROMPTS
    assert all(len(p) == corpus.PROMPT_CHARS for p in prompts)


def test_cli_parses_every_command():
    p = lm.parser()
    assert p.parse_args(["corpus"]).command == "corpus"
    args = p.parse_args(["draft", "--run-dir", "r", "--minutes", "2"])
    assert (args.minutes, args.layers, args.batch, args.hard_weight) == (2.0, 1, 8, 0.1)
    assert p.parse_args(["target", "--run-dir", "r"]).minutes == 60.0
    assert p.parse_args(["eval", "--run-dir", "r"]).new_tokens == 128


def test_a_run_of_so_many_steps_ends_its_schedule_at_the_last_step():
    budget = TrainConfig(minutes=10, lr=1.0, warmup_steps=1, final_lr_ratio=0.1)
    steps = dataclasses.replace(budget, minutes=1e6, max_steps=100)
    assert budget.lr_at(50, elapsed_s=600) == pytest.approx(0.1)  # the budget spent
    assert steps.lr_at(0, elapsed_s=0) == pytest.approx(1.0)
    assert steps.lr_at(50, elapsed_s=600) == pytest.approx(0.55)  # half way, whatever the time
    assert steps.lr_at(100, elapsed_s=600) == pytest.approx(0.1)
