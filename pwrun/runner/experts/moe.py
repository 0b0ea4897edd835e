"""The MoE block forward over experts in the page pool, and the live routing statistics.

What it does: ``PooledMoE.__call__`` is the MoE block the model calls. With the kernels: the router matmul
(router and shared-expert gate fused in one), one routing kernel (top-k, gate, statistics), then the experts'
kernels (``run_experts``). Without (the reference): the model's router, then the same dense expert loop as the
16-bit model over ``expert_weights``. It also accumulates the live routing statistics on the device (no host sync
inside the step); ``take_stats`` reads and zeroes them. ``APMoE`` is it over AP blocks: the fused AP kernels
reading the ``KernelTables``, or each block dequantized from its pages at its committed q (memoized until q
changes, ``invalidate``); ``pwrun.runner.experts.dense.DenseMoE`` over 16-bit blocks.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from pwformat.ap import dequantize
from pwformat.layout import LUT_BYTES, words_per_row
from pwkernels.dense_gemv import linear
from pwkernels.moe.dispatch import ap_moe, ap_moe_block
from pwkernels.route_topk import accumulate_routing_stats, route_topk
from pwrun.core.weight_table import WeightPageTable
from pwrun.model.inventory import SHARED_EXPERT
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import experts_forward, route
from pwrun.model.weights import MLPWeights, MoEWeights
from pwrun.runner.experts.tables import TABLE_ROW_ALIGN, KernelTables


class PooledMoE:
    """MoE forward of ``model``'s layers on ``device``: routing and statistics here, the experts in a subclass."""

    def __init__(self, model: LeanMoEModel, device: torch.device, use_kernel: bool) -> None:
        self.model, self.spec = model, model.spec
        self.use_kernel = use_kernel
        self.device = device
        num_layers = self.spec.num_layers
        e_max = max((ls.moe.num_experts for ls in self.spec.layers if ls.moe is not None), default=1)
        # live routing statistics (read and zeroed every few steps), shared expert in column e_max
        # (fp32 for the routing kernel's atomics; fp64 sums on the reference path)
        acc_dtype = torch.float32 if use_kernel else torch.float64
        # rows padded to a multiple of TABLE_ROW_ALIGN columns, so each layer's row the routing kernel updates starts
        # 16-byte aligned (else two compiled variants, as for the tables)
        cols = -(-(e_max + 1) // TABLE_ROW_ALIGN) * TABLE_ROW_ALIGN
        self.mass_acc = torch.zeros(num_layers, cols, dtype=acc_dtype, device=self.device)[:, :e_max + 1]
        self.norm_acc = torch.zeros(num_layers, e_max + 1, 4, dtype=acc_dtype, device=self.device)
        self.observe = True  # the runner turns it off when no planner reads the statistics
        self.e_max = e_max
        self._shared_ids: dict[int, torch.Tensor] = {}
        self._router_gate = _fuse_router_and_gate(model) if use_kernel else {}

    def expert_weights(self, layer: int, lw: MoEWeights) -> MoEWeights:
        """``lw`` with the layer's experts as dense [N, K] tensors (or indexables of them): the reference path."""
        raise NotImplementedError

    def run_experts(self, x: torch.Tensor, layer: int, ids: torch.Tensor, w: torch.Tensor,
                    shared_w: torch.Tensor | None, activation: str) -> torch.Tensor:
        """Kernel path: routed experts ``ids`` / ``w`` [T, k] plus, where the layer has one, the shared expert times
        ``shared_w`` [T, 1] fp32 (its gate applied) -> [T, H] in x's dtype, without a host sync."""
        raise NotImplementedError

    def shared_ids(self, t: int) -> torch.Tensor:
        """[t, 1] int64 zeros: every token selects the shared expert (made once per t, reused by graph replays)."""
        sid = self._shared_ids.get(t)
        if sid is None:
            sid = self._shared_ids[t] = torch.zeros(t, 1, dtype=torch.int64, device=self.device)
        return sid

    def __call__(self, x: torch.Tensor, layer: int, r: torch.Tensor | None = None) -> torch.Tensor:
        """MoE output [T, H] for normalised hidden states x [T, H] with the pooled experts; ``r``: the router's
        input where it is not x (``pwrun.model.moe.router_input``)."""
        lw = self.model.weights.layers[layer].moe
        spec = self.spec.layers[layer].moe
        assert lw is not None and spec is not None
        if self.use_kernel:
            return self._kernel(x, layer, lw, spec, x if r is None else r)
        weights, ids = route(x if r is None else r, lw.router, spec, lw.expert_scale)
        if self.observe:
            self._observe(layer, x, ids, weights, spec.num_experts, lw.shared is not None)
        return experts_forward(x, self.expert_weights(layer, lw), weights, ids, spec.num_experts, layer,
                               activation=spec.activation)

    def _kernel(self, x: torch.Tensor, layer: int, lw: MoEWeights, spec: Any, r: torch.Tensor) -> torch.Tensor:
        """Kernel path: router matmul (router and shared gate in one), one routing kernel (top-k, gate,
        statistics), then ``run_experts``."""
        e = spec.num_experts
        has_gate = lw.shared_gate is not None
        weight = self._router_gate.get(layer, lw.router)
        logits = linear(r, weight)
        # the statistics take the weights after the per-expert scale (applied in the kernel, as ``route`` does)
        stats = (self.mass_acc[layer], self.norm_acc[layer]) if self.observe and e == self.e_max else None
        w, ids, shared_w = route_topk(logits, x, e, spec.top_k, spec.norm_topk_prob, has_gate, stats,
                                      has_shared=lw.shared is not None, scale=lw.expert_scale)
        if self.observe and stats is None:
            self._observe(layer, x, ids, w, e, lw.shared is not None)
        return self.run_experts(x, layer, ids, w, None if lw.shared is None else shared_w[:, None], spec.activation)

    def _observe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 shared: bool) -> None:
        accumulate_routing_stats(self.mass_acc[layer], self.norm_acc[layer], x, ids, weights,
                                 self.mass_acc.shape[1] - 1, shared)

    def take_stats(self) -> tuple[Any, Any]:
        """The routing-weight sums [L, E+1] and norm accumulators [L, E+1, 4] (numpy) since the last call."""
        m, a = self.mass_acc.cpu().numpy().copy(), self.norm_acc.cpu().numpy().copy()
        self.mass_acc.zero_()
        self.norm_acc.zero_()
        return m, a


class APMoE(PooledMoE):
    """MoE forward of ``model``'s layers with AP blocks ``keys`` (shapes ``shapes``) committed in ``wpt``."""

    def __init__(self, model: LeanMoEModel, keys: list[tuple[int, int, str]], shapes: list[tuple[int, int]],
                 wpt: WeightPageTable, tables: KernelTables, use_kernel: bool) -> None:
        super().__init__(model, tables.device, use_kernel)
        self.wpt, self.tables = wpt, tables
        self.shape = shapes
        self.index = {k: i for i, k in enumerate(keys)}
        self.page_bytes = tables.page_bytes
        self._dense: dict[int, torch.Tensor] = {}

    def invalidate(self, blocks: list[int]) -> None:
        """Forget the dense copies of ``blocks`` (their committed bits changed)."""
        for i in blocks:
            self._dense.pop(i, None)

    def dense(self, i: int) -> torch.Tensor:
        """Dense weight [N, K] (model dtype) of block i at its committed q, read from its pool pages."""
        w = self._dense.get(i)
        if w is None:
            n, k = self.shape[i]
            q = int(self.wpt.q[i])
            kw = words_per_row(k)
            wpp, epp = self.page_bytes // 4, self.page_bytes // LUT_BYTES
            words, luts = self.tables.words, self.tables.lut_view
            planes = torch.stack([words[s * wpp: s * wpp + n * kw].view(n, kw)
                                  for s in self.wpt.plane_start[i, :q].tolist()])
            ls = int(self.wpt.lut_start[i]) * epp
            lut = luts[ls: ls + n * 2**q].view(n, 2**q)
            w = dequantize(planes, lut, k, q, self.model.dtype)
            self._dense[i] = w
        return w

    def expert_weights(self, layer: int, lw: MoEWeights) -> MoEWeights:
        return cast(MoEWeights, _DenseMoE(self, layer, lw))

    def run_experts(self, x: torch.Tensor, layer: int, ids: torch.Tensor, w: torch.Tensor,
                    shared_w: torch.Tensor | None, activation: str) -> torch.Tensor:
        """The fused AP kernels for the routed experts and the shared expert (``ap_moe_block``)."""
        if shared_w is None:
            return ap_moe(x, ids, w, self.tables.experts(layer), check=False, activation=activation)
        return ap_moe_block(x, ids, w, self.tables.experts(layer), self.tables.experts(layer, "shared"),
                            shared_w, self.shared_ids(x.shape[0]), check=False, activation=activation)


def _fuse_router_and_gate(model: LeanMoEModel) -> dict[int, torch.Tensor]:
    """{layer: [E+1, H]} each MoE layer's router with its shared-expert gate as the last row, so that one
    matmul gives the routing and gate logits. The layer's weights become views of it (no extra memory)."""
    fused: dict[int, torch.Tensor] = {}
    for layer, lw in enumerate(model.weights.layers):
        m = lw.moe
        if m is None or m.shared_gate is None:
            continue
        both = torch.cat([m.router, m.shared_gate.reshape(1, -1)])
        m.router, m.shared_gate = both[:-1], both[-1:].view(m.shared_gate.shape)
        fused[layer] = both
    return fused


class _Units:
    def __init__(self, moe: APMoE, layer: int, unit: str) -> None:
        self.moe, self.layer, self.unit = moe, layer, unit

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.moe.dense(self.moe.index[(self.layer, e, self.unit)])


class _DenseMoE:
    """Duck-typed ``MoEWeights`` whose expert tensors are the dense views of the AP blocks (reference path)."""

    def __init__(self, moe: APMoE, layer: int, lw: MoEWeights) -> None:
        self.router, self.shared_gate = lw.router, lw.shared_gate
        self.gate_up, self.down = _Units(moe, layer, "gate_up"), _Units(moe, layer, "down")
        self.shared = None if lw.shared is None else MLPWeights(
            moe.dense(moe.index[(layer, SHARED_EXPERT, "gate_up")]),
            moe.dense(moe.index[(layer, SHARED_EXPERT, "down")]))
