"""The weight page table (SPEC section 3) and where each block's planes and LUT sit in the page pool.

What it does: for every expert linear block i it keeps the supported bitwidths B_i, the
committed bitwidth q_i (what kernels read now), the target of an in-flight raise, the
state of each bit-plane p (GPU / CPU / IN_TRANSFER), the first pool page of each resident plane
and of the resident LUT, and the pages M_i^b takes at each b. It turns planner actions into pool
operations and **copy orders** for the data plane (which copies bytes and updates the kernels'
tables; this module moves no bytes):

* ``lower(i, b')``: q_i drops at a step boundary; the b'-bit LUT is written over the first pages
  of the b-bit LUT's run (it is at most half its size, so no page is needed), the LUT's tail
  pages and planes b'..q-1 go back to the pool. Nothing is copied to the host: the pinned host
  mirror already holds every plane (weights never change), so offloading is a release.
  ``lower_many`` does it for a whole demotion plan in one vectorized call.
* ``begin_raise(i, b)``: takes runs for planes q..b-1 and a fresh b-bit LUT (or fails and takes
  nothing), marks them IN_TRANSFER and returns the host->device copy orders;
  ``finish_raise(i)`` (once the copies are confirmed) raises q_i and frees the old LUT.

``check`` asserts the invariant q_i <= resident planes (and that the committed LUT is resident).
Control plane: numpy and ints, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pwrun.core.pool import WEIGHT, OutOfPages, PagePool

GPU = 0
CPU = 1
IN_TRANSFER = 2
PARENT_BITS = 8


@dataclass(frozen=True)
class CopyOrder:
    """Copy host mirror object -> pool pages starting at ``page``: plane ``index`` or the LUT of ``index`` bits."""

    block: int
    what: str  # "plane" or "lut"
    index: int
    page: int


class WeightPageTable:
    """Arrays over n blocks: q [n]; state, plane_start [n, 8]; lut_start, lut_bits, pending [n]."""

    def __init__(self, bits: list[int], plane_pages: np.ndarray, lut_pages: np.ndarray) -> None:
        """``plane_pages`` [n]: pages per plane; ``lut_pages`` [n, 9]: pages of the b-bit LUT at column b."""
        self.bits = np.asarray(bits, dtype=np.int64)
        self.plane_pages = np.asarray(plane_pages, dtype=np.int64)
        self.lut_pages = np.asarray(lut_pages, dtype=np.int64)
        self.n = self.plane_pages.size
        self.q = np.zeros(self.n, dtype=np.int64)
        self.state = np.full((self.n, PARENT_BITS), CPU, dtype=np.int8)
        self.plane_start = np.full((self.n, PARENT_BITS), -1, dtype=np.int64)
        self.lut_start = np.full(self.n, -1, dtype=np.int64)
        self.lut_bits = np.zeros(self.n, dtype=np.int64)
        self.pending = np.zeros(self.n, dtype=np.int64)  # target bits of an in-flight raise, 0 = none
        self._new_lut = np.full(self.n, -1, dtype=np.int64)
        self.version = 0  # counts the changes of q, state, pending and lut_bits (readers cache what they derive)

    def pages_at(self, b: int | np.ndarray) -> np.ndarray:
        """[n] pool pages of every block at bitwidth(s) b (b planes + the b-bit LUT)."""
        b = np.broadcast_to(np.asarray(b, dtype=np.int64), (self.n,))
        return b * self.plane_pages + self.lut_pages[np.arange(self.n), b]

    def pages_at_mean_bits(self, mean_bits: float) -> float:
        """Pool pages of every block at ``mean_bits`` (between two stored bitwidths: linear between their totals;
        below the lowest or above the highest: that one's)."""
        bits = sorted(int(b) for b in self.bits)
        if mean_bits <= bits[0]:
            return float(self.pages_at(bits[0]).sum())
        if mean_bits >= bits[-1]:
            return float(self.pages_at(bits[-1]).sum())
        lo = max(b for b in bits if b <= mean_bits)
        hi = min(b for b in bits if b >= mean_bits)
        p_lo, p_hi = float(self.pages_at(lo).sum()), float(self.pages_at(hi).sum())
        return p_lo if hi == lo else p_lo + (mean_bits - lo) / (hi - lo) * (p_hi - p_lo)

    def mean_bits_for_pages(self, pages: float) -> float:
        """The least mean bits whose ``pages_at_mean_bits`` reaches ``pages`` (its inverse; the lowest or highest
        stored bitwidth outside their range)."""
        bits = sorted(int(b) for b in self.bits)
        totals = [float(self.pages_at(b).sum()) for b in bits]
        if pages <= totals[0]:
            return float(bits[0])
        for b0, p0, b1, p1 in zip(bits, totals, bits[1:], totals[1:], strict=False):
            if pages <= p1:  # and > p0: so p1 > p0
                return b0 + (pages - p0) / (p1 - p0) * (b1 - b0)
        return float(bits[-1])

    def resident_depth(self) -> np.ndarray:
        """[n] number of leading planes (0, 1, ...) that are on the device."""
        on = self.state == GPU
        return np.where(on.all(axis=1), PARENT_BITS, np.argmin(on, axis=1))

    def _check_bits(self, b: int) -> None:
        if b not in self.bits:
            raise ValueError(f"bitwidth {b} is not one of {self.bits.tolist()}")

    def place(self, pool: PagePool, i: int, b: int) -> list[CopyOrder]:
        """Initial placement of block i at b bits (nothing resident yet); ``OutOfPages`` if the pool is short."""
        self._check_bits(b)
        if self.q[i] != 0:
            raise ValueError(f"block {i} is already placed")
        taken: list[tuple[int, int]] = []
        try:
            for _p in range(b):
                taken.append((pool.allocate_run(int(self.plane_pages[i])), int(self.plane_pages[i])))
            taken.append((pool.allocate_run(int(self.lut_pages[i, b])), int(self.lut_pages[i, b])))
        except OutOfPages:
            for s, n in taken:
                pool.release_run(s, n, WEIGHT)
            raise
        orders = []
        for p in range(b):
            self.plane_start[i, p], self.state[i, p] = taken[p][0], GPU
            orders.append(CopyOrder(i, "plane", p, taken[p][0]))
        self.lut_start[i], self.lut_bits[i] = taken[b][0], b
        self.q[i] = b
        self.version += 1
        return [*orders, CopyOrder(i, "lut", b, taken[b][0])]

    def lower(self, pool: PagePool, i: int, b: int) -> list[CopyOrder]:
        """q_i <- b (< q_i) now; frees planes b..q-1 and the LUT's tail. Returns the LUT copy order."""
        self._check_bits(b)
        q = int(self.q[i])
        if not b < q or self.pending[i]:
            raise ValueError(f"block {i}: cannot lower from {q} to {b} bits (pending raise: {self.pending[i]})")
        for p in range(b, q):
            pool.release_run(int(self.plane_start[i, p]), int(self.plane_pages[i]), WEIGHT)
            self.plane_start[i, p], self.state[i, p] = -1, CPU
        keep, have = int(self.lut_pages[i, b]), int(self.lut_pages[i, q])
        if have > keep:
            pool.release_run(int(self.lut_start[i]) + keep, have - keep, WEIGHT)
        self.lut_bits[i] = b
        self.q[i] = b
        self.version += 1
        return [CopyOrder(i, "lut", b, int(self.lut_start[i]))]

    def lower_many(self, pool: PagePool, blocks: np.ndarray, to_bits: np.ndarray) -> list[CopyOrder]:
        """``lower`` for distinct ``blocks`` [m] to ``to_bits`` [m] at once (an admission under pressure demotes
        hundreds per step): the same pool and table state and the same copy orders, in block order; all or
        nothing, ``ValueError`` as ``lower`` raises it (first offending block), or for arrays that are not 1-D
        integer arrays of one length, ids outside 0..n-1 or a block given twice. ``lower`` stays as its
        block-by-block reference (SPEC section 3: q_i drops at a step boundary, planes above it are released)."""
        i, b = np.asarray(blocks), np.asarray(to_bits)
        if i.shape != b.shape or i.ndim != 1 or not (np.issubdtype(i.dtype, np.integer) or i.size == 0) or not (
                np.issubdtype(b.dtype, np.integer) or b.size == 0):
            raise ValueError("blocks and to_bits must be 1-D integer arrays of one length")
        i, b = i.astype(np.int64), b.astype(np.int64)
        if ((i < 0) | (i >= self.n)).any():
            raise ValueError(f"a block id is not in 0..{self.n - 1}")
        if np.unique(i).size != i.size:
            raise ValueError("a block is lowered twice in one call")
        bad = np.flatnonzero(~np.isin(b, self.bits))
        if bad.size:
            self._check_bits(int(b[bad[0]]))
        q = self.q[i]
        bad = np.flatnonzero((b >= q) | (self.pending[i] != 0))
        if bad.size:
            k = bad[0]
            raise ValueError(f"block {int(i[k])}: cannot lower from {int(q[k])} to {int(b[k])} bits "
                             f"(pending raise: {int(self.pending[i[k]])})")
        p = np.arange(PARENT_BITS)[None, :]
        drop = (p >= b[:, None]) & (p < q[:, None])  # [m, 8] planes b..q-1 go back to the pool
        rows, planes = np.nonzero(drop)
        keep, have = self.lut_pages[i, b], self.lut_pages[i, q]
        pool.release_runs(np.concatenate([self.plane_start[i[rows], planes], self.lut_start[i] + keep]),
                          np.concatenate([self.plane_pages[i[rows]], np.maximum(have - keep, 0)]), WEIGHT)
        self.plane_start[i[rows], planes] = -1
        self.state[i[rows], planes] = CPU
        self.lut_bits[i] = b
        self.q[i] = b
        self.version += 1
        return [CopyOrder(blk, "lut", bits, start)
                for blk, bits, start in zip(i.tolist(), b.tolist(), self.lut_start[i].tolist(), strict=True)]

    def begin_raise(self, pool: PagePool, i: int, b: int) -> list[CopyOrder] | None:
        """Take pages for raising block i to b bits; None (nothing taken) if the pool has no room."""
        self._check_bits(b)
        q = int(self.q[i])
        if not b > q or self.pending[i]:
            raise ValueError(f"block {i}: cannot raise from {q} to {b} bits (pending raise: {self.pending[i]})")
        taken: list[tuple[int, int]] = []
        try:
            for _p in range(q, b):
                taken.append((pool.allocate_run(int(self.plane_pages[i])), int(self.plane_pages[i])))
            taken.append((pool.allocate_run(int(self.lut_pages[i, b])), int(self.lut_pages[i, b])))
        except OutOfPages:
            for s, n in taken:
                pool.release_run(s, n, WEIGHT)
            return None
        orders = []
        for j, p in enumerate(range(q, b)):
            self.plane_start[i, p], self.state[i, p] = taken[j][0], IN_TRANSFER
            orders.append(CopyOrder(i, "plane", p, taken[j][0]))
        self._new_lut[i] = taken[-1][0]
        self.pending[i] = b
        self.version += 1
        return [*orders, CopyOrder(i, "lut", b, taken[-1][0])]

    def finish_raise(self, pool: PagePool, i: int) -> None:
        """The copies of block i's raise are confirmed: q_i <- its target, the old LUT's pages are freed."""
        b, q = int(self.pending[i]), int(self.q[i])
        if not b:
            raise ValueError(f"block {i} has no raise in flight")
        self.state[i, q:b] = GPU
        pool.release_run(int(self.lut_start[i]), int(self.lut_pages[i, q]), WEIGHT)
        self.lut_start[i], self.lut_bits[i] = self._new_lut[i], b
        self.q[i] = b
        self.pending[i] = 0
        self._new_lut[i] = -1
        self.version += 1

    def weight_pages(self) -> int:
        """Pages the weight objects hold now (committed + in transfer)."""
        in_flight = np.where(self.pending > 0, self.lut_pages[np.arange(self.n), self.pending], 0)
        return int((self.state != CPU).sum(axis=1) @ self.plane_pages
                   + self.lut_pages[np.arange(self.n), self.lut_bits].sum() + in_flight.sum())

    def check(self) -> None:
        """The invariant of SPEC section 3: q_i <= resident planes and the q_i-bit LUT is resident."""
        bad = np.flatnonzero(self.q > self.resident_depth())
        assert bad.size == 0, f"blocks {bad[:5].tolist()} read planes that are not resident"
        bad = np.flatnonzero((self.lut_bits != self.q) | (self.lut_start < 0))
        assert bad.size == 0, f"blocks {bad[:5].tolist()} have no resident LUT at their committed bits"
