"""16-bit expert weights in the page pool: placed once, read through per-layer offset tables (SPEC sections 3, 7).

What it does: ``DenseExpertStore`` takes every expert linear block of the model from an ``ExpertSource`` one MoE
layer at a time (the checkpoint, ``pwrun.model.streamed``: never the whole model on the host), gives each block one
contiguous run of the pool's WEIGHT pages and copies its [N, K] weight there in the model's dtype. Per MoE layer it
keeps the element offsets of its blocks (routed: [2E], shared: [2]) as device tensors over a view of the pool in
the model's dtype, which the 16-bit MoE kernels read (``DenseExperts``). Nothing moves afterwards: no planner, no
demotion, no host mirror. ``DenseMoE`` is the MoE forward over them: the routing of ``PooledMoE``, then
``pwkernels.moe.dense`` (kernels), or the reference expert loop over views of the pool (no copy).
"""

from __future__ import annotations

from typing import Protocol, cast

import numpy as np
import torch

from pwkernels.moe.dense import dense_moe
from pwkernels.moe.experts import DenseExperts, stacked_views
from pwkernels.moe.launch import DenseMoEConfig
from pwrun.core.decision import WeightMoves
from pwrun.core.pool import WEIGHT, PagePool
from pwrun.model.lean import LeanMoEModel
from pwrun.model.weights import MLPWeights, MoEWeights
from pwrun.runner.experts.moe import PooledMoE


class ExpertSource(Protocol):
    """Where the 16-bit experts come from, one MoE layer at a time."""

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, MLPWeights | None]:
        """gate_up [E, 2I, H], down [E, H, I] and the shared expert (or None) of MoE layer ``index``."""
        ...


def dense_block_pages(n: int, k: int, elt: int, page_bytes: int) -> int:
    """Pool pages of one [n, k] 16-bit block of ``elt``-byte elements (whole pages: one run per block)."""
    return -(-n * k * elt // page_bytes)


class DenseExpertStore:
    """Every expert block of ``model`` from ``source`` in WEIGHT runs of ``pool`` (bytes: ``memory``)."""

    def __init__(self, source: ExpertSource, model: LeanMoEModel, pool: PagePool, memory: torch.Tensor,
                 use_kernel: bool, config: DenseMoEConfig | None = None) -> None:
        spec, dt = model.spec, model.dtype
        self.pool, self.memory = pool, memory
        page = pool.cfg.page_bytes
        elt = dt.itemsize
        if page % elt:
            raise ValueError(f"a page of {page} bytes does not hold whole {dt} elements")
        self.view = memory.view(dt)
        self.bytes_h2d = 0
        self.runs: list[tuple[int, int]] = []  # (first page, pages) of every block, in placement order
        self._tables: dict[tuple[int, str], DenseExperts] = {}
        for ls in spec.layers:
            if ls.moe is None:
                continue
            gate_up, down, shared = source.layer(ls.index)
            routed = [w for e in range(ls.moe.num_experts) for w in (gate_up[e], down[e])]
            self._tables[(ls.index, "routed")] = self._place(routed, spec.hidden_size, ls.moe.expert_intermediate)
            if shared is not None:
                self._tables[(ls.index, "shared")] = self._place([shared.gate_up, shared.down], spec.hidden_size,
                                                                 ls.moe.shared_intermediate)
            del gate_up, down, shared, routed
        if memory.is_cuda:  # the copies are queued without blocking; the first step must not count them
            torch.cuda.current_stream(memory.device).synchronize()
        self.moe = DenseMoE(model, self, use_kernel, config)
        self.moe.observe = False  # no planner reads routing statistics

    def _place(self, blocks: list[torch.Tensor], hidden: int, inter: int) -> DenseExperts:
        page, elt = self.pool.cfg.page_bytes, self.view.element_size()
        offsets = []
        for w in blocks:
            pages = dense_block_pages(w.shape[0], w.shape[1], elt, page)
            start = self.pool.allocate_run(pages, WEIGHT)  # OutOfPages: the caller's budget check failed
            self.runs.append((start, pages))
            at = start * page // elt
            self.view[at:at + w.numel()].copy_(w.reshape(-1), non_blocking=True)
            self.bytes_h2d += w.numel() * elt
            offsets.append(at)
        return DenseExperts(self.view, torch.tensor(offsets, dtype=torch.int64, device=self.memory.device),
                            hidden, inter, stacked_views(self.view, offsets, hidden, inter))

    def experts(self, layer: int, kind: str = "routed") -> DenseExperts:
        """The kernels' ``DenseExperts`` of one layer's routed (or shared) experts."""
        return self._tables[(layer, kind)]

    @property
    def weight_pages(self) -> int:
        return sum(n for _, n in self.runs)

    def apply(self, moves: WeightMoves) -> None:
        """Nothing to mirror: 16-bit experts never move (``moves`` is always empty)."""
        if not moves.empty:
            raise ValueError("16-bit experts in the pool do not move")

    def finished_reloads(self) -> list[int]:
        return []

    def take_stats(self) -> tuple[np.ndarray, np.ndarray]:
        return self.moe.take_stats()


class DenseMoE(PooledMoE):
    """MoE forward of ``model``'s layers over the 16-bit blocks of ``store``; ``config``: the kernels' paths."""

    def __init__(self, model: LeanMoEModel, store: DenseExpertStore, use_kernel: bool,
                 config: DenseMoEConfig | None = None) -> None:
        super().__init__(model, store.memory.device, use_kernel)
        self.store = store
        self.config = config

    def expert_weights(self, layer: int, lw: MoEWeights) -> MoEWeights:
        return cast(MoEWeights, _Views(self.store, layer, lw))

    def run_experts(self, x: torch.Tensor, layer: int, ids: torch.Tensor, w: torch.Tensor,
                    shared_w: torch.Tensor | None, activation: str) -> torch.Tensor:
        """``pwkernels.moe.dense`` for the routed experts, and for the shared one as an always-selected expert."""
        y = dense_moe(x, ids, w, self.store.experts(layer), self.config, activation)
        if shared_w is None:
            return y
        return y + dense_moe(x, self.shared_ids(x.shape[0]), shared_w, self.store.experts(layer, "shared"),
                             self.config, activation)


class _Blocks:
    """``[e]`` -> the [N, K] view of block ``2e + unit`` of one layer's ``DenseExperts`` (host sync, reference)."""

    def __init__(self, ex: DenseExperts, unit: int) -> None:
        self.ex, self.unit = ex, unit

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.ex.block(2 * e + self.unit)


class _Views:
    """Duck-typed ``MoEWeights`` whose expert tensors are views of the pool (the reference path)."""

    def __init__(self, store: DenseExpertStore, layer: int, lw: MoEWeights) -> None:
        self.router, self.shared_gate = lw.router, lw.shared_gate
        routed = store.experts(layer)
        self.gate_up, self.down = _Blocks(routed, 0), _Blocks(routed, 1)
        self.shared = None
        if lw.shared is not None:
            sh = store.experts(layer, "shared")
            self.shared = MLPWeights(sh.block(0), sh.block(1))
