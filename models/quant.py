"""Block-quantized weights at their own width: GGUF's block formats read into integer codes
with a scale and an offset a block of 32 inputs (w = d * code + m, exactly the values the
format stores), and packed in the layout of the native products (models/quant.c).

Q4_0, Q4_1 and Q4_K keep 4-bit codes; Q8_0 and Q5_0 take 8 bits (Q5_0's fifth bit makes
its codes 0..31). The legacy types' scales and offsets are float16 as in the file (their
offsets, -8 d, -16 d, -128 d, are exact in float16), Q4_K's are float32 (a sub-block's
d * scale is exact there, not in float16). Types without codes here (Q6_K's sub-blocks of
16 inputs, Q5_K, the IQ types) are dequantized by the loader (models/gguf.py) and named in
the start log.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGML

QK = 32  # inputs a block
QO = 16  # outputs a block of the packed layout

# the GGUF types read as codes; a tensor of any other quantized type is dequantized
CODE_TYPES = (GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q8_0, GGML.Q4_K)


@dataclass(frozen=True)
class Codes:
    """A weight [O, I] as w = d * code + m, a scale and an offset each output and 32 inputs."""

    codes: torch.Tensor  # [O, I] uint8, below 2**bits
    d: torch.Tensor  # [O, I / 32] float32
    m: torch.Tensor  # [O, I / 32] float32
    bits: int  # 4 or 8
    half: bool  # d and m exact in float16

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[O, I] float32."""
        d = self.d.repeat_interleave(QK, 1)
        m = self.m.repeat_interleave(QK, 1)
        return self.codes.float() * d + m

    def rows(self, ids: torch.Tensor) -> Codes:
        """The outputs `ids` (a permutation, a slice)."""
        return Codes(self.codes[ids], self.d[ids], self.m[ids], self.bits, self.half)


def cat(parts: list[Codes]) -> Codes:
    """Weights stacked along their outputs (q|k|v, gate|up), at the widest of their forms:
    4-bit codes go to 8 bits and float16 scales to float32 where the parts differ, both
    exact."""
    return Codes(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.d for p in parts]),
        torch.cat([p.m for p in parts]),
        max(p.bits for p in parts),
        all(p.half for p in parts),
    )


def _half(x: np.ndarray) -> np.ndarray:
    return x.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones (GGUF's order
    within a 32-input block)."""
    return np.concatenate([qs & 15, qs >> 4], -1)


def codes_of(raw: np.ndarray, kind: GGML, inputs: int) -> Codes:
    """A GGUF tensor's bytes [O, bytes a row] of a type in CODE_TYPES as Codes."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, inputs // QK if kind != GGML.Q4_K else inputs // 256, -1)
    half = True
    if kind == GGML.Q4_0:
        d = _half(blocks[..., 0:2].copy())[..., 0]
        codes, m = _nibbles(blocks[..., 2:18]), -8 * d
        bits = 4
    elif kind == GGML.Q4_1:
        d, m = _half(blocks[..., 0:2].copy())[..., 0], _half(blocks[..., 2:4].copy())[..., 0]
        codes, bits = _nibbles(blocks[..., 4:20]), 4
    elif kind == GGML.Q5_0:
        d = _half(blocks[..., 0:2].copy())[..., 0]
        high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [.., 32] bit i
        codes, m = _nibbles(blocks[..., 6:22]) | (high << 4), -16 * d
        bits = 8
    elif kind == GGML.Q8_0:
        d = _half(blocks[..., 0:2].copy())[..., 0]
        codes = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m, bits = -128 * d, 8
    elif kind == GGML.Q4_K:
        codes, d, m = _q4_k(blocks)
        bits, half = 4, False
    else:
        raise ValueError(f"no codes for GGUF type {kind.name}")
    return Codes(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, inputs)),
        torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32).reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32).reshape(rows, -1)),
        bits,
        half,
    )


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [O, n, 144] (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles) -> codes [O, n, 256], d and m [O, n, 8]: w = d sc q - dmin mn a sub-block."""
    d = _half(blocks[..., 0:2].copy())
    dmin = _half(blocks[..., 2:4].copy())
    s = blocks[..., 4:16].astype(np.uint8)
    low = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)  # 4 chunks of 64 inputs
    codes = np.stack([qs & 15, qs >> 4], -2).reshape(*blocks.shape[:-1], 256)
    return codes, d * low.astype(np.float32), -(dmin * mins.astype(np.float32))


def pack(c: Codes) -> torch.Tensor:
    """The packed layout of models/quant.c: for each 16 outputs (zero-padded) and 32 inputs,
    the codes (4-bit: four 64-byte vectors, vector j with inputs 8j..8j+3 in the low nibbles
    and 8j+4..8j+7 in the high; 8-bit: eight, vector g with inputs 4g..4g+3; output o's four in
    bytes 4o..4o+3), then the 16 scales, then the 16 offsets. [bytes] uint8."""
    out, inp = c.shape
    pad = -out % QO
    codes, d, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (c.codes, c.d, c.m))
    ob, nk = (out + pad) // QO, inp // QK
    q = codes.view(ob, QO, nk, 8, 4)  # output block, output, block, group of 4, input
    if c.bits == 4:
        q = q[:, :, :, 0::2] | (q[:, :, :, 1::2] << 4)
    q = q.permute(0, 2, 3, 1, 4).reshape(ob, nk, -1)
    dtype = torch.float16 if c.half else torch.float32
    scales = [t.to(dtype).view(ob, QO, nk).transpose(1, 2).contiguous() for t in (d, m)]
    return torch.cat([q, *(s.view(torch.uint8).reshape(ob, nk, -1) for s in scales)], -1).view(-1)


def exact_in_half(c: Codes) -> bool:
    """Whether float16 holds the scales and offsets exactly (the legacy types' always do,
    but for an overflow)."""
    return all(bool((t.to(torch.float16).float() == t).all()) for t in (c.d, c.m))
