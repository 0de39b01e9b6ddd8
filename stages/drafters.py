"""Choose the drafter once, at start-up, from the speculative config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import SpecConfig
from models.loader import load_model
from stages.draft import Drafter, NgramDrafter, NoDrafter
from stages.draft_model import DraftModelDrafter


def build_drafter(spec: SpecConfig, engine: Any, demo_dir: Path) -> Drafter:
    """The drafter for `spec.method`; `engine` supplies the target, device and KV geometry."""
    if spec.method == "none":
        return NoDrafter()
    if spec.method == "ngram":
        return NgramDrafter(spec.ngram_min, spec.ngram_max)
    if spec.method == "draft":
        directory = Path(spec.draft) if spec.draft else demo_dir / "draft"
        model = load_model(directory, engine.model.embed_tokens.weight.dtype, engine.device)
        if model.config.vocab_size != engine.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size}) differs from the "
                f"target's ({engine.vocab_size})"
            )
        cache = engine._new_cache(model, engine.allocator.num_pages, engine.cache.data.dtype)
        return DraftModelDrafter(model, cache, engine.config.max_running, spec.sampled_drafts)
    raise ValueError(f"speculative method {spec.method!r} is not available yet")
