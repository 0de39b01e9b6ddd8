"""Choose the drafter once, at start-up, from the speculative config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import SpecConfig
from models.eagle import EagleHead, load_eagle_head
from models.llama import prepare_for_inference
from models.loader import load_model
from models.mtp import load_mtp_head
from stages.draft import Drafter, NgramDrafter, NoDrafter
from stages.draft_model import DraftModelDrafter
from stages.eagle_drafter import DynamicTree, EagleDrafter, EagleTreeDrafter, FixedTree
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
        prepare_for_inference(model)
        if model.config.vocab_size != engine.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size}) differs from the "
                f"target's ({engine.vocab_size})"
            )
        cache = engine._new_cache(model, engine.allocator.num_pages, engine.cache.data.dtype)
        return DraftModelDrafter(model, cache, engine.config.max_running, spec.sampled_drafts)
    if spec.method == "eagle":
        eagle_dir = _head_dir(spec, engine, demo_dir / "eagle", "EAGLE")
        eagle = load_eagle_head(eagle_dir, engine.model)  # one layer: a one-layer cache
        prepare_for_inference(eagle)
        if spec.tree != "chain":
            return _eagle_tree(spec, engine, eagle)
        cache = engine._new_cache(eagle, engine.allocator.num_pages, engine.cache.data.dtype)
        return EagleDrafter(eagle, cache, engine.config.max_running, spec.sampled_drafts)
    if spec.method == "mtp":
        head = load_mtp_head(_head_dir(spec, engine, demo_dir / "mtp", "MTP"), engine.model)
        prepare_for_inference(head)
        cache = engine._new_cache(head, engine.allocator.num_pages, engine.cache.data.dtype)
        return MTPDrafter(head, cache, engine.config.max_running, spec.sampled_drafts)
    raise ValueError(f"speculative method {spec.method!r} is not available yet")


def _head_dir(spec: SpecConfig, engine: Any, demo_head: Path, name: str) -> Path:
    """The head directory given with --draft; without one, the demo's head, which fits only
    the demo target."""
    if spec.draft:
        return Path(spec.draft)
    if engine.config.model is not None:
        raise ValueError(
            f"no demo {name} head fits this target: name a head directory with --draft"
        )
    return demo_head


def _eagle_tree(spec: SpecConfig, engine: Any, head: EagleHead) -> EagleTreeDrafter:
    """A tree drafter; the head's cache gets scratch slots past the engine's pages, where each
    row's tree nodes keep their head KV while the tree is drafted."""
    shape: FixedTree | DynamicTree
    if spec.tree == "fixed":
        shape = FixedTree(spec.tree_paths, engine.device)
    else:
        shape = DynamicTree(spec.tree_depth, spec.tree_topk, engine.device)
    rows, pages = engine.config.max_running, engine.allocator.num_pages
    page_size = engine.config.kv.page_size
    scratch_pages = -(-rows * shape.scratch_size // page_size)
    cache = engine._new_cache(head, pages + scratch_pages, engine.cache.data.dtype)
    start = pages * page_size
    return EagleTreeDrafter(head, cache, rows, shape, engine.cache, start, spec.sampled_drafts)
