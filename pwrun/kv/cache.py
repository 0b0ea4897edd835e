"""Storage of the paged KV cache: one K and one V tensor of blocks per layer.

What it does: holds ``k[l], v[l]``: [num_blocks, block_size, Hkv, D] and writes a step's new
keys/values into their slots; ``gather`` reads one sequence's first ``length`` positions
through its block table (the pure-PyTorch reference path of paged attention). It does not
decide which block a token goes to (``blocks.py`` does).
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """K/V block storage; ``bytes_per_block`` is B_KV of SPEC Eq. 7 (all layers, K and V)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block across all layers, K and V (B_KV, SPEC Eq. 7)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at ``slots`` [T] int64 (slot = block * block_size + offset)."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1: two [length, Hkv, D] tensors.

        ``block_table``: [nb] int64 physical block ids of the sequence, nb * block_size >= length.
        """
        k = self.k[layer].index_select(0, block_table).flatten(0, 1)[:length]
        v = self.v[layer].index_select(0, block_table).flatten(0, 1)[:length]
        return k, v
