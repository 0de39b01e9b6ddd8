"""DeepSeek-V3's decoder over a flat batch of tokens: multi-head latent attention (MLA) over a
paged cache of latents, and mixture-of-experts layers (transformers' `DeepseekV3ForCausalLM`
is the reference).

MLA runs in its absorbed form for every forward. A token's keys and values are one latent
c (kv_lora_rank wide, normed) and one rotary key k_r (qk_rope_head_dim wide), shared by every
head; head h's key is [c W_uk[h], k_r] and its value c W_uv[h]. Folding W_uk into the query,
q'[h] = [q_nope[h] W_uk[h], q_rope[h]], attention becomes one "head" of keys [c, k_r] read by
all query heads (as multi-query attention), and its output, a mix of latents, is projected by
W_uv[h] afterwards. So the paged cache holds the latent and the rotary key a token (its
num_kv_heads is 1, its head_dim kv_lora_rank + qk_rope_head_dim) and the engine's attention
backends run it unchanged; the values are the keys themselves (the output's rotary columns
are dropped), so the cache stores each token's row twice, as keys and as values. Prefill
chunks run the expanded form instead (each head's keys and values expanded from the cached
latents), whose products are smaller when there are many queries.

A MoE layer routes each token to `num_experts_per_tok` of `n_routed_experts` experts: sigmoid
scores plus a correction bias choose them, only inside the `topk_group` best of `n_group`
groups (a group's score: its two best experts'), the chosen scores (without the bias) weight
their outputs, normalised when `norm_topk_prob`, times `routed_scaling_factor`; shared experts
see every token. The first `first_k_dense_replace` layers are dense.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from models.attention import Attention, TorchPagedAttention
from models.checkpoint import (
    CONFIG,
    DTYPES,
    WEIGHTS,
    CheckpointError,
    first_id,
    iter_safetensors,
    read_config,
    to_be_loaded,
)
from models.llama import MLP, RMSNorm, rotate, run_layers

ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6
INIT_STD = 0.02  # a fresh router's and experts' weights (transformers' initializer_range)
BIAS_RATE = 1e-3  # the router bias's step towards balanced experts while training (its gamma)
# forwards of at least this many tokens (prefill chunks) run MLA expanded where they can
EXPANDED_MIN_TOKENS = 128  # the q and kv latents' norms (not the config's rms_norm_eps)


@dataclass(frozen=True)
class DeepseekConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers'
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: queries projected directly
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0  # 0: every layer dense
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # YaRN's keys, or empty
    rope_interleave: bool = True  # the rotary dimensions in pairs (x0, x1), (x2, x3), ...
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = ARCHITECTURE
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    # the paged cache's view of a token: one latent "head"
    num_kv_heads = 1

    def __post_init__(self) -> None:
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ValueError(
                    f"n_routed_experts ({self.n_routed_experts}) must be a multiple of "
                    f"n_group ({self.n_group})"
                )
            if not 0 < self.num_experts_per_tok <= self.topk_group * self.experts_per_group:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                    f"the experts of topk_group groups ({self.topk_group} x "
                    f"{self.experts_per_group})"
                )

    @property
    def head_dim(self) -> int:
        """A cached token's width: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    def is_moe(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(the query-key width), times YaRN's mscale(mscale_all_dim) squared."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        all_dim = self.rope_scaling.get("mscale_all_dim")
        if self.rope_scaling and all_dim:
            scale *= yarn_mscale(self.rope_scaling["factor"], all_dim) ** 2
        return scale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(cfg: DeepseekConfig) -> tuple[torch.Tensor, float]:
    """([qk_rope_head_dim / 2] inverse frequencies, the factor cos and sin are scaled by):
    plain, or YaRN's blend of interpolated and extrapolated frequencies."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    s = cfg.rope_scaling
    if not s:
        return inv_freq, 1.0
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high += 0.001 if low == high else 0
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention = s.get("attention_factor")
    if attention is None:
        mscale, all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
        else:
            attention = yarn_mscale(factor)
    return inv_freq, float(attention)


class DeepseekRotary(nn.Module):
    inv_freq: torch.Tensor  # [qk_rope_head_dim / 2]

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        # on the meta device (a model to be loaded) a placeholder: the loader computes it
        inv_freq, self.factor = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, qk_rope_head_dim], scaled by YaRN's factor, sin's first half
        negated (models/llama.py `rotate`)."""
        freqs = positions.float()[:, None, None] * self.inv_freq
        cos, sin = freqs.cos() * self.factor, freqs.sin() * self.factor
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


class LatentAttention(nn.Module):
    """Multi-head latent attention, absorbed (the module docstring). Loaded with the
    checkpoint's kv_b_proj, which `absorb` splits into W_uk and W_uv."""

    w_uk: torch.Tensor  # [H, qk_nope_head_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [H, v_head_dim, kv_lora_rank]

    def __init__(self, cfg: DeepseekConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.cfg = cfg
        h, heads, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        q_width = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        self.q_proj: nn.Module | None = None
        self.q_a_proj: nn.Module | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        up = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj: nn.Linear | None = nn.Linear(cfg.kv_lora_rank, up, bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=bias)
        # the backends scale scores by 1 / sqrt(head_dim); MLA's own scale is folded in here
        self.q_scale = cfg.softmax_scale * math.sqrt(cfg.head_dim)
        self.expanded_min_tokens = EXPANDED_MIN_TOKENS

    @torch.no_grad()
    def absorb(self) -> None:
        """kv_b_proj split into W_uk and W_uv (held instead of it), and with
        `rope_interleave` the rotary rows of the q and kv projections put in rotate-half
        order (evens, then odds): the rotation of pairs becomes the usual one."""
        cfg = self.cfg
        w_uk, w_uv = self._split_kv_b()
        self.register_buffer("w_uk", w_uk.contiguous(), persistent=False)
        self.register_buffer("w_uv", w_uv.contiguous(), persistent=False)
        self.kv_b_proj = None
        if not cfg.rope_interleave:
            return
        r = cfg.qk_rope_head_dim
        order = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
        q = self.q_proj if self.q_proj is not None else self.q_b_proj
        assert isinstance(q, nn.Linear)
        rows = q.weight.view(cfg.num_heads, -1, q.weight.shape[1])
        rows[:, cfg.qk_nope_head_dim :] = rows[:, cfg.qk_nope_head_dim :][:, order]
        kv = self.kv_a_proj_with_mqa
        kv.weight[cfg.kv_lora_rank :] = kv.weight[cfg.kv_lora_rank :][order]
        if kv.bias is not None:
            kv.bias[cfg.kv_lora_rank :] = kv.bias[cfg.kv_lora_rank :][order]

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk, W_uv): views of kv_b_proj's weight (training: their gradients reach it), or
        the absorbed copies."""
        if self.kv_b_proj is None:
            return self.w_uk, self.w_uv
        if self.cfg.rope_interleave:  # its rotary rows are reordered when absorbed
            raise ValueError("a model with rope_interleave runs absorbed: train without it")
        return self._split_kv_b()

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv_b_proj is not None
        w = self.kv_b_proj.weight.view(self.cfg.num_heads, -1, self.cfg.kv_lora_rank)
        w_uk, w_uv = w.split((self.cfg.qk_nope_head_dim, self.cfg.v_head_dim), 1)
        return w_uk, w_uv

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        cfg, t = self.cfg, x.shape[0]
        nope, rope, latent = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        w_uk, w_uv = self.up_projections()
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, cfg.num_heads, nope + rope).split((nope, rope), -1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split((latent, rope), -1)
        k_rope = rotate(k_rope[:, None], cos, sin)[:, 0]
        k = torch.cat((self.kv_a_layernorm(c), k_rope), -1)[:, None]  # [T, 1, latent + rope]
        q_rope = rotate(q_rope, cos, sin)
        if self.expanded(attn, t):
            assert isinstance(attn, TorchPagedAttention)
            out = self._expanded(attn, q_nope, q_rope, k, w_uk, w_uv)
        else:
            q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # W_uk folded into q
            q = torch.cat((q_latent, q_rope), -1) * self.q_scale
            out = attn(self.layer, q, k, k)[..., :latent]  # one head, keys and values alike
            out = torch.einsum("thl,hvl->thv", out, w_uv)
        return self.o_proj(out.reshape(t, cfg.num_heads * cfg.v_head_dim))

    def expanded(self, attn: Attention, tokens: int) -> bool:
        """Whether a forward runs the expanded form: a prefill chunk (at least
        `expanded_min_tokens`) through torch's paged attention."""
        torch_path = isinstance(attn, TorchPagedAttention) and attn.kernel is None
        return torch_path and tokens >= self.expanded_min_tokens

    def _expanded(
        self, attn: TorchPagedAttention, q_nope: torch.Tensor, q_rope: torch.Tensor,
        k: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """[T, H, v_head_dim]: every key and value expanded from the cached latents, each
        head attending its own (the absorbed form's result, in fewer products when there are
        many queries: scores over qk_head_dim rather than kv_lora_rank + qk_rope_head_dim)."""
        cfg, meta = self.cfg, attn.meta
        latents, _ = attn.keys(self.layer, k, k)  # [B, 1, Lmax, latent + rope]
        c, k_rope = latents[:, 0].split((cfg.kv_lora_rank, cfg.qk_rope_head_dim), -1)
        k_nope = torch.einsum("bsl,hnl->bhsn", c, w_uk)  # [B, H, Lmax, nope]
        values = torch.einsum("bsl,hvl->bhsv", c, w_uv)  # [B, H, Lmax, v]
        keys = torch.cat((k_nope, k_rope[:, None].expand(-1, cfg.num_heads, -1, -1)), -1)
        q = attn.padded(torch.cat((q_nope, q_rope), -1))  # [B * Qmax, H, qk]
        q = q.view(meta.num_seqs, meta.max_q, cfg.num_heads, -1).transpose(1, 2)
        visible = meta.visible()[:, None]  # [B, 1, Qmax, Lmax]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, scale=cfg.softmax_scale
        )
        return attn.unpadded(out.transpose(1, 2))


class Router(nn.Module):
    """Each token's experts [T, k] and their weights [T, k] (the module docstring)."""

    e_score_correction_bias: torch.Tensor  # [E]

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=INIT_STD)  # (a no-op for a model about to be loaded)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(-1, cfg.n_group, cfg.experts_per_group)
        best = groups.topk(2, -1).values.sum(-1).topk(cfg.topk_group, -1).indices  # [T, G']
        kept = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~kept.repeat_interleave(cfg.experts_per_group, 1), -math.inf)
        experts = choice.topk(cfg.num_experts_per_tok, -1).indices
        if self.training:  # DeepSeek-V3's balancing without a loss: the bias follows the load
            with torch.no_grad():
                load = torch.bincount(experts.flatten(), minlength=cfg.n_routed_experts).float()
                self.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts


class Experts(nn.Module):
    """The routed experts' weights, stacked: gate|up [E, 2I, H] and down [E, H, I]."""

    # forwards of at most this many tokens (decodes, verifies) read each token's experts by
    # gathering their weights: no shape depends on the routing, so nothing waits for the
    # host (MTP's one-token mode); longer ones (prefills) run each expert over its tokens
    gathered_max_tokens = 64

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        for p in (self.gate_up_proj, self.down_proj):  # (no-ops for a model about to be loaded)
            nn.init.normal_(p, std=INIT_STD)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] through each token's experts [T, k], their outputs summed by weights."""
        if x.shape[0] <= self.gathered_max_tokens:
            gate, up = torch.einsum("th,tkih->tki", x, self.gate_up_proj[experts]).chunk(2, -1)
            y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, self.down_proj[experts])
            return torch.einsum("tkh,tk->th", y, weights.to(y.dtype))
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():  # each expert over the tokens routed to it
            rows, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = MLP(cfg, shared) if shared else None  # type: ignore[arg-type]
        # 2: a forward's tokens (a verify's 2 x D) in two micro-batches, one after the other
        # (on GPUs the second's expert traffic overlaps the first's compute); the same rows
        self.micro_batches = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.micro_batches == 2 and x.shape[0] > 1:
            return torch.cat([self._one_pass(part) for part in x.chunk(2)])
        return self._one_pass(x)

    def _one_pass(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        return out + self.shared_experts(x) if self.shared_experts is not None else out


class DeepseekLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer: int, moe: bool):
        """`layer`: the index of its KV in the cache; `moe`: experts, else a dense MLP."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = MoE(cfg) if moe else MLP(cfg)  # type: ignore[arg-type]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    """Parameter names follow transformers' (`model.layers.0.self_attn.kv_b_proj.weight`, ...),
    the experts stacked as in its `DeepseekV3Experts`; the forward and `logits` as
    LlamaModel's, so the engine serves it alike."""

    def __init__(self, cfg: DeepseekConfig, device: torch.device | str | None = None):
        super().__init__()
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.config = cfg
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(
                DeepseekLayer(cfg, i, cfg.is_moe(i)) for i in range(cfg.num_layers)
            )
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
            self.rotary = DeepseekRotary(cfg)

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
        x, aux = run_layers(self.layers, None, x, cos, sin, attn, aux_layers)
        return self.norm(x), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, vocab] for the chosen rows hidden [R, H]."""
        return self.lm_head(hidden)


# ---------------------------------------------------------------- loading

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate")  # fmt: skip
LAYER = re.compile(r"layers\.(\d+)\.")
EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
FLOAT32_KEPT = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # the router's


def config_from_hf(d: dict[str, Any]) -> DeepseekConfig:
    """DeepseekConfig from a parsed config.json (transformers' or the published one)."""
    quant = d.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "fp8":
        raise CheckpointError(f"unsupported quantization {quant.get('quant_method')!r} (fp8 only)")
    for key, wanted in (("hidden_act", "silu"), ("scoring_func", "sigmoid"),
                        ("topk_method", "noaux_tc")):  # fmt: skip
        if d.get(key, wanted) != wanted:
            raise CheckpointError(f"unsupported {key} {d[key]!r} (only {wanted})")
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn", "deepseek_yarn"):
        raise CheckpointError(f"unsupported rope type {kind!r} (supported: default, yarn)")
    scaling = {k: params[k] for k in YARN_KEYS if params.get(k) is not None}
    if kind != "default" and not {"factor", "original_max_position_embeddings"} <= set(scaling):
        raise CheckpointError("yarn rope scaling needs factor and original_max_position_embeddings")
    try:
        return DeepseekConfig(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            q_lora_rank=d.get("q_lora_rank"),
            moe_intermediate_size=d.get("moe_intermediate_size") or 0,
            n_routed_experts=d.get("n_routed_experts") or 0,
            n_shared_experts=d.get("n_shared_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok") or 0,
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=d.get("first_k_dense_replace") or 0,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(params.get("rope_theta", d.get("rope_theta", 10000.0))),
            rope_scaling=scaling if kind != "default" else {},
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            bos_token_id=first_id(d.get("bos_token_id")),
            eos_token_id=first_id(d.get("eos_token_id")),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """A float8 weight [out, in] times its per-block scales [ceil(out / b0), ceil(in / b1)]."""
    out, inp = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out]
    return weight.float() * scale.repeat_interleave(block[1], 1)[:, :inp]


def load_deepseek(
    directory: str | Path, dtype: torch.dtype, device: torch.device | str
) -> DeepseekModel:
    """A DeepseekModel with the directory's weights (`read_state`), absorbed, in eval mode.
    The layers past `num_hidden_layers` (the MTP layer) are left to the MTP drafter."""
    d = read_config(directory)
    cfg = config_from_hf(d)
    with to_be_loaded():
        model = DeepseekModel(cfg)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]

    def main_model(name: str) -> bool:
        layer = LAYER.match(name)
        return layer is None or int(layer[1]) < cfg.num_layers

    state = read_state(directory, d, main_model)
    state = checked(state, expected, dtype, device, str(directory))
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.device(device):
        model.rotary = DeepseekRotary(cfg)  # its buffer is computed, not stored
    for attention in model.modules():
        if isinstance(attention, LatentAttention):
            attention.absorb()
    return model.eval().requires_grad_(False)


def read_state(
    directory: str | Path, d: dict[str, Any], wanted: Callable[[str], bool]
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose names (without "model.") `wanted` takes: float8
    block-quantized weights dequantized (`weight_scale_inv`), the routed experts stacked
    (one tensor each, as published and as transformers saves them, or already stacked)."""
    config = config_from_hf(d)
    block = tuple((d.get("quantization_config") or {}).get("weight_block_size", (128, 128)))
    tensors, scales = {}, {}
    for hf_name, tensor in iter_safetensors(directory):
        name = hf_name.removeprefix("model.")
        if not wanted(name.removesuffix("_scale_inv")) or tensor.numel() == 0:
            continue  # (transformers writes empty shared experts where there are none)
        if name.endswith("_scale_inv"):
            scales[name.removesuffix("_scale_inv")] = tensor
        else:
            tensors[name] = tensor
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, int, str], torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.dtype == torch.float8_e4m3fn:
            if name not in scales:
                raise CheckpointError(f"float8 tensor {name!r} has no weight_scale_inv")
            tensor = dequantize(tensor, scales[name], block)  # type: ignore[arg-type]
        elif tensor.dtype not in DTYPES.values():
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        if match := EXPERT.fullmatch(name):
            experts[(int(match[1]), int(match[2]), match[3])] = tensor
        else:
            state[name] = tensor
    return state | _stacked_experts(config, experts)


def checked(
    state: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device | str,
    source: str,
) -> dict[str, torch.Tensor]:
    """`state` checked against the expected names and shapes, in `dtype` (the router's
    weights in float32, as transformers keeps them) on `device`."""
    for name, tensor in state.items():
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {name!r} in {source}")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                f"{expected[name]}"
            )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"tensor {missing[0]!r} missing from {source}")
    return {
        name: t.to(device=device, dtype=torch.float32 if name.endswith(FLOAT32_KEPT) else dtype)
        for name, t in state.items()
    }


def _stacked_experts(
    cfg: DeepseekConfig, experts: dict[tuple[int, int, str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The per-expert weights, (layer, expert, projection) -> [out, in], stacked per layer."""
    state = {}
    for layer in {key[0] for key in experts}:
        try:
            per = [[experts.pop((layer, e, p)) for p in ("gate", "up", "down")]
                   for e in range(cfg.n_routed_experts)]  # fmt: skip
        except KeyError as missing:
            raise CheckpointError(f"layer {layer} lacks expert weights {missing.args[0]}") from None
        prefix = f"layers.{layer}.mlp.experts."
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat((g, u)) for g, u, _ in per])
        state[prefix + "down_proj"] = torch.stack([down for _, _, down in per])
    if experts:
        layer, e, proj = min(experts)
        raise CheckpointError(f"unexpected expert {e} of layer {layer} ({proj}_proj)")
    return state


# ---------------------------------------------------------------- saving


def config_to_hf(cfg: DeepseekConfig, dtype: torch.dtype, mtp_layers: int = 0) -> dict[str, Any]:
    """config.json contents transformers' DeepseekV3Config and `config_from_hf` read."""
    rope = {"rope_type": "yarn", **cfg.rope_scaling} if cfg.rope_scaling else None
    return {
        "architectures": [ARCHITECTURE], "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "n_group": cfg.n_group,
        "topk_group": cfg.topk_group, "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "first_k_dense_replace": cfg.first_k_dense_replace, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope, "rope_interleave": cfg.rope_interleave,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": mtp_layers, "torch_dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip


def published(state: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> dict:
    """Our tensors under DeepSeek's published names (`prefix` before each, the routed experts
    one tensor each), in `dtype` but the router's (float32)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach().to("cpu", torch.float32 if name.endswith(FLOAT32_KEPT) else dtype)
        if name.endswith("experts.gate_up_proj"):
            base = prefix + name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*t.chunk(2, 1), strict=True)):
                out |= {f"{base}{e}.gate_proj.weight": gate, f"{base}{e}.up_proj.weight": up}
        elif name.endswith("experts.down_proj"):
            base = prefix + name.removesuffix("down_proj")
            out |= {f"{base}{e}.down_proj.weight": down for e, down in enumerate(t)}
        else:
            out[prefix + name] = t
    return {name: t.contiguous() for name, t in out.items()}


def save_deepseek(
    model: DeepseekModel, directory: str | Path, dtype: torch.dtype = torch.bfloat16
) -> None:
    """config.json and model.safetensors of a model not yet absorbed (as trained), readable
    by `load_deepseek` and by transformers."""
    cfg = model.config
    if any(isinstance(m, LatentAttention) and m.kv_b_proj is None for m in model.modules()):
        raise ValueError("an absorbed model no longer holds kv_b_proj: save it before")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    state = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    tensors = published({n: t for n, t in state.items() if n != "lm_head.weight"}, "model.", dtype)
    if "lm_head.weight" in state:
        tensors["lm_head.weight"] = state["lm_head.weight"].detach().to("cpu", dtype)
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    (root / CONFIG).write_text(json.dumps(config_to_hf(cfg, dtype), indent=2) + "\n")


def save_mtp_layer(
    state: dict[str, torch.Tensor], directory: str | Path, dtype: torch.dtype = torch.bfloat16
) -> None:
    """An MTP head's tensors (models/mtp.py names) added to the DeepSeek checkpoint in
    `directory` as its layer `num_hidden_layers` (DeepSeek's placement and names); the layer
    there before, if any, replaced. The shared embedding and head are not copied."""
    root = Path(directory)
    d = read_config(root)
    layer = f"model.layers.{d['num_hidden_layers']}."
    tensors = {n: t for n, t in load_file(str(root / WEIGHTS)).items() if not n.startswith(layer)}
    ours = {name.removeprefix("block."): t for name, t in state.items()}
    tensors |= published(ours, layer, dtype)
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    (root / CONFIG).write_text(json.dumps(d | {"num_nextn_predict_layers": 1}, indent=2) + "\n")
