"""Engine configuration: frozen dataclasses, validated once, built by the CLIs."""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATIVE_METHODS = ("none", "draft", "ngram", "eagle", "mtp")


@dataclass(frozen=True)
class KVConfig:
    page_size: int = 16  # FlashInfer's usual page; small enough that rollback wastes little
    num_pages: int = 0  # 0: as many as `memory_fraction` of free memory holds
    memory_bytes: int = 1 << 30  # KV budget (target and drafter) when num_pages is 0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {self.page_size}")
        if self.num_pages < 0:
            raise ValueError(f"num_pages must not be negative, got {self.num_pages}")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "none"
    draft: str | None = None  # draft model / head directory; None: the built-in demo's
    num_speculative_tokens: int = 4  # k: the demo pair's acceptance peaks around 4 (bench/)
    sampled_drafts: bool = False  # draft by sampling q (kept whole) instead of the argmax
    ngram_min: int = 1  # n-gram drafter: shortest suffix matched against the context
    ngram_max: int = 4  # longest suffix tried first

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

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # Hugging Face directory of the target; None: the built-in demo
    spec: SpecConfig = field(default_factory=SpecConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    device: str = "cpu"
    dtype: str = "float32"  # weights and activations; bfloat16 checkpoints are upcast on CPU
    max_running: int = 64  # bound on requests decoding at once
    max_waiting: int = 256  # bound on the waiting queue; past it submissions are refused
    max_batch_tokens: int = 512  # prefill tokens per step; longer prompts are chunked
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    pipelined: bool = True  # plan step N+1 while the device runs step N
    trace_file: str | None = None  # step timeline as JSON lines
    device_delay: float = 0.0  # tests: random delay (seconds) injected into device work
    seed: int = 0  # seeds requests that bring none

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        for name in ("max_running", "max_waiting", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must not be negative")
