"""Engine configuration: frozen dataclasses, validated once; the one source of every flag.

A field made with `option(...)` is a command-line flag: its name (`max_running` ->
`--max-running`, or the flag it names), its type and its default are the field's, so the
command line and the library cannot disagree. `add_options` adds a dataclass's flags to a
parser; `from_options` builds the dataclass from what was parsed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------------------------------------
# Flags from fields


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: tuple[Any, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    many: bool = False,
) -> Any:
    """A dataclass field with its flag: `help` says what it does; a boolean's flag flips the
    default (`--no-prefix-cache` for a field that defaults to True); `parse` reads one value,
    `many` takes a list of them (the field holds a tuple)."""
    meta = dict(help=help, flag=flag, metavar=metavar, choices=choices, parse=parse, many=many)
    return field(default=default, metadata=meta)


def options(config: type) -> list[dataclasses.Field]:
    """The fields of a config dataclass that are flags."""
    return [f for f in dataclasses.fields(config) if "help" in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float}


def add_options(parser: argparse.ArgumentParser, config: type, title: str) -> None:
    """Add each option of `config` to `parser`, in a group of the help named `title`."""
    group = parser.add_argument_group(title)
    for f in options(config):
        meta, dest = f.metadata, f"{config.__name__}.{f.name}"
        default: Any = f.default
        if f.type == "bool":
            action = "store_false" if default else "store_true"
            group.add_argument(flag_of(f), dest=dest, action=action, help=meta["help"])
            continue
        shown = "" if default is None or meta["many"] else f" (default: {default})"
        group.add_argument(
            flag_of(f),
            dest=dest,
            default=list(default) if meta["many"] else default,
            type=meta["parse"] or PARSERS.get(str(f.type), str),
            choices=meta["choices"],
            metavar=None if meta["choices"] else meta["metavar"] or f.name.upper(),
            nargs="*" if meta["many"] else None,
            help=meta["help"] + shown,
        )


def from_options(config: type, parsed: argparse.Namespace, **given: Any) -> Any:
    """The dataclass made of what `parsed` holds for its options, and `given`."""
    values = vars(parsed)
    for f in options(config):
        value = values[f"{config.__name__}.{f.name}"]
        given[f.name] = tuple(value) if f.metadata["many"] else value
    return config(**given)


# ---------------------------------------------------------------------------------------------
# The configs

# grammar: no model; a request's drafts are what its grammar implies (structured output)
SPECULATIVE_METHODS = (
    "auto",  # per request and step, whatever pays (stages/policy.py)
    "none",
    "draft",
    "ngram",
    "suffix",
    "eagle",
    "mtp",
    "grammar",
    "hybrid",  # suffix decoding, else a model (--hybrid-head)
)
MODELLESS = ("none", "ngram", "suffix", "grammar")  # the methods that draft with no model
HEADS = ("eagle", "mtp")
MODEL_DRAFTERS = ("draft", *HEADS)  # drafters with a model and a KV cache of their own
ATTENTION_BACKENDS = ("torch", "flashinfer")  # engine/builder.py makes them
ATTENTION_CHOICES = ("auto", *ATTENTION_BACKENDS)  # auto: flashinfer on CUDA where it imports
DTYPES = ("float32", "bfloat16", "float16")
TREE_SHAPES = ("chain", "fixed", "dynamic")
# the default fixed tree: each path ranks the children taken from the root down (0: the
# drafter's top token); wide near the root, where acceptance is likeliest, then chain-like
FIXED_TREE = (
    (0,),
    (1,),
    (2,),
    (0, 0),
    (0, 1),
    (1, 0),
    (0, 0, 0),
    (0, 0, 0, 0),
)


KV_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class KVConfig:
    # FlashInfer's usual page; small enough that rollback wastes little
    page_size: int = option(16, "tokens per KV page", metavar="N")
    num_pages: int = option(0, "KV pages; 0: as many as --kv-memory-bytes holds", metavar="N")
    memory_bytes: int = option(
        1 << 30,
        "the KV budget when --num-pages is 0: the target's cache and a drafter's, which gets half",
        flag="--kv-memory-bytes",
        metavar="BYTES",
    )
    # full pages found again by their tokens and every token before (kv/prefix.py)
    prefix_cache: bool = option(
        True,
        "re-prefill every prompt whole instead of sharing the KV pages of a prefix seen "
        "before (a second turn of a chat, a common system prompt)",
        flag="--no-prefix-cache",
    )
    dtype: str = option(
        "auto",
        "the KV cache's dtype; auto: float16 for a GGUF file served at its quantized types "
        "(as llama.cpp keeps it), else the dtype the model computes in",
        flag="--kv-dtype",
        choices=KV_DTYPES,
    )

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; choose from {KV_DTYPES}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {self.page_size}")
        if self.num_pages < 0:
            raise ValueError(f"num_pages must not be negative, got {self.num_pages}")


@dataclass(frozen=True)
class SpecConfig:
    method: str = option(
        "auto",
        "how draft tokens are proposed; none: no speculation; draft: a draft model; ngram: "
        "the context's earlier text; suffix: suffix decoding over the request's context and "
        "recent outputs; eagle, mtp: a head; grammar: no model, what a request's grammar "
        "implies; hybrid: suffix where it expects to pay, else --hybrid-head; auto: each "
        "request, each step, whatever it expects to give the most tokens a second: nothing, "
        "ngram, suffix, or a model (the draft model of demo and qwen2.5-coder, or --draft "
        "as --hybrid-head says), from its own measured acceptance and the cost model",
        flag="--speculative",
        choices=SPECULATIVE_METHODS,
    )
    draft: str | None = option(
        None,
        "draft model (a directory or a .gguf file), EAGLE or MTP head; default: the demo's, "
        "the shipped heads, or the pair's draft model",
        metavar="PATH",
    )
    # k: the demo pair's acceptance peaks around 4 (bench/)
    num_speculative_tokens: int = option(
        4,
        "draft tokens a step; with the cost model, the most (MTP with 1: no-sync mode)",
        metavar="K",
    )
    # a quarter of Qwen2.5-0.5B's bytes is its lm_head over 151,936 tokens, read every draft
    # token; lossless whatever the size (the target verifies, q is 0 outside it)
    draft_vocab: int = option(
        32768,
        "a draft model's logits over this many tokens (models/vocab.py: a corpus's most "
        "frequent, then the lowest ids), the others never drafted; 0: all of them",
        metavar="N",
    )
    # a sampled request's drafts are draws from the drafter's processed q (accepted with
    # min(1, p/q), far more often than the argmax's p at temperature 1): a chain's tokens, a
    # fixed tree's children (independent draws at each node, verified by the multi-draft rule);
    # an all-greedy step drafts the argmax either way, and a dynamic tree, which ranks its
    # candidates by score, always verifies top-k children (point masses)
    sampled_drafts: bool = option(
        True,
        "chains and fixed trees: draft the drafter's top tokens for sampled requests too, "
        "instead of draws from its distribution (which the target accepts far more often "
        "at temperature > 0)",
        flag="--argmax-drafts",
    )
    # a request's grammar masks the drafter's q too (grammar-aware drafting): no draft is spent
    # on a token the grammar forbids, and a token the grammar forces is drafted for free
    grammar_drafting: bool = option(
        True,
        "structured output: drafters draft from their own distribution, not from it masked "
        "by the request's grammar (the sampler still rejects what the grammar forbids)",
        flag="--no-grammar-drafting",
    )
    ngram_min: int = option(1, "n-gram drafter: shortest suffix matched", metavar="N")
    ngram_max: int = option(4, "n-gram drafter: longest suffix, tried first", metavar="N")
    # the cost model picks each step's k in 0..num_speculative_tokens (engine/cost.py): a fixed
    # k loses at large batch or poor acceptance, where verifying k + 1 rows costs more than
    # the accepted tokens save
    adaptive_k: bool = option(
        True,
        "draft exactly K tokens every step instead of letting the cost model choose 0..K",
        flag="--fixed-k",
    )
    calibration: str | None = option(
        None, "cost model curves: read if present, else saved", metavar="PATH"
    )
    # a chain verifies the fewest rows; trees pay with a head that accepts well (the verify
    # batch holds tree_nodes + 1 rows per sequence)
    tree: str = option(
        "chain",
        "EAGLE and MTP heads: draft a chain, a fixed tree or the dynamic EAGLE-2 tree",
        choices=TREE_SHAPES,
    )
    # a verify of N + 1 rows costs more than a one-token step, and the more so the larger N
    # (docs/performance.md: One-off studies; bench/results/NOTES.md)
    tree_nodes: int = option(8, "dynamic tree: nodes verified a step", metavar="N")
    # levels drafted; acceptance rarely runs deeper
    tree_depth: int = option(4, "dynamic tree: levels drafted", metavar="D")
    tree_topk: int = option(
        4, "dynamic tree: children per expanded node, nodes expanded per level", metavar="K"
    )
    tree_paths: tuple[tuple[int, ...], ...] = option(
        FIXED_TREE,
        "fixed tree: its nodes, each the ranks taken from the root down (0.1: the top "
        "token's second child); default: 8 nodes, wide near the root",
        metavar="PATH",
        parse=lambda path: tuple(int(rank) for rank in path.split(".")),
        many=True,
    )
    # hybrid: suffix decoding's draft where it expects at least hybrid_min_score accepted
    # tokens (stages/suffix.py), else the head's (a chain; its refill runs over every
    # committed token, whoever drafted it)
    hybrid_head: str = option(
        "auto",
        "the model --speculative hybrid and auto draft with where suffix decoding (and for "
        "auto n-gram) does not: a head or the draft model; auto: the draft model where the "
        "target ships one, else for hybrid eagle, for auto --draft's eagle or none",
        choices=("auto", *MODEL_DRAFTERS),
    )
    hybrid_min_score: float = option(
        1.0, "hybrid: suffix drafts where they expect at least S tokens accepted", metavar="S"
    )

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; choose from {SPECULATIVE_METHODS}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}"
            )
        if self.draft_vocab < 0:
            raise ValueError("draft_vocab must not be negative")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.hybrid_head not in ("auto", "none", *MODEL_DRAFTERS):
            raise ValueError(
                f"unknown hybrid head {self.hybrid_head!r}; choose from {MODEL_DRAFTERS}"
            )
        if self.hybrid_min_score < 0:
            raise ValueError("hybrid_min_score must not be negative")
        self._check_tree()

    def _check_tree(self) -> None:
        if self.tree not in TREE_SHAPES:
            raise ValueError(f"unknown tree {self.tree!r}; choose from {TREE_SHAPES}")
        if self.tree != "chain" and self.method not in HEADS:
            raise ValueError(f"--tree {self.tree} needs a head: --speculative eagle or mtp")
        if not 1 <= self.tree_nodes <= 64:
            raise ValueError(f"tree_nodes must be in 1..64, got {self.tree_nodes}")
        if not 1 <= self.tree_depth <= 16 or not 1 <= self.tree_topk <= 16:
            raise ValueError("tree_depth and tree_topk must be in 1..16")
        candidates = self.tree_topk + (self.tree_depth - 1) * self.tree_topk**2
        if self.tree == "dynamic" and self.tree_nodes > candidates:
            raise ValueError(
                f"a dynamic tree of depth {self.tree_depth} and top-k {self.tree_topk} has "
                f"{candidates} candidates, fewer than tree_nodes ({self.tree_nodes})"
            )
        if self.tree == "fixed":
            check_tree_paths(self.tree_paths)

    @property
    def num_draft_tokens(self) -> int:
        """k of a speculative step: draft tokens of a chain, nodes of a tree."""
        if self.tree == "fixed":
            return len(self.tree_paths)
        return self.tree_nodes if self.tree == "dynamic" else self.num_speculative_tokens

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def drafting_model(self) -> str:
        """The method whose model drafts: the method, or for hybrid and auto --hybrid-head
        ("none" for auto without a model)."""
        return self.hybrid_head if self.method in ("hybrid", "auto") else self.method

    @property
    def head(self) -> str | None:
        """The head the method drafts with (eagle or mtp; hybrid's), None for other methods."""
        return self.drafting_model if self.drafting_model in HEADS else None

    @property
    def drafters(self) -> tuple[str, ...]:
        """What a request may ask for as its speculative_method: none, the method, and the
        hybrid's two halves."""
        if self.method == "hybrid":
            return ("none", "hybrid", "suffix", self.hybrid_head)
        if self.method == "auto":
            model = (self.hybrid_head,) if self.hybrid_head != "none" else ()
            return ("none", "auto", "ngram", "suffix", *model)
        return ("none", self.method) if self.method != "none" else ("none",)

    @property
    def drafter_names(self) -> tuple[str, str]:
        """The names of what drafts a step's rows on the device and on the host (a hybrid's
        host half is suffix decoding), as the stream reports who proposed each token."""
        return self.drafting_model, "suffix" if self.method == "hybrid" else self.method

    @property
    def keeps_cache(self) -> bool:
        """Whether the drafter keeps a KV cache of its own (a draft model or a head)."""
        return self.drafting_model in MODEL_DRAFTERS

    @property
    def one_token_mode(self) -> bool:
        """MTP with k = 1: the host plans each step before the previous one is sampled (the
        device settles the lengths), so nothing on the device waits for the host."""
        return self.method == "mtp" and self.num_speculative_tokens == 1 and self.tree == "chain"

    @property
    def picks_k(self) -> bool:
        """Whether the cost model chooses each step's k (chains with the host in the loop)."""
        return self.adaptive_k and self.tree == "chain" and not self.one_token_mode


def check_tree_paths(paths: tuple[tuple[int, ...], ...]) -> None:
    """A fixed tree: distinct non-empty paths of ranks >= 0, each one's parent path present."""
    present = set(paths)
    if not paths or len(present) != len(paths):
        raise ValueError("a fixed tree needs distinct paths")
    for path in paths:
        if not path or min(path) < 0:
            raise ValueError(f"tree path {path} must be non-empty ranks >= 0")
        if len(path) > 1 and path[:-1] not in present:
            raise ValueError(f"tree path {path} lacks its parent {path[:-1]}")


# what the weights are served as: "auto" a GGUF file at its own types (the native quantized
# products, CPU) and a Hugging Face directory at its dtype; the others convert what was loaded
WEIGHTS = ("auto", "float32", "bfloat16", "int8")
DEVICE = re.compile(r"(cpu|cuda(:\d+)?)\Z")


DEMO = "demo"  # the tiny family trained by train/ (models/demo)
SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct from its registry package
QWEN_CODER = "qwen2.5-coder"  # Qwen2.5-Coder-1.5B-Instruct drafted by its 0.5B (models/fetch.py)
WITH_DRAFT_MODEL = (DEMO, QWEN_CODER)  # the named targets that ship a draft model


@dataclass(frozen=True)
class DebugConfig:
    """What tests turn (no flags)."""

    pipelined: bool = True  # plan step N+1 while the device runs step N
    device_delay: float = 0.0  # a random delay (seconds) injected into device work
    # called as each device stage starts, with (stage name, plan, device plan): a test's
    # injected failure (it raises) or probe
    fault: Callable[[str, Any, Any], None] | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: str = option(
        SMOLLM2,
        f"target: {SMOLLM2} (SmolLM2-135M-Instruct), {DEMO} (the tiny trained family), "
        f"{QWEN_CODER} (Qwen2.5-Coder-1.5B-Instruct, its 0.5B the draft model; fetched from "
        "the registry the first time), a Hugging Face directory or a .gguf file",
    )
    spec: SpecConfig = field(default_factory=SpecConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    device: str = option("cpu", "torch device: cpu, cuda, cuda:1, ...")
    # `backend` resolves auto
    attention: str = option(
        "auto",
        "attention backend of every forward; auto: flashinfer on CUDA where it imports, else "
        "torch; flashinfer: CUDA, bfloat16 or float16 only",
        choices=ATTENTION_CHOICES,
    )
    # greedy output then equals plain decoding's with no near-tie exception; slower linears
    # at one row and blocked attention
    batch_invariant: bool = option(
        False,
        "a request's tokens depend on nothing but its own (not on the other requests, the "
        "number of rows a forward has or prompt chunking): slower, CPU float32 only",
    )
    # `graphs` resolves auto: a small forward on a GPU is launch-bound (docs/performance.md,
    # "On an H200"); the CPU's forwards gain nothing from static buffers
    cuda_graphs: str = option(
        "auto",
        "decode and verify forwards over static buffers per batch and context bucket, "
        "captured as CUDA graphs and replayed each step (MTP's one-token step whole): auto "
        "(on on CUDA, with the torch attention backend), on (also with --attention "
        "flashinfer; on the CPU the same buffers run eagerly), off",
        choices=("auto", "on", "off"),
    )
    # 2: the source design's two halves of a verify batch
    moe_micro_batches: int = option(
        1,
        "a MoE target's expert layers run each forward's tokens in this many parts",
        choices=(1, 2),
    )
    # auto: a quarter to an eighth of float32's bytes a forward for a quantized file
    weights: str = option(
        "auto",
        "auto: a .gguf file served at its own quantized types (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, "
        "Q6_K by the native kernels on the CPU; other types dequantized, named in the start "
        "log), a Hugging Face directory at its dtype; float32, bfloat16, int8 (weight-only, a "
        "scale an output row, CPU only): whatever was loaded converted to that",
        choices=WEIGHTS,
    )
    # `torch_dtype` resolves auto: the weights' dtype where they name one, else bfloat16 on
    # CUDA, where the kernels are made for it, and float32 on the CPU, where bfloat16
    # checkpoints are upcast
    dtype: str = option(
        "auto",
        "weights and activations: auto (bfloat16 on CUDA, float32 on the CPU), float32, "
        "bfloat16 or float16",
        choices=("auto", *DTYPES),
    )
    max_running: int = option(64, "requests decoding at once", metavar="N")
    max_waiting: int = option(256, "waiting requests; past them: 503", metavar="N")
    max_batch_tokens: int = option(
        512, "prefill tokens a step; longer prompts are chunked", metavar="N"
    )
    max_model_len: int = option(0, "context in tokens; 0: the model's", metavar="N")
    trace_file: str | None = option(
        None, "write the step timeline to this file, as JSON lines", metavar="PATH"
    )
    seed: int = option(0, "seed of the requests that bring none", metavar="N")
    # a prefill chunk of max_batch_tokens takes well under a second on a CPU
    watchdog_s: float = option(
        60.0,
        "exit (status 1) when no step completes for S seconds while requests wait",
        flag="--watchdog-seconds",
        metavar="S",
    )
    max_failed_steps: int = option(8, "consecutive failed steps that stop the engine", metavar="N")
    tensor_parallel_size: int = option(
        1,
        "ranks the target is split over: N processes on this machine (gloo), or the group "
        "torchrun started; Hugging Face directories in float32/bfloat16 only; k is fixed",
        metavar="N",
    )

    def __post_init__(self) -> None:
        self._resolve_spec()
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.tensor_parallel_size > 1 and (
            self.device != "cpu" or self.weights == "int8" or self.batch_invariant
        ):
            raise ValueError(
                "tensor parallelism runs float weights on the CPU (gloo) only: not with "
                "--weights int8, --batch-invariant or a CUDA device yet"
            )
        if not DEVICE.match(self.device):
            raise ValueError(f"unknown device {self.device!r}: cpu, cuda or cuda:N")
        if self.watchdog_s <= 0 or self.max_failed_steps < 1:
            raise ValueError("watchdog_s must be > 0 and max_failed_steps at least 1")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"unknown attention backend {self.attention!r}; choose from {ATTENTION_CHOICES}"
            )
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose auto or from {DTYPES}")
        if self.backend == "flashinfer" and not self.device.startswith("cuda"):
            raise ValueError("--attention flashinfer runs on CUDA only: use torch on the CPU")
        if self.backend == "flashinfer" and self.torch_dtype == "float32":
            raise ValueError(
                "FlashInfer has no float32 kernels: --dtype bfloat16 or float16 with it"
            )
        if self.moe_micro_batches not in (1, 2):
            raise ValueError(f"moe_micro_batches must be 1 or 2, got {self.moe_micro_batches}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs is auto, on or off, not {self.cuda_graphs!r}")
        if self.graphs and self.batch_invariant:
            raise ValueError("--cuda-graphs with --batch-invariant: not yet (--cuda-graphs off)")
        if self.graphs and self.tensor_parallel_size > 1:
            raise ValueError("--cuda-graphs with tensor parallelism: not yet (--cuda-graphs off)")
        if self.batch_invariant and self.backend != "torch":
            raise ValueError("batch-invariant mode runs the torch attention backend only")
        if self.weights not in WEIGHTS:
            raise ValueError(f"unknown weights {self.weights!r}; choose from {WEIGHTS}")
        if self.weights == "int8" and (self.batch_invariant or self.device != "cpu"):
            raise ValueError("--weights int8 runs on the CPU, without --batch-invariant")
        kv = self.kv.dtype
        if kv not in ("auto", self.torch_dtype) and self.torch_dtype != "float32":
            raise ValueError(f"a {self.torch_dtype} model keeps its KV cache in {self.torch_dtype}")
        named = self.weights in ("float32", "bfloat16")
        if named and self.dtype not in ("auto", self.weights):
            raise ValueError(f"--weights {self.weights} with --dtype {self.dtype}: pick one")
        for name in ("max_running", "max_waiting", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must not be negative")

    def _resolve_spec(self) -> None:
        """The model that hybrid and auto draft with where --hybrid-head is auto: the draft
        model where the target ships one; else the EAGLE head for hybrid, and for auto the
        head --draft names or none (the shipped heads of SmolLM2 do not pay: docs/models.md;
        auto then weighs n-gram and suffix decoding alone). Set once, here, before anyone
        reads it: the config is frozen."""
        spec = self.spec
        if spec.hybrid_head == "auto":
            if self.model in WITH_DRAFT_MODEL:
                head = "draft"
            else:
                head = "eagle" if spec.method == "hybrid" or spec.draft else "none"
            spec = dataclasses.replace(spec, hybrid_head=head)
        object.__setattr__(self, "spec", spec)

    @property
    def torch_dtype(self) -> str:
        """The dtype's name, auto resolved by the device."""
        if self.dtype != "auto":
            return self.dtype
        if self.weights in ("float32", "bfloat16"):
            return self.weights
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def kv_torch_dtype(self) -> str:
        """The KV cache's dtype's name, auto resolved by what was loaded."""
        return self.kv_dtype_choice[0]

    @property
    def kv_dtype_choice(self) -> tuple[str, str]:
        """The KV cache's dtype's name and why it is that one (the start log says both)."""
        if self.kv.dtype != "auto":
            return self.kv.dtype, "--kv-dtype"
        if self.quantized and self.gguf:
            # as llama.cpp keeps it: half the bytes every attention reads, and a model already
            # rounded to a few bits a weight
            return "float16", "a GGUF file served at its quantized types"
        return self.torch_dtype, "the dtype the model computes in"

    @property
    def gguf(self) -> bool:
        """Whether the target is a GGUF file (the named models other than the demo are)."""
        return self.model in (SMOLLM2, QWEN_CODER) or str(self.model).endswith(".gguf")

    @property
    def quantized(self) -> bool:
        """Whether a GGUF target is served at its own quantized types (--weights auto, on the
        CPU in float32)."""
        return self.weights == "auto" and self.device == "cpu" and self.torch_dtype == "float32"

    @property
    def graphs(self) -> bool:
        """Whether decode forwards run over static buffers (CUDA graphs), auto resolved: on
        CUDA, unless FlashInfer, batch invariance or tensor parallelism is asked for
        (FlashInfer's forwards under graphs are asked for by `--cuda-graphs on`: they have
        not yet run on a GPU)."""
        if self.cuda_graphs != "auto":
            return self.cuda_graphs == "on"
        eager = self.attention == "flashinfer" or self.batch_invariant
        return self.device.startswith("cuda") and not eager and self.tensor_parallel_size == 1

    @property
    def backend(self) -> str:
        """The attention backend, auto resolved: FlashInfer on CUDA in a 16-bit dtype where it
        imports and no graphs are captured (graphs' default is torch's attention, the one
        proven under them); the builder falls back to torch for a head size it has no
        kernels for."""
        if self.attention != "auto":
            return self.attention
        cuda, half = self.device.startswith("cuda"), self.torch_dtype != "float32"
        usable = cuda and half and not self.graphs
        return "flashinfer" if usable and importlib.util.find_spec("flashinfer") else "torch"


ROUTINGS = ("prefix", "ray")  # engine/router.py: ours by prompt prefix; Ray Serve's default


@dataclass(frozen=True)
class ReplicasConfig:
    """Engine replicas on Ray Serve behind one endpoint (engine/replicas.py); 0: none, one
    engine in the server's own process, and Ray is never imported."""

    replicas: int = option(0, "engine replicas on Ray Serve behind the endpoint", metavar="N")
    ray_address: str | None = option(
        None,
        "a running Ray cluster to join (ray start --head); default: a local one",
        metavar="ADDR",
    )
    # Ray's default of 1 CPU a replica leaves a 2-core machine room for 2 replicas only
    replica_cpus: float = option(1.0, "CPUs Ray reserves for each replica", metavar="C")
    replica_threads: int = option(
        0, "torch threads of each replica; 0: its CPUs, at least 1", metavar="N"
    )
    routing: str = option(
        "prefix",
        "prefix: to the replica holding the prompt's prefix while it is not overloaded, else "
        "the least loaded; ray: Ray Serve's default (two random replicas, the less loaded)",
        flag="--replica-routing",
        choices=ROUTINGS,
    )
    # a replica more than this many requests busier than the idlest loses its prefixes' turn
    imbalance: int = option(
        4,
        "requests a prefix's replica may run past the idlest",
        flag="--replica-imbalance",
        metavar="N",
    )

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.replica_threads < 0 or self.imbalance < 0:
            raise ValueError("replicas, replica_threads and imbalance must not be negative")
        if self.replica_cpus <= 0:
            raise ValueError("replica_cpus must be > 0")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; choose from {ROUTINGS}")

    @property
    def threads(self) -> int:
        """Each replica's torch threads, 0 resolved by its CPUs."""
        return self.replica_threads or max(1, int(self.replica_cpus))
