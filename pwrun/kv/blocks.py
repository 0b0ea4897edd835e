"""KV block allocator and per-sequence block tables (control plane: ints and lists, no torch).

What it does: hands out fixed-size KV blocks (``block_size`` tokens each) from a free list with
reference counts, and keeps one block table per sequence (logical block j of a sequence lives
in physical block ``table[j]``), as PagedAttention does. Token t of a sequence is stored in
slot ``table[t // block_size] * block_size + t % block_size``. It does not own memory: the
runner's ``PagedKVCache`` holds the tensors; a later stage puts the blocks in the shared page
pool with the weight bit-planes (SPEC section 5).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks: the scheduler must queue or preempt (never a user error)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Free list over ``num_blocks`` physical blocks with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (refcount 1 each); raises ``OutOfBlocks`` and takes none if short."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, block: int) -> None:
        """Add a reference to an allocated block (prefix sharing / fork)."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; the block returns to the free list at zero."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} released twice")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]


class KVAllocator(Protocol):
    """What ``BlockTables`` needs from an allocator (``BlockAllocator`` or the pooled one)."""

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def release(self, block: int) -> None: ...


class BlockTables:
    """Per-sequence block tables over one allocator (``BlockAllocator`` or ``PooledBlockAllocator``)."""

    def __init__(self, allocator: KVAllocator, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator, self.block_size = allocator, block_size
        self._tables: dict[int, list[int]] = {}

    def table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def extra_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks still to allocate so that ``seq_id`` can hold ``num_tokens`` tokens."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - have)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; ``OutOfBlocks`` leaves it unchanged."""
        need = self.extra_blocks(seq_id, num_tokens)
        new = self.allocator.allocate(need) if need else []
        self._tables.setdefault(seq_id, []).extend(new)

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Physical slots of tokens ``start..end-1`` of ``seq_id`` (already reserved)."""
        t, bs = self._tables[seq_id], self.block_size
        if blocks_needed(end, bs) > len(t):
            raise ValueError(f"sequence {seq_id} has {len(t)} blocks, token {end - 1} not reserved")
        return [t[p // bs] * bs + p % bs for p in range(start, end)]

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id`` and forget its table."""
        for b in self._tables.pop(seq_id, []):
            self.allocator.release(b)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables
