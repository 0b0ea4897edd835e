"""Expert weights in the page pool: the runner's side of the weight page table (SPEC sections 3 and 6).

What it does: puts together the host mirror (``mirror.py``: planes and LUTs in host memory, copies into
the pool, reloads on a side stream), the kernels' tables (``tables.py``) and the MoE forward
(``moe.py``) for every expert linear block in the ``WeightPageTable``'s order. ``place`` makes the
initial placement; ``apply`` mirrors the engine core's ``WeightMoves`` on the device: committed reloads
and demotions rewrite the tables (and a demotion its LUT, on the compute stream, ordered after every
kernel that read the old one), reloads start their copies; ``finished_reloads`` says which reload
batches completed. It decides nothing: the engine core changed the page table already.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pwrun.core.decision import WeightMoves
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.core.pool import PagePool
from pwrun.core.weight_table import CopyOrder, WeightPageTable
from pwrun.model.lean import LeanMoEModel
from pwrun.runner.experts.mirror import HostMirror
from pwrun.runner.experts.moe import APMoE
from pwrun.runner.experts.tables import KernelTables


class ExpertStore:
    """Every expert linear block of ``model`` (in ``table``'s order, paged by ``wpt`` in ``pool``) in ``memory``."""

    def __init__(self, artifact: Any, model: LeanMoEModel, table: BlockTable, wpt: WeightPageTable, pool: PagePool,
                 memory: torch.Tensor, use_kernel: bool) -> None:
        self.wpt, self.pool, self.memory = wpt, pool, memory
        keys = [(int(la), int(e), UNITS[u]) for la, e, u in zip(table.layer, table.expert, table.unit, strict=True)]
        shapes = table.shapes(model.spec)
        lut_dtype = torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float16
        page_bytes = pool.cfg.page_bytes
        self.mirror = HostMirror(artifact, keys, shapes, [int(b) for b in table.bits], lut_dtype, memory, page_bytes)
        self.tables = KernelTables(keys, model.spec, memory, page_bytes, lut_dtype)
        self.moe = APMoE(model, keys, shapes, wpt, self.tables, use_kernel)

    @property
    def bytes_h2d(self) -> int:
        """Bytes copied host -> device so far (placement and reloads; demotions copy only a smaller LUT)."""
        return self.mirror.bytes_h2d

    def place(self, q_bits: np.ndarray) -> None:
        """Initial placement at bitwidths ``q_bits`` [n]; raises ``OutOfPages`` if the pool is too small.

        Returns once the planes are on the device: the copies are queued without blocking, and a step queued
        behind them would count the upload as its own time."""
        orders: list[CopyOrder] = []
        for i in range(self.wpt.n):
            orders += self.wpt.place(self.pool, i, int(q_bits[i]))
        self.mirror.copy(orders)
        self._sync(list(range(self.wpt.n)))
        if self.memory.is_cuda:
            torch.cuda.current_stream(self.memory.device).synchronize()

    def apply(self, moves: WeightMoves) -> None:
        """Mirror ``moves`` on the device, in order: committed reloads, demotions, reloads to start."""
        self._sync(moves.committed)
        self.mirror.copy(moves.lut_copies)
        self._sync(moves.lowered)
        self.mirror.start(moves.reloads)

    def finished_reloads(self) -> list[int]:
        """Reload batches whose copies completed since the last call."""
        return self.mirror.finished()

    def _sync(self, blocks: list[int]) -> None:
        self.moe.invalidate(blocks)
        self.tables.sync(np.asarray(blocks, dtype=np.int64), self.wpt)

    def take_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """The live routing statistics since the last call (see ``APMoE.take_stats``)."""
        return self.moe.take_stats()
