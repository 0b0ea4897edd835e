"""The paged KV cache stored in the shared page pool (data plane; SPEC section 5).

What it does: views the pool's bytes as pages of [block_size, Hkv, D] (one page = one layer's K
or V of one KV block) and keeps a device table ``unit`` [2L, max_blocks] int64: row 2l holds the
page of layer l's K of every KV block, row 2l+1 its V. It offers the ``PagedKVCache`` interface
(``write``, ``gather``), so the reference attention runs unchanged, and ``layer_tables`` for the
Triton paged-decode kernel.
Blocks are mapped by ``map_blocks`` with the pages the engine core's allocator gave them; it allocates nothing.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import paged_decode_attention
from kernels.rope_kv import rope_kv_write
from kernels.varlen_attention import varlen_paged_attention
from pwrun.model.ops import rope_inv_freq
from pwrun.model.step import StepTensors


class PooledKVCache:
    """KV blocks of ``num_layers`` layers (ids below ``max_blocks``) in the pages of ``memory`` (uint8
    [num_pages * page_bytes]); ``use_kernel``: the Triton paths (paged decode attention, RoPE + KV write)."""

    def __init__(self, memory: torch.Tensor, num_layers: int, max_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, use_kernel: bool = True) -> None:
        self.block_size = block_size
        self.use_kernel = use_kernel
        self.pages = memory.view(dtype).view(-1, block_size, num_kv_heads, head_dim)
        self.rows = self.pages.view(-1, num_kv_heads, head_dim)
        self.unit = torch.zeros(2 * num_layers, max(max_blocks, 1), dtype=torch.int64, device=memory.device)
        self._inv_freq: dict[tuple[int, float], torch.Tensor] = {}
        self._step_units: torch.Tensor | None = None  # [2L, S, nb] int32 pages of this decode step's blocks

    def map_blocks(self, new: tuple[tuple[int, tuple[int, ...]], ...]) -> None:
        """Point the device table at the pages of newly allocated blocks: (block id, its 2L pages) pairs."""
        if not new:
            return
        idx = torch.tensor([b for b, _ in new], dtype=torch.int64, device=self.unit.device)
        self.unit[:, idx] = torch.tensor([p for _, p in new], dtype=torch.int64, device=self.unit.device).T

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at ``slots`` [T] int64 (slot = block * block_size + offset)."""
        bs = self.block_size
        blk, off = slots // bs, slots % bs
        self.rows.index_copy_(0, self.unit[2 * layer][blk] * bs + off, k)
        self.rows.index_copy_(0, self.unit[2 * layer + 1][blk] * bs + off, v)

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1 ([length, Hkv, D] each) through ``block_table`` [nb]."""
        k = self.pages.index_select(0, self.unit[2 * layer][block_table]).flatten(0, 1)[:length]
        v = self.pages.index_select(0, self.unit[2 * layer + 1][block_table]).flatten(0, 1)[:length]
        return k, v

    def begin_step(self, step: StepTensors) -> None:
        """Per-step setup (the model calls it first): with the kernels, every layer's K/V page table at once."""
        self._step_units = None
        if self.use_kernel and step.padded_tables is not None:
            # [2L, S, nb] int32 in rows padded to 16 bytes: each layer's table starts aligned (see StepTensors.build)
            s, nb = step.padded_tables.shape
            flat = torch.empty(self.unit.shape[0], -(-s * nb // 4) * 4, dtype=torch.int32, device=self.unit.device)
            flat[:, : s * nb] = self.unit[:, step.padded_tables.long()].flatten(1)
            self._step_units = flat[:, : s * nb].view(-1, s, nb)

    def _tables(self, layer: int, step: StepTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 [S, nb] pages of layer ``layer``'s K and V for the step's padded block tables."""
        assert step.padded_tables is not None
        units = self._step_units
        if units is not None and units.shape[1:] == step.padded_tables.shape:
            return units[2 * layer], units[2 * layer + 1]
        bt = step.padded_tables.long()
        return self.unit[2 * layer][bt].to(torch.int32), self.unit[2 * layer + 1][bt].to(torch.int32)

    def varlen_attention(self, layer: int, q: torch.Tensor, step: StepTensors, scale: float,
                         window: int = 0) -> torch.Tensor | None:
        """Triton variable-length paged attention [T, Hq, D] for any step (prompt chunks beside decodes) when
        the kernels run; None elsewhere (the caller runs the reference)."""
        if (not self.use_kernel or step.padded_tables is None or step.context_lens_t is None
                or step.query_start_t is None):
            return None
        kt, vt = self._tables(layer, step)
        return varlen_paged_attention(q, self.pages, self.pages, kt, vt, step.query_start_t, step.context_lens_t,
                                      step.max_query_len, scale, window)

    def decode_attention(self, layer: int, q: torch.Tensor, step: StepTensors, scale: float) -> torch.Tensor | None:
        """Triton paged-decode attention [S, Hq, D] for a pure decode step on CUDA; None elsewhere (reference)."""
        if not self.use_kernel or step.padded_tables is None or step.context_lens_t is None:
            return None
        kt, vt = self._tables(layer, step)
        return paged_decode_attention(q, self.pages, self.pages, kt, step.context_lens_t, scale, v_block_tables=vt)

    def write_rope(self, layer: int, step: StepTensors, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   theta: float) -> torch.Tensor | None:
        """RoPE on q/k [T, H*, D] and the K/V write in one Triton kernel (CUDA); returns rotated q, or None
        (then the caller runs the eager RoPE and ``write``)."""
        if not self.use_kernel:
            return None

        d = q.shape[-1]
        inv = self._inv_freq.get((d, theta))
        if inv is None:
            inv = self._inv_freq[(d, theta)] = rope_inv_freq(d, theta, q.device)
        return rope_kv_write(q, k, v, step.positions, inv, self.rows, step.slots, self.unit[2 * layer],
                             self.unit[2 * layer + 1], self.block_size)

    def layer_tables(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids [S, nb] of layer ``layer``'s K and of its V for block tables [S, nb]."""
        return self.unit[2 * layer][block_tables], self.unit[2 * layer + 1][block_tables]
