"""Llama-family decoder (Llama, Qwen2, Mistral) over a flat batch of tokens.

The forward returns the hidden states after the final norm; the lm_head is applied only to
the rows a caller asks for (`logits`), never to every prompt token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from models import native
from models.attention import Attention, TorchPagedAttention
from models.linear import FusedLinear, QuantLinear, TiedEmbedding, fuse_linears


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3", ...} or empty
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q, k and v
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, with llama3 scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type", "default"))
    if kind == "llama3":
        s = cfg.rope_scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope type {kind!r}")
    return inv_freq.float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos, sin [T, 1, D] (the rotate-half convention), with `sin`'s
    first half negated (`Rotary`): rotating half is then a roll, one operation instead of four,
    and the product is bit for bit the same, (-a) * b being -(a * b)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native = False  # through models/kernels.c (prepare_for_inference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return native.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, in_features: int = 0):
        """`in_features`: the width q, k and v read (0: hidden_size; EAGLE-3's layer reads 2H)."""
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        h, bias = cfg.hidden_size, cfg.attention_bias
        inp = in_features or h
        # q, k and v: the checkpoint's (training's); replaced by qkv when prepared
        self.q_proj: nn.Linear | None = nn.Linear(inp, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj: nn.Linear | None = nn.Linear(inp, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj: nn.Linear | None = nn.Linear(inp, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj: nn.Module = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)
        self.qkv: FusedLinear | QuantLinear | None = None  # q|k|v fused for inference
        self.native = False  # rotary through models/kernels.c (prepare_for_inference)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        t, heads, d = x.shape[0], (self.num_heads, self.num_kv_heads), self.head_dim
        if self.qkv is None:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            qk, v = torch.cat((self.q_proj(x), self.k_proj(x)), -1), self.v_proj(x)
        else:
            qk, v = self.qkv(x).split_with_sizes((sum(heads) * d, heads[1] * d), -1)
        # q and k rotated as one tensor: half the operations of rotating each
        qk = qk.view(t, sum(heads), d)
        qk = native.rope_(qk, cos, sin) if self.native else rotate(qk, cos, sin)
        q, k = qk.split_with_sizes(heads, 1)
        v = v.view(t, self.num_kv_heads, d)
        return self.o_proj(attn(self.layer, q, k, v).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, intermediate_size: int = 0):
        """`intermediate_size`: 0 for the config's (a MoE's shared experts have their own)."""
        super().__init__()
        self.intermediate_size = intermediate_size or cfg.intermediate_size
        # gate and up: the checkpoint's (training's); replaced by gate_up when prepared
        h, i = cfg.hidden_size, self.intermediate_size
        self.gate_proj: nn.Linear | None = nn.Linear(h, i, bias=False)
        self.up_proj: nn.Linear | None = nn.Linear(h, i, bias=False)
        self.down_proj: nn.Module = nn.Linear(i, h, bias=False)
        self.gate_up: FusedLinear | QuantLinear | None = None  # gate|up fused for inference
        self.native = False  # silu(gate) * up through models/kernels.c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            assert self.gate_up is not None
            return self.down_proj(native.silu_mul(self.gate_up(x)))
        if self.gate_up is None:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up.split(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int, input_norm: bool = True):
        super().__init__()
        self.input_layernorm: nn.Module = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        )
        self.self_attn = SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def prepare_for_inference(
    module: nn.Module, batch_invariant: bool = False, int8: bool = False
) -> None:
    """Make `module` (a model or head) ready to serve, each weight held once in the layout its
    product reads (models/linear.py): q|k|v and gate|up fused, every linear a FusedLinear
    (the originals dropped), a tied embedding read from the lm_head's weight; norms, rotary
    and silu(gate) * up through the native kernels where they can, a model's forwards of a
    few tokens through its NativeDecoder. The outputs equal the plain forward's up to float
    rounding. `batch_invariant`: a row's result the same bits however it is batched, which
    the kernels' products are (no NativeDecoder: the engine's attention is its own). `int8`:
    every linear weight-only int8 (a tied embedding stays float).
    Inference only: no backward, and the checkpoint's names are gone."""
    for sub in list(module.modules()):
        if isinstance(sub, SelfAttention) and sub.qkv is None:
            assert sub.q_proj is not None and sub.k_proj is not None and sub.v_proj is not None
            sub.qkv = FusedLinear([sub.q_proj, sub.k_proj, sub.v_proj], int8)
            sub.q_proj = sub.k_proj = sub.v_proj = None
        elif isinstance(sub, MLP) and sub.gate_up is None:
            assert sub.gate_proj is not None and sub.up_proj is not None
            sub.gate_up = FusedLinear([sub.gate_proj, sub.up_proj], int8)
            sub.gate_proj = sub.up_proj = None
    lm_head, embed = getattr(module, "lm_head", None), getattr(module, "embed_tokens", None)
    tied = (  # a model's (a head has no embedding of its own)
        isinstance(lm_head, nn.Linear)
        and isinstance(embed, nn.Embedding)
        and lm_head.weight is embed.weight
    )
    fuse_linears(module, int8)
    # (a vocabulary split over tensor-parallel ranks keeps its embedding's rows apart)
    if tied and not int8 and isinstance(module.lm_head, FusedLinear):
        module.embed_tokens = TiedEmbedding(module.lm_head)  # type: ignore[assignment]
    for kept in [*module.parameters(), *module.buffers()]:
        if kept.device.type == "cpu":  # its own memory: a checkpoint's file mapping let go
            kept.data = kept.data.clone()
    fused = [sub for sub in module.modules() if isinstance(sub, FusedLinear)]
    if batch_invariant and any(lin.blocked is None for lin in fused):
        raise ValueError("batch-invariant mode needs the native kernels (float32 on a CPU)")
    for sub in module.modules():
        if isinstance(sub, RMSNorm):
            sub.native = native.usable(sub.weight)
        elif isinstance(sub, SelfAttention | MLP):  # float32 on the CPU, as their products
            product = sub.qkv if isinstance(sub, SelfAttention) else sub.gate_up
            sub.native = product is not None and product.runs_native
    for sub in module.modules():
        if isinstance(sub, Stacked) and not batch_invariant:
            sub.decoder = NativeDecoder.of(sub.stack())


@runtime_checkable
class Stacked(Protocol):
    """A model or head whose decoder layers a NativeDecoder can run (run_layers)."""

    decoder: NativeDecoder | None

    def stack(self) -> list[DecoderLayer]: ...


def run_layers(
    layers: Iterable[nn.Module],
    decoder: NativeDecoder | None,
    x: torch.Tensor,  # [T, H]
    cos: torch.Tensor,
    sin: torch.Tensor,
    attn: Attention,
    aux_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x through the decoder layers of a model or head: by its NativeDecoder where that runs
    (a few tokens, the native attention), else layer by layer; and the outputs of
    `aux_layers`."""
    if (
        decoder is not None
        and x.shape[0] <= DECODER_MAX_TOKENS
        and isinstance(attn, TorchPagedAttention)
        and attn.kernel is not None
    ):
        return x, decoder(x, cos, sin, attn, aux_layers)
    aux = []
    for i, layer in enumerate(layers):
        x = layer(x, cos, sin, attn)
        if i in aux_layers:
            aux.append(x)
    return x, aux


DECODER_MAX_TOKENS = 64  # a forward of at most this many tokens runs through NativeDecoder


class NativeDecoder:
    """A stack of decoder layers run for a few tokens (a decode, a verify of k + 1 rows, a
    tree, a batch of them) in one native call (models/kernels.c: decode_layers): there a layer's
    dozen small torch operations cost more than its products, which the kernels' blocked
    products stream as fast as torch's."""

    def __init__(self, layers: list[DecoderLayer], table: torch.Tensor, keep: list):
        self.layers = layers
        self.table = table  # [layers, 19] int64 (kernels.c: the layer table)
        self.keep = keep  # the blocked weights the table points to
        # per choice of aux layers: [layers] uint8 flags and how many are set
        self.aux_flags: dict[tuple[int, ...], tuple[torch.Tensor, int]] = {}
        first = layers[0].self_attn
        self.shape = (first.num_heads, first.num_kv_heads, first.head_dim)
        self.inter = layers[0].mlp.intermediate_size
        self.eps = layers[0].post_attention_layernorm.eps

    @classmethod
    def of(cls, layers: list[DecoderLayer]) -> NativeDecoder | None:
        """The decoder of these prepared layers, or None where the kernels cannot run them
        (not built, not float32 on the CPU, a head size the attention kernel does not take,
        batch-invariant linears)."""
        rows: list[list[int]] = []
        keep: list[torch.Tensor] = []

        def linear(lin: nn.Module) -> list[int] | None:
            """(weight, scales, bias, code width) of a product the kernels can run."""
            if not (isinstance(lin, FusedLinear | QuantLinear) and lin.runs_native):
                return None
            bias = lin.bias.contiguous() if lin.bias is not None else None
            if isinstance(lin, QuantLinear):  # a product of parts carries its biases itself
                tensors, width = [lin.packed, None, None if lin.parts else bias], lin.form
            else:
                tensors, width = [lin.blocked, lin.scales, bias], 0
            keep.extend(t for t in tensors if t is not None)
            return [t.data_ptr() if t is not None else 0 for t in tensors] + [width]

        for layer in layers:
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            if not (attn.native and mlp.native and native.decoder_usable(attn.head_dim)):
                return None
            assert attn.qkv is not None and mlp.gate_up is not None  # prepared
            norms = [n for n in (norm, layer.post_attention_layernorm) if isinstance(n, RMSNorm)]
            if len({n.eps for n in norms}) != 1:
                return None
            products = [linear(m) for m in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)]
            if any(p is None for p in products):
                return None
            head = [
                norm.weight.data_ptr() if isinstance(norm, RMSNorm) else 0,
                layer.post_attention_layernorm.weight.data_ptr(),
                attn.layer,
            ]
            rows.append(head + [p for ptrs in products if ptrs for p in ptrs])
        return cls(layers, torch.tensor(rows, dtype=torch.int64), keep) if rows else None

    def __call__(
        self,
        x: torch.Tensor,  # [T, H], the residual stream, updated in place
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: TorchPagedAttention,
        aux_layers: tuple[int, ...],
    ) -> list[torch.Tensor]:
        """The outputs of `aux_layers` ([T, H] each); x holds the last layer's."""
        assert attn.kernel is not None
        if aux_layers not in self.aux_flags:  # built once per choice of layers
            chosen = [i for i in range(len(self.layers)) if i in aux_layers]
            flags = torch.zeros(len(self.layers), dtype=torch.uint8)
            flags[chosen] = 1
            self.aux_flags[aux_layers] = flags, len(chosen)
        every, count = self.aux_flags[aux_layers]
        out = x.new_empty(count, *x.shape)
        native.decode_layers(
            x,
            self.table,
            self.shape,
            self.inter,
            self.eps,
            cos,
            sin,
            attn.kernel,
            attn.cache.data,
            out,
            every,
        )
        return list(out.unbind(0))


class Rotary(nn.Module):
    inv_freq: torch.Tensor  # [head_dim / 2]

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # on the meta device (a model to be loaded) a placeholder: the loader computes it
        placeholder = torch.get_default_device().type == "meta"
        inv_freq = torch.empty(cfg.head_dim // 2) if placeholder else rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for positions [T], sin's first half negated (`rotate`):
        computed in float32, handed over in the activations' dtype (as transformers does)."""
        freqs = positions.float()[:, None, None] * self.inv_freq  # [T, 1, head_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype), sin.to(dtype)


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        # an nn.Embedding and nn.Linear to train and load; at inference, read where a tied or
        # quantized table is kept (models/linear.py)
        self.embed_tokens: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.lm_head: nn.Module = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.decoder: NativeDecoder | None = None  # short forwards (prepare_for_inference)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: Attention,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states after the final norm [T, H], and the outputs of `aux_layers` [T, H]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        x, aux = run_layers(self.layers, self.decoder, x, cos, sin, attn, aux_layers)
        return self.norm(x), aux

    def stack(self) -> list[DecoderLayer]:
        """The decoder layers, for NativeDecoder (prepare_for_inference)."""
        return list(self.layers)  # type: ignore[arg-type]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, vocab] for the chosen rows hidden [R, H]."""
        return self.lm_head(hidden)
