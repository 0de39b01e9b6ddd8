"""The engine's one page allocator, shared by the target's and the drafter's caches."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """More pages were asked for than are free."""


class PageAllocator:
    """Hands out page ids. A page id indexes every model's KV cache alike.

    Pages freed while the device may still write them (a rollback or a finish decided from a
    step whose successor is already queued) are parked until that step has completed:
    `free(pages, after_step=n)` then `release(completed_step)`.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._parked: list[tuple[int, list[int]]] = []
        self._completed_through = -1  # steps up to this one have completed

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_parked(self) -> int:
        return sum(len(pages) for _, pages in self._parked)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free - self.num_parked

    def alloc(self, n: int) -> list[int]:
        """n page ids, or OutOfPages (and nothing changes) when fewer are free."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return pages

    def free(self, pages: list[int], after_step: int | None = None) -> None:
        if not pages:
            return
        if after_step is None or after_step <= self._completed_through:
            self._free.extend(pages)
        else:
            self._parked.append((after_step, list(pages)))

    def release(self, completed_step: int) -> None:
        """Return the pages parked behind steps up to `completed_step`."""
        self._completed_through = max(self._completed_through, completed_step)
        keep = []
        for step, pages in self._parked:
            if step <= completed_step:
                self._free.extend(pages)
            else:
                keep.append((step, pages))
        self._parked = keep
