"""pack_tree_mask against a bit-by-bit reference of FlashInfer's packed custom-mask layout."""

import random

import torch

from models.masks import pack_tree_mask


def reference_pack(masks: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Row-major bits per request, each request on fresh bytes, bit i of a byte = element 8k+i."""
    packed, indptr = [], [0]
    for mask in masks:
        flat = [bool(x) for x in mask.flatten().tolist()]
        for start in range(0, len(flat), 8):
            byte = 0
            for i, bit in enumerate(flat[start : start + 8]):
                byte |= int(bit) << i
            packed.append(byte)
        indptr.append(len(packed))
    return packed, indptr


def test_single_byte_bit_order():
    mask = torch.tensor([[True, False, False, False], [False, False, True, True]])
    packed, indptr = pack_tree_mask([mask])
    assert packed.dtype == torch.uint8 and indptr.dtype == torch.int32
    assert packed.tolist() == [0b11000001]
    assert indptr.tolist() == [0, 1]


def test_segments_start_on_fresh_bytes():
    a = torch.ones(1, 3, dtype=torch.bool)  # 3 bits -> one byte 0b111
    b = torch.ones(3, 3, dtype=torch.bool)  # 9 bits -> 0xff, 0x01
    packed, indptr = pack_tree_mask([a, b])
    assert packed.tolist() == [0b111, 0xFF, 0x01]
    assert indptr.tolist() == [0, 1, 3]


def test_random_masks_match_reference():
    rng = random.Random(3)
    for _ in range(20):
        masks = []
        for _ in range(rng.randint(1, 5)):
            qo, kv = rng.randint(1, 9), rng.randint(1, 40)
            masks.append(torch.rand(qo, kv) < rng.random())
        packed, indptr = pack_tree_mask(masks)
        want_packed, want_indptr = reference_pack(masks)
        assert packed.tolist() == want_packed
        assert indptr.tolist() == want_indptr


def test_tree_mask_prefix_and_ancestors():
    # prefix of 5 keys, tree root -> (1, 2), 1 -> 3: node i sees the prefix and its ancestors
    parents = [-1, 0, 0, 1]
    tree = torch.zeros(4, 4, dtype=torch.bool)
    for i, parent in enumerate(parents):
        tree[i, i] = True
        if parent >= 0:
            tree[i] |= tree[parent]
    mask = torch.cat((torch.ones(4, 5, dtype=torch.bool), tree), dim=1)
    packed, indptr = pack_tree_mask([mask])
    assert (packed.tolist(), indptr.tolist()) == reference_pack([mask])


def test_empty_batch():
    packed, indptr = pack_tree_mask([])
    assert packed.numel() == 0
    assert indptr.tolist() == [0]
