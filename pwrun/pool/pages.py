"""A pool of fixed-size pages shared by KV blocks and weight bit-planes (SPEC sections 3, 5, 6).

What it does: hands out page ids from one free list and remembers each page's owner, a KV
block or a weight bit-plane, so that a plane freed by a demotion becomes pages the KV
allocator can take and the reverse. ``check`` verifies conservation (KV + weight + free =
pool) and that no page has two owners. It owns no memory: the model runner maps page ids to
byte ranges of one device tensor. Control plane: ints and lists only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

FREE = 0
KV = 1
WEIGHT = 2


class OutOfPages(RuntimeError):
    """Not enough free pages: the planner must free weight planes or the scheduler must wait/preempt."""


@dataclass(frozen=True)
class PoolConfig:
    """``num_pages`` pages of ``page_bytes`` bytes each."""

    num_pages: int
    page_bytes: int

    def __post_init__(self) -> None:
        if self.num_pages <= 0 or self.page_bytes <= 0:
            raise ValueError("num_pages and page_bytes must be positive")

    def pages_for(self, nbytes: int) -> int:
        """Pages that hold ``nbytes`` bytes (ceil)."""
        return -(-nbytes // self.page_bytes)


class PagePool:
    """Free list + owner kind per page."""

    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self._free: deque[int] = deque(range(cfg.num_pages))
        self._kind = [FREE] * cfg.num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def count(self, kind: int) -> int:
        return sum(1 for k in self._kind if k == kind)

    def allocate(self, n: int, kind: int) -> list[int]:
        """Take ``n`` pages for ``kind`` (KV or WEIGHT); raises ``OutOfPages`` and takes none if short."""
        if kind not in (KV, WEIGHT):
            raise ValueError(f"unknown page owner kind {kind}")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._kind[p] = kind
        return pages

    def release(self, pages: list[int], kind: int) -> None:
        """Return pages owned by ``kind``; raises ``ValueError`` on a double free or a foreign page."""
        for p in pages:
            if self._kind[p] != kind:
                raise ValueError(f"page {p} is not owned by kind {kind}")
        for p in pages:
            self._kind[p] = FREE
            self._free.append(p)

    def check(self) -> None:
        """Raise ``AssertionError`` unless pages are conserved and the free list matches the owners."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice on the free list"
        assert free == {p for p, k in enumerate(self._kind) if k == FREE}, "free list and owners disagree"
        assert self.count(KV) + self.count(WEIGHT) + len(free) == self.cfg.num_pages
