"""What a forward's attention needs to know about its queries and keys (a plain type)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SharedKeys:
    """What the forwards over the same keys derive from them once, the first of them building
    it: the copies of a metadata that keep its kv_slots and kv_lens (a tree's verify, a step's
    drafter forwards) hold the same SharedKeys."""

    # (key indices [1, 1, Lmax], whether each key exists [B, 1, Lmax])
    keys: tuple[torch.Tensor, torch.Tensor] | None = None
    # by a cache's page size: [B, Lmax] the row of each key in a layer's rows
    key_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # by a cache's layout: (the rows a layer gathers [2 * B * Lmax], the gather buffer)
    reads: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tree: TreeKeys | None = None  # the keys a drafted tree's levels see


@dataclass(frozen=True)
class TreeKeys:
    """The keys a tree drafter's levels see, the same at every level of a step: the committed
    pairs, then each row's scratch slots (where the levels write their nodes' KV)."""

    scratch: torch.Tensor  # [B, S] each row's scratch slots
    kv_slots: torch.Tensor  # [B, Lmax + S] the step's key slots, then the scratch
    committed: torch.Tensor  # [B, 1, Lmax] bool: which of the step's keys are committed
    shared: SharedKeys  # what the levels' forwards share


@dataclass
class AttentionMetadata:
    """Where the T query tokens of one forward write their KV and which keys they see.

    Sequences are padded to the longest one so that a layer's attention is one batched call.
    Key j of sequence b lives at slot `kv_slots[b, j]`; a query sees key j when j <= its
    position (causal by position, which holds for prefill, decode and chain verify) and
    j < kv_lens[b], unless `mask` (a tree) says otherwise.
    """

    slot_mapping: torch.Tensor  # [T] int64, slot each token's K/V is written to
    kv_slots: torch.Tensor  # [B, Lmax] int64, slot of each key (padding points at slot 0)
    kv_lens: torch.Tensor  # [B] int64, number of keys of each sequence
    q_index: torch.Tensor  # [T] int64, index of each token in the padded [B * Qmax] layout
    # (tokens come sequence by sequence, in the order qo_indptr gives them)
    q_positions: torch.Tensor  # [B, Qmax] int64, position of each padded query (0 for padding)
    mask: torch.Tensor | None = None  # [B, Qmax, Lmax] bool; replaces the causal rule (trees)
    shared: SharedKeys = field(default_factory=SharedKeys, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.kv_slots.shape[0]

    @property
    def max_q(self) -> int:
        return self.q_positions.shape[1]

    def visible(self) -> torch.Tensor:
        """[B, Qmax, Lmax] bool: which keys each padded query attends to."""
        keys, in_seq = self._keys()
        if self.mask is not None:
            return self.mask & in_seq
        return (keys <= self.q_positions[:, :, None]) & in_seq

    def _keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key indices [1, 1, Lmax], whether each key exists [B, 1, Lmax])."""
        if self.shared.keys is None:
            keys = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)[None, None]
            self.shared.keys = keys, keys < self.kv_lens[:, None, None]
        return self.shared.keys
