"""Page accounting: allocator, page tables and the CSR metadata built from them."""

import random

import pytest

from kv.pages import OutOfPages, PageAllocator
from kv.table import PageTable, build_csr


def owned(tables: list[PageTable]) -> list[int]:
    return [p for t in tables for p in t.pages]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("page_size", [1, 16])
def test_random_grow_truncate_free_returns_every_page(seed, page_size):
    rng = random.Random(seed)
    allocator = PageAllocator(40)
    tables = [PageTable(page_size) for _ in range(5)]
    lengths = [0] * len(tables)
    step = 0
    for _ in range(300):
        b = rng.randrange(len(tables))
        table = tables[b]
        if rng.random() < 0.6:
            target = lengths[b] + rng.randint(1, 3 * page_size)
            try:
                table.grow(allocator, target)
                lengths[b] = target
            except OutOfPages:
                pass
        else:
            lengths[b] = rng.randint(0, lengths[b])
            after = step if rng.random() < 0.5 else None
            table.truncate(allocator, lengths[b], after_step=after)
        if rng.random() < 0.3:
            allocator.release(step - 1)  # the previous step has completed
            step += 1
        pages = owned(tables)
        assert len(pages) == len(set(pages)), "a page is owned twice"
        assert allocator.num_used == len(pages)
        for t, length in zip(tables, lengths, strict=True):
            assert t.capacity >= length and len(t.pages) == -(-length // page_size)
    for table in tables:
        table.truncate(allocator, 0, after_step=step)
    allocator.release(step)
    # every page is free when no request is live
    assert allocator.num_free == allocator.num_pages and allocator.num_parked == 0
    assert sorted(allocator.alloc(allocator.num_pages)) == list(range(allocator.num_pages))


def test_out_of_pages_changes_nothing():
    allocator = PageAllocator(4)
    table = PageTable(page_size=4)
    table.grow(allocator, 6)  # 2 pages
    pages_before = list(table.pages)
    with pytest.raises(OutOfPages, match="asked for 3 KV pages, 2 free of 4"):
        table.grow(allocator, 6 + 3 * 4)
    assert table.pages == pages_before
    assert allocator.num_free == 2 and allocator.num_used == 2
    with pytest.raises(OutOfPages):
        allocator.alloc(3)
    assert allocator.num_free == 2
    table.grow(allocator, 16)  # exactly what is left still fits
    assert allocator.num_free == 0 and len(table.pages) == 4


def test_parked_pages_wait_for_their_step():
    allocator = PageAllocator(3)
    table = PageTable(page_size=2)
    table.grow(allocator, 6)
    freed = table.pages[1:]
    table.truncate(allocator, 2, after_step=7)
    assert allocator.num_free == 0 and allocator.num_parked == 2 and allocator.num_used == 1
    with pytest.raises(OutOfPages):
        allocator.alloc(1)
    allocator.release(6)
    assert allocator.num_free == 0 and allocator.num_parked == 2
    allocator.release(7)
    assert allocator.num_parked == 0
    assert sorted(allocator.alloc(2)) == sorted(freed)


def test_release_keeps_later_steps_parked():
    allocator = PageAllocator(4)
    a, b = allocator.alloc(1), allocator.alloc(1)
    allocator.free(a, after_step=3)
    allocator.free(b, after_step=5)
    allocator.release(4)
    assert allocator.num_free == 3 and allocator.num_parked == 1
    allocator.release(5)
    assert allocator.num_free == 4


def test_pages_freed_behind_a_completed_step_return_at_once():
    """Parking behind a step that has already completed would strand the pages: no later
    release may come (the engine found this as a hang with every page parked)."""
    allocator = PageAllocator(2)
    pages = allocator.alloc(2)
    allocator.release(5)
    allocator.free(pages, after_step=4)
    assert allocator.num_free == 2 and allocator.num_parked == 0


def test_truncate_keeps_partial_page_and_grow_is_idempotent():
    allocator = PageAllocator(8)
    table = PageTable(page_size=4)
    table.grow(allocator, 9)
    assert len(table.pages) == 3
    table.grow(allocator, 12)  # still fits
    assert len(table.pages) == 3 and allocator.num_free == 5
    table.truncate(allocator, 5)
    assert len(table.pages) == 2 and allocator.num_free == 6
    table.truncate(allocator, 8)
    assert len(table.pages) == 2
    table.truncate(allocator, 0)
    assert table.pages == [] and allocator.num_free == 8


def test_slots_follow_pages():
    table = PageTable(page_size=4, pages=[7, 2])
    assert table.slots(2, 7) == [30, 31, 8, 9, 10]


def test_build_csr_hand_built():
    t0 = PageTable(page_size=4, pages=[5, 1, 3])
    t1 = PageTable(page_size=4, pages=[0])
    t2 = PageTable(page_size=4, pages=[2, 6])
    # 9 slots: 3 pages, 1 in the last; 4 slots: a full page; 8 slots: both pages full
    csr = build_csr([t0, t1, t2], kv_lens=[9, 4, 8], q_lens=[9, 1, 3])
    assert csr.qo_indptr == [0, 9, 10, 13]
    assert csr.kv_indptr == [0, 3, 4, 6]
    assert csr.kv_indices == [5, 1, 3, 0, 2, 6]
    assert csr.kv_last_page_len == [1, 4, 4]


def test_build_csr_uses_only_the_pages_in_use():
    table = PageTable(page_size=16, pages=[4, 9, 11])  # look-ahead page 11 not yet written
    csr = build_csr([table], kv_lens=[17], q_lens=[1])
    assert csr.kv_indices == [4, 9]
    assert csr.kv_last_page_len == [1]
    one = build_csr([PageTable(page_size=1, pages=[3, 0])], kv_lens=[2], q_lens=[2])
    assert (one.kv_indices, one.kv_last_page_len) == ([3, 0], [1])


def test_build_csr_rejects_a_table_too_short():
    table = PageTable(page_size=4, pages=[1])
    with pytest.raises(ValueError, match="5 slots"):
        build_csr([table], kv_lens=[5], q_lens=[1])
