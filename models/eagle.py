"""The EAGLE heads: one decoder layer over the target's features and the next tokens' embeddings.

Pairing: head input i is `fc(cat(embed(t_{i+1}), f_i))`, where f_i is the target's hidden state
after its final norm at position i; the head's output at i is its guess of f_{i+1}, and the
target's lm_head turns it into the distribution of t_{i+2}. The embedding and the lm_head are
the target's (shared, never stored with the head).

Two layouts:
- SafeAILab EAGLE-1: `fc.weight` [H, 2H] (and `fc.bias` when trained with one), `layers.0.*`
  without `input_layernorm`, no final norm (a checkpoint's `embed_tokens.weight` is ignored);
- ours, `"eagle_norms": true` in config.json: the layer's input norm and a final `norm.weight`
  before the lm_head, so the output lands in the space the target's lm_head expects.

EAGLE-3 (`Eagle3Head`) reads three of the target's layers instead of its last: f_i is
`fc(cat(a_i, b_i, c_i))` [H, 3H] over the residual stream entering the layers named by
`eagle_aux_hidden_state_layer_ids` (vLLM's convention; by default 2, L/2 and L-3). Its layer's
attention reads `cat(input_layernorm(embed(t_{i+1})), hidden_norm(f_i))` [2H] while f_i is the
residual; its own final `norm` and `lm_head` [draft_vocab, H] give logits over a reduced draft
vocabulary, draft id d standing for target id d + d2t[d] (`t2d` [vocab] marks the target ids
kept). Later draft steps feed back the layer's output (before the norm). Two layouts load:
SpecForge's (`midlayer.*`, `draft_vocab_size` and `eagle_config` in config.json; what vLLM
reads) and the `speculators` package's (`layers.0.*`, `transformer_layer_config`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from core.step import TargetOutput
from models.attention import Attention
from models.checkpoint import CONFIG, WEIGHTS, CheckpointError, read_config, read_safetensors
from models.llama import (
    MLP,
    DecoderLayer,
    LlamaConfig,
    LlamaModel,
    NativeDecoder,
    RMSNorm,
    Rotary,
    SelfAttention,
    run_layers,
)
from models.loader import config_from_hf, config_to_hf

NORMS_KEY = "eagle_norms"  # config.json flag of our normed variant
TORCH_WEIGHTS = "pytorch_model.bin"  # SafeAILab's usual file
# tensors some checkpoints carry that the head does not own or recomputes
IGNORED = ("embed_tokens.weight", "layers.0.self_attn.rotary_emb.inv_freq")


class EagleHead(nn.Module):
    """The head's own weights; `target` lends its embedding and lm_head (not a submodule, so
    the head's state_dict holds only the head's tensors)."""

    target: LlamaModel
    pair_offset = 0  # the pair (t_{i+1}, f_i) sits at position i (stages/head_drafter.py)

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
        cos, sin = self.rotary(positions, x.dtype)
        x, _ = run_layers(self.layers, self.decoder, x, cos, sin, attn)
        return self.norm(x)

    def stack(self) -> list[DecoderLayer]:
        """The head's layer, for NativeDecoder (prepare_for_inference)."""
        return list(self.layers)  # type: ignore[arg-type]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[R, vocab] from the head's features [R, H], through the target's lm_head."""
        return self.target.logits(features)

    @property
    def target_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the head reads besides the final hidden states: none."""
        return ()

    def target_features(self, out: TargetOutput) -> torch.Tensor:
        """[T, H] f of the tokens the target ran: its hidden states after the final norm."""
        return out.hidden


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
) -> EagleHead | Eagle3Head:
    """An EagleHead from a SafeAILab directory or one written by save_eagle_head (or an
    Eagle3Head from an EAGLE-3 directory), in eval mode, in the target's dtype and device
    unless told otherwise."""
    raw = read_config(directory)
    if is_eagle3(raw):
        return load_eagle3_head(directory, raw, target, dtype, device)
    norms = bool(raw.get(NORMS_KEY, False))
    cfg = config_from_hf(raw | {"num_hidden_layers": 1})
    state = {k: v for k, v in _read_weights(directory).items() if k not in IGNORED}
    weight = target.norm.weight  # the target's device and dtype
    head = EagleHead(cfg, target, norms, fc_bias="fc.bias" in state)
    kind = "normed (eagle_norms)" if norms else "SafeAILab EAGLE-1"
    _check_state(head, state, directory, kind)
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


def _check_state(
    head: nn.Module, state: dict[str, torch.Tensor], directory: str | Path, kind: str
) -> None:
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
        raise CheckpointError(f"EAGLE head in {directory} ({kind} layout): " + "; ".join(problems))


EAGLE3_ARCH = "LlamaForCausalLMEagle3"  # SpecForge's config.json architecture
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
SPECULATORS_PREFIX = "layers.0."  # the speculators package's name for the layer
MIDLAYER = "midlayer."
# speculators' config flags for variants this head does not implement
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's usual low, middle and high layers (vLLM's and SpecForge's default)."""
    return 2, num_layers // 2, num_layers - 3


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over `cat(input_layernorm(embeds), hidden_norm(f))`
    [2H], with f (or, with `norm_before_residual`, hidden_norm(f)) as the residual."""

    def __init__(self, cfg: LlamaConfig, norm_before_residual: bool = False):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, 0, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]
        features: torch.Tensor,  # [T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: Attention,
    ) -> torch.Tensor:
        normed = self.hidden_norm(features)
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        residual = normed if self.norm_before_residual else features
        x = residual + self.self_attn(x, cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """EAGLE-3's own weights (module docstring); `target` lends the embedding, and the
    lm_head when the head has none of its own (`shared_lm_head`: a draft vocabulary equal to
    the target's, written without an lm_head)."""

    target: LlamaModel
    pair_offset = 0  # the pair (t_{i+1}, f_i) sits at position i (stages/head_drafter.py)
    d2t: torch.Tensor  # [draft_vocab] int64: target id - draft id
    t2d: torch.Tensor  # [vocab] bool: the target ids of the draft vocabulary
    draft_ids: torch.Tensor  # [draft_vocab] int64: target id of each draft id

    def __init__(
        self,
        cfg: LlamaConfig,
        target: LlamaModel,
        aux_layers: tuple[int, ...],
        draft_vocab: int,
        shared_lm_head: bool = False,
        norm_before_residual: bool = False,
    ):
        super().__init__()
        h, layers, vocab = cfg.hidden_size, target.config.num_layers, target.config.vocab_size
        if h != target.config.hidden_size:
            raise CheckpointError(
                f"the EAGLE-3 head's hidden size ({h}) differs from the target's "
                f"({target.config.hidden_size})"
            )
        rising = list(aux_layers) == sorted(set(aux_layers))
        if not (aux_layers and rising and 0 < aux_layers[0] and aux_layers[-1] <= layers):
            raise CheckpointError(
                f"EAGLE-3 {AUX_KEY} {list(aux_layers)} must rise within 1 .. {layers} (the "
                f"residual stream entering each layer, {layers}: the last one's output)"
            )
        if not 0 < draft_vocab <= vocab or (shared_lm_head and draft_vocab != vocab):
            raise CheckpointError(
                f"EAGLE-3 draft vocabulary {draft_vocab} does not fit the target's {vocab}"
                + (" (a shared lm_head needs the whole vocabulary)" if shared_lm_head else "")
            )
        self.config = cfg
        self.aux_layers = tuple(aux_layers)
        self.fc = nn.Linear(len(aux_layers) * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg, norm_before_residual)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = None if shared_lm_head else nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool))
        self.register_buffer("draft_ids", torch.arange(draft_vocab), persistent=False)
        self.rotary = Rotary(cfg)
        object.__setattr__(self, "target", target)

    @property
    def reduced(self) -> bool:
        return self.d2t.numel() < self.t2d.numel()

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary as the sorted target ids [draft_vocab] it keeps."""
        ids = target_ids.sort().values.to(self.d2t.device)
        if ids.numel() != self.d2t.numel() or ids.unique().numel() != ids.numel():
            raise ValueError(f"a draft vocabulary needs {self.d2t.numel()} distinct target ids")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        self.draft_ids = ids

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs are the residual stream entering `aux_layers`."""
        return tuple(i - 1 for i in self.aux_layers)

    def target_features(self, out: TargetOutput) -> torch.Tensor:
        """[T, H] f of the tokens the target ran: fc over its `target_layers` outputs."""
        assert out.aux is not None, "the verifier ran without the head's target layers"
        return self.fuse(out.aux)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, H] from the target's layer outputs concatenated [T, 3H]."""
        return self.fc(aux.to(self.norm.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] t_{i+1}
        features: torch.Tensor,  # [T, H] f_i (fused target layers, or the head's own fed back)
        positions: torch.Tensor,  # [T] i
        attn: Attention,
    ) -> torch.Tensor:
        """[T, H] the layer's output before the final norm: what drafting feeds back."""
        embeds = self.target.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, embeds.dtype)
        return self.midlayer(embeds, features.to(embeds.dtype), cos, sin, attn)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[R, draft_vocab] over the draft vocabulary (training's view)."""
        normed = self.norm(features)
        if self.lm_head is None:
            return self.target.logits(normed)
        return self.lm_head(normed)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[R, vocab] over the target's vocabulary: -inf outside the draft vocabulary, so
        drafts, their q and the coupling's argmax all stay inside it."""
        small = self.draft_logits(features)
        if not self.reduced:
            return small
        full = small.new_full((small.shape[0], self.t2d.numel()), float("-inf"))
        return full.index_copy_(1, self.draft_ids, small)


def save_eagle3_head(
    head: Eagle3Head, directory: str | Path, dtype: torch.dtype = torch.float32
) -> None:
    """config.json and model.safetensors in SpecForge's layout (`midlayer.*`, d2t, t2d)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(head.config, dtype) | {
        "architectures": [EAGLE3_ARCH],
        "num_hidden_layers": 1,
        "vocab_size": head.t2d.numel(),
        "tie_word_embeddings": False,  # the lm_head is the head's own, or the target's
        "draft_vocab_size": head.d2t.numel(),
        "eagle_config": {AUX_KEY: list(head.aux_layers)},
        "norm_before_residual": head.midlayer.norm_before_residual,
    }
    tensors = {}
    for name, t in head.state_dict().items():
        keep = t.dtype if t.dtype in (torch.int64, torch.bool) else dtype
        tensors[name] = t.detach().to(device="cpu", dtype=keep).contiguous()
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    with open(root / CONFIG, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def is_eagle3(raw: dict) -> bool:
    archs = raw.get("architectures") or []
    return raw.get("speculators_model_type") == "eagle3" or EAGLE3_ARCH in archs


def load_eagle3_head(
    directory: str | Path, raw: dict, target: LlamaModel, dtype=None, device=None
) -> Eagle3Head:
    """An Eagle3Head from either layout (module docstring), in eval mode."""
    layer_cfg = raw.get("transformer_layer_config") or raw  # speculators nests the layer's
    bad = [flag for flag in UNSUPPORTED_FLAGS if raw.get(flag)]
    if bad:
        raise CheckpointError(f"EAGLE-3 head in {directory}: {bad} are not supported")
    aux = raw.get(AUX_KEY) or (raw.get("eagle_config") or {}).get(AUX_KEY)
    aux = tuple(aux) if aux else default_aux_layers(target.config.num_layers)
    vocab = layer_cfg.get("vocab_size", target.config.vocab_size)
    if vocab != target.config.vocab_size:
        raise CheckpointError(
            f"EAGLE-3 head in {directory} is for a vocabulary of {vocab}, the target's has "
            f"{target.config.vocab_size}"
        )
    cfg = config_from_hf(
        layer_cfg | {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    )
    state = {
        MIDLAYER + k.removeprefix(SPECULATORS_PREFIX) if k.startswith(SPECULATORS_PREFIX) else k: v
        for k, v in _read_weights(directory).items()
        if k not in IGNORED and not k.endswith("rotary_emb.inv_freq")
    }
    draft_vocab = raw.get("draft_vocab_size") or vocab
    head = Eagle3Head(
        cfg,
        target,
        aux,
        draft_vocab,
        shared_lm_head="lm_head.weight" not in state,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )
    if draft_vocab == vocab:  # speculators and SpecForge write no mapping for a full vocabulary
        state.setdefault("d2t", head.d2t)
        state.setdefault("t2d", head.t2d)
    _check_state(head, state, directory, "EAGLE-3")
    head.load_state_dict(state)
    ids = torch.arange(draft_vocab) + head.d2t
    distinct = ids.unique().numel() == draft_vocab and 0 <= int(ids.min()) <= int(ids.max()) < vocab
    if not (distinct and bool(head.t2d[ids].all()) and int(head.t2d.sum()) == draft_vocab):
        raise CheckpointError(f"EAGLE-3 head in {directory}: d2t and t2d disagree")
    head.draft_ids = ids
    weight = target.norm.weight  # the target's device and dtype
    head.to(device=device or weight.device, dtype=dtype or weight.dtype)  # d2t, t2d keep theirs
    head.rotary = Rotary(cfg).to(device or weight.device)
    return head.eval().requires_grad_(False)
