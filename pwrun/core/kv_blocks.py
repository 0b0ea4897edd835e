"""KV blocks in the shared page pool and per-request block tables (SPEC section 5; control plane, no torch).

What it does: ``PooledBlockAllocator`` hands out KV blocks with reference counts; block b is
``2 * num_layers`` pages of the ``PagePool`` (layer l's K page and V page, anywhere in the pool),
taken from the pool's free pages when the block is allocated and handed back when its last
reference goes, so the KV cache grows into pages that demoted bit-planes freed and shrinks to give
them back. ``pages(b)`` tells the runner where block b's pages are; block ids are small integers
reused from a free list (they index the runner's device-side page table). ``BlockTables`` keeps one
table per request (logical block j of a request lives in block ``table[j]``): token t is stored in
slot ``table[t // block_size] * block_size + t % block_size``, as PagedAttention does.
"""

from __future__ import annotations

from typing import Protocol

from pwformat.cost import kv_block_pages
from pwrun.core.pool import KV, PagePool


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks: the scheduler must queue or preempt (never a user error)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class PooledBlockAllocator:
    """KV blocks of ``block_pages`` pages each (``pwformat.cost.kv_block_pages``), over ``pool``; at most
    ``max_blocks`` ids."""

    def __init__(self, pool: PagePool, num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError("num_layers must be positive")
        self.pool, self.num_layers = pool, num_layers
        self.block_pages = kv_block_pages(num_layers)
        self.max_blocks = pool.cfg.num_pages // self.block_pages
        self.num_blocks = self.max_blocks
        self._ids = list(range(self.max_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._pages: dict[int, list[int]] = {}
        self.new_blocks: list[int] = []  # allocated since the runner last mapped them

    @property
    def num_free(self) -> int:
        """F_blk of SPEC Eq. 7: KV blocks the pool's free pages could hold now."""
        return min(self.pool.num_free // self.block_pages, len(self._ids))

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
        """The block's 2L pages: layer l's K page at index 2l, its V page at 2l + 1."""
        return self._pages[block]

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
            self.pool.release(self._pages.pop(block), KV)
            self._ids.append(block)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)


class KVAllocator(Protocol):
    """What ``BlockTables`` needs from an allocator."""

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def release(self, block: int) -> None: ...


class BlockTables:
    """Per-request block tables over one allocator (``PooledBlockAllocator``; tests may give a fake one)."""

    def __init__(self, allocator: KVAllocator, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator, self.block_size = allocator, block_size
        self._tables: dict[int, list[int]] = {}

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

    def free(self, rid: int) -> None:
        """Release every block of ``rid`` and forget its table."""
        for b in self._tables.pop(rid, []):
            self.allocator.release(b)

    def __contains__(self, rid: int) -> bool:
        return rid in self._tables
