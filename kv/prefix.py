"""Prefix caching: full KV pages found again by the tokens they hold and every token before.

Block hashing, as vLLM does, rather than SGLang's radix tree: pages are the unit that is
shared, so a block of `page_size` tokens is the unit that is looked up, and a dict keyed by
(the block before's id, the block's tokens) finds a prompt's cached pages in one probe per
page. The key holds the tokens themselves, so two different prefixes never share a page (no
hash collision can), and a block's id is never reused, so an evicted block's children are
unreachable rather than wrong. A radix tree would also match inside a page; here a hit ends at
a page boundary.

A cached page holds every model's KV at its slots (the target's and a draft model's: one page
id indexes each cache); a draft model that deferred its prefill may not have written its own
yet, which the block says (`drafted`), so that a hit knows where the draft model must start.
Pages in use are counted by the allocator (kv/pages.py); a cached page no request uses is
`idle`, kept in least-recently-used order and evicted when the allocator needs pages.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

Key = tuple[int, tuple[int, ...]]  # (the block before's id, 0 for the first; the tokens)


@dataclass
class Block:
    id: int
    page: int
    # the token after the block in the sequence that wrote its page (None: not yet known);
    # an EAGLE head keeps that token's pair at the block's last slot
    next_token: int | None = None
    drafted: bool = False  # the draft model's KV of the page is written too


class PrefixIndex:
    def __init__(self, page_size: int, pairs_ahead: bool = False):
        """`pairs_ahead`: a drafter keeps at a block's last slot something of the token after
        the block (an EAGLE head's pair: token p's at slot p - 1), so a hit ends where the
        next token differs from the one the block's page was written with."""
        self.page_size = page_size
        self.pairs_ahead = pairs_ahead
        self.blocks: dict[Key, Block] = {}
        self.key_of: dict[int, Key] = {}  # page -> its block's key
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds
        self._ids = itertools.count(1)
        self.queried = 0  # prompt tokens looked up
        self.hit = 0  # of them, found cached

    def match(self, ids: list[int], max_tokens: int) -> list[int]:
        """The pages of the longest cached prefix of `ids` of at most `max_tokens` tokens
        (with `pairs_ahead`, whose every block was written before the token `ids` has next)."""
        ps, parent, pages = self.page_size, 0, []
        for start in range(0, max_tokens - ps + 1, ps):
            block = self.blocks.get((parent, tuple(ids[start : start + ps])))
            if block is None or (self.pairs_ahead and block.next_token != ids[start + ps]):
                break
            pages.append(block.page)
            parent = block.id
        return pages

    def record(self, queried: int, hit: int) -> None:
        """An admitted prompt's tokens looked up, and how many of them were found."""
        self.queried += queried
        self.hit += hit

    def insert(self, ids: list[int], pages: list[int], drafted: int | None = None) -> None:
        """Cache the full blocks of `ids` held by `pages` (page j holds tokens j * ps ..);
        a block cached already keeps its page. `drafted`: how many leading tokens have the
        draft model's KV written too (None: all of them)."""
        ps, parent = self.page_size, 0
        drafted = len(ids) if drafted is None else drafted
        for j, page in enumerate(pages[: len(ids) // ps]):
            key = (parent, tuple(ids[j * ps : (j + 1) * ps]))
            block = self.blocks.get(key)
            if block is None:
                if page in self.key_of:  # holds other tokens: the ids are not the page's
                    return
                block = self.blocks[key] = Block(next(self._ids), page)
                self.key_of[page] = key
            if block.page == page and block.next_token is None and len(ids) > (j + 1) * ps:
                block.next_token = ids[(j + 1) * ps]
            if block.page == page and drafted >= (j + 1) * ps:
                block.drafted = True
            parent = block.id

    def drafted_tokens(self, pages: list[int]) -> int:
        """How many leading tokens of a hit's `pages` have the draft model's KV written."""
        count = 0
        for page in pages:
            if not self.blocks[self.key_of[page]].drafted:
                break
            count += self.page_size
        return count

    def holds(self, page: int) -> bool:
        return page in self.key_of

    def evict(self, n: int) -> list[int]:
        """The n least recently used idle pages, dropped from the cache."""
        pages = []
        for _ in range(min(n, len(self.idle))):
            page, _ = self.idle.popitem(last=False)
            del self.blocks[self.key_of.pop(page)]
            pages.append(page)
        return pages

    @property
    def hit_rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0
