"""Per-request page tables and the CSR page-table metadata of a batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv.pages import PageAllocator


@dataclass
class PageTable:
    """The pages holding one request's KV, in order; slot j is pages[j // ps] * ps + j % ps."""

    page_size: int
    pages: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def pages_needed(self, num_slots: int) -> int:
        return max(0, -(-num_slots // self.page_size) - len(self.pages))

    def grow(self, allocator: PageAllocator, num_slots: int) -> None:
        """Make room for `num_slots` slots; raises OutOfPages (changing nothing) when short."""
        need = self.pages_needed(num_slots)
        if need:
            self.pages.extend(allocator.alloc(need))

    def truncate(
        self, allocator: PageAllocator, num_slots: int, after_step: int | None = None
    ) -> None:
        """Drop the pages wholly past `num_slots`."""
        keep = -(-num_slots // self.page_size)
        allocator.free(self.pages[keep:], after_step)
        del self.pages[keep:]

    def slot(self, j: int) -> int:
        return self.pages[j // self.page_size] * self.page_size + j % self.page_size

    def slots(self, start: int, end: int) -> list[int]:
        return [self.slot(j) for j in range(start, end)]


@dataclass
class CSRPages:
    """FlashInfer's paged-KV description of a batch (all int32 on the device side)."""

    qo_indptr: list[int]  # [B + 1] query tokens of sequence b: qo_indptr[b]..qo_indptr[b+1]
    kv_indptr: list[int]  # [B + 1] pages of sequence b: kv_indices[kv_indptr[b]..kv_indptr[b+1]]
    kv_indices: list[int]  # [total pages]
    kv_last_page_len: list[int]  # [B] slots used in each sequence's last page (1..page_size)


def build_csr(tables: list[PageTable], kv_lens: list[int], q_lens: list[int]) -> CSRPages:
    """CSR metadata for sequences whose KV (after this forward's writes) spans kv_lens slots."""
    qo_indptr, kv_indptr, kv_indices, last = [0], [0], [], []
    for table, kv_len, q_len in zip(tables, kv_lens, q_lens, strict=True):
        num_pages = -(-kv_len // table.page_size)
        if num_pages > len(table.pages):  # short indices would shift every later sequence
            raise ValueError(f"{kv_len} slots do not fit in {len(table.pages)} pages")
        kv_indices.extend(table.pages[:num_pages])
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        last.append(kv_len - (num_pages - 1) * table.page_size)
    return CSRPages(qo_indptr, kv_indptr, kv_indices, last)
