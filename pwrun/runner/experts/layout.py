"""Pool pages of an AP block's planes and LUTs, and M_i^b rounded to whole pages (SPEC Eq. 3).

What it does: ``block_pages`` counts the pool pages of one bit-plane and of each b-bit LUT of blocks of
shapes (N, K); ``page_rounded_bytes`` turns them into the [n, nb] byte table the planner plans with.
"""

from __future__ import annotations

import numpy as np

from pwrun.ap.format import words_per_row
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.model.inventory import expert_blocks
from pwrun.model.spec import ModelSpec

LUT_BYTES = 2  # LUT entries are stored as 16-bit floats (fp16, or bf16 for a bf16 model)


def block_pages(shapes: list[tuple[int, int]], bits: list[int], page_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Pool pages per plane [n] and per b-bit LUT [n, 9] (column b) of blocks of shapes (N, K)."""
    plane_pages = np.array([-(-n * words_per_row(k) * 4 // page_bytes) for n, k in shapes], dtype=np.int64)
    lut_pages = np.zeros((len(shapes), 9), dtype=np.int64)
    for b in bits:
        lut_pages[:, b] = [-(-n * 2**b * LUT_BYTES // page_bytes) for n, _ in shapes]
    return plane_pages, lut_pages


def table_shapes(table: BlockTable, spec: ModelSpec) -> list[tuple[int, int]]:
    """(N, K) of every block of ``table``, in its order."""
    shapes = {(b.layer, b.expert, b.unit): (b.n, b.k) for b in expert_blocks(spec)}
    return [shapes[(int(la), int(e), UNITS[u])] for la, e, u in zip(table.layer, table.expert, table.unit,
                                                                     strict=True)]


def page_rounded_bytes(table: BlockTable, spec: ModelSpec, page_bytes: int) -> np.ndarray:
    """[n, nb] M_i^b rounded up to whole pool pages (bytes), for ``table``'s blocks and bitwidths."""
    plane_pages, lut_pages = block_pages(table_shapes(table, spec), [int(b) for b in table.bits], page_bytes)
    return (table.bits[None, :] * plane_pages[:, None] + lut_pages[:, table.bits]) * page_bytes
