"""The native CPU kernels (models/kernels.c) as torch functions.

A forward of a small model at batch 1 is mostly small operations: an RMSNorm through torch
is about ten dispatched operations for 576 floats, the rotary embedding five, a layer's
attention a gather of its whole context into a fresh buffer plus SDPA. Each function here
does one of those groups in one call, for float32 tensors on the CPU at inference
(`prepare_for_inference` turns them on; `available()` says whether they built). Their results
equal the torch operations' up to float rounding (tests/test_native.py). The products over a
GGUF file's block types (models/quant.c: qlinear, qlinear_parts, qrows) run on the path the
CPU's features allow, chosen at run time (`quant_path`; tests/test_quant.py).

The kernels are built by the normal install (setup.py) and are optional: where there is no
C compiler, or with TANDEM_NATIVE=0 in the environment, the models run their torch path.
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:
    from models import _kernels  # type: ignore[attr-defined]
except ImportError:  # not built: the torch path
    _kernels = None

DISABLE_ENV = "TANDEM_NATIVE"  # "0": run the torch path even where the kernels built
# the quantized products' path (kernels.c, quant.c): "auto" (the best the CPU has), "vnni512",
# "avx2", or "torch" (dequantize, then torch's product)
QUANT_PATH_ENV = "TANDEM_QUANT_PATH"
QUANT_PATHS = {"torch": 0, "avx2": 1, "vnni512": 2}
# how the quantized products quantize their activations (quant.c): "int8" (one term, the
# default) or "int8x2" (two: the residual quantized again)
ACTIVATIONS_ENV = "TANDEM_QUANT_ACTIVATIONS"


def available() -> bool:
    return _kernels is not None and os.environ.get(DISABLE_ENV, "1") != "0"


def quant_path() -> str:
    """The path quantized products take here: the one TANDEM_QUANT_PATH forces (refused where
    the CPU lacks it), else the best the CPU has; "torch" where the kernels did not build."""
    want = os.environ.get(QUANT_PATH_ENV, "auto")
    if want != "auto" and want not in QUANT_PATHS:
        raise ValueError(f"{QUANT_PATH_ENV}={want!r}: choose auto or one of {list(QUANT_PATHS)}")
    if not available():
        return "torch"
    chosen = _kernels.qpath(QUANT_PATHS.get(want, -1))
    name = {v: k for k, v in QUANT_PATHS.items()}[chosen]
    if want != "auto" and name != want:
        raise ValueError(f"{QUANT_PATH_ENV}={want}: this CPU lacks the instructions it needs")
    return name


def two_terms() -> bool:
    """Whether the products quantize their activations as two int8 terms
    (TANDEM_QUANT_ACTIVATIONS=int8x2). One term's rounding flips near-tied greedy tokens of
    SmolLM2-135M's ("the capital of France"), which two keep, at 1.1x its decode, 1.5x its
    5-row verify and 1.8x its prefill: docs/performance.md, "The activations' precision". The
    default is one term, as llama.cpp's; its perplexity stays within 0.5% of float32's."""
    want = os.environ.get(ACTIVATIONS_ENV, "int8")
    if want not in ("int8", "int8x2"):
        raise ValueError(f"{ACTIVATIONS_ENV}={want!r}: choose int8 or int8x2")
    return want == "int8x2"


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors: built, float32 on the CPU."""
    return available() and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


KV_DTYPES = (torch.float32, torch.float16)  # what the native attention reads


def attention_usable(cache_data: torch.Tensor, head_dim: int, queries: torch.dtype) -> bool:
    """Whether PagedAttention runs over this cache: float32 or float16 on the CPU, float32
    queries, whole 16-float vectors a head."""
    on_cpu = cache_data.device.type == "cpu" and cache_data.dtype in KV_DTYPES
    return available() and on_cpu and queries == torch.float32 and head_dim % 16 == 0


def decoder_usable(head_dim: int) -> bool:
    """Whether decode_layers runs: the kernels built, heads of whole 16-float vectors."""
    return available() and head_dim % 16 == 0 and head_dim <= 1024


BLOCK = 16  # outputs a block of a blocked weight (kernels.c: products with blocked weights)


def blocked(weight: torch.Tensor) -> torch.Tensor:
    """W [O, I] (float32 or int8) as kernels.c's blocks: [ceil(O / 16), I, 16], zero-padded."""
    out, inp = weight.shape
    pad = -out % BLOCK
    w = torch.cat([weight, weight.new_zeros(pad, inp)]) if pad else weight.contiguous()
    return w.view(-1, BLOCK, inp).transpose(1, 2).contiguous()


def padded(v: torch.Tensor) -> torch.Tensor:
    """A per-output vector padded with zeros to whole blocks (int8 scales)."""
    pad = -v.shape[0] % BLOCK
    return torch.cat([v, v.new_zeros(pad)]) if pad else v.contiguous()


def linear(
    x: torch.Tensor,  # [M, I] float32
    weight: torch.Tensor,  # blocked(): float32, or int8 with `scales`
    out_features: int,
    bias: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,  # padded() [ceil(O / 16) * 16] float32
) -> torch.Tensor:
    """x W^T + bias [M, O] from blocked weights."""
    x = x.contiguous()
    rows, inp = x.shape
    y = x.new_empty(rows, out_features)
    int8 = weight.dtype == torch.int8
    _kernels.linear(
        y.data_ptr(),
        x.data_ptr(),
        0 if int8 else weight.data_ptr(),
        weight.data_ptr() if int8 else 0,
        scales.data_ptr() if scales is not None else 0,
        bias.data_ptr() if bias is not None else 0,
        rows,
        inp,
        out_features,
        torch.get_num_threads(),
    )
    return y


def qlinear(
    x: torch.Tensor,  # [M, I] float32
    packed: torch.Tensor,  # models/quant.py: pack
    shape: tuple[int, int],  # O, I
    form: int,  # models/quant.py: form
    bias: torch.Tensor | None = None,  # [O]
) -> torch.Tensor:
    """x W^T + bias [M, O] from packed codes (quant.c)."""
    x = x.contiguous()
    y = x.new_empty(x.shape[0], shape[0])
    bias_at = bias.data_ptr() if bias is not None else 0
    threads = torch.get_num_threads()
    _kernels.qlinear(
        y.data_ptr(),
        x.data_ptr(),
        packed.data_ptr(),
        bias_at,
        x.shape[0],
        shape[1],
        shape[0],
        form,
        threads,
    )
    return y


def qlinear_parts(x: torch.Tensor, table: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, I] through products side by side (quant.c: qgemm_parts' table): [M, O]."""
    x = x.contiguous()
    y = x.new_empty(x.shape[0], out_features)
    threads = torch.get_num_threads()
    _kernels.qlinear_parts(
        y.data_ptr(), x.data_ptr(), table.data_ptr(), x.shape[0], x.shape[1], threads
    )
    return y


def qrows(
    ids: torch.Tensor, packed: torch.Tensor, shape: tuple[int, int], form: int
) -> torch.Tensor:
    """Rows `ids` of a packed W, dequantized: [*ids.shape, I] float32."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], shape[1])
    _kernels.qrows(out.data_ptr(), packed.data_ptr(), flat.data_ptr(), flat.shape[0], *shape, form)
    return out.view(*ids.shape, shape[1])


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (int64, the first of equal largest values, a NaN the largest): through the
    kernel for float32 on the CPU, whose one vectorised pass takes a fraction of torch's
    scalar reduction over a vocabulary (greedy sampling and drafting, every step)."""
    if not usable(x) or x.dim() == 0 or x.shape[-1] == 0:
        return x.argmax(-1)
    x = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    _kernels.argmax(out.data_ptr(), x.data_ptr(), out.numel(), x.shape[-1])
    return out


def coupled_tokens(probs: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
    """[R] int64: the seeded coupling's token of each row of probs [R, V] (float32), keys [R]
    uint32 the hash states of its seed and position (stages/rng.py)."""
    probs = probs.contiguous()
    keys = np.ascontiguousarray(keys, dtype=np.uint32)
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    _kernels.coupled_tokens(out.data_ptr(), probs.data_ptr(), keys.ctypes.data, *probs.shape)
    return out


def coupling_uniforms(keys: np.ndarray, vocab: int) -> torch.Tensor:
    """[R, vocab] float32: the seeded coupling's uniform r of each token, keys [R] uint32."""
    keys = np.ascontiguousarray(keys, dtype=np.uint32)
    out = torch.empty(len(keys), vocab)
    _kernels.coupling_uniforms(out.data_ptr(), keys.ctypes.data, len(keys), vocab)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (H,), weight, eps) for x [..., H]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _kernels.rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated in place as models.llama.rotate does (cos and sin [T, 1, D],
    sin's first half negated); x's heads and elements must be contiguous within a row."""
    t, heads, dim = x.shape
    if not (_rows_ok(x) and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_: each row of x must hold its heads contiguously")
    _kernels.rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads, dim, x.stride(0))
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] holding gate then up; [T, I]."""
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    _kernels.silu_mul(out.data_ptr(), gate_up.data_ptr(), rows, inter)
    return out


class PagedAttention:
    """Paged attention of one forward's tokens (see kernels.c): built once a forward from
    what every layer shares, then called by each layer with its q, k, v and its rows of the
    cache; the int64 index tensors are made contiguous once here."""

    def __init__(
        self,
        page_size: int,
        write_rows: torch.Tensor,  # [T], key row each token's k goes to
        read_rows: torch.Tensor,  # [B, Lmax], key row of each sequence's keys
        kv_lens: torch.Tensor,  # [B]
        q_index: torch.Tensor,  # [T], b * Qmax + i, sequence by sequence
        q_positions: torch.Tensor,  # [B, Qmax]
        mask: torch.Tensor | None,  # [B, Qmax, Lmax] bool (a tree), else causal by position
    ):
        def ints(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.int64).contiguous()

        self.seqs, self.qmax = q_positions.shape
        self.lmax = read_rows.shape[-1]
        # kept: the kernel reads them through their pointers
        self.tensors = [
            ints(write_rows),
            ints(read_rows),
            ints(kv_lens),
            ints(q_index),
            ints(q_positions),
        ]
        if mask is not None:
            self.tensors.append(mask.contiguous().view(torch.uint8))
        self.pointers = [t.data_ptr() for t in self.tensors] + ([] if mask is not None else [0])
        self.page_size = page_size

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: torch.Tensor
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] (heads contiguous within a row) float32, store
        [pages * 2 * page_size, Hkv, D] contiguous, float32 or float16; [T, Hq, D]."""
        tokens, hq, dim = q.shape
        if not (q.dtype == k.dtype == v.dtype == torch.float32 and store.dtype in KV_DTYPES):
            raise ValueError("paged attention: float32 queries, a float32 or float16 store")
        if not (_rows_ok(q) and _rows_ok(k) and _rows_ok(v)):
            raise ValueError("paged attention: each row must hold its heads contiguously")
        if not store.is_contiguous():
            raise ValueError("paged attention: the store must be contiguous")
        out = q.new_empty(tokens, hq, dim)
        _kernels.paged_attention(
            out.data_ptr(),
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            store.data_ptr(),
            *self.pointers,
            tokens,
            self.seqs,
            self.qmax,
            self.lmax,
            hq,
            k.shape[1],
            dim,
            self.page_size,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            dim**-0.5,
            torch.get_num_threads(),
            store.dtype == torch.float16,
        )
        return out


def decode_layers(
    x: torch.Tensor,  # [T, H] float32, updated in place
    table: torch.Tensor,  # [layers, 19] int64 (kernels.c)
    shape: tuple[int, int, int],  # q heads, kv heads, head_dim
    inter: int,
    eps: float,
    cos: torch.Tensor,  # [T, 1, D]
    sin: torch.Tensor,
    attention: PagedAttention,  # this forward's, over `store`
    store: torch.Tensor,  # the cache [layers, pages, 2, page_size, Hkv, D], contiguous, f32/f16
    aux_out: torch.Tensor,  # [sum(aux_every), T, H]
    aux_every: torch.Tensor,  # [layers] uint8
) -> None:
    """The T tokens through the table's layers (kernels.c: decode_layers)."""
    hq, hkv, dim = shape
    if not (x.is_contiguous() and store.is_contiguous() and cos.is_contiguous()):
        raise ValueError("decode_layers: x, the cache and cos must be contiguous")
    _kernels.decode_layers(
        x.data_ptr(),
        table.data_ptr(),
        table.shape[0],
        x.shape[0],
        x.shape[1],
        hq,
        hkv,
        dim,
        inter,
        eps,
        cos.data_ptr(),
        sin.data_ptr(),
        store.data_ptr(),
        store.stride(0),
        *attention.pointers,
        attention.seqs,
        attention.qmax,
        attention.lmax,
        attention.page_size,
        aux_out.data_ptr(),
        aux_every.data_ptr(),
        torch.get_num_threads(),
        store.dtype == torch.float16,
    )


def _rows_ok(x: torch.Tensor) -> bool:
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]
