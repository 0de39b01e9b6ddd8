"""Model shapes of the demo family and the losses they are trained with."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import CausalAttention
from models.deepseek import DeepseekConfig
from models.llama import LlamaConfig, LlamaModel


def target_config(vocab_size: int, eos_id: int) -> LlamaConfig:
    """About 22M parameters: what 60 minutes of two CPU cores train reasonably."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=384,
        intermediate_size=1024,
        num_layers=12,
        num_heads=6,
        num_kv_heads=2,
        max_position_embeddings=2048,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


def draft_config(vocab_size: int, eos_id: int, num_layers: int = 1) -> LlamaConfig:
    """One layer: at batch 1 a step of our model code costs mostly per-layer overhead, and
    measured with the torch paged backend (512-token context) a 2-layer draft step cost 1/5.4
    to 1/6 of a target step, a 1-layer one 1/10 (the issue asks for at least 1/8)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=2048,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


def deepseek_config(vocab_size: int, eos_id: int) -> DeepseekConfig:
    """A DeepSeek-V3-style target small enough to commit with its MTP layer in 10 MB
    (bfloat16): latent attention, a dense first layer, then 8 experts in 2 groups, 2 a token
    and a shared one; tied embeddings; rotate-half rotary (training runs it unabsorbed)."""
    return DeepseekConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_layers=3,
        num_heads=4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        moe_intermediate_size=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        rope_interleave=False,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style: small normal weights; the residual outputs shrink with depth (the stacked
    experts of a MoE alike)."""
    residual_std = std / math.sqrt(2 * model.config.num_layers)  # type: ignore[operator]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            out_proj = name.endswith(("o_proj", "down_proj"))
            nn.init.normal_(module.weight, std=residual_std if out_proj else std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "mlp.gate.weight")):
            nn.init.normal_(param, std=std)
        elif name.endswith("experts.down_proj"):
            nn.init.normal_(param, std=residual_std)


def forward_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """[B * S, vocab] logits for ids [B, S], each row a sequence starting at position 0."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).repeat(b)
    hidden, _ = model(ids.reshape(-1), positions, CausalAttention(b, s))
    return model.logits(hidden)


def lm_loss(model: LlamaModel, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy for batch [B, S + 1]."""
    logits = forward_logits(model, batch[:, :-1])
    return F.cross_entropy(logits, batch[:, 1:].reshape(-1))


def distill_loss(
    draft: LlamaModel, target: LlamaModel, batch: torch.Tensor, hard_weight: float
) -> torch.Tensor:
    """KL(p_target || q_draft) over the full vocabulary (temperature 1), mixed with
    `hard_weight` of the ordinary next-token loss; batch [B, S + 1]."""
    ids = batch[:, :-1]
    with torch.no_grad():
        teacher = F.log_softmax(forward_logits(target, ids), dim=-1)  # [B * S, V]
    student = F.log_softmax(forward_logits(draft, ids), dim=-1)  # [B * S, V]
    kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    if hard_weight == 0:
        return kl
    hard = F.nll_loss(student, batch[:, 1:].reshape(-1))
    return (1 - hard_weight) * kl + hard_weight * hard


@torch.no_grad()
def heldout_loss(model: LlamaModel, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token loss over windows [N, S + 1], in chunks of `batch` windows."""
    model.eval()
    total = 0.0
    for chunk in windows.split(batch):
        total += lm_loss(model, chunk).item() * len(chunk)
    return total / len(windows)
