"""Train the demo target's EAGLE and MTP heads: `python -m train.heads {precompute,train,
validate,table}`.

    python -m train.heads precompute --run-dir RUN              # target outputs -> RUN/heads-data
    python -m train.heads train --run-dir RUN --kind eagle --minutes 8
    python -m train.heads precompute --run-dir RUN --target smollm2 --eagle3   # a chat target
    python -m train.heads train --run-dir RUN --target smollm2 --kind eagle3 --minutes 40
    python -m train.heads validate --run-dir RUN --kind eagle --head RUN/heads/eagle/head
    python -m train.heads table --run-dir RUN                   # the ablation table

RUN holds `train_tokens.npy` and `heldout_tokens.npy`: for the demo a `train.lm` run directory
(`python -m train.lm tokenizer --run-dir RUN` makes the tokenizer, and the first `target` or
`draft` run tokenises the corpus); for a chat target `train.chat_data` writes them. `--target`
is a directory, a GGUF file or a name server.py knows (smollm2). `--eagle3` also stores the
target layers an EAGLE-3 head reads; its draft vocabulary is the training tokens' most frequent
`--draft-vocab`. Each kind trains in RUN/heads/KIND (checkpoints, logs,
the exported head in `head/`, validation JSON); `--resume` continues a run, and precompute
skips finished shards.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from pathlib import Path

import numpy as np
import torch

from engine.builder import model_path
from models.eagle import Eagle3Head, default_aux_layers, save_eagle3_head, save_eagle_head
from models.llama import prepare_for_inference
from models.loader import load_model
from models.mtp import MTPHead, save_mtp_head
from train import head_data, head_train
from train.head_train import KINDS, HeadData, HeadLoss
from train.lm import HELDOUT_TOKENS, TRAIN_TOKENS
from train.loop import TrainConfig, cpu_has_bf16, load_best, train

log = logging.getLogger("train")

HEADS_DIR = "heads"
DEMO_TARGET = Path("models/demo/target")


def load_target(name: str) -> torch.nn.Module:
    target = load_model(model_path(name), dtype=torch.float32, device="cpu")
    head_train.freeze_shared(target)
    return target


def cmd_precompute(args: argparse.Namespace) -> None:
    target = load_target(args.target)
    prepare_for_inference(target)  # the serving engine's products: 1.35x the plain forward's
    layers = target.config.num_layers
    aux = tuple(i - 1 for i in default_aux_layers(layers)) if args.eagle3 else ()
    cfg = head_data.PrecomputeConfig(
        window=args.window,
        topk=args.topk,
        train_tokens=args.tokens,
        heldout_tokens=args.heldout_tokens,
        batch=args.batch,
        aux_layers=aux,
    )
    splits = {}
    # the small held-out split first: training can start from a partial train split
    for split, name in (("heldout", HELDOUT_TOKENS), ("train", TRAIN_TOKENS)):
        path = args.run_dir / name
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: tokenise the corpus with train.lm first")
        splits[split] = np.load(path, mmap_mode="r")
    head_data.precompute(target, splits, args.run_dir / head_data.DATA_DIR, cfg)


def export_head(head: head_train.Head, out: Path, dtype: torch.dtype) -> None:
    if isinstance(head, MTPHead):
        save_mtp_head(head, out, dtype)
    elif isinstance(head, Eagle3Head):
        save_eagle3_head(head, out, dtype)
    else:
        save_eagle_head(head, out, dtype)
    log.info("exported %s", out)


def cmd_train(args: argparse.Namespace) -> None:
    data_dir = args.run_dir / head_data.DATA_DIR
    data = HeadData(head_data.load_split(data_dir, "train")).subset(args.fraction, args.seed)
    heldout = HeadData(head_data.load_split(data_dir, "heldout"))
    if args.kind == "eagle3":  # its loss reads the target layers, not the final hidden state
        data, heldout = data.without("hidden"), heldout.without("hidden")
    # --epochs: the same passes over the data whatever its size (a learning curve's points)
    epoch_steps = -(-len(data) * args.epochs // args.batch) if args.epochs else 0
    cfg = TrainConfig(
        minutes=args.minutes,
        lr=args.lr,
        warmup_steps=args.warmup,
        batch=args.batch,
        seq=data.window - 1,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        checkpoint_minutes=args.checkpoint_minutes,
        max_steps=args.max_steps or round(epoch_steps),
        seed=args.seed,
        bf16=cpu_has_bf16() if args.bf16 == "auto" else args.bf16 == "on",
    )
    loss = HeadLoss.default(args.kind)
    if args.feature_weight is not None:
        loss = HeadLoss(args.kind, args.feature_weight, loss.ce_weight, loss.noise)
    target = load_target(args.target)
    torch.manual_seed(cfg.seed)
    draft_ids = None
    if args.kind == "eagle3":
        tokens = np.load(args.run_dir / TRAIN_TOKENS, mmap_mode="r")
        draft_ids = head_train.draft_vocabulary(tokens, args.draft_vocab)
        share = np.isin(tokens, draft_ids.numpy()).mean()
        log.info(
            "draft vocabulary: %d ids, %.1f%% of the training tokens", len(draft_ids), 100 * share
        )
        if not data.has("aux"):
            raise SystemExit("the precomputed data has no target layers: precompute with --eagle3")
    layers = tuple(head_data.read_meta(data_dir).get("aux_layers", ()))  # older stores: none
    head = head_train.build_head(args.kind, target, draft_ids, layers)
    log.info(
        "%s head: %.2fM trainable parameters; %d windows of %d tokens (%.2fM tokens); %s",
        *(args.kind, head_train.trainable(head) / 1e6, len(data), data.window),
        *(len(data) * data.window / 1e6, loss),
    )
    run = args.run_dir / HEADS_DIR / args.kind
    run.mkdir(parents=True, exist_ok=True)
    sampler = head_train.IndexSampler(len(data), cfg.batch, cfg.seed)

    def evaluate() -> float:
        metrics = head_train.heldout_metrics(head, heldout, loss)
        log.info("held-out %s", {k: round(v, 4) for k, v in metrics.items()})
        return metrics["loss"]

    loss_fn = functools.partial(head_train.training_loss, head, data, loss)
    state = train(head, loss_fn, sampler, cfg, run, resume=args.resume, evaluate=evaluate)
    load_best(run, head, state)  # checkpoints are chosen on the validation split
    metrics = head_train.heldout_metrics(head, heldout, loss)
    summary = {"kind": args.kind, "steps": state.step, "minutes": state.elapsed_s / 60}
    summary |= {"windows": len(data), "fraction": args.fraction, "best_step": state.best_step}
    summary |= {"tokens": state.tokens, "heldout": metrics}
    (run / "train.json").write_text(json.dumps(summary, indent=2) + "\n")
    export_head(head, args.out or run / "head", getattr(torch, args.dtype))


def cmd_validate(args: argparse.Namespace) -> None:
    from train import head_validate

    result = head_validate.run(args)
    text = json.dumps(result, indent=2) + "\n"
    out = args.json or args.run_dir / HEADS_DIR / args.kind / "validate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text, end="")


def cmd_table(args: argparse.Namespace) -> None:
    from train import head_validate

    print(head_validate.table(args.run_dir / HEADS_DIR))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.heads", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("precompute", help="store the target's features and top-k logits")
    pre.add_argument("--tokens", type=int, default=600_000, help="training tokens to store")
    pre.add_argument("--heldout-tokens", type=int, default=16_384)
    pre.add_argument("--window", type=int, default=512)
    pre.add_argument("--topk", type=int, default=16)
    pre.add_argument("--batch", type=int, default=4, help="windows per target forward")
    pre.add_argument("--eagle3", action="store_true", help="store EAGLE-3's target layers too")
    tr = sub.add_parser("train", help="train one head on the stored data")
    tr.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget")
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--warmup", type=int, default=30, help="warm-up steps")
    tr.add_argument("--batch", type=int, default=4, help="windows per step")
    tr.add_argument("--weight-decay", type=float, default=0.01)
    tr.add_argument("--grad-clip", type=float, default=0.5)
    tr.add_argument("--feature-weight", type=float, help="override the kind's feature term")
    tr.add_argument("--checkpoint-minutes", type=float, default=3.0)
    tr.add_argument("--max-steps", type=int, default=0, help="stop early (smoke tests)")
    tr.add_argument("--fraction", type=float, default=1.0, help="train on this share of windows")
    tr.add_argument("--epochs", type=float, default=0, help="passes over the data (0: budget)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    bf16 = "bfloat16 autocast of the forward (auto: where the CPU has bfloat16 dot products)"
    tr.add_argument("--bf16", choices=("auto", "on", "off"), default="auto", help=bf16)
    tr.add_argument("--dtype", default="bfloat16", help="dtype of the exported weights")
    tr.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3's draft vocabulary")
    tr.add_argument("--out", type=Path, help="export directory (default RUN/heads/KIND/head)")
    va = sub.add_parser("validate", help="acceptance and accuracy through the engine")
    va.add_argument("--head", type=Path, required=True, help="head directory")
    va.add_argument("--k", type=int, default=4, help="draft tokens per step")
    va.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    va.add_argument("--prompts", type=int, default=0, help="first N held-out prompts (0: all)")
    va.add_argument("--chat", action="store_true", help="the held-out chat prompts")
    va.add_argument("--json", type=Path, help="output (default RUN/heads/KIND/validate.json)")
    sub.add_parser("table", help="the ablation table from the validation results")
    for name in ("train", "validate"):
        sub.choices[name].add_argument("--kind", choices=KINDS, required=True)
    for s in sub.choices.values():
        s.add_argument("--run-dir", type=Path, required=True)
        s.add_argument("--target", default=str(DEMO_TARGET))
    return p


COMMANDS = {
    "precompute": cmd_precompute,
    "train": cmd_train,
    "validate": cmd_validate,
    "table": cmd_table,
}


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    COMMANDS[args.command](args)


if __name__ == "__main__":
    main()
