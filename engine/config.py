"""Engine configuration: frozen dataclasses, validated once, built by the CLIs."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field

# grammar: no model; a request's drafts are what its grammar implies (structured output)
SPECULATIVE_METHODS = ("none", "draft", "ngram", "suffix", "eagle", "mtp", "grammar", "hybrid")
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
    page_size: int = 16  # FlashInfer's usual page; small enough that rollback wastes little
    num_pages: int = 0  # 0: as many as `memory_fraction` of free memory holds
    # KV budget (the target's cache and a drafter's, which gets half) when num_pages is 0
    memory_bytes: int = 1 << 30
    # full pages found again by their tokens and every token before (kv/prefix.py), shared
    # between requests
    prefix_cache: bool = True
    # KV_DTYPES; "auto": float16 for a float32 model on the CPU (as llama.cpp keeps it: half
    # the bytes every attention reads, converted by F16C's instructions), else the model's
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; choose from {KV_DTYPES}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {self.page_size}")
        if self.num_pages < 0:
            raise ValueError(f"num_pages must not be negative, got {self.num_pages}")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "none"
    draft: str | None = None  # draft model / head directory; None: the built-in demo's
    num_speculative_tokens: int = 4  # k: the demo pair's acceptance peaks around 4 (bench/)
    # a sampled request's drafts are draws from the drafter's processed q (accepted with
    # min(1, p/q), far more often than the argmax's p at temperature 1): a chain's tokens, a
    # fixed tree's children (independent draws at each node, verified by the multi-draft rule);
    # an all-greedy step drafts the argmax either way, and a dynamic tree, which ranks its
    # candidates by score, always verifies top-k children (point masses)
    sampled_drafts: bool = True
    # a request's grammar masks the drafter's q too (grammar-aware drafting): no draft is spent
    # on a token the grammar forbids, and a token the grammar forces is drafted for free
    grammar_drafting: bool = True
    ngram_min: int = 1  # n-gram drafter: shortest suffix matched against the context
    ngram_max: int = 4  # longest suffix tried first
    # the cost model picks each step's k in 0..num_speculative_tokens (engine/cost.py): a fixed
    # k loses at large batch or poor acceptance, where verifying k + 1 rows costs more than
    # the accepted tokens save
    adaptive_k: bool = True
    calibration: str | None = None  # cost curves: loaded from here if present, else saved
    # a head's (EAGLE or MTP) tree drafting: a chain verifies the fewest rows; trees pay with
    # a head that accepts well (the verify batch holds tree_nodes + 1 rows per sequence)
    tree: str = "chain"
    # dynamic tree: N nodes; a verify of N + 1 rows costs more than a one-token step, and
    # the more so the larger N (docs/performance.md: One-off studies; bench/results/NOTES.md)
    tree_nodes: int = 8
    tree_depth: int = 4  # dynamic tree: levels drafted; acceptance rarely runs deeper
    tree_topk: int = 4  # dynamic tree: children per expanded node, nodes expanded per level
    tree_paths: tuple[tuple[int, ...], ...] = FIXED_TREE  # fixed tree: its nodes (8, as above)
    # hybrid: suffix decoding's draft where it expects at least hybrid_min_score accepted
    # tokens (stages/suffix.py), else the head's (a chain; its refill runs over every
    # committed token, whoever drafted it)
    hybrid_head: str = "eagle"
    hybrid_min_score: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; choose from {SPECULATIVE_METHODS}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.hybrid_head not in MODEL_DRAFTERS:
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
            raise ValueError(f"tree drafting ({self.tree}) needs a head: the eagle or mtp method")
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
        """The method whose model drafts: the method, or for hybrid its --hybrid-head."""
        return self.hybrid_head if self.method == "hybrid" else self.method

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
        return ("none", self.method) if self.method != "none" else ("none",)

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


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # Hugging Face directory of the target; None: the built-in demo
    spec: SpecConfig = field(default_factory=SpecConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    device: str = "cpu"
    # the attention backend of every forward (ATTENTION_CHOICES; `backend` resolves auto)
    attention: str = "auto"
    # a row's result depends on nothing but its own tokens: not on the other rows, the number
    # of rows or how a prompt was chunked (greedy output then equals plain decoding's with no
    # near-tie exception); slower linears at one row and blocked attention
    batch_invariant: bool = False
    # a MoE target's expert layers run each forward's tokens in this many micro-batches
    # (1 or 2: the source design's two halves of a verify batch)
    moe_micro_batches: int = 1
    # WEIGHTS: "auto" serves a GGUF file's quantized types as they are stored (a quarter to
    # an eighth of float32's bytes a forward); "int8" every linear weight-only int8 (a scale
    # an output row); "float32" and "bfloat16" everything at that dtype
    weights: str = "auto"
    # weights and activations (`torch_dtype` resolves auto): the weights' dtype where they
    # name one, else bfloat16 on CUDA, where the kernels are made for it, and float32 on the
    # CPU, where bfloat16 checkpoints are upcast
    dtype: str = "auto"
    max_running: int = 64  # bound on requests decoding at once
    max_waiting: int = 256  # bound on the waiting queue; past it submissions are refused
    max_batch_tokens: int = 512  # prefill tokens per step; longer prompts are chunked
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    pipelined: bool = True  # plan step N+1 while the device runs step N
    trace_file: str | None = None  # step timeline as JSON lines
    device_delay: float = 0.0  # tests: random delay (seconds) injected into device work
    seed: int = 0  # seeds requests that bring none
    # supervision: a loop that completes no step for this long while requests wait is hung
    # (a prefill chunk of max_batch_tokens takes well under a second on a CPU)
    watchdog_s: float = 60.0
    max_failed_steps: int = 8  # consecutive failed steps that open the circuit breaker
    tensor_parallel_size: int = 1  # ranks the target is split over (engine/parallel.py)

    def __post_init__(self) -> None:
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
        """The KV cache's dtype's name, auto resolved by the device."""
        if self.kv.dtype != "auto":
            return self.kv.dtype
        float32_cpu = self.device == "cpu" and self.torch_dtype == "float32"
        return "float16" if float32_cpu else self.torch_dtype

    @property
    def quantized(self) -> bool:
        """Whether a GGUF target is served at its own quantized types (--weights auto, on the
        CPU in float32)."""
        return self.weights == "auto" and self.device == "cpu" and self.torch_dtype == "float32"

    @property
    def backend(self) -> str:
        """The attention backend, auto resolved: FlashInfer on CUDA in a 16-bit dtype where it
        imports (the builder falls back to torch for a head size it has no kernels for)."""
        if self.attention != "auto":
            return self.attention
        cuda, half = self.device.startswith("cuda"), self.torch_dtype != "float32"
        return "flashinfer" if cuda and half and importlib.util.find_spec("flashinfer") else "torch"
