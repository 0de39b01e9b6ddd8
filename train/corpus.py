"""The demo models' corpus: the Python standard library shipped with the interpreter.

The file lists and the held-out prompts are recorded in this folder (paths relative to the
stdlib root) so that every later run, and every benchmark, reads exactly the same text.
Loading checks the recorded files against this interpreter's stdlib and fails loudly when they
differ, rather than silently training or measuring on something else.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_LIST = HERE / "corpus_files.txt"
HELDOUT_LIST = HERE / "heldout_files.txt"
PROMPTS_FILE = HERE / "heldout_prompts.json"

MAX_FILE_BYTES = 400 * 1024  # a handful of generated tables beyond this would dominate
HELDOUT_PERCENT = 2
NUM_PROMPTS = 64
PROMPT_CHARS = 400  # chosen by characters, so the prompts do not depend on a tokenizer
PROMPT_SEED = 1234


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """Stable across machines and Python runs (unlike `hash`)."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


def scan_stdlib(root: Path) -> list[str]:
    """Sorted posix paths, relative to `root`, of the .py files of at most MAX_FILE_BYTES."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or not path.is_file():
            continue
        if path.stat().st_size <= MAX_FILE_BYTES:
            found.append(rel)
    return sorted(found)


@dataclass(frozen=True)
class Corpus:
    """The recorded split: `train` and `heldout` are relative paths under `root`."""

    root: Path
    train: list[str]
    heldout: list[str]

    def read(self, rel_path: str) -> str:
        return (self.root / rel_path).read_text(encoding="utf-8", errors="replace")

    def texts(self, split: str) -> list[str]:
        return [self.read(p) for p in (self.train if split == "train" else self.heldout)]


def _read_list(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line]


def load_corpus(directory: Path = HERE, root: Path | None = None) -> Corpus:
    """The recorded corpus; raises if a recorded file is missing from this interpreter."""
    root = root or stdlib_root()
    train = _read_list(directory / TRAIN_LIST.name)
    heldout = _read_list(directory / HELDOUT_LIST.name)
    missing = [p for p in train + heldout if not (root / p).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} recorded corpus files are missing under {root} (first: "
            f"{missing[0]}); this interpreter's standard library differs from the one the "
            f"demo models were trained on (Python 3.11)"
        )
    return Corpus(root, train, heldout)


def choose_prompts(corpus: Corpus, count: int, chars: int, seed: int) -> list[dict]:
    """`count` snippets of `chars` characters, each starting at a line start of a held-out file.

    Only non-blank lines that leave `chars` characters after them are candidates; a fixed seed
    picks among all candidates of all held-out files, so the choice depends on nothing else.
    """
    candidates = []
    for rel in corpus.heldout:
        text = corpus.read(rel)
        offset = 0
        for line in text.splitlines(keepends=True):
            if line.strip() and offset + chars <= len(text):
                candidates.append((rel, offset))
            offset += len(line)
    picks = sorted(random.Random(seed).sample(candidates, count))
    prompts = []
    for rel, offset in picks:
        prompts.append({"file": rel, "offset": offset, "text": corpus.read(rel)[offset:][:chars]})
    return prompts


def write_corpus(directory: Path = HERE, root: Path | None = None) -> Corpus:
    """Scan the stdlib, record the split and choose the held-out prompts (before any training)."""
    root = root or stdlib_root()
    files = scan_stdlib(root)
    train = [p for p in files if not is_heldout(p)]
    heldout = [p for p in files if is_heldout(p)]
    (directory / TRAIN_LIST.name).write_text("".join(p + "\n" for p in train))
    (directory / HELDOUT_LIST.name).write_text("".join(p + "\n" for p in heldout))
    corpus = Corpus(root, train, heldout)
    prompts = choose_prompts(corpus, NUM_PROMPTS, PROMPT_CHARS, PROMPT_SEED)
    (directory / PROMPTS_FILE.name).write_text(json.dumps(prompts, indent=1) + "\n")
    return corpus


def load_prompts(path: Path = PROMPTS_FILE) -> list[str]:
    """The held-out prompt texts that every benchmark uses."""
    return [p["text"] for p in json.loads(path.read_text())]
