"""KV blocks in the shared page pool and per-request block tables (SPEC section 5; control plane, no torch).

What it does: ``PooledBlockAllocator`` hands out KV blocks with reference counts; block b is
``layout.pages_per_block`` pages of the ``PagePool`` (each layer's K and V, anywhere in the pool;
``pwformat.kv_layout``), taken from the pool's free pages when the block is allocated and handed back
when its last reference goes, so the KV cache grows into pages that demoted bit-planes freed and shrinks
to give them back. A block that has fallen out of the sliding window of its sequence gives its
sliding-window layers' pages back at once (``trim``) and keeps only the global layers' pages. ``pages(b)``
tells the runner where block b's pages are; block ids are small integers reused from a free list (they
index the runner's device-side page table). ``BlockTables`` keeps one table per request (logical block j
of a request lives in block ``table[j]``): token t is stored in slot
``table[t // block_size] * block_size + t % block_size``, as PagedAttention does.
"""

from __future__ import annotations

from typing import Protocol

from pwformat.kv_layout import KVLayout
from pwrun.core.pool import KV, PagePool


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks: the scheduler must queue or preempt (never a user error)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class PooledBlockAllocator:
    """KV blocks of ``layout.pages_per_block`` pages each over ``pool`` (an int: that many uniform layers, two
    pages each); at most ``max_blocks`` ids. A trimmed block keeps only its global layers' pages, so up to
    every id may be in use at once: ``max_blocks`` counts whole blocks' pages and the trimmed blocks' ids come on
    top (as many as the pool could hold trimmed blocks)."""

    def __init__(self, pool: PagePool, layout: int | KVLayout) -> None:
        self.layout = KVLayout.uniform(layout) if isinstance(layout, int) else layout
        self.pool, self.num_layers = pool, self.layout.num_layers
        self.block_pages = self.layout.pages_per_block
        self._sliding = self.layout.sliding_pages
        self.max_blocks = self.layout.max_blocks(pool.cfg.num_pages)
        self.num_blocks = self.max_blocks
        self._ids = list(range(self.max_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._pages: dict[int, list[int]] = {}
        self._trimmed: set[int] = set()
        self.trimmed_pages = 0  # sliding-window pages given back by trims, in total
        self.new_blocks: list[int] = []  # allocated since the runner last mapped them

    @property
    def num_free(self) -> int:
        """F_blk of SPEC Eq. 7: KV blocks the pool's free pages could hold now."""
        return min(self.pool.num_free // self.block_pages, len(self._ids))

    @property
    def num_trimmed(self) -> int:
        """Blocks in use that gave back their sliding-window pages."""
        return len(self._trimmed)

    @property
    def kv_pages(self) -> int:
        """Pool pages the blocks in use hold."""
        return self.block_pages * len(self._refs) - len(self._sliding) * len(self._trimmed)

    @property
    def sliding_kv_pages(self) -> int:
        """Pool pages of sliding-window layers the blocks in use hold (untrimmed blocks only)."""
        return len(self._sliding) * (len(self._refs) - len(self._trimmed))

    def trimmed(self, block: int) -> bool:
        return block in self._trimmed

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (refcount 1); raises ``OutOfBlocks`` and takes nothing if the pool is short."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            b = self._ids.pop()
            self._pages[b] = self.pool.allocate_top(self.block_pages, KV)
            self._refs[b] = 1
            out.append(b)
        self.new_blocks.extend(out)
        return out

    def pages(self, block: int) -> list[int]:
        """The block's pages in ``layout`` order (layer l's from ``layout.offsets[l]``)."""
        return self._pages[block]

    def trim(self, block: int) -> bool:
        """Give the sliding-window layers' pages of ``block`` back to the pool (its global layers' stay). Only
        a block with one reference (no other sequence reads its window) that is not trimmed yet; True if done."""
        if not self._sliding or block in self._trimmed or self._refs.get(block, 0) != 1:
            return False
        pages = self._pages[block]
        self.pool.release([pages[i] for i in self._sliding], KV)
        self._trimmed.add(block)
        self.trimmed_pages += len(self._sliding)
        return True

    def share(self, block: int) -> None:
        if self._refs.get(block, 0) <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; at zero the block's pages go back to the pool."""
        if self._refs.get(block, 0) <= 0:
            raise ValueError(f"block {block} released twice")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            del self._refs[block]
            pages = self._pages.pop(block)
            if block in self._trimmed:
                self._trimmed.discard(block)
                gone = set(self._sliding)
                pages = [p for i, p in enumerate(pages) if i not in gone]
            self.pool.release(pages, KV)
            self._ids.append(block)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)


class KVAllocator(Protocol):
    """What ``BlockTables`` needs from an allocator."""

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def release(self, block: int) -> None: ...

    def trim(self, block: int) -> bool: ...


class BlockTables:
    """Per-request block tables over one allocator (``PooledBlockAllocator``; tests may give a fake one)."""

    def __init__(self, allocator: KVAllocator, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator, self.block_size = allocator, block_size
        self._tables: dict[int, list[int]] = {}
        self._trimmed: dict[int, int] = {}  # leading blocks of a request already offered to ``trim``

    def table(self, rid: int) -> list[int]:
        return self._tables[rid]

    def extra_blocks(self, rid: int, num_tokens: int) -> int:
        """Blocks still to allocate so that ``rid`` can hold ``num_tokens`` tokens."""
        have = len(self._tables.get(rid, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - have)

    def reserve(self, rid: int, num_tokens: int) -> None:
        """Grow ``rid``'s table to hold ``num_tokens`` tokens; ``OutOfBlocks`` leaves it unchanged."""
        need = self.extra_blocks(rid, num_tokens)
        new = self.allocator.allocate(need) if need else []
        self._tables.setdefault(rid, []).extend(new)

    def slots(self, rid: int, start: int, end: int) -> list[int]:
        """Physical slots of tokens ``start..end-1`` of ``rid`` (already reserved)."""
        t, bs = self._tables[rid], self.block_size
        if blocks_needed(end, bs) > len(t):
            raise ValueError(f"request {rid} has {len(t)} blocks, token {end - 1} not reserved")
        return [t[p // bs] * bs + p % bs for p in range(start, end)]

    def trim(self, rid: int, first_needed: int) -> int:
        """Offer ``rid``'s blocks that hold only positions below ``first_needed`` (the oldest key any later query
        of a sliding-window layer reads) to the allocator's ``trim``; returns the blocks trimmed now."""
        t = self._tables.get(rid)
        if t is None:
            return 0
        upto = min(max(first_needed, 0) // self.block_size, len(t))
        done = 0
        for j in range(self._trimmed.get(rid, 0), upto):
            done += self.allocator.trim(t[j])
        self._trimmed[rid] = max(upto, self._trimmed.get(rid, 0))
        return done

    def free(self, rid: int) -> None:
        """Release every block of ``rid`` and forget its table."""
        self._trimmed.pop(rid, None)
        for b in self._tables.pop(rid, []):
            self.allocator.release(b)

    def __contains__(self, rid: int) -> bool:
        return rid in self._tables
