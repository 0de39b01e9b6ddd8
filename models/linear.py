"""Inference-time projections: the linears that read the same input fused into one product
(q|k|v, gate|up), each weight held once, in the layout its product reads.

On a CPU where the native kernels built (float32), that layout is the kernels' blocks
(models/native.py: blocked), read by one product for every row count: a decode's one row, a
verify's or a tree's few (the weights stream from memory once for up to 64 rows), a prefill
chunk's hundreds (as fast as oneDNN's packed product there; `python -m bench.forward`). A
row's result depends only on that row, so the same product serves `--batch-invariant`. A tied
embedding looks its rows up in the lm_head's blocks. Elsewhere (CUDA, bfloat16, no compiler)
the weight is the stacked [O, I] matrix and the product torch's. Weight-only int8
(`--weights int8`) stores int8 with a scale a row, in the same two layouts. A GGUF file's
block types stay as they are stored (QuantLinear: models/quant.py packs them, quant.c
multiplies them).

Training never uses these: the originals are dropped when a model is prepared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models import native
from models.quant import TWO_TERMS, Codes, PackedWeight, packed_weight


class FusedLinear(nn.Module):
    """y = x @ W.T + b for x [T, I], with W [O, I] the given linears' weights stacked."""

    bias: torch.Tensor | None

    def __init__(self, linears: Sequence[nn.Linear], int8: bool = False):
        super().__init__()
        weights = [lin.weight.detach() for lin in linears]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)  # one: W, not a copy
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b.detach() if b is not None else weight.new_zeros(lin.out_features)
                    for b, lin in zip(biases, linears, strict=True)
                ]
            )
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = [lin.out_features for lin in linears]
        self.out_features: int = weight.shape[0]
        self.in_features: int = weight.shape[1]
        scales = None
        if int8:  # symmetric, a scale a row: the row's largest magnitude maps to 127
            w = weight.float()
            scales = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
            weight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            scales = scales.to(linears[0].weight.dtype)
        # exactly one of: the kernels' blocks (with padded scales), or W (with scales)
        self.blocked: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        if native.usable(linears[0].weight):
            self.blocked = native.blocked(weight)
            self.scales = native.padded(scales) if scales is not None else None
        else:
            self.weight, self.scales = weight.contiguous(), scales

    @property
    def runs_native(self) -> bool:
        return self.blocked is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None:
            return native.linear(x, self.blocked, self.out_features, self.bias, self.scales)
        assert self.weight is not None
        if self.scales is None:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The product split back into the fused linears' outputs."""
        return self(x).split_with_sizes(self.sizes, -1)  # (Tensor.split wraps it in Python)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [*ids.shape, I] (a float weight's: a tied embedding's lookup)."""
        if self.scales is not None:
            raise ValueError("an int8 weight's rows are not an embedding")
        if self.blocked is not None:  # row o is column o % 16 of block o // 16
            return self.blocked[ids // native.BLOCK, :, ids % native.BLOCK]
        assert self.weight is not None
        return F.embedding(ids, self.weight)


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W block-quantized (models/quant.py), the given parts stacked along
    their outputs. Where the native kernels run it, W is held packed and multiplied at its
    width (quant.c); elsewhere it is held as codes and dequantized for each product (torch's
    path: slow, exact, and the reference the kernels are tested against)."""

    bias: torch.Tensor | None

    def __init__(
        self,
        weight: Codes | PackedWeight | list[PackedWeight],
        sizes: Sequence[int] = (),
        bias: torch.Tensor | None = None,
        two_terms: bool = False,
    ):
        """`weight`: packed already (where the native kernels run), or codes, or (parts
        whose forms have no common one, as a Q4_K q|k beside a Q6_K v) packed parts run
        side by side; `sizes`: the outputs of the parts stacked in it (models.quant.cat);
        `two_terms`: the kernels quantize the activations as two int8 terms (quant.py:
        TWO_TERMS; torch's path is exact anyway)."""
        super().__init__()
        if isinstance(weight, Codes) and native.quant_path() != "torch":
            weight = packed_weight(weight)
        parts = weight if isinstance(weight, list) else [weight]
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = list(sizes) or [sum(p.shape[0] for p in parts)]
        self.out_features, self.in_features = sum(p.shape[0] for p in parts), parts[0].shape[1]
        # exactly one of: packed for the kernels (one weight, or parts), or codes for torch's
        self.packed: torch.Tensor | None = None
        self.codes: Codes | None = None
        self.parts: list[PackedWeight] = []
        self.terms = TWO_TERMS if two_terms else 0
        if isinstance(weight, Codes):
            self.codes, self.form = weight, weight.form
        elif isinstance(weight, PackedWeight):
            self.packed, self.form = weight.data, weight.form | self.terms
        else:
            self.parts, self.form = weight, -1  # quant.c: a qgemm_parts table
            self.packed = self._parts_table(bias)

    def _parts_table(self, bias: torch.Tensor | None) -> torch.Tensor:
        """quant.c's qgemm_parts table: the count, then each part's weight, bias, outputs
        and form (the tensors it points to kept by this module)."""
        biases = bias.split([p.shape[0] for p in self.parts]) if bias is not None else None
        self.part_biases = [b.contiguous() for b in biases] if biases is not None else []
        table = [len(self.parts)]
        for i, part in enumerate(self.parts):
            at = self.part_biases[i].data_ptr() if self.part_biases else 0
            table += [part.data.data_ptr(), at, part.shape[0], part.form | self.terms]
        return torch.tensor(table, dtype=torch.int64)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def runs_native(self) -> bool:
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts:
            assert self.packed is not None  # the parts' table
            return native.qlinear_parts(x, self.packed, self.out_features)
        if self.packed is not None:
            return native.qlinear(x, self.packed, self.shape, self.form, self.bias)
        assert self.codes is not None
        return F.linear(x, self.codes.dequantize(), self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The product split back into the parts' outputs."""
        return self(x).split_with_sizes(self.sizes, -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [*ids.shape, I], dequantized (an embedding's lookup)."""
        if self.parts:
            raise ValueError("a product of parts is not an embedding")
        if self.packed is not None:
            return native.qrows(ids, self.packed, self.shape, self.form)
        assert self.codes is not None
        return self.codes.rows(ids.reshape(-1)).dequantize().view(*ids.shape, -1)


class TiedEmbedding(nn.Module):
    """An embedding whose table is a linear's weight, read where the linear keeps it: the
    lm_head's when tied, or a quantized table's own."""

    def __init__(self, head: FusedLinear | QuantLinear):
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids)


def fuse_linears(module: nn.Module, int8: bool = False) -> None:
    """Every plain nn.Linear below `module` swapped for its FusedLinear, the original
    dropped (its weight freed once nothing else holds it)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, FusedLinear([child], int8))


def held_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages `module` keeps: its parameters, buffers and products'
    weights (a weight shared by two of them counted once)."""
    tensors = [*module.parameters(), *module.buffers()]
    for sub in module.modules():
        if isinstance(sub, FusedLinear):
            tensors += [t for t in (sub.blocked, sub.weight, sub.scales) if t is not None]
        elif isinstance(sub, QuantLinear):
            held = [sub.packed] if sub.packed is not None else []
            held += [part.data for part in sub.parts]
            if sub.codes is not None:
                held += [sub.codes.codes, sub.codes.d, sub.codes.m]
            tensors += held
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
