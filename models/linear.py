"""Inference-time projections: linears that read the same input fused into one product, with
weights prepacked for oneDNN on the CPU.

Why: a verify pass multiplies M = k + 1 rows per sequence by every weight. On the CPU, the
default (MKL) product costs several times more at 2 <= M <= 8 than at M = 1 although the
weights are read once either way, while oneDNN's prepacked path stays nearly flat up to
M = 16 (`python -m bench.verify_cost`). A single row still goes to MKL, with W stored
transposed ([I, O] in memory, W itself a view): MKL's one-row product over that layout is
faster than over [O, I] and than the packed path (figures: bench/results/NOTES.md). Fusing
q|k|v and gate|up also halves the calls, each of which costs tens of microseconds at the
demo's shapes. Training never uses these (the prepacked path has no backward).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models import native

PACK_ROWS_HINT = 8  # oneDNN picks its blocking for this many rows: verify passes are 2-16
# A weight this large streams from memory whichever kernel reads it, and oneDNN's packed
# layout streams it faster than MKL's one-row product (a real model's lm_head; bench.forward)
PACKED_ONE_ROW_BYTES = 32 << 20


class PackedLinear(nn.Module):
    """y = x @ W.T + b for x [T, I], with W [O, I] the given linears' weights stacked."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        if len(linears) == 1:  # the same parameters: the state_dict keeps their names
            self.weight, self.bias = linears[0].weight, linears[0].bias
        else:  # stacked copies, outside the state_dict (the fused linears keep theirs)
            stacked = torch.cat([lin.weight.detach() for lin in linears])  # [O, I]
            self.register_buffer("weight", stacked, persistent=False)
            biases = [lin.bias for lin in linears]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [b.detach() if b is not None else stacked.new_zeros(lin.out_features)
                     for b, lin in zip(biases, linears, strict=True)]
                )  # fmt: skip
            self.register_buffer("bias", bias, persistent=False)
        self.sizes = [lin.out_features for lin in linears]
        self.packed = None
        w = self.weight
        self.one_row_packed = False  # whether a single row goes to oneDNN too
        if (
            w.device.type == "cpu"
            and w.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
        ):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)
            self.one_row_packed = w.numel() * w.element_size() >= PACKED_ONE_ROW_BYTES
            # the one-row product reads W column by column: stored [I, O], MKL streams it
            w.data = w.detach().t().contiguous().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or (x.shape[0] == 1 and not self.one_row_packed):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The product split back into the fused linears' outputs."""
        return self(x).split_with_sizes(self.sizes, -1)  # (Tensor.split wraps it in Python)


class Int8Linear(nn.Module):
    """A PackedLinear's product with weight-only int8: W ~ scales * Q, Q int8 [O, I] with one
    scale a row (symmetric: the row's largest magnitude maps to 127), x and the result float;
    a quarter of float32's bytes (`--quantization int8`). The product is the native kernels'
    over blocked weights where they built, else torch's `aten._weight_int8pack_mm`."""

    def __init__(self, linear: PackedLinear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight", q.contiguous(), persistent=False)
        self.register_buffer("scales", scales.to(linear.weight.dtype), persistent=False)
        self.bias = linear.bias
        self.sizes = linear.sizes
        self.out_features = q.shape[0]
        # the native kernels' layout (models/native.py: blocked): they stream int8 at the
        # memory's rate, torch's kernel ran SmolLM2's forward at 18x its floor
        self.blocked: torch.Tensor | None = None
        self.blocked_scales: torch.Tensor | None = None
        if native.usable(linear.weight):
            self.blocked, self.blocked_scales = native.blocked(q), native.padded(scales)
            self.weight = q.new_empty(0)  # only the blocked copy is read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None:
            return native.linear(x, self.blocked, self.out_features, self.bias, self.blocked_scales)
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split_with_sizes(self.sizes, -1)


def quantize_int8(module: nn.Module) -> None:
    """Every PackedLinear below `module` swapped for its Int8Linear (a tied lm_head gets its
    own int8 copy; the embedding it shares stays float)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, Int8Linear(child))


def make_batch_invariant(module: nn.Module) -> None:
    """Every PackedLinear below `module` takes oneDNN's packed product for one row too: its
    result for a row is then the same bits whatever the number of rows (MKL's one-row
    product rounds differently), which `--batch-invariant` needs."""
    for sub in module.modules():
        if isinstance(sub, PackedLinear):
            if sub.packed is None:
                raise ValueError(
                    "batch-invariant mode needs float32 weights on a CPU with oneDNN "
                    f"(got {sub.weight.dtype} on {sub.weight.device})"
                )
            sub.one_row_packed = True


def pack_linears(module: nn.Module, skip: Collection[nn.Module] = ()) -> None:
    """Swap every plain nn.Linear below `module` (but those in `skip`) for a PackedLinear."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child not in skip:
                setattr(parent, name, PackedLinear([child]))
