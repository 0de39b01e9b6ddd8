"""Draft trees: ancestry, the verify forward's view of a tree, and moving the accepted path's
KV to where its positions belong."""

from __future__ import annotations

import torch

from core.step import DevicePlan, Drafts
from kv.cache import KVCache


def tree_ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, N, N] bool, node j is an ancestor of node i or i itself, for parents [B, N] (-1:
    the root) of a tree no deeper than `depth`."""
    n = parents.shape[1]
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(parents.shape[0], n, n)
    ancestors = eye
    for _ in range(depth - 1):  # each round adds one more generation
        above = ancestors.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, n))
        ancestors = eye | (above & (parents >= 0)[..., None])
    return ancestors


def tree_drafts(dev: DevicePlan, tokens, parents, depths, depth: int, ancestors=None) -> Drafts:
    """A tree's Drafts with what the target's verify forward needs, built on the device.

    tokens, parents, depths: [B, N] (depths from 1); ancestors [B, N, N] when the caller
    knows them (a fixed shape), else found from the parents. Verify row 0 is the root (the last
    committed token, at position base), row 1 + i node i (position base + depth, slot
    base + 1 + i). Every row sees the committed keys 0 .. base; a node also sees the nodes on
    its own path, itself included: keys base + 1 + j for its ancestors j."""
    if ancestors is None:
        ancestors = tree_ancestors(parents, depth)  # [B, N, N]
    b, n = tokens.shape
    zero = torch.zeros_like(depths[:, :1])
    positions = dev.base[:, None] + torch.cat([zero, depths], 1)  # [B, N + 1]
    lmax = dev.target_meta.kv_slots.shape[1]
    keys = torch.arange(lmax, device=tokens.device)
    prefix = keys[None, :] <= dev.base[:, None]  # [B, Lmax]
    node = keys[None, :] - dev.base[:, None] - 1  # [B, Lmax] node index of each key
    in_tree = (node >= 0) & (node < n)
    rows = torch.cat([torch.zeros_like(ancestors[:, :1]), ancestors], 1)  # [B, N + 1, N]
    index = node.clamp(0, n - 1)[:, None, :].expand(b, n + 1, lmax)
    mask = prefix[:, None, :] | (rows.gather(2, index) & in_tree[:, None, :])
    return Drafts(tokens, None, parents, ancestors, depth, depths, positions, mask)


def move_tree_path(
    cache: KVCache,
    tail_slots: torch.Tensor,  # [B, >= D + 2] slots of positions base, base + 1, ...
    path: torch.Tensor,  # [B, D] accepted tree nodes, -1 padded
    accepted: torch.Tensor,  # [B] accepted count
) -> None:
    """After a tree: node i's KV was written at slot base + 1 + i; the accepted path's j-th
    node moves to base + 1 + j, where its position belongs. The rest of the tree lies past
    the committed length and is overwritten later; its pages stay the sequence's. Fixed
    shapes (no host sync): entries past the accepted count copy a slot onto itself."""
    d = path.shape[1]
    dst = tail_slots[:, 1 : d + 1]  # [B, D]
    src = tail_slots.gather(1, 1 + path.clamp(min=0))  # [B, D] the path's node slots
    src = torch.where(torch.arange(d, device=path.device) < accepted[:, None], src, dst)
    cache.move(src.flatten(), dst.flatten())
