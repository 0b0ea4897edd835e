"""Routing buckets (SPEC section 4): hot/warm/cold experts by routing mass, with multipliers and floors.

What it does: ``BucketPolicy`` says where the bucket boundaries lie (quantiles of the routed
experts' mass), each bucket's damage multiplier mu (Eq. 8), its bitwidth floor at each floor
stage (stage 0 most conservative) and its depth cap (the most bits one planning step may remove
from a block). ``assign`` maps blocks to buckets; the always-active shared expert is in the
hottest bucket. Bucket 0 is the coldest. Control plane: numpy only.

Band (our choice; SPEC section 4 leaves it open): ``neutral_from_bits`` is the uniform-equivalent
expert budget at and above which the planner uses the neutral policy instead (one bucket, mu 1,
floors at the seed bits). ``pwcal search-buckets`` sets it where its held-out confirmation shows no
gain of the searched policy over the neutral one: the multipliers amplify the calibration text's
routing mass, a prior worth its risk on other text only where it measurably helps.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from pwrun.core.planner.tables import SHARED_EXPERT, BlockTable


@dataclass(frozen=True)
class BucketPolicy:
    """``quantiles``: upper mass quantile of buckets 0..n-2 (the last bucket reaches 1.0).

    ``mu``, ``depth_cap``: per bucket; ``floors``: per stage, per bucket (bitwidths);
    ``neutral_from_bits``: uniform-equivalent bits per expert weight (``BlockTable.uniform_bytes``) at and
    above which the neutral policy applies instead; None: this policy applies at every budget.
    """

    quantiles: tuple[float, ...]
    mu: tuple[float, ...]
    floors: tuple[tuple[int, ...], ...]
    depth_cap: tuple[int, ...]
    neutral_from_bits: float | None = None

    def __post_init__(self) -> None:
        nb = len(self.quantiles) + 1
        if len(self.mu) != nb or len(self.depth_cap) != nb or any(len(f) != nb for f in self.floors):
            raise ValueError(f"a policy of {nb} buckets needs {nb} mu, depth caps and floors per stage")
        if list(self.quantiles) != sorted(self.quantiles) or not all(0 < q < 1 for q in self.quantiles):
            raise ValueError("bucket quantiles must be increasing and inside (0, 1)")
        if not self.floors:
            raise ValueError("at least one floor stage is needed")
        if any(m <= 0 for m in self.mu) or any(c < 1 for c in self.depth_cap):
            raise ValueError("mu must be > 0 and depth caps >= 1")
        if self.neutral_from_bits is not None and not self.neutral_from_bits > 0:
            raise ValueError("neutral_from_bits must be > 0 (or None)")

    @property
    def num_buckets(self) -> int:
        return len(self.quantiles) + 1

    def assign(self, table: BlockTable) -> np.ndarray:
        """Bucket [n] int of every block: mass quantile among routed experts; shared -> hottest."""
        routed = table.expert != SHARED_EXPERT
        bounds = np.quantile(table.mass[routed], self.quantiles) if routed.any() else np.array([])
        bucket = np.searchsorted(bounds, table.mass, side="left")
        bucket[~routed] = self.num_buckets - 1
        return bucket.astype(np.int64)

    def neutral_from_bytes(self, table: BlockTable) -> int | None:
        """Expert bytes (int) of ``table`` at and above which the neutral policy applies (None: never):
        ``table.uniform_bytes`` of ``neutral_from_bits`` clamped to the table's bitwidths (our choice, see the
        module docstring; SPEC section 4 leaves it open)."""
        if self.neutral_from_bits is None:
            return None
        return table.uniform_bytes(min(max(self.neutral_from_bits, float(table.bits[0])), float(table.bits[-1])))

    def without_band(self) -> BucketPolicy:
        """This policy at every budget (``neutral_from_bits`` dropped)."""
        return replace(self, neutral_from_bits=None)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_frame(df: Any) -> BucketPolicy:
        """The policy stored in a ``buckets`` table (pandas DataFrame; schema in ``pwformat.tables``)."""
        df = df.sort_values("bucket")
        band = float(df.neutral_from_bits.iloc[0]) if "neutral_from_bits" in df else math.nan
        return BucketPolicy(tuple(float(x) for x in df.mass_quantile_hi.iloc[:-1]), tuple(float(x) for x in df.mu),
                            (tuple(int(x) for x in df.floor_stage0), tuple(int(x) for x in df.floor_stage1)),
                            tuple(int(x) for x in df.depth_cap), None if math.isnan(band) else band)

    @staticmethod
    def neutral(seed_bits: int) -> BucketPolicy:
        """One bucket, mu 1, floor at the seed, depth cap 1: the plain greedy planner."""
        return BucketPolicy(quantiles=(), mu=(1.0,), floors=((seed_bits,),), depth_cap=(1,))
