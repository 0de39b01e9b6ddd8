"""A drafter head for your own model, in one command: `python -m train.auto`.

    python -m train.auto --model MODEL --hours 6 --out my-head [--run-dir RUN] [--kind eagle3]

MODEL is a Hugging Face directory, a GGUF file or a name server.py knows. The budget is spent
in stages, each a share of it, each resuming where it stopped when the command is run again
(the stages it finished are recorded in RUN/auto.json):

1. prompts: the pool (train.prompts): the model's own user turns, the given prompts, tasks
   over the machine's text;
2. answers: the model answers them through our engine (train.chat_data generate);
3. tokens: the token streams, with a validation split (train.chat_data tokens);
4. features: the target's outputs the head learns from (train.heads precompute);
5. training: the head (train.heads train; bfloat16 autocast where the CPU has it);
6. validation: acceptance through the engine on the held-out chat prompts (train.heads
   validate --chat).

The head is written to --out; serve it with `python server.py --model MODEL --speculative
eagle --draft OUT` (`mtp` for an MTP head). The progress bar counts the budget; the ETA is
the budget's rest (a stage that runs past its share pushes the others back).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from train import chat_data, heads, prompts
from train.lm import TRAIN_TOKENS

log = logging.getLogger("train")

STATE = "auto.json"


@dataclass(frozen=True)
class Stage:
    name: str
    share: float  # of the budget
    run: Callable[[argparse.Namespace, float], None]  # (args, minutes)


def run_prompts(args: argparse.Namespace, minutes: float) -> None:
    prompts.main(
        ["--out", str(args.run_dir / "data" / prompts.POOL), "--model", args.model]
        + ["--self-written", str(args.self_written), "--text", str(args.text_tasks)]
        + ["--minutes", f"{minutes:.2f}"]
    )


def run_answers(args: argparse.Namespace, minutes: float) -> None:
    data = ["--data", str(args.run_dir / "data"), "--model", args.model]
    chat_data.main(data + ["generate", "--minutes", f"{minutes:.2f}"])


def run_tokens(args: argparse.Namespace, minutes: float) -> None:
    data = ["--data", str(args.run_dir / "data"), "--model", args.model]
    chat_data.main(data + ["tokens", "--run-dir", str(args.run_dir), "--text-tokens", "0"])


def run_features(args: argparse.Namespace, minutes: float) -> None:
    tokens = len(np.load(args.run_dir / TRAIN_TOKENS, mmap_mode="r"))
    eagle3 = ["--eagle3"] if args.kind == "eagle3" else []
    heads.main(
        ["precompute", "--run-dir", str(args.run_dir), "--target", args.model]
        + ["--tokens", str(tokens), "--window", str(args.window), *eagle3]
    )


def run_training(args: argparse.Namespace, minutes: float) -> None:
    heads.main(
        ["train", "--run-dir", str(args.run_dir), "--target", args.model, "--kind", args.kind]
        + ["--minutes", f"{minutes:.2f}", "--resume", "--out", str(args.out)]
    )


def run_validation(args: argparse.Namespace, minutes: float) -> None:
    heads.main(
        ["validate", "--run-dir", str(args.run_dir), "--target", args.model, "--kind", args.kind]
        + ["--head", str(args.out), "--chat", "--prompts", str(args.validate_prompts)]
        + ["--json", str(args.out / "validate.json")]
    )


STAGES = [
    Stage("prompts", 0.10, run_prompts),
    Stage("answers", 0.40, run_answers),
    Stage("tokens", 0.0, run_tokens),
    Stage("features", 0.15, run_features),
    Stage("training", 0.30, run_training),
    Stage("validation", 0.05, run_validation),
]


def read_state(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"done": [], "seconds": 0.0}


def run(args: argparse.Namespace) -> None:
    args.run_dir.mkdir(parents=True, exist_ok=True)
    state_path = args.run_dir / STATE
    state = read_state(state_path)
    budget = args.hours * 3600
    bar = tqdm(total=round(budget), initial=round(state["seconds"]), unit="s", desc="budget")
    for i, stage in enumerate(STAGES, 1):
        if stage.name in state["done"]:
            continue
        bar.set_postfix_str(f"{i}/{len(STAGES)} {stage.name}")
        log.info(
            "stage %d/%d: %s (%.0f of %.0f budget minutes spent, ETA %.0f min)",
            *(i, len(STAGES), stage.name, state["seconds"] / 60, budget / 60),
            max(budget - state["seconds"], 0) / 60,
        )
        start = time.monotonic()
        stage.run(args, stage.share * budget / 60)
        state["seconds"] += time.monotonic() - start
        state["done"].append(stage.name)
        state_path.write_text(json.dumps(state, indent=1) + "\n")
        bar.update(min(round(state["seconds"]), bar.total) - bar.n)
    bar.close()
    log.info("the head is in %s (%.0f minutes in all)", args.out, state["seconds"] / 60)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.auto", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a directory, a GGUF file or smollm2")
    p.add_argument("--hours", type=float, required=True, help="the time budget")
    p.add_argument("--out", type=Path, required=True, help="where the head is written")
    p.add_argument("--run-dir", type=Path, help="the work folder (default: OUT.run)")
    p.add_argument("--kind", default="eagle3", choices=("eagle3", "mtp", "eagle-original"))
    p.add_argument("--self-written", type=int, default=3000, help="user turns the model writes")
    p.add_argument("--text-tasks", type=int, default=2000, help="tasks over the machine's text")
    p.add_argument("--validate-prompts", type=int, default=16, help="held-out chats validated")
    p.add_argument("--window", type=int, default=512, help="tokens of a training window")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.run_dir = args.run_dir or args.out.with_name(args.out.name + ".run")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    run(args)


if __name__ == "__main__":
    main()
