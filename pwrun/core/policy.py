"""Serving policies (SPEC section 8 baselines and ablations) as one frozen dataclass; the CLI names them.

What it does: a ``Policy`` says how expert bitwidths are chosen: by the planner at run time
(``placement="planner"``: ``pagedweight``, without the prompt-residual heads (eta = 1: on the bundled model they
changed no served perplexity measurably, docs/eval/ablations.md); ``residual``, with them (SPEC Eq. 5-6, an artifact
from ``pwcal fit-residual``); and the paper's other ablations: ``no-routing``, no routing statistics, one bucket and
no online mass; ``no-movement``, demoted planes are never reloaded; ``no-sensitivity``, damage = bits dropped
instead of the Hessian sensitivity), or once before serving (``uniform``: every block at ``bits``; ``static``: a fixed
mixed-precision allocation chosen offline from the global sensitivity to fit the budget at the workload's
peak KV, MxMoE-style), or not at all (``16-bit``: the checkpoint's own experts, held at 16 bits in the page pool,
``placement="dense"``; no artifact). ``Policy.named`` turns a CLI name (and ``--bits``) into one. Control plane.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from pwformat.errors import PagedWeightError
from pwrun.core.planner.runtime import PlannerConfig

Placement = Literal["planner", "uniform", "static", "dense"]


@dataclass(frozen=True)
class Policy:
    """``name`` (as the CLI calls it), ``placement``, ``bits`` (uniform only), and the planner's ablation switches."""

    name: str = "pagedweight"
    placement: Placement = "planner"
    bits: int | None = None
    use_routing: bool = True
    use_residual: bool = False
    use_sensitivity: bool = True
    movement: bool = True

    def __post_init__(self) -> None:
        if (self.placement == "uniform") != (self.bits is not None):
            raise ValueError("bits go with the uniform placement, and only with it")

    @property
    def dense(self) -> bool:
        """The experts stay at 16 bits: served from the checkpoint, no artifact read."""
        return self.placement == "dense"

    @property
    def calibrated(self) -> bool:
        """Serving ranks the AP blocks by the artifact's sensitivity and routing tables (every placement but uniform
        and the 16-bit experts)."""
        return self.placement in ("planner", "static")

    @property
    def dynamic(self) -> bool:
        """The planner moves expert bitwidths while serving."""
        return self.placement == "planner"

    def planner_config(self, base: PlannerConfig) -> PlannerConfig | None:
        """``base`` with this policy's ablation switches, or None when no planner runs."""
        if not self.dynamic:
            return None
        return replace(base, use_routing=self.use_routing, use_residual=self.use_residual,
                       use_sensitivity=self.use_sensitivity, movement=self.movement)

    def reads(self, table: str) -> bool:
        """Whether serving reads the optional calibration table ``table`` ("buckets", "residual_heads",
        "block_features")."""
        if table == "buckets":
            return self.placement == "static" or (self.dynamic and self.use_routing)
        return self.dynamic and self.use_residual

    def check_bits(self, supported: list[int]) -> None:
        """Raise ``PagedWeightError`` if the uniform ``bits`` are not among the artifact's ``supported`` ones."""
        if self.bits is not None and self.bits not in supported:
            raise PagedWeightError(f"--bits {self.bits} is not one of the artifact's bitwidths {supported}")

    @staticmethod
    def named(name: str, bits: int | None = None) -> Policy:
        """The policy the CLI calls ``name`` (``--bits`` with ``uniform`` only); ``PagedWeightError`` otherwise."""
        if name not in POLICIES:
            raise PagedWeightError(f"unknown --policy {name!r}: choose one of {', '.join(POLICIES)}")
        if name == "uniform" and bits is None:
            raise PagedWeightError("--policy uniform needs --bits B (one of the artifact's bitwidths)")
        if name != "uniform" and bits is not None:
            raise PagedWeightError("--bits only goes with --policy uniform")
        return POLICIES[name] if bits is None else replace(POLICIES[name], bits=bits)


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy(),
    Policy("no-routing", use_routing=False),
    Policy("residual", use_residual=True),
    Policy("no-movement", movement=False),
    Policy("no-sensitivity", use_sensitivity=False),
    Policy("uniform", "uniform", bits=8),
    Policy("static", "static"),
    Policy("16-bit", "dense"),
)}
ABLATIONS = tuple(name for name, p in POLICIES.items() if p.dynamic and name != "pagedweight")
