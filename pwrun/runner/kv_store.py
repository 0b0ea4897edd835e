"""The paged KV cache stored in the shared page pool (data plane; SPEC section 5).

What it does: views the pool's bytes, per layer, as units of [block_size, Hkv, D] (a page is one
unit of the widest layer's K or V, or ``sub`` units of a narrower layer: ``pwformat.kv_layout``) and
keeps a device table ``unit`` [2L, max_blocks] int64: row 2l holds the unit of layer l's K of every KV
block (in layer l's view), row 2l+1 its V. It offers the ``PagedKVCache`` interface (``write``,
``gather``), so the reference attention runs unchanged, and ``layer_tables`` for the Triton
paged-decode kernel. Blocks are mapped by ``map_blocks`` with the pages the engine core's allocator
gave them; it allocates nothing. A sliding-window layer never reads the units of blocks outside its
window (their pages may already belong to something else).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pwformat.kv_layout import KVLayout
from pwkernels.paged_attention import paged_decode_attention
from pwkernels.rope_kv import rope_kv_write
from pwkernels.varlen_attention import varlen_paged_attention
from pwrun.model.ops import rope_inv_freq
from pwrun.model.step import StepTensors


class PooledKVCache:
    """KV blocks of ``num_layers`` layers (ids below ``max_blocks``) in the pages of ``memory`` (uint8
    [num_pages * page_bytes]); ``use_kernel``: the Triton paths (paged decode attention, RoPE + KV write).
    Every layer has ``num_kv_heads`` x ``head_dim``, unless ``layers`` gives (Hkv, D, window) per layer."""

    def __init__(self, memory: torch.Tensor, num_layers: int, max_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, use_kernel: bool = True,
                 layers: Sequence[tuple[int, int, int | None]] | None = None) -> None:
        self.block_size = block_size
        self.use_kernel = use_kernel
        shapes = list(layers) if layers is not None else [(num_kv_heads, head_dim, None)] * num_layers
        self.layout = KVLayout.of(shapes)
        flat = memory.view(dtype)
        views = {(h, d): flat.view(-1, block_size, h, d) for h, d, _ in shapes}
        self.layer_pages = [views[(h, d)] for h, d, _ in shapes]
        self.layer_rows = [p.view(-1, p.shape[2], p.shape[3]) for p in self.layer_pages]
        widest = self.layout.token_elems.index(self.layout.page_token_elems)
        self.pages, self.rows = self.layer_pages[widest], self.layer_rows[widest]
        self.unit = torch.zeros(2 * len(shapes), max(max_blocks, 1), dtype=torch.int64, device=memory.device)
        self._inv_freq: dict[tuple[int, float, int | None], torch.Tensor] = {}
        self._step_units: torch.Tensor | None = None  # [2L, S, nb] int32 pages of this decode step's blocks

    def map_blocks(self, new: tuple[tuple[int, tuple[int, ...]], ...]) -> None:
        """Point the device table at the pages of newly allocated blocks: (block id, its pages in layout order)
        pairs."""
        if not new:
            return
        lay = self.layout
        idx = torch.tensor([b for b, _ in new], dtype=torch.int64, device=self.unit.device)
        units = [[u for layer in range(lay.num_layers) for u in lay.units(layer, p)] for _, p in new]
        self.unit[:, idx] = torch.tensor(units, dtype=torch.int64, device=self.unit.device).T

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at ``slots`` [T] int64 (slot = block * block_size + offset)."""
        # a view made per call: with autograd (the Fisher importance) a cached view of a shared base is refused
        bs, rows = self.block_size, self.layer_pages[layer].flatten(0, 1)
        blk, off = slots // bs, slots % bs
        rows.index_copy_(0, self.unit[2 * layer][blk] * bs + off, k)
        rows.index_copy_(0, self.unit[2 * layer + 1][blk] * bs + off, v)

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1 ([length, Hkv, D] each) through ``block_table`` [nb]."""
        pages = self.layer_pages[layer]
        k = pages.index_select(0, self.unit[2 * layer][block_table]).flatten(0, 1)[:length]
        v = pages.index_select(0, self.unit[2 * layer + 1][block_table]).flatten(0, 1)[:length]
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
        pages = self.layer_pages[layer]
        return varlen_paged_attention(q, pages, pages, kt, vt, step.query_start_t, step.context_lens_t,
                                      step.max_query_len, scale, window)

    def decode_attention(self, layer: int, q: torch.Tensor, step: StepTensors, scale: float,
                         window: int | None = None) -> torch.Tensor | None:
        """Triton paged-decode attention [S, Hq, D] for a pure decode step on CUDA (the last ``window`` positions
        of each sequence on a sliding-window layer); None elsewhere (reference)."""
        if not self.use_kernel or step.padded_tables is None or step.context_lens_t is None:
            return None
        kt, vt = self._tables(layer, step)
        pages = self.layer_pages[layer]
        return paged_decode_attention(q, pages, pages, kt, step.context_lens_t, scale, v_block_tables=vt,
                                      window=window)

    def write_rope(self, layer: int, step: StepTensors, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   theta: float, rotary_dim: int | None = None) -> torch.Tensor | None:
        """RoPE on q/k [T, H*, D] and the K/V write in one Triton kernel (CUDA); returns rotated q, or None
        (then the caller runs the eager RoPE and ``write``). ``rotary_dim``: partial RoPE (``rope_inv_freq``)."""
        if not self.use_kernel:
            return None

        d = q.shape[-1]
        key = (d, theta, rotary_dim)
        inv = self._inv_freq.get(key)
        if inv is None:
            inv = self._inv_freq[key] = rope_inv_freq(d, theta, q.device, rotary_dim)
        return rope_kv_write(q, k, v, step.positions, inv, self.layer_rows[layer], step.slots, self.unit[2 * layer],
                             self.unit[2 * layer + 1], self.block_size)

    def layer_tables(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids [S, nb] of layer ``layer``'s K and of its V for block tables [S, nb]."""
        return self.unit[2 * layer][block_tables], self.unit[2 * layer + 1][block_tables]
