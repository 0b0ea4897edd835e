"""Calibration tables as flat numpy arrays indexed by linear block i (control plane, no torch).

What it does: ``BlockTable`` holds, for every expert linear block i = (layer, expert, unit), the
supported bitwidths B (shared by all blocks), s_i^b (Eq. 2), M_i^b (Eq. 3), calibration tokens
and the expert's routing mass m (Eq. 1; the always-active shared expert gets mass 1). It is
built from the ``sensitivity`` and ``routing`` tables written by ``pwcal sensitivity``.
Global damage g_i^{b->b'} (Eq. 4) and freed bytes Delta (Eq. 3) are derived on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from pwrun.model.inventory import SHARED_EXPERT, expert_blocks
from pwrun.model.spec import ModelSpec

if TYPE_CHECKING:
    import pandas as pd

UNITS = ("gate_up", "down")


@dataclass(frozen=True)
class BlockTable:
    """Arrays over blocks: layer/expert/unit [n] int; sens/bytes [n, len(bits)]; tokens/mass [n]."""

    bits: np.ndarray
    layer: np.ndarray
    expert: np.ndarray
    unit: np.ndarray  # index into UNITS
    sens: np.ndarray
    bytes: np.ndarray
    tokens: np.ndarray
    mass: np.ndarray

    @property
    def n(self) -> int:
        return int(self.layer.size)

    def columns(self, bits: np.ndarray | int) -> np.ndarray:
        """Column of ``bits`` (a bitwidth, or [n] of them) in ``self.bits``, the planner's internal indexing of the
        [n, nb] arrays; raises ``ValueError`` for a bitwidth the table does not have. One table lookup: cheap on
        the runtime planner's path."""
        col = self._column_of.take(bits, mode="clip")  # out of range lands on an end entry, which is -1
        if (col < 0).any():
            bad = sorted(set(np.atleast_1d(bits).tolist()) - set(self.bits.tolist()))
            raise ValueError(f"bitwidths {bad} are not among the calibrated ones {self.bits.tolist()}")
        return col

    @cached_property
    def _column_of(self) -> np.ndarray:
        """[bits[-1] + 2] int64: the column of bitwidth b at b, -1 where the table has no such bitwidth."""
        lut = np.full(int(self.bits[-1]) + 2, -1, dtype=np.int64)
        lut[self.bits] = np.arange(self.bits.size)
        return lut

    def total_bytes(self, q_bits: np.ndarray) -> int:
        """Sum of M_i^{q_i} (bytes) for the bitwidths ``q_bits`` [n]."""
        return int(self.bytes[np.arange(self.n), self.columns(q_bits)].sum())

    def uniform_bytes(self, bits: float) -> int:
        """Expert bytes (int) at uniform-equivalent ``bits``: an integer b is sum_i M_i^b, every block at b bits
        (SPEC section 2's memory accounting); a fraction interpolates linearly between the neighbouring
        bitwidths (3.5 = midway between uniform 3 and 4). Raises ``ValueError`` if a neighbouring bitwidth is
        not in ``self.bits`` (callers clamp to [bits[0], bits[-1]], e.g. ``BucketPolicy.neutral_from_bytes``)."""
        lo, hi = int(np.floor(bits)), int(np.ceil(bits))
        b_lo = int(self.bytes[:, self.columns(lo)].sum())
        b_hi = int(self.bytes[:, self.columns(hi)].sum())
        return int(b_lo + (bits - lo) * (b_hi - b_lo))

    def global_damage(self) -> np.ndarray:
        """g [n, nb, nb] float64, read-only: g[i, a, c] = max(s_i^{bits[c]} - s_i^{bits[a]}, 0) (Eq. 4; only c < a
        matters). Computed once per table (the runtime planner refreshes d_hat from it every few steps)."""
        return self._global_damage

    @cached_property
    def _global_damage(self) -> np.ndarray:
        g = np.maximum(self.sens[:, None, :] - self.sens[:, :, None], 0.0)
        g.setflags(write=False)
        return g

    def shapes(self, spec: ModelSpec) -> list[tuple[int, int]]:
        """(N, K) of every block in table order, from ``spec``'s inventory (the input of ``pwformat.cost``)."""
        by_key = {(b.layer, b.expert, b.unit): (b.n, b.k) for b in expert_blocks(spec)}
        return [by_key[(int(la), int(e), UNITS[u])] for la, e, u in zip(self.layer, self.expert, self.unit,
                                                                          strict=True)]

    def freed(self) -> np.ndarray:
        """Delta [n, nb, nb]: Delta[i, a, c] = M_i^{bits[a]} - M_i^{bits[c]} (Eq. 3)."""
        return self.bytes[:, :, None] - self.bytes[:, None, :]

    @staticmethod
    def from_frames(sensitivity: pd.DataFrame, routing: pd.DataFrame) -> BlockTable:
        """Build from the ``sensitivity`` and ``routing`` tables (schemas in ``pwformat.tables``)."""
        bits = np.sort(sensitivity.bits.unique())
        wide = sensitivity.pivot_table(index=["layer", "expert", "unit"], columns="bits",
                                       values=["sensitivity", "bytes"], aggfunc="first").sort_index()
        idx = wide.index.to_frame(index=False)
        meta = sensitivity.drop_duplicates(["layer", "expert", "unit"]).set_index(["layer", "expert", "unit"])
        mass = routing.set_index(["layer", "expert"]).mass
        keys = list(zip(idx.layer, idx.expert, strict=True))
        m = np.array([1.0 if e == SHARED_EXPERT else float(mass.get((la, e), 0.0)) for la, e in keys])
        return BlockTable(
            bits=bits.astype(np.int64),
            layer=idx.layer.to_numpy(np.int64),
            expert=idx.expert.to_numpy(np.int64),
            unit=np.array([UNITS.index(u) for u in idx.unit], dtype=np.int64),
            sens=wide["sensitivity"][bits].to_numpy(np.float64),
            bytes=wide["bytes"][bits].to_numpy(np.int64),
            tokens=meta.loc[list(wide.index), "tokens"].to_numpy(np.int64),
            mass=m,
        )
