"""Train the built-in demo model family: `python -m train.lm {corpus,tokenizer,target,draft,eval}`.

A run directory (outside the repository) holds the tokenizer, the tokenised corpus, the
checkpoints and the evaluation results; the finished models go to `models/demo/*` as Hugging
Face directories. The steps, in order:

    python -m train.lm corpus                       # once: records the file lists and prompts
    python -m train.lm tokenizer --run-dir RUN
    python -m train.lm target --run-dir RUN --minutes 60
    python -m train.lm draft --run-dir RUN --minutes 15
    python -m train.lm eval --run-dir RUN

    python -m train.lm target --run-dir RUN --arch deepseek --out models/demo/deepseek

`target` and `draft` checkpoint every few minutes; `--resume` continues a run (and, once the
budget is spent, only exports it again).
"""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from models.deepseek import DeepseekModel, save_deepseek
from models.llama import LlamaModel
from models.loader import save_pretrained
from train import bpe, corpus, data, objectives
from train.loop import TrainConfig, train

log = logging.getLogger("train")

TRAIN_TOKENS = "train_tokens.npy"
HELDOUT_TOKENS = "heldout_tokens.npy"
HELDOUT_WINDOWS = 16  # windows of `seq` tokens for the held-out loss logged at checkpoints


def load_run_tokenizer(run_dir: Path) -> Tokenizer:
    path = run_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m train.lm tokenizer` first")
    return bpe.load_tokenizer(path)


def split_tokens(run_dir: Path, tok: Tokenizer, split: str) -> np.ndarray:
    """The split tokenised once and cached in the run directory."""
    name = TRAIN_TOKENS if split == "train" else HELDOUT_TOKENS
    if (run_dir / name).exists():
        return np.load(run_dir / name, mmap_mode="r")
    texts = corpus.load_corpus().texts(split)
    tokens = data.cached_tokens(run_dir / name, tok, texts)
    log.info("%s split: %d files, %.2fM tokens", split, len(texts), len(tokens) / 1e6)
    return tokens


def export(model: LlamaModel | DeepseekModel, tok: Tokenizer, out: Path) -> None:
    """Write the model (bfloat16 safetensors, config.json) and the tokenizer files to `out`."""
    if isinstance(model, DeepseekModel):
        save_deepseek(model, out, dtype=torch.bfloat16)
    else:
        save_pretrained(model, out, dtype=torch.bfloat16)
    bpe.save_tokenizer(tok, out, model.config.max_position_embeddings)
    log.info("exported %s", out)


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        minutes=args.minutes,
        lr=args.lr,
        batch=args.batch,
        seq=args.seq,
        max_steps=args.max_steps,
        seed=args.seed,
    )


def cmd_corpus(args: argparse.Namespace) -> None:
    found = corpus.write_corpus()
    log.info("recorded %d training and %d held-out files", len(found.train), len(found.heldout))


def cmd_tokenizer(args: argparse.Namespace) -> None:
    texts = corpus.load_corpus().texts("train")
    tok = bpe.train_tokenizer(texts, args.vocab)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    bpe.save_tokenizer(tok, args.run_dir, max_length=2048)
    sample = "".join(texts[:50])
    ratio = len(sample.encode()) / len(tok.encode(sample).ids)
    log.info("vocab %d, %.2f bytes per token", tok.get_vocab_size(), ratio)


def cmd_target(args: argparse.Namespace) -> None:
    tok = load_run_tokenizer(args.run_dir)
    cfg = train_config(args)
    tokens = split_tokens(args.run_dir, tok, "train")
    heldout = data.fixed_windows(
        split_tokens(args.run_dir, tok, "heldout"), HELDOUT_WINDOWS, cfg.seq
    )
    torch.manual_seed(cfg.seed)
    vocab, eos = tok.get_vocab_size(), bpe.eos_id(tok)
    model: LlamaModel | DeepseekModel
    if args.arch == "deepseek":
        model = DeepseekModel(objectives.deepseek_config(vocab, eos))
    else:
        model = LlamaModel(objectives.target_config(vocab, eos))
    objectives.init_weights(model)
    log.info("target: %.1fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    sampler = data.WindowSampler(tokens, cfg.batch, cfg.seq, cfg.seed)
    run = args.run_dir / "target"
    run.mkdir(parents=True, exist_ok=True)
    train(
        model,
        functools.partial(objectives.lm_loss, model),
        sampler,
        cfg,
        run,
        resume=args.resume,
        evaluate=functools.partial(objectives.heldout_loss, model, heldout),
    )
    export(model, tok, args.out)


def cmd_draft(args: argparse.Namespace) -> None:
    from models.loader import load_model

    tok = load_run_tokenizer(args.run_dir)
    cfg = train_config(args)
    target = load_model(args.target, dtype=torch.float32, device="cpu")
    target.eval().requires_grad_(False)
    tokens = split_tokens(args.run_dir, tok, "train")
    heldout = data.fixed_windows(
        split_tokens(args.run_dir, tok, "heldout"), HELDOUT_WINDOWS, cfg.seq
    )
    torch.manual_seed(cfg.seed)
    shape = objectives.draft_config(tok.get_vocab_size(), bpe.eos_id(tok), args.layers)
    model = LlamaModel(shape)
    objectives.init_weights(model)
    log.info("draft: %.1fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    # a different seed from the target's, so the draft does not see the same windows in order
    sampler = data.WindowSampler(tokens, cfg.batch, cfg.seq, cfg.seed + 1)
    run = args.run_dir / "draft"
    run.mkdir(parents=True, exist_ok=True)
    loss = functools.partial(objectives.distill_loss, model, target, hard_weight=args.hard_weight)
    train(
        model,
        loss,
        sampler,
        cfg,
        run,
        resume=args.resume,
        evaluate=functools.partial(objectives.heldout_loss, model, heldout),
    )
    export(model, tok, args.out)


def cmd_eval(args: argparse.Namespace) -> None:
    from train import evaluate

    evaluate.run(args.run_dir, args.target, args.draft, args.windows, args.new_tokens)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.lm", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("corpus", help="record the stdlib file lists and the held-out prompts")
    tk = sub.add_parser("tokenizer", help="train the byte-level BPE")
    tk.add_argument("--vocab", type=int, default=4096)
    # the draft's step is dominated by the frozen target's forward, so it keeps batch 8 too:
    # in a 15-minute budget, more updates matter more than less noisy ones
    for name, minutes in (("target", 60.0), ("draft", 15.0)):
        t = sub.add_parser(name, help=f"train the {name} model")
        t.add_argument("--minutes", type=float, default=minutes, help="wall-clock budget")
        t.add_argument("--batch", type=int, default=8)
        t.add_argument("--seq", type=int, default=512)
        t.add_argument("--lr", type=float, default=1e-3)
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--max-steps", type=int, default=0, help="stop early (smoke tests)")
        t.add_argument("--resume", action="store_true", help="continue from the checkpoint")
        t.add_argument("--out", type=Path, default=Path("models/demo") / name)
    target = sub.choices["target"]
    arch = "deepseek: a DeepSeek-V3-style target (train/objectives.py deepseek_config)"
    target.add_argument("--arch", choices=("llama", "deepseek"), default="llama", help=arch)
    draft = sub.choices["draft"]
    draft.add_argument("--target", type=Path, default=Path("models/demo/target"))
    draft.add_argument("--layers", type=int, default=1)
    draft.add_argument("--hard-weight", type=float, default=0.1, help="share of label loss")
    ev = sub.add_parser("eval", help="held-out losses, agreement and acceptance lengths")
    ev.add_argument("--target", type=Path, default=Path("models/demo/target"))
    ev.add_argument("--draft", type=Path, default=Path("models/demo/draft"))
    ev.add_argument("--windows", type=int, default=64, help="held-out windows of 512 tokens")
    ev.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    for s in sub.choices.values():
        if s.prog.split()[-1] != "corpus":
            s.add_argument("--run-dir", type=Path, required=True)
    return p


COMMANDS = {
    "corpus": cmd_corpus,
    "tokenizer": cmd_tokenizer,
    "target": cmd_target,
    "draft": cmd_draft,
    "eval": cmd_eval,
}


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    COMMANDS[args.command](args)


if __name__ == "__main__":
    main()
