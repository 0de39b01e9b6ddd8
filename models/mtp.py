"""A DeepSeek-style multi-token-prediction (MTP) head over a Llama block, and its checkpoints.

For token t_{i+1} and the target's hidden state H_i (after the target's final norm):

    h = block(eh_proj(cat(enorm(embed(t_{i+1})), hnorm(H_i))))      # embedding first
    logits = lm_head(shared_head.norm(h))

`embed` and `lm_head` are the target's (shared, never copied); `shared_head.norm` is the head's
own RMSNorm. `h` (the block output, before `shared_head.norm`) is what the head feeds back as
the hidden state of its next chained prediction, as DeepSeek's MTP modules do.

Checkpoints use DeepSeek's names under `model.layers.{N}.`: `enorm.weight`, `hnorm.weight`,
`eh_proj.weight` [H, 2H], the block (`self_attn.*`, `mlp.*`, `input_layernorm.weight`,
`post_attention_layernorm.weight`) and `shared_head.norm.weight`; a DeepSeek layer's own
`embed_tokens` and `shared_head.head` are ignored (the target's are used). Two directory kinds
load: a standalone head (config.json with `"architectures": ["TandemMTPHead"]` and Llama fields
for the one block, tensors under `model.layers.0.`), and a Llama or DeepSeek-V3 checkpoint
carrying an MTP layer after its last layer (`num_nextn_predict_layers` >= 1, the layer at
index `num_hidden_layers`, DeepSeek's placement); a DeepSeek layer's block is latent attention
and experts (models/deepseek.py), its experts one tensor each or float8 as the target's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from core.step import TargetOutput
from models import deepseek
from models.attention import Attention
from models.checkpoint import (
    CONFIG,
    DTYPES,
    WEIGHTS,
    CheckpointError,
    iter_safetensors,
    read_config,
    to_be_loaded,
)
from models.deepseek import DeepseekConfig, DeepseekLayer, DeepseekRotary
from models.llama import (
    DecoderLayer,
    LlamaConfig,
    LlamaModel,
    NativeDecoder,
    RMSNorm,
    Rotary,
    run_layers,
)
from models.loader import config_from_hf, config_to_hf

ARCHITECTURE = "TandemMTPHead"
# tensors of a DeepSeek MTP layer that duplicate the target's (shared here, so not loaded)
SHARED_SUFFIXES = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    """Holds `norm` so that the parameter is named `shared_head.norm.weight`, as DeepSeek's."""

    def __init__(self, cfg: LlamaConfig | DeepseekConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPHead(nn.Module):
    """One MTP module. Its attention is layer 0 of whatever paged KV the caller passes in."""

    target: LlamaModel  # shared embedding and lm_head; not a submodule (not in state_dict)
    pair_offset = 1  # the pair (t_{i+1}, H_i) sits at position i + 1 (stages/head_drafter.py)
    target_layers: tuple[int, ...] = ()  # it reads the target's final hidden states only

    def __init__(self, cfg: LlamaConfig | DeepseekConfig, target: LlamaModel):
        super().__init__()
        if cfg.hidden_size != target.config.hidden_size:
            raise ValueError(
                f"MTP head hidden size {cfg.hidden_size} != target's {target.config.hidden_size}"
            )
        self.config = dataclasses.replace(cfg, num_layers=1, vocab_size=target.config.vocab_size)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block: nn.Module
        self.rotary: nn.Module
        if isinstance(self.config, DeepseekConfig):  # a DeepSeek MTP layer's block: experts
            self.block = DeepseekLayer(self.config, 0, moe=self.config.n_routed_experts > 0)
            self.rotary = DeepseekRotary(self.config)
        else:
            self.block = DecoderLayer(self.config, 0)
            self.rotary = Rotary(self.config)
        self.shared_head = SharedHead(self.config)
        self.decoder: NativeDecoder | None = None  # short forwards (prepare_for_inference)
        object.__setattr__(self, "target", target)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] token t_{i+1} of each pair
        hidden: torch.Tensor,  # [T, H] H_i: the target's (final-normed) or the head's own
        positions: torch.Tensor,  # [T] rotary position of each pair
        attn: Attention,
    ) -> torch.Tensor:
        """[T, H] block outputs (before `shared_head.norm`): the next chained hidden states."""
        embed = self.enorm(self.target.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat((embed, self.hnorm(hidden)), dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        return run_layers([self.block], self.decoder, x, cos, sin, attn)[0]

    def stack(self) -> list[DecoderLayer]:
        """The head's block, for NativeDecoder (prepare_for_inference): a Llama block's."""
        return [self.block] if isinstance(self.block, DecoderLayer) else []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, vocab] from block outputs [R, H], through the head's norm and the target's head."""
        return self.target.logits(self.shared_head.norm(hidden))

    def target_features(self, out: TargetOutput) -> torch.Tensor:
        """[T, H] H of the tokens the target ran: its hidden states after the final norm."""
        return out.hidden


def save_mtp_head(head: MTPHead, directory: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """A standalone head directory (config.json and model.safetensors) for `load_mtp_head`;
    a DeepSeek head goes into its target's checkpoint in `directory` (its MTP layer)."""
    if isinstance(head.config, DeepseekConfig):  # into the target's checkpoint, as DeepSeek's
        deepseek.save_mtp_layer(head.state_dict(), directory, dtype)
        return
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(dataclasses.replace(head.config, architecture="LlamaForCausalLM"), dtype)
    config |= {"architectures": [ARCHITECTURE], "model_type": "tandem_mtp"}
    tensors = {
        _checkpoint_name(name, 0): t.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, t in head.state_dict().items()
    }
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    (root / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def load_mtp_head(directory: str | Path, target: LlamaModel) -> MTPHead:
    """The head of a standalone head directory or of a Llama checkpoint with an MTP layer,
    sharing `target`'s embedding and lm_head, in the target's dtype and device, in eval mode."""
    d = read_config(directory)
    cfg, layer = _head_config(d, directory)
    if cfg.hidden_size != target.config.hidden_size:
        raise CheckpointError(
            f"the MTP head in {directory} has hidden size {cfg.hidden_size}, "
            f"the target {target.config.hidden_size}"
        )
    weight = target.norm.weight  # the target's device and dtype
    with to_be_loaded():
        head = MTPHead(cfg, target)
    expected = {name: tuple(p.shape) for name, p in head.state_dict().items()}
    if isinstance(cfg, DeepseekConfig):
        state = _deepseek_layer(directory, d, layer, expected, weight.dtype, weight.device)
    else:
        state = _load_layer(directory, layer, expected, weight.dtype, weight.device)
    head.load_state_dict(state, assign=True)
    with torch.device(weight.device):  # its buffer is computed, not stored
        head.rotary = DeepseekRotary(cfg) if isinstance(cfg, DeepseekConfig) else Rotary(cfg)
    if isinstance(head.block, DeepseekLayer):
        head.block.self_attn.absorb()
    return head.eval().requires_grad_(False)


def _head_config(d: dict, directory: str | Path) -> tuple[LlamaConfig | DeepseekConfig, int]:
    """(config of the head's block, index N of its `model.layers.{N}.` tensors)."""
    archs = d.get("architectures") or []
    if archs == [ARCHITECTURE]:
        return config_from_hf(d | {"architectures": ["LlamaForCausalLM"]}), 0
    if d.get("num_nextn_predict_layers", 0) >= 1:
        read = deepseek.config_from_hf if archs == [deepseek.ARCHITECTURE] else config_from_hf
        return read(d), int(d["num_hidden_layers"])
    raise CheckpointError(
        f"{directory} holds no MTP head: config.json needs architectures [{ARCHITECTURE!r}] "
        "or num_nextn_predict_layers >= 1"
    )


def _checkpoint_name(name: str, layer: int) -> str:
    """Our parameter name -> DeepSeek's (the block's parameters sit directly in the layer)."""
    return f"model.layers.{layer}.{name.removeprefix('block.')}"


def _load_layer(
    directory: str | Path,
    layer: int,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Our-named tensors of layer N, checked against `expected` names and shapes."""
    by_file_name = {_checkpoint_name(name, layer): name for name in expected}
    prefix = f"model.layers.{layer}."
    standalone = layer == 0
    state: dict[str, torch.Tensor] = {}
    for file_name, tensor in iter_safetensors(directory):
        if file_name.startswith(prefix) and file_name.endswith(SHARED_SUFFIXES):
            continue
        if file_name not in by_file_name:
            if standalone or file_name.startswith(prefix):
                raise CheckpointError(f"unexpected tensor {file_name!r} in {directory}")
            continue  # the target's own tensors, in a checkpoint that carries both
        name = by_file_name[file_name]
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {file_name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {expected[name]}"
            )
        if tensor.dtype not in DTYPES.values():
            raise CheckpointError(f"tensor {file_name!r} has unsupported dtype {tensor.dtype}")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(by_file_name) - {_checkpoint_name(n, layer) for n in state})
    if missing:
        raise CheckpointError(f"MTP tensor(s) {missing} missing from {directory}")
    return state


def _deepseek_layer(
    directory: str | Path,
    d: dict,
    layer: int,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Our-named tensors of a DeepSeek checkpoint's MTP layer N (models/deepseek.py
    `read_state`: float8 dequantized, experts stacked), checked against `expected`."""
    prefix = f"layers.{layer}."
    state = deepseek.read_state(
        directory, d, lambda n: n.startswith(prefix) and not n.endswith(SHARED_SUFFIXES)
    )
    ours = {name.removeprefix("block."): name for name in expected}
    state = {ours.get(n.removeprefix(prefix), n): t for n, t in state.items()}
    return deepseek.checked(state, expected, dtype, device, str(directory))
