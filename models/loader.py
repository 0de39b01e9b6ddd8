"""Hugging Face checkpoint directories <-> LlamaModel.

A directory holds config.json and either model.safetensors or shards listed in
model.safetensors.index.json. Tensor names are Hugging Face's: ours with a "model." prefix,
except `lm_head.weight`, which is absent when the embeddings are tied.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.checkpoint import (
    CONFIG,
    DTYPES,
    WEIGHTS,
    CheckpointError,
    first_id,
    iter_safetensors,
    read_config,
    safetensors_files,
    to_be_loaded,
)
from models.deepseek import load_deepseek
from models.gguf import load_gguf_model
from models.llama import LlamaConfig, LlamaModel, Rotary
from models.shard import Shard, shard_module

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# buffers some older checkpoints carry; we recompute them
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------- config.json


def config_from_hf(d: dict[str, Any]) -> LlamaConfig:
    """LlamaConfig from a parsed Hugging Face config.json.

    `eos_token_id` may be a list in the file; the first id is kept, and `eos_token_ids`
    gives them all.
    """
    arch = _architecture(d)
    _check_unsupported_features(d, arch)
    rope_theta, rope_scaling = _rope(d)
    try:
        return LlamaConfig(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM",
            architecture=arch,
            bos_token_id=first_id(d.get("bos_token_id")),
            eos_token_id=first_id(d.get("eos_token_id")),
        )
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"config.json: {e}") from None


def eos_token_ids(d: dict[str, Any]) -> list[int]:
    """Every end-of-sequence id config.json names (Llama 3 lists several), for a stop set."""
    value = d.get("eos_token_id")
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def checkpoint_dtype(d: dict[str, Any]) -> torch.dtype | None:
    """The dtype config.json declares (`dtype`, or the older `torch_dtype`), if any."""
    name = d.get("dtype") or d.get("torch_dtype")
    if name is None:
        return None
    if name not in DTYPES:
        raise CheckpointError(f"unsupported checkpoint dtype {name!r} (expected one of {DTYPES})")
    return DTYPES[name]


def config_to_hf(cfg: LlamaConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json contents in the older, widely read form (rope_theta, rope_scaling)."""
    if cfg.architecture not in MODEL_TYPES:
        raise CheckpointError(f"unsupported architecture {cfg.architecture!r}")
    if cfg.attention_bias != (cfg.architecture == "Qwen2ForCausalLM"):
        raise CheckpointError(
            f"{cfg.architecture} cannot express attention_bias={cfg.attention_bias} "
            "(only Qwen2 has q/k/v biases)"
        )
    d: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) or None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": _dtype_name(dtype),
    }
    if cfg.architecture == "LlamaForCausalLM":
        d |= {"attention_bias": False, "mlp_bias": False}
    elif cfg.architecture == "Qwen2ForCausalLM":
        d |= {"sliding_window": None, "use_sliding_window": False}
    else:
        d |= {"sliding_window": None}
    return d


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if len(archs) != 1 or archs[0] not in MODEL_TYPES:
        raise CheckpointError(
            f"unsupported architecture {archs!r}; supported: {sorted(MODEL_TYPES)}"
        )
    return str(archs[0])


def _check_unsupported_features(d: dict[str, Any], arch: str) -> None:
    if d.get("quantization_config"):
        raise CheckpointError("quantized checkpoints are not supported")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"unsupported hidden_act {act!r} (only silu)")
    if arch == "LlamaForCausalLM" and (d.get("attention_bias") or d.get("mlp_bias")):
        raise CheckpointError("Llama with attention_bias or mlp_bias is not supported")
    window = d.get("sliding_window")
    # Mistral always applies its window; Qwen2 only when use_sliding_window is set
    uses_window = arch == "MistralForCausalLM" or d.get("use_sliding_window", False)
    max_pos = d.get("max_position_embeddings", 2048)
    if uses_window and window is not None and window < max_pos:
        raise CheckpointError(
            f"sliding_window={window} is below max_position_embeddings={max_pos}; "
            "sliding-window attention is not implemented"
        )
    checkpoint_dtype(d)


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, rope_scaling) from either `rope_parameters` or the older keys."""
    params = d.get("rope_parameters")
    if params:
        scaling = dict(params)
        theta = scaling.pop("rope_theta", d.get("rope_theta", 10000.0))
    else:
        scaling = dict(d.get("rope_scaling") or {})
        theta = d.get("rope_theta", 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), {}
    if kind != "llama3":
        raise CheckpointError(f"unsupported rope type {kind!r} (supported: default, llama3)")
    missing = [k for k in LLAMA3_KEYS if k not in scaling]
    if missing:
        raise CheckpointError(f"llama3 rope scaling lacks {missing}")
    return float(theta), {"rope_type": "llama3"} | {k: scaling[k] for k in LLAMA3_KEYS}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise CheckpointError(f"unsupported dtype {dtype} (expected one of {list(DTYPES)})")


# ---------------------------------------------------------------- model


def load_model(
    directory: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    cache_dir: Path | None = None,
    shard: Shard | None = None,
    quantized: bool = False,
) -> LlamaModel:
    """A LlamaModel with the directory's weights (or a GGUF file's, models/gguf.py, whose
    dequantized weights are kept in `cache_dir` when given), converted to `dtype`, in eval
    mode. `shard`: this rank's slice of a tensor-parallel model (models/shard.py), read
    from the files slice by slice. `quantized`: a GGUF file's linears at their own types
    (models/gguf.py)."""
    if Path(directory).suffix == ".gguf":
        if shard is not None:
            raise ValueError(
                "a GGUF file is not served with tensor parallelism: give a Hugging Face "
                "directory (or --tensor-parallel-size 1)"
            )
        return load_gguf_model(directory, dtype, device, cache_dir, quantized)
    d = read_config(directory)
    if d.get("architectures") == ["DeepseekV3ForCausalLM"]:
        if shard is not None:
            raise ValueError("a DeepSeek model is not served with tensor parallelism yet")
        return load_deepseek(directory, dtype, device)  # type: ignore[return-value]
    cfg = config_from_hf(d)
    with to_be_loaded():
        model = LlamaModel(cfg)
    if shard is not None:
        with contextlib.ExitStack() as files:
            shard_module(model, shard, True, _lazy_source(directory, model, files), dtype, device)
        return _finish(model, device)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
    state = _load_state(directory, expected, dtype, device)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return _finish(model, device)


def _finish(model: LlamaModel, device: torch.device | str) -> LlamaModel:
    """A loaded model's computed buffers, checked complete, in eval mode."""
    cfg = model.config
    with torch.device(device):
        model.rotary = Rotary(cfg)  # its buffer is computed, not stored
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{left[0]!r} was not loaded")
    model.eval().requires_grad_(False)
    return model


def _lazy_source(
    directory: str | Path, model: LlamaModel, files: contextlib.ExitStack
) -> Callable[[str], Any]:
    """name -> the checkpoint's lazy slice of that parameter (read only where taken), its
    full shape checked against the model's."""
    where = {}
    for path in safetensors_files(directory):
        f = files.enter_context(safe_open(str(path), framework="pt"))
        where.update({hf.removeprefix("model."): (f, hf) for hf in f.keys()})

    def source(name: str) -> Any:
        if name not in where:
            raise CheckpointError(f"tensor {_hf_name(name)!r} missing from {directory}")
        f, hf_name = where[name]
        tensor = f.get_slice(hf_name)
        expected = tuple(model.get_parameter(name).shape)
        if tuple(tensor.get_shape()) != expected:
            raise CheckpointError(
                f"tensor {hf_name!r} has shape {tuple(tensor.get_shape())}, "
                f"the config implies {expected}"
            )
        return tensor

    return source


def _load_state(
    directory: str | Path,
    expected: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Our-named tensors of the checkpoint, checked against `expected` names and shapes."""
    state: dict[str, torch.Tensor] = {}
    for hf_name, tensor in iter_safetensors(directory):
        name = hf_name.removeprefix("model.")
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and name not in expected):
            continue
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {hf_name!r} in {directory}")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {expected[name]}"
            )
        if tensor.dtype not in DTYPES.values():
            raise CheckpointError(f"tensor {hf_name!r} has unsupported dtype {tensor.dtype}")
        state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"tensor {_hf_name(missing[0])!r} missing from {directory}")
    return state


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


def save_pretrained(
    model: LlamaModel, directory: str | Path, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write config.json and model.safetensors, readable by load_model and by transformers."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    hf_config = config_to_hf(cfg, dtype)
    tensors = {
        _hf_name(name): t.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, t in model.state_dict().items()
        if not (cfg.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    with open(root / CONFIG, "w") as f:
        json.dump(hf_config, f, indent=2)
        f.write("\n")
