"""The EAGLE head: one decoder layer over the target's features and the next tokens' embeddings.

Pairing: head input i is `fc(cat(embed(t_{i+1}), f_i))`, where f_i is the target's hidden state
after its final norm at position i; the head's output at i is its guess of f_{i+1}, and the
target's lm_head turns it into the distribution of t_{i+2}. The embedding and the lm_head are
the target's (shared, never stored with the head).

Two layouts:
- SafeAILab EAGLE-1: `fc.weight` [H, 2H] (and `fc.bias` when trained with one), `layers.0.*`
  without `input_layernorm`, no final norm (a checkpoint's `embed_tokens.weight` is ignored);
- ours, `"eagle_norms": true` in config.json: the layer's input norm and a final `norm.weight`
  before the lm_head, so the output lands in the space the target's lm_head expects.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from models.attention import Attention
from models.llama import (
    DecoderLayer,
    LlamaConfig,
    LlamaModel,
    NativeDecoder,
    RMSNorm,
    Rotary,
    run_layers,
)
from models.loader import (
    CONFIG,
    WEIGHTS,
    CheckpointError,
    config_from_hf,
    config_to_hf,
    read_config,
    read_safetensors,
)

NORMS_KEY = "eagle_norms"  # config.json flag of our normed variant
TORCH_WEIGHTS = "pytorch_model.bin"  # SafeAILab's usual file
# tensors some checkpoints carry that the head does not own or recomputes
IGNORED = ("embed_tokens.weight", "layers.0.self_attn.rotary_emb.inv_freq")


class EagleHead(nn.Module):
    """The head's own weights; `target` lends its embedding and lm_head (not a submodule, so
    the head's state_dict holds only the head's tensors)."""

    target: LlamaModel

    def __init__(self, cfg: LlamaConfig, target: LlamaModel, norms: bool, fc_bias: bool):
        super().__init__()
        if cfg.hidden_size != target.config.hidden_size:
            raise CheckpointError(
                f"the EAGLE head's hidden size ({cfg.hidden_size}) differs from the "
                f"target's ({target.config.hidden_size})"
            )
        self.config = cfg
        self.norms = norms
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, input_norm=norms)])
        self.norm: nn.Module = RMSNorm(h, cfg.rms_norm_eps) if norms else nn.Identity()
        self.rotary = Rotary(cfg)
        self.decoder: NativeDecoder | None = None  # short forwards (prepare_for_inference)
        object.__setattr__(self, "target", target)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] t_{i+1}
        features: torch.Tensor,  # [T, H] f_i (target's, or the head's own fed back)
        positions: torch.Tensor,  # [T] i
        attn: Attention,
    ) -> torch.Tensor:
        """[T, H] the head's features: what the lm_head reads and what drafting feeds back."""
        embeds = self.target.embed_tokens(input_ids)  # [T, H]
        x = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        cos, sin = self.rotary(positions)
        x, _ = run_layers(self.layers, self.decoder, x, cos, sin, attn)
        return self.norm(x)

    def stack(self) -> list[DecoderLayer]:
        """The head's layer, for NativeDecoder (prepare_for_inference)."""
        return list(self.layers)  # type: ignore[arg-type]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[R, vocab] from the head's features [R, H], through the target's lm_head."""
        return self.target.logits(features)


def save_eagle_head(
    head: EagleHead, directory: str | Path, dtype: torch.dtype = torch.float32
) -> None:
    """Write config.json (with the norms flag) and model.safetensors of the head's own tensors."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(head.config, dtype) | {"num_hidden_layers": 1, NORMS_KEY: head.norms}
    tensors = {
        name: t.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, t in head.state_dict().items()
    }
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    with open(root / CONFIG, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def load_eagle_head(
    directory: str | Path,
    target: LlamaModel,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> EagleHead:
    """An EagleHead from a SafeAILab directory or one written by save_eagle_head, in eval mode,
    in the target's dtype and device unless told otherwise."""
    raw = read_config(directory)
    norms = bool(raw.get(NORMS_KEY, False))
    cfg = config_from_hf(raw | {"num_hidden_layers": 1})
    state = {k: v for k, v in _read_weights(directory).items() if k not in IGNORED}
    weight = target.embed_tokens.weight
    head = EagleHead(cfg, target, norms, fc_bias="fc.bias" in state)
    _check_state(head, state, directory)
    head.load_state_dict(state)
    head.to(device=device or weight.device, dtype=dtype or weight.dtype)
    head.rotary = Rotary(cfg).to(device or weight.device)  # its buffer stays float32
    return head.eval().requires_grad_(False)


def _read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of pytorch_model.bin (SafeAILab's usual file) when present, else of
    model.safetensors or its shards; names without a "model." prefix."""
    root = Path(directory)
    if (root / TORCH_WEIGHTS).is_file():
        state = torch.load(root / TORCH_WEIGHTS, map_location="cpu", weights_only=True)
        return {name.removeprefix("model."): t for name, t in state.items()}
    return {name.removeprefix("model."): t for name, t in read_safetensors(directory).items()}


def _check_state(head: EagleHead, state: dict[str, torch.Tensor], directory: str | Path) -> None:
    """CheckpointError naming every missing, unexpected and mis-shaped tensor."""
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{name} {tuple(t.shape)} (expected {expected[name]})"
        for name, t in sorted(state.items())
        if name in expected and tuple(t.shape) != expected[name]
    ]
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if unexpected:
        problems.append(f"unexpected {unexpected}")
    if shapes:
        problems.append(f"mis-shaped {shapes}")
    if problems:
        kind = "normed (eagle_norms)" if head.norms else "SafeAILab EAGLE-1"
        raise CheckpointError(f"EAGLE head in {directory} ({kind} layout): " + "; ".join(problems))
