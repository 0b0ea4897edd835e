"""Live statistics of the running batch and the prompt-residual heads (SPEC section 4, Eq. 1, 5, 6).

What it does: ``OnlineStats`` keeps, per (MoE layer, expert), a decayed window of the live batch's
routing mass (Eq. 1 over recent steps) and of the input-norm accumulators behind the prompt
features phi (routing-weighted mean and RMS input norm, max input norm), fed once per step with
numpy arrays by the runtime. ``block_mass`` maps them to blocks (the shared expert: 1);
``block_log_features`` gives phi as log ratios to the calibration features, the form the heads
were fit on (``pwcal fit-residual``). ``ResidualHeads`` applies the heads: rho_hat = w . phi + a
(Eq. 5) and eta = exp(alpha * c * clip(rho_hat, rho_min, rho_max)) (Eq. 6) for every block and
transition at once. Runtime approximation (documented): the fused kernel does not expose the
down projection's input, so a down block uses its expert's gate_up input features.
Control plane: numpy only (the heads' table arrives as a pandas frame read elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pwrun.core.planner.tables import UNITS
from pwrun.model.inventory import SHARED_EXPERT

if TYPE_CHECKING:
    import pandas as pd

FEATURES = ("mean_norm", "rms_norm", "max_norm")


class OnlineStats:
    """Decayed live statistics over ``num_layers`` x ``num_experts`` (+1 column for the shared expert)."""

    def __init__(self, layer: np.ndarray, expert: np.ndarray, num_layers: int, num_experts: int, decay: float,
                 calib_features: np.ndarray | None = None) -> None:
        """``layer``/``expert`` [n]: each block's position; ``calib_features`` [n, 3] reference phi (or None)."""
        self.decay = decay
        self.num_experts = num_experts
        self.col = np.where(expert == SHARED_EXPERT, num_experts, expert)
        self.layer = layer
        self.mass = np.zeros((num_layers, num_experts + 1))
        self.acc = np.zeros((num_layers, num_experts + 1, 4))  # sum r, sum r*n, sum r*n^2, max n
        self.calib = calib_features
        self.steps = 0

    def update(self, mass: np.ndarray, acc: np.ndarray) -> None:
        """One step's routing weight sums ``mass`` [L, E+1] and norm accumulators ``acc`` [L, E+1, 4]."""
        self.mass = self.decay * self.mass + mass
        old = self.acc
        self.acc = self.decay * old
        self.acc[..., 3] = np.maximum(self.decay * old[..., 3], acc[..., 3])
        self.acc[..., :3] += acc[..., :3]
        self.steps += 1

    def block_mass(self) -> np.ndarray:
        """[n] live routing mass (Eq. 1, normalised per layer over routed experts); shared expert 1."""
        routed = self.mass[:, : self.num_experts]
        tot = routed.sum(axis=1, keepdims=True)
        norm = np.where(tot > 0, routed / np.maximum(tot, 1e-30), 1.0 / self.num_experts)
        m = np.concatenate([norm, np.ones((norm.shape[0], 1))], axis=1)
        return m[self.layer, self.col]

    def block_log_features(self) -> np.ndarray:
        """[n, 3] log(live phi / calibration phi); 0 (no evidence) where a block saw no live token."""
        a = self.acc[self.layer, self.col]
        r = a[:, 0]
        seen = r > 1e-12
        live = np.stack([a[:, 1] / np.maximum(r, 1e-30), np.sqrt(a[:, 2] / np.maximum(r, 1e-30)), a[:, 3]], axis=1)
        if self.calib is None:
            return np.zeros_like(live)
        ok = seen[:, None] & (live > 0) & (self.calib > 0)
        return np.where(ok, np.log(np.where(ok, live, 1.0) / np.where(ok, self.calib, 1.0)), 0.0)


class ResidualHeads:
    """The heads of ``residual_heads.parquet``: one per (unit, bits_from, bits_to)."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame.reset_index(drop=True)

    def eta(self, bits: np.ndarray, unit: np.ndarray, phi: np.ndarray, alpha: float) -> np.ndarray:
        """eta [n, nb, nb] (Eq. 6) for block units ``unit`` [n] (0 gate_up, 1 down) and features ``phi`` [n, 3].

        Transitions without a head get eta = 1.
        """
        n, nb = unit.size, bits.size
        out = np.ones((n, nb, nb))
        index = {int(b): j for j, b in enumerate(bits)}
        for h in self.frame.itertuples(index=False):
            a, c = index.get(int(h.bits_from)), index.get(int(h.bits_to))
            if a is None or c is None:
                continue
            rows = unit == UNITS.index(str(h.unit))
            w = np.array([h.w_mean_norm, h.w_rms_norm, h.w_max_norm])
            rho = np.clip(phi[rows] @ w + h.intercept, h.rho_min, h.rho_max)
            out[rows, a, c] = np.exp(alpha * float(np.clip(h.confidence, 0.0, 1.0)) * rho)
        return out
