"""Choose the drafter once, at start-up, from the speculative config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import SpecConfig
from models.eagle import load_eagle_head
from models.loader import load_model
from models.mtp import load_mtp_head
from stages.draft import Drafter, NgramDrafter, NoDrafter
from stages.draft_model import DraftModelDrafter
from stages.eagle_drafter import EagleDrafter
from stages.mtp_drafter import MTPDrafter


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
    if spec.method == "eagle":
        if not spec.draft:
            raise ValueError(
                "no demo EAGLE head is trained yet: name a head directory with --draft"
            )
        eagle = load_eagle_head(spec.draft, engine.model)  # one layer: a one-layer cache
        cache = engine._new_cache(eagle, engine.allocator.num_pages, engine.cache.data.dtype)
        return EagleDrafter(eagle, cache, engine.config.max_running, spec.sampled_drafts)
    if spec.method == "mtp":
        if not spec.draft:
            raise ValueError("no demo MTP head is trained yet: name a head directory with --draft")
        head = load_mtp_head(spec.draft, engine.model)
        cache = engine._new_cache(head, engine.allocator.num_pages, engine.cache.data.dtype)
        return MTPDrafter(head, cache, engine.config.max_running, spec.sampled_drafts)
    raise ValueError(f"speculative method {spec.method!r} is not available yet")
