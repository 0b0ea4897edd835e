"""The device tables the fused MoE kernels read, kept in step with the weight page table (SPEC section 3).

What it does: per MoE layer and kind (routed / shared experts) the kernel reads plane word offsets
[rows, 8] int64, LUT element offsets [rows] int64 and committed bits [rows] int32 (``APExperts``).
Every layer's tables are row ranges of three device tensors, so one update of any set of blocks is
three scatters (``sync``), and the per-layer views the kernels read never change identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pwformat.layout import LUT_BYTES
from pwkernels.moe.experts import APExperts
from pwrun.core.planner.tables import UNITS
from pwrun.core.weight_table import WeightPageTable
from pwrun.model.inventory import SHARED_EXPERT
from pwrun.model.spec import ModelSpec

TABLE_ROW_ALIGN = 4  # rows: 4 int32 bits = 16 bytes (int64 offsets: 32 and 256 bytes)


@dataclass
class _LayerTables:
    plane_offset: torch.Tensor  # int64 [rows, 8] word offsets into the pool
    lut_offset: torch.Tensor  # int64 [rows] element offsets (16-bit) into the pool
    bits: torch.Tensor  # int32 [rows]


class KernelTables:
    """Tables of blocks ``keys`` (layer, expert, unit) over ``memory`` (uint8 pool bytes; pages of ``page_bytes``)."""

    def __init__(self, keys: list[tuple[int, int, str]], spec: ModelSpec, memory: torch.Tensor, page_bytes: int,
                 lut_dtype: torch.dtype) -> None:
        self.spec, self.page_bytes = spec, page_bytes
        self.device = memory.device
        self.words = memory.view(torch.int32)
        self.lut_view = memory.view(lut_dtype)
        row = np.array([0 if e == SHARED_EXPERT else 2 * e for _, e, _ in keys]) + np.array(
            [UNITS.index(u) for _, _, u in keys])
        counts: dict[tuple[int, str], int] = {}
        for la, e, _ in keys:
            k = (la, "shared" if e == SHARED_EXPERT else "routed")
            counts[k] = counts.get(k, 0) + 1
        # each layer's rows start at a multiple of TABLE_ROW_ALIGN, so every view the kernels read starts 16-byte
        # aligned: Triton specializes a kernel on whether each pointer argument is 16-byte aligned, so an odd
        # layer's tables at 8 bytes past it would compile every decode kernel a second time inside serving
        bases, total = {}, 0
        for k in sorted(counts):
            bases[k], total = total, total + -(-counts[k] // TABLE_ROW_ALIGN) * TABLE_ROW_ALIGN
        self._plane_offset = torch.zeros(total, 8, dtype=torch.int64, device=self.device)
        self._lut_offset = torch.zeros(total, dtype=torch.int64, device=self.device)
        self._bits = torch.zeros(total, dtype=torch.int32, device=self.device)
        self._tables: dict[tuple[int, str], _LayerTables] = {}
        for key, base in bases.items():
            end = base + counts[key]
            self._tables[key] = _LayerTables(self._plane_offset[base:end], self._lut_offset[base:end],
                                             self._bits[base:end])
        self.table_row = np.array([bases[(la, "shared" if e == SHARED_EXPERT else "routed")] + r
                                   for (la, e, _), r in zip(keys, row, strict=True)], dtype=np.int64)
        self._experts: dict[tuple[int, str], Any] = {}  # (layer, kind) -> cached APExperts (see ``experts``)

    def sync(self, blocks: np.ndarray, w: WeightPageTable) -> None:
        """Write the tables (plane/LUT offsets, bits) of ``blocks`` from the page table ``w``."""
        ii = np.asarray(blocks, dtype=np.int64)
        if ii.size == 0:
            return
        wpp, epp = self.page_bytes // 4, self.page_bytes // LUT_BYTES
        starts = w.plane_start[ii]
        offs = np.where((np.arange(8)[None, :] < w.q[ii][:, None]) & (starts >= 0), starts * wpp, 0)
        # one host -> device copy of [m, 11] int64: table row, 8 plane offsets, LUT offset, bits
        packed = self._to_device(np.concatenate([self.table_row[ii][:, None], offs, (w.lut_start[ii] * epp)[:, None],
                                                 w.q[ii][:, None]], axis=1).astype(np.int64))
        rows = packed[:, 0]
        self._plane_offset[rows] = packed[:, 1:9]
        self._lut_offset[rows] = packed[:, 9]
        self._bits[rows] = packed[:, 10].to(torch.int32)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """``a`` on the device without blocking the host: on CUDA through pinned memory, so that a table update
        made while the device computes a step is queued behind it instead of waiting for it (a pageable copy
        waits for the compute stream)."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def experts(self, layer: int, kind: str = "routed") -> APExperts:
        """The kernel's ``APExperts`` view of one layer's routed (or shared) experts.

        Built once per (layer, kind) and cached: it holds views of the pool and of the table rows, which
        ``sync`` updates in place, so it always reads the committed state. It is rebuilt only if one of those
        tensors was replaced (an identity check, no device work).
        """
        key = (layer, kind)
        t = self._tables[key]
        ex = self._experts.get(key)
        if ex is None or not (ex.pool is self.words and ex.lut_pool is self.lut_view
                              and ex.plane_offset is t.plane_offset and ex.lut_offset is t.lut_offset
                              and ex.bits is t.bits):
            moe = self.spec.layers[layer].moe
            assert moe is not None
            inter = moe.shared_intermediate if kind == "shared" else moe.expert_intermediate
            ex = self._experts[key] = APExperts(self.words, t.plane_offset, self.lut_view, t.lut_offset, t.bits,
                                                self.spec.hidden_size, inter)
        return ex
