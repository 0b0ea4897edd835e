"""The weight page table (SPEC section 3): per linear block, committed q, desired d and plane states.

What it does: for every expert linear block i it keeps the supported bitwidths B_i (seed..8),
the committed bitwidth q_i (what kernels read now), the desired d_i (what the planner chose), the
state of each bit-plane p (GPU / CPU / IN_TRANSFER) and its pool pages, and M_i^b. Lowering is
``commit_lower`` (q drops at a step boundary; the surplus planes may then leave the device) and
raising is ``commit_raise`` (allowed only once the planes are resident). ``check`` asserts the
invariant q_i <= number of leading GPU-resident planes of i. Control plane: numpy and ints, no torch.
"""

from __future__ import annotations

import numpy as np

GPU = 0
CPU = 1
IN_TRANSFER = 2


class WeightPageTable:
    """Arrays over blocks: q, d [n] int; state [n, 8] (GPU/CPU/IN_TRANSFER); pages[i][p] page ids."""

    def __init__(self, bits: list[int], plane_pages: list[int], q0: np.ndarray) -> None:
        """``bits``: supported bitwidths; ``plane_pages[i]``: pool pages per plane of block i; ``q0`` [n]."""
        self.bits = np.asarray(bits)
        self.n = len(plane_pages)
        self.plane_pages = np.asarray(plane_pages, dtype=np.int64)
        self.q = np.asarray(q0, dtype=np.int64).copy()
        self.d = self.q.copy()
        self.state = np.full((self.n, 8), CPU, dtype=np.int8)
        self.pages: list[list[list[int]]] = [[[] for _ in range(8)] for _ in range(self.n)]
        if not np.isin(self.q, self.bits).all():
            raise ValueError(f"initial bitwidths must be in {bits}")

    def resident_depth(self) -> np.ndarray:
        """[n] number of leading planes (0, 1, ...) that are on the GPU."""
        on = self.state == GPU
        return np.where(on.all(axis=1), 8, np.argmin(on, axis=1))

    def set_resident(self, i: int, plane: int, pages: list[int]) -> None:
        self.state[i, plane] = GPU
        self.pages[i][plane] = pages

    def commit_lower(self, blocks: np.ndarray, to_bits: np.ndarray) -> None:
        """q_i <- b' (< q_i) at a step boundary; planes stay resident until moved off."""
        if (to_bits >= self.q[blocks]).any() or not np.isin(to_bits, self.bits).all():
            raise ValueError("commit_lower needs supported bitwidths below the committed ones")
        self.q[blocks] = to_bits
        self.d[blocks] = to_bits

    def commit_raise(self, blocks: np.ndarray, to_bits: np.ndarray) -> None:
        """q_i <- b'' (> q_i); raises ``ValueError`` if a needed plane is not resident yet."""
        if (to_bits <= self.q[blocks]).any() or not np.isin(to_bits, self.bits).all():
            raise ValueError("commit_raise needs supported bitwidths above the committed ones")
        if (self.resident_depth()[blocks] < to_bits).any():
            raise ValueError("cannot raise q before its planes are resident (SPEC section 6)")
        self.q[blocks] = to_bits
        self.d[blocks] = to_bits

    def surplus_planes(self, i: int) -> list[int]:
        """Resident planes of block i above its committed q (candidates to move to the host)."""
        return [p for p in range(int(self.q[i]), 8) if self.state[i, p] == GPU]

    def check(self) -> None:
        """The invariant of SPEC section 3: q_i <= resident planes, at every moment a kernel can run."""
        bad = np.flatnonzero(self.q > self.resident_depth())
        assert bad.size == 0, f"blocks {bad[:5].tolist()} read planes that are not resident"
