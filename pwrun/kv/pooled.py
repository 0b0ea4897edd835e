"""KV block allocator whose blocks live in the shared page pool (SPEC section 5; control plane, no torch).

What it does: the same interface as ``BlockAllocator`` (``num_free``, ``allocate``, ``share``,
``release``, ``refcount``), but a KV block is not a slot of its own tensor: block b is
``2 * num_layers`` pages of the ``PagePool`` (layer l's K page and V page, anywhere in the pool),
taken from the pool's free pages when the block is allocated and handed back when its last
reference goes. So the KV cache grows into pages that demoted bit-planes freed, and shrinks to
give them back. ``pages(b)`` tells the runner where block b's pages are. Block ids are small
integers reused from a free list (they index the runner's device-side page table).
"""

from __future__ import annotations

from pwrun.kv.blocks import OutOfBlocks
from pwrun.pool.pages import KV, PagePool


class PooledBlockAllocator:
    """KV blocks of ``2 * num_layers`` pages each, over ``pool``; at most ``max_blocks`` ids."""

    def __init__(self, pool: PagePool, num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError("num_layers must be positive")
        self.pool, self.num_layers = pool, num_layers
        self.max_blocks = pool.cfg.num_pages // (2 * num_layers)
        self.num_blocks = self.max_blocks
        self._ids = list(range(self.max_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._pages: dict[int, list[int]] = {}
        self.new_blocks: list[int] = []  # allocated since the runner last mapped them

    @property
    def num_free(self) -> int:
        """F_blk of SPEC Eq. 7: KV blocks the pool's free pages could hold now."""
        return min(self.pool.num_free // (2 * self.num_layers), len(self._ids))

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
            self._pages[b] = self.pool.allocate_top(2 * self.num_layers, KV)
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
