"""The engine's one page allocator, shared by the target's and the drafter's caches."""

from __future__ import annotations

from kv.prefix import PrefixIndex


class OutOfPages(RuntimeError):
    """More pages were asked for than are free."""


class PageAllocator:
    """Hands out page ids. A page id indexes every model's KV cache alike.

    A page may be held by several requests (a cached prefix, `share`); it returns when the
    last of them frees it. Pages returned while the device may still write them (a rollback
    or a finish decided from a step whose successor is already queued) are parked until that
    step has completed: `free(pages, after_step=n)` then `release(completed_step)`. With
    `prefixes`, a returned page that holds a cached block stays cached, idle, until a request
    shares it again or `alloc` evicts it; idle pages count as free.
    """

    def __init__(self, num_pages: int, prefixes: PrefixIndex | None = None):
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        self.num_pages = num_pages
        self.prefixes = prefixes
        self._free = list(range(num_pages - 1, -1, -1))
        self._holders = [0] * num_pages  # requests holding each page
        self._parked: list[tuple[int, list[int]]] = []
        self._completed_through = -1  # steps up to this one have completed

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_cached_idle

    @property
    def num_cached_idle(self) -> int:
        return len(self.prefixes.idle) if self.prefixes is not None else 0

    @property
    def num_parked(self) -> int:
        return sum(len(pages) for _, pages in self._parked)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free - self.num_parked

    def alloc(self, n: int) -> list[int]:
        """n page ids, or OutOfPages (and nothing changes) when fewer are free; idle cached
        pages are evicted, least recently used first, once the never-cached ones run out."""
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} KV pages, {self.num_free} free of {self.num_pages}")
        short = n - len(self._free)
        if short > 0:
            assert self.prefixes is not None
            self._free += self.prefixes.evict(short)
        pages = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        for page in pages:
            self._holders[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of these cached pages (a prefix hit)."""
        for page in pages:
            self._holders[page] += 1
            if self.prefixes is not None:
                self.prefixes.idle.pop(page, None)

    def free(self, pages: list[int], after_step: int | None = None) -> None:
        """One holder fewer for each page; those none holds return (after `after_step`)."""
        returned = []
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                returned.append(page)
        if not returned:
            return
        if after_step is None or after_step <= self._completed_through:
            self._return(returned)
        else:
            self._parked.append((after_step, returned))

    def release(self, completed_step: int) -> None:
        """Return the pages parked behind steps up to `completed_step`."""
        self._completed_through = max(self._completed_through, completed_step)
        keep = []
        for step, pages in self._parked:
            if step <= completed_step:
                self._return(pages)
            else:
                keep.append((step, pages))
        self._parked = keep

    def _return(self, pages: list[int]) -> None:
        for page in pages:
            if self._holders[page]:  # a prefix hit took it while it was parked
                continue
            if self.prefixes is not None and self.prefixes.holds(page):
                self.prefixes.idle[page] = None  # the most recently used
            else:
                self._free.append(page)
