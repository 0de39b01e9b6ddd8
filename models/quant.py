"""Block-quantized weights at their own width: GGUF's block formats read into integer codes
with a scale and an offset a block of 32 inputs, or 16 for Q6_K (w = d * code + m, exactly
the values the format stores), and packed in the layout of the native products
(models/quant.c).

Codes keep their width: 4 bits (Q4_0, Q4_1, Q4_K), 5 (Q5_0), 6 (Q6_K), 8 (Q8_0), and so do
the scales: the legacy types' float16 scales and offsets as in the file (implied offsets,
-8 d, -16 d, -32 d, -128 d, not stored), the K types' integer scales a sub-block times float16
ones each 256 inputs (Supers), so a packed file is about its own size. Types without codes
here (Q5_K, Q2_K, Q3_K, the IQ types) are dequantized by the loader (models/gguf.py) and named
in the start log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGML

QK = 32  # inputs a block
QO = 16  # outputs a block of the packed layout

# the GGUF types read as codes; a tensor of any other quantized type is dequantized
CODE_TYPES = (GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q8_0, GGML.Q4_K, GGML.Q6_K)


@dataclass(frozen=True)
class Supers:
    """A K type's scales as the file keeps them: integers each `block` inputs times float16
    ones each 256 inputs (Q4_K: scales and minima; Q6_K: signed scales), packed so (the
    float32 d and m of Codes are their products, exact)."""

    d: torch.Tensor  # [O, I / 256] float32, exact in float16
    dmin: torch.Tensor | None  # [O, I / 256] (Q4_K)
    scales: torch.Tensor  # [O, I / block] int16: Q4_K's 0..63, Q6_K's -128..127
    mins: torch.Tensor | None  # [O, I / 32] int16 (Q4_K)

    def rows(self, ids: torch.Tensor) -> Supers:
        pick = lambda t: None if t is None else t[ids]  # noqa: E731
        return Supers(self.d[ids], pick(self.dmin), self.scales[ids], pick(self.mins))


def _cat_supers(parts: list[Supers | None]) -> Supers | None:
    if any(p is None for p in parts):
        return None
    kept = [p for p in parts if p is not None]
    join = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return Supers(
        torch.cat([p.d for p in kept]),
        join([p.dmin for p in kept]),
        torch.cat([p.scales for p in kept]),
        join([p.mins for p in kept]),
    )


@dataclass(frozen=True)
class Codes:
    """A weight [O, I] as w = d * code + m, a scale and an offset each output and `block`
    inputs."""

    codes: torch.Tensor  # [O, I] uint8, below 2**bits
    d: torch.Tensor  # [O, I / block] float32
    m: torch.Tensor  # [O, I / block] float32
    bits: int  # 4, 5, 6 or 8
    half: bool  # d and m exact in float16
    block: int = QK  # 16 for 6-bit codes (Q6_K), else 32
    zero: int = 0  # m = -zero d (Q4_0 8, Q5_0 16, Q6_K 32, Q8_0 128), not stored; 0: m stored
    supers: Supers | None = None  # a K type's scales as stored (packed instead of d and m)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def form(self) -> int:
        return form(self.bits, self.half, self.zero, self.supers is not None)

    def dequantize(self) -> torch.Tensor:
        """[O, I] float32."""
        d = self.d.repeat_interleave(self.block, 1)
        m = self.m.repeat_interleave(self.block, 1)
        return self.codes.float() * d + m

    def rows(self, ids: torch.Tensor) -> Codes:
        """The outputs `ids` (a permutation, a slice)."""
        supers = self.supers.rows(ids) if self.supers is not None else None
        return replace(self, codes=self.codes[ids], d=self.d[ids], m=self.m[ids], supers=supers)


def form(bits: int, half: bool, zero: int, supers: bool = False) -> int:
    """A packed weight's form as quant.c's qweight reads it."""
    return bits + 256 * half + 512 * supers + 65536 * zero


# a form's flag: the activations quantized as two int8 terms (quant.c: quantize_rows), each
# input off by at most 1/254 of one term's error, for twice the rows' products
TWO_TERMS = 1 << 24


def cat(parts: list[Codes]) -> Codes | None:
    """Weights of one form stacked along their outputs (q|k|v, gate|up); None where the parts'
    forms (their types) differ: those run side by side as parts, each at its own width."""
    if len({(p.form, p.block) for p in parts}) > 1:
        return None
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return replace(
        first,
        codes=torch.cat([p.codes for p in parts]),
        d=torch.cat([p.d for p in parts]),
        m=torch.cat([p.m for p in parts]),
        supers=_cat_supers([p.supers for p in parts]),
    )


def _half(x: np.ndarray) -> np.ndarray:
    return x.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones (GGUF's order
    within a 32-input block)."""
    return np.concatenate([qs & 15, qs >> 4], -1)


def codes_of(raw: np.ndarray, kind: GGML, inputs: int) -> Codes:
    """A GGUF tensor's bytes [O, bytes per row] of a type in CODE_TYPES as Codes."""
    rows = raw.shape[0]
    super_block = kind in (GGML.Q4_K, GGML.Q6_K)
    blocks = raw.reshape(rows, inputs // (256 if super_block else QK), -1)
    half, block, zero, supers = True, QK, 0, None
    if kind == GGML.Q4_0:
        d = _half(blocks[..., 0:2].copy())[..., 0]
        codes, m = _nibbles(blocks[..., 2:18]), -8 * d
        bits, zero = 4, 8
    elif kind == GGML.Q4_1:
        d, m = _half(blocks[..., 0:2].copy())[..., 0], _half(blocks[..., 2:4].copy())[..., 0]
        codes, bits = _nibbles(blocks[..., 4:20]), 4
    elif kind == GGML.Q5_0:
        d = _half(blocks[..., 0:2].copy())[..., 0]
        high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [.., 32] bit i
        codes, m = _nibbles(blocks[..., 6:22]) | (high << 4), -16 * d
        bits, zero = 5, 16
    elif kind == GGML.Q8_0:
        d = _half(blocks[..., 0:2].copy())[..., 0]
        codes = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        m, bits, zero = -128 * d, 8, 128
    elif kind == GGML.Q4_K:
        codes, d, m, supers = _q4_k(blocks)
        bits, half = 4, False
    elif kind == GGML.Q6_K:
        codes, d, supers = _q6_k(blocks)
        m, bits, half, block, zero = -32 * d, 6, False, 16, 32
    else:
        raise ValueError(f"no codes for GGUF type {kind.name}")
    return Codes(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, inputs)),
        torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32).reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32).reshape(rows, -1)),
        bits,
        half,
        block,
        zero,
        supers,
    )


def _ints(x: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int16).reshape(rows, -1))


def _floats(x: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(rows, -1))


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, Supers]:
    """Q6_K super-blocks [O, n, 210] (128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    scales, d) -> codes [O, n, 256], d [O, n, 16] and the scales as stored: w = d sc (q - 32)
    each 16 inputs."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 64)  # two halves of 128 inputs
    qh = blocks[..., 128:192].reshape(*lead, 2, 32)
    low = np.stack([ql & 15, ql >> 4], -2).reshape(*lead, 2, 4, 32)  # [.., half, quarter, 32]
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], -2)  # [.., half, quarter, 32]
    codes = (low | (high << 4)).reshape(*lead, 256)
    scales = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _half(blocks[..., 208:210].copy())
    rows = blocks.shape[0]
    return codes, d * scales, Supers(_floats(d, rows), None, _ints(scales, rows), None)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, Supers]:
    """Q4_K super-blocks [O, n, 144] (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles) -> codes [O, n, 256], d and m [O, n, 8] and the scales as stored: w = d sc q -
    dmin mn a sub-block."""
    d = _half(blocks[..., 0:2].copy())
    dmin = _half(blocks[..., 2:4].copy())
    s = blocks[..., 4:16].astype(np.uint8)
    low = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)  # 4 chunks of 64 inputs
    codes = np.stack([qs & 15, qs >> 4], -2).reshape(*blocks.shape[:-1], 256)
    rows = blocks.shape[0]
    supers = Supers(_floats(d, rows), _floats(dmin, rows), _ints(low, rows), _ints(mins, rows))
    return codes, d * low.astype(np.float32), -(dmin * mins.astype(np.float32)), supers


def pack_codes(c: Codes) -> torch.Tensor:
    """The packed layout of models/quant.c: for each 16 outputs (zero-padded) and 32 inputs,
    a chunk of the codes, output o's four inputs of group g (inputs 4g..4g+3) in bytes
    4o..4o+3 of a 64-byte vector: 8-bit codes in eight vectors, vector g group g's; narrower
    ones' low nibbles in four (vector j: group 2j in the low nibbles, 2j + 1 in the high),
    then 5 bits: one vector of fifth bits (bit g: group g's), 6 bits: two of the fifth and
    sixth (vector h, bits 2i and 2i + 1: group 4h + i's); then the 16 scales and, unless
    implied (zero), the 16 offsets (6 bits: the two 16-input halves' scales). [bytes]."""
    out, inp = c.shape
    pad = -out % QO
    codes, d, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (c.codes, c.d, c.m))
    ob, nk = (out + pad) // QO, inp // QK
    q = codes.view(ob, QO, nk, 8, 4).permute(0, 2, 3, 1, 4)  # [ob, block, group, output, 4]
    planes = [q] if c.bits == 8 else [(q[:, :, 0::2] & 15) | ((q[:, :, 1::2] & 15) << 4)]
    high = (q >> 4).to(torch.int32)  # the fifth (and sixth) bits
    if c.bits == 5:  # bit g: group g's
        planes.append((high << torch.arange(8).view(1, 1, 8, 1, 1)).sum(2, keepdim=True))
    if c.bits == 6:  # vector h, bits 2i, 2i + 1: group 4h + i's
        shifts = (2 * torch.arange(4)).view(1, 1, 1, 4, 1, 1)
        pairs = high.view(ob, nk, 2, 4, QO, 4) << shifts
        planes.append(pairs.sum(3))
    if c.zero and not torch.equal(m, -c.zero * d):
        raise ValueError(f"codes with zero {c.zero} take the offset -{c.zero} d")
    if c.bits == 6 and (c.block, c.zero) != (16, 32):
        raise ValueError("6-bit codes come as Q6_K's: a scale each 16 inputs, zero 32")
    parts = [p.reshape(ob, nk, -1).to(torch.uint8) for p in planes]
    if c.supers is not None:
        return _with_supers(parts, c.supers, ob, nk, pad)
    dtype = torch.float16 if c.half else torch.float32
    if c.bits == 6:  # the halves' scales
        scales = [d.to(dtype).view(ob, QO, nk, 2).permute(0, 2, 3, 1).reshape(ob, nk, 2 * QO)]
    else:
        scales = [t.to(dtype).view(ob, QO, nk).transpose(1, 2) for t in (d, m)[: 2 - bool(c.zero)]]
    parts += [s.contiguous().view(torch.uint8).reshape(ob, nk, -1) for s in scales]
    return torch.cat(parts, -1).view(-1)


SUPER = 8  # chunks a set of a K type's float16 scales (256 inputs)


def _with_supers(
    parts: list[torch.Tensor], supers: Supers, ob: int, nk: int, pad: int
) -> torch.Tensor:
    """The chunks with their integer scales (Q4_K: 16 scales, 16 minima; Q6_K: the halves'
    16 scales, signed), then the float16 scales of each 8 chunks (16 d, Q4_K's 16 dmin)."""
    grid = lambda t, per: torch.nn.functional.pad(t, (0, 0, 0, pad)).view(ob, QO, nk, per)  # noqa: E731
    if supers.mins is None:  # Q6_K: [ob, chunk, half, output]
        ints = [grid(supers.scales, 2).permute(0, 2, 3, 1).to(torch.int8).view(torch.uint8)]
        floats = [supers.d]
    else:
        assert supers.dmin is not None
        ints = [
            grid(t, 1).permute(0, 2, 3, 1).to(torch.uint8) for t in (supers.scales, supers.mins)
        ]
        floats = [supers.d, supers.dmin]
    parts += [t.reshape(ob, nk, -1) for t in ints]
    sets = nk // SUPER
    halves = [
        torch.nn.functional.pad(t, (0, 0, 0, pad)).to(torch.float16).view(ob, QO, sets)
        for t in floats
    ]
    tail = torch.stack([h.transpose(1, 2) for h in halves], 2)  # [ob, set, kind, output]
    return torch.cat([torch.cat(parts, -1).view(-1), tail.contiguous().view(torch.uint8).view(-1)])


def exact_in_half(c: Codes) -> bool:
    """Whether float16 holds the scales and offsets exactly (the legacy types' always do,
    but for an overflow)."""
    return all(bool((t.to(torch.float16).float() == t).all()) for t in (c.d, c.m))


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the layout of the native products, with what they need to read it."""

    data: torch.Tensor  # [bytes] uint8 (pack_codes)
    shape: tuple[int, int]  # O, I
    form: int  # quant.c's qweight: bits, float16 scales, zero, supers
    supers_bytes: int = 0  # the float16 scales at the end of `data` (K types)


def packed_weight(c: Codes) -> PackedWeight:
    """c packed, its scales in float16 where they are exact there (else float32)."""
    if c.half and not exact_in_half(c):
        c = replace(c, half=False)
    sets = -(-c.shape[0] // QO) * (c.shape[1] // (QK * SUPER))
    per_set = 0 if c.supers is None else 2 * QO * (1 if c.supers.dmin is None else 2)
    return PackedWeight(pack_codes(c), c.shape, c.form, sets * per_set)


PACK_ROWS = 4096  # outputs read and packed at a time: a large table's temporaries stay small


def packed_rows(
    read: Callable[[int, int], np.ndarray], rows: int, kind: GGML, inputs: int
) -> PackedWeight:
    """A tensor's codes packed PACK_ROWS outputs at a time (whole output blocks, which pack_codes
    alone: the chunks go block after block, as do a K type's float16 scales after them) into
    one buffer; `read(start, stop)`: the tensor's bytes of those outputs."""
    data, chunk_at, super_at, forms = None, 0, 0, set[int]()
    blocks = -(-rows // QO)
    for start in range(0, rows, PACK_ROWS):
        part = packed_weight(codes_of(read(start, start + PACK_ROWS), kind, inputs))
        part_blocks = -(-part.shape[0] // QO)
        chunks = part.data.numel() - part.supers_bytes
        if data is None:  # every part packs blocks of these sizes
            chunk_block, super_block = chunks // part_blocks, part.supers_bytes // part_blocks
            data = torch.empty(blocks * (chunk_block + super_block), dtype=torch.uint8)
            super_at = blocks * chunk_block
        data[chunk_at : chunk_at + chunks] = part.data[:chunks]
        data[super_at : super_at + part.supers_bytes] = part.data[chunks:]
        chunk_at, super_at = chunk_at + chunks, super_at + part.supers_bytes
        forms |= {part.form}
    if data is None or len(forms) > 1:  # a part's scales overflowed float16: all float32
        return packed_weight(replace(codes_of(read(0, rows), kind, inputs), half=False))
    return PackedWeight(data, (rows, inputs), forms.pop(), data.numel() - chunk_at)
