"""Serving policies (SPEC section 8 baselines and ablations), selectable by ``--policy``.

What it does: names each policy and says what it turns on: the dynamic planner (and which of its
inputs), or a static allocation. ``pagedweight`` is the full method; ``uniform`` (static uniform
APL at ``--bits``); ``static`` (a fixed mixed-precision allocation chosen offline from the global
sensitivity to fit the budget at the workload's peak KV, MxMoE-style); and the four ablations of
the paper: ``no-routing`` (no routing statistics: one bucket, no online mass), ``no-residual``
(no prompt factor, eta = 1), ``no-movement`` (demoted planes are dropped, never reloaded),
``no-sensitivity`` (damage = bits dropped instead of the Hessian sensitivity). Control plane.
"""

from __future__ import annotations

from dataclasses import replace

from pwrun.core.planner.runtime import PlannerConfig
from pwrun.errors import PagedWeightError

DYNAMIC = {
    "pagedweight": {},
    "no-routing": {"use_routing": False},
    "no-residual": {"use_residual": False},
    "no-movement": {"movement": False},
    "no-sensitivity": {"use_sensitivity": False},
}
STATIC = ("uniform", "static")
POLICIES = (*DYNAMIC, *STATIC)


def check_policy(name: str, bits: int | None, supported: list[int]) -> None:
    """Raise ``PagedWeightError`` for an unknown policy or a missing/unsupported ``--bits``."""
    if name not in POLICIES:
        raise PagedWeightError(f"unknown --policy {name!r}: choose one of {', '.join(POLICIES)}")
    if name == "uniform":
        if bits is None:
            raise PagedWeightError("--policy uniform needs --bits B (one of the artifact's bitwidths "
                                   f"{supported})")
        if bits not in supported:
            raise PagedWeightError(f"--bits {bits} is not one of the artifact's bitwidths {supported}")
    elif bits is not None:
        raise PagedWeightError("--bits only goes with --policy uniform")


def planner_config(name: str, base: PlannerConfig) -> PlannerConfig | None:
    """The planner configuration of a dynamic policy, or None for a static one."""
    if name in STATIC:
        return None
    return replace(base, **DYNAMIC[name])
