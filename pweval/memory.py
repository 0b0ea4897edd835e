"""Memory footprints of static deployments (16-bit experts, uniform b-bit AP experts) for a workload.

What it does: a static deployment keeps its experts at one size and must hold the KV cache of the
workload at full concurrency (``max_batch`` of its longest requests at their full length) to serve
it without queueing; its footprint is ``fixed`` (the non-expert weights in the model dtype, as the runtime holds
them) + ``workspace`` (the runtime's step activation bound, ``budget.workspace_bytes``)
+ ``experts`` + ``kv``, in bytes. The same byte functions as the runtime's are used (``pwformat.cost``:
page-rounded AP planes and LUTs; ``pwformat.kv_layout``: KV pages and blocks), so a
uniform-b run at its footprint budget fits exactly. These footprints are the "equal total memory"
points of the quality-memory comparison (SPEC section 8) and the budget grid of the sweep. No
device memory is allocated here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pweval.workload import Workload
from pwformat.cost import page_rounded_bytes
from pwrun.core.config import EngineConfig
from pwrun.core.kv_blocks import blocks_needed
from pwrun.engine.budget import workspace_bytes
from pwrun.model.inventory import expert_blocks, kv_layout
from pwrun.model.lean import LeanMoEModel
from pwrun.model.spec import ModelSpec


@dataclass(frozen=True)
class Footprint:
    """Bytes of each part of a static deployment; ``total`` is what ``--gpu-memory`` must give it."""

    fixed: int
    workspace: int
    experts: int
    kv: int

    @property
    def total(self) -> int:
        return self.fixed + self.workspace + self.experts + self.kv


def non_expert_bytes(model: LeanMoEModel) -> int:
    """Bytes of ``model``'s weights other than the routed and shared experts (what the runtime keeps fixed)."""
    elt = model.weights.embed.element_size()
    return model.weights.num_bytes() - sum(b.n * b.k for b in expert_blocks(model.spec)) * elt


def full_concurrency_kv_bytes(workload: Workload, spec: ModelSpec, ecfg: EngineConfig, dtype: torch.dtype) -> int:
    """KV bytes of the ``max_batch`` longest requests at full length (prompt + continuation - 1 tokens each)."""
    blocks = sorted((blocks_needed(r.tokens - 1, ecfg.block_size) for r in workload.requests),
                    reverse=True)[:ecfg.max_batch]
    return sum(blocks) * kv_layout(spec).block_bytes(ecfg.block_size, dtype.itemsize)


def expert_bytes(spec: ModelSpec, bits: int, ecfg: EngineConfig, dtype: torch.dtype) -> int:
    """Pool bytes of every expert block at ``bits`` (AP planes + LUT, page-rounded); 16 means dense 16-bit."""
    blocks = expert_blocks(spec)
    if bits == 16:
        return sum(b.n * b.k * 2 for b in blocks)
    page = kv_layout(spec).page_bytes(ecfg.block_size, dtype.itemsize)
    return int(page_rounded_bytes([(b.n, b.k) for b in blocks], np.array([bits]), page).sum())


def static_footprint(spec: ModelSpec, fixed_bytes: int, workload: Workload, ecfg: EngineConfig, bits: int,
                     dtype: torch.dtype, cuda: bool = False) -> Footprint:
    """Footprint of serving ``workload`` at full concurrency with every expert at ``bits`` (16 = 16-bit model)."""
    elt = dtype.itemsize
    work = workspace_bytes(spec, ecfg.max_step_tokens, ecfg.max_batch,
                           min(workload.longest, spec.max_position_embeddings), elt, cuda=cuda)
    return Footprint(fixed_bytes, work, expert_bytes(spec, bits, ecfg, dtype),
                     full_concurrency_kv_bytes(workload, spec, ecfg, dtype))
