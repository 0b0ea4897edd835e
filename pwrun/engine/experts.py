"""Expert weights in the page pool: host mirror, copy orders, the kernels' tables, the MoE forward.

What it does (data plane of SPEC sections 3 and 6): keeps every block's 8 bit-planes and every
LUT in host memory (pinned on CUDA; the **host mirror**: weights never change, so a demotion copies
nothing back), executes the ``CopyOrder`` lists of ``WeightPageTable`` into the pool's bytes, and
keeps per MoE layer the device tables the fused kernel reads (``APExperts``: plane word offsets,
LUT offsets, committed bits) in step with the page table. Raises copy host -> device on a side
CUDA stream and are committed only once their event has completed (``poll``); lowering is
committed at once (the LUT rewrite is ordered on the compute stream after every kernel that read
the old one). ``moe`` is the MoE block forward the model calls: the Triton kernel on CUDA, or on
CPU the reference (dequantize each block from its pages at its committed q, memoized until q
changes, then the same dense expert loop as the 16-bit model). It also accumulates the live
routing statistics on the device (no host sync inside the step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from pwrun.ap.artifact import APArtifact
from pwrun.ap.format import dequantize, words_per_row
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import experts_forward, route
from pwrun.model.spec import ModelSpec
from pwrun.model.weights import MLPWeights, MoEWeights
from pwrun.planner.tables import UNITS, BlockTable
from pwrun.pool.pages import PagePool
from pwrun.pool.weight_table import CopyOrder, WeightPageTable

LUT_BYTES = 2  # LUT entries are stored as 16-bit floats (fp16, or bf16 for a bf16 model)
TABLE_ROW_ALIGN = 4  # rows: 4 int32 bits = 16 bytes (int64 offsets: 32 and 256 bytes), see ExpertStore.__init__


def block_pages(shapes: list[tuple[int, int]], bits: list[int], page_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Pool pages per plane [n] and per b-bit LUT [n, 9] (column b) of blocks of shapes (N, K)."""
    plane_pages = np.array([-(-n * words_per_row(k) * 4 // page_bytes) for n, k in shapes], dtype=np.int64)
    lut_pages = np.zeros((len(shapes), 9), dtype=np.int64)
    for b in bits:
        lut_pages[:, b] = [-(-n * 2**b * LUT_BYTES // page_bytes) for n, _ in shapes]
    return plane_pages, lut_pages


def page_rounded_bytes(table: BlockTable, spec: ModelSpec, page_bytes: int) -> np.ndarray:
    """[n, nb] M_i^b rounded up to whole pool pages (bytes), for ``table``'s blocks and bitwidths."""
    shapes = {(b.layer, b.expert, b.unit): (b.n, b.k) for b in expert_blocks(spec)}
    sh = [shapes[(int(la), int(e), UNITS[u])] for la, e, u in zip(table.layer, table.expert, table.unit,
                                                                      strict=True)]
    plane_pages, lut_pages = block_pages(sh, [int(b) for b in table.bits], page_bytes)
    return (table.bits[None, :] * plane_pages[:, None] + lut_pages[:, table.bits]) * page_bytes


@dataclass
class _LayerTables:
    plane_offset: torch.Tensor  # int64 [rows, 8] word offsets into the pool
    lut_offset: torch.Tensor  # int64 [rows] element offsets (16-bit) into the pool
    bits: torch.Tensor  # int32 [rows]


class ExpertStore:
    """Every expert linear block of ``model`` (in ``table``'s order) placed in ``pool``/``memory``."""

    def __init__(self, artifact: Any, model: LeanMoEModel, table: BlockTable, pool: PagePool,
                 memory: torch.Tensor, use_kernel: bool) -> None:
        self.model, self.table, self.pool, self.memory = model, table, pool, memory
        self.device = memory.device
        self.page_bytes = pool.cfg.page_bytes
        self.use_kernel = use_kernel
        self.lut_dtype = torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float16
        self.spec = model.spec
        shapes = {(b.layer, b.expert, b.unit): (b.n, b.k) for b in expert_blocks(model.spec)}
        self.n = table.n
        self.key = [(int(la), int(e), UNITS[u]) for la, e, u in zip(table.layer, table.expert, table.unit,
                                                                    strict=True)]
        self.shape = [shapes[k] for k in self.key]
        self.index = {k: i for i, k in enumerate(self.key)}
        pin = self.device.type == "cuda"
        bits = [int(b) for b in table.bits]
        planes_of: list[torch.Tensor | None] = [None] * self.n
        luts_of: list[dict[int, torch.Tensor] | None] = [None] * self.n
        for layer in sorted({k[0] for k in self.key}):
            t = artifact.layer_tensors(layer)
            for i in (i for i, k in enumerate(self.key) if k[0] == layer):
                name = APArtifact.key(LinearBlock(*self.key[i], *self.shape[i]))
                planes = t[f"{name}.planes"].contiguous()
                luts = {b: t[f"{name}.lut{b}"].to(self.lut_dtype).contiguous() for b in bits}
                planes_of[i] = planes.pin_memory() if pin else planes
                luts_of[i] = {b: x.pin_memory() for b, x in luts.items()} if pin else luts
        self.host_planes: list[torch.Tensor] = [p for p in planes_of if p is not None]
        self.host_luts: list[dict[int, torch.Tensor]] = [x for x in luts_of if x is not None]
        self.wpt = WeightPageTable(bits, *block_pages(self.shape, bits, self.page_bytes))
        self.words = memory.view(torch.int32)
        self.lut_view = memory.view(self.lut_dtype)
        self._dense: dict[int, torch.Tensor] = {}
        self._tables: dict[tuple[int, str], _LayerTables] = {}
        self._experts: dict[tuple[int, str], Any] = {}  # (layer, kind) -> cached APExperts (see ``experts``)
        self.row = np.array([0 if e == SHARED_EXPERT else 2 * e for _, e, _ in self.key]) + np.array(
            [UNITS.index(u) for _, _, u in self.key])
        # every layer's kernel tables are row ranges of three device tensors, so that one update of any set of
        # blocks is three scatters (the per-layer tables the kernels read are views)
        counts: dict[tuple[int, str], int] = {}
        for la, e, _ in self.key:
            k = (la, "shared" if e == SHARED_EXPERT else "routed")
            counts[k] = counts.get(k, 0) + 1
        # each layer's rows start at a multiple of TABLE_ROW_ALIGN, so every view the kernels read starts 16-byte
        # aligned: Triton specializes a kernel on whether each pointer argument is 16-byte aligned, and Qwen's
        # 120 + 2 rows per layer put odd layers' bits at 8 bytes past it, so every decode kernel compiled twice,
        # the second time inside serving (the warm-up's fresh tensors are aligned): the likely cause of a ~50 s
        # first-run stall on the H200 (batch 4: prefill at 186 tokens/s over 9216 prompt tokens, ~14.5k in later runs;
        # bench/results/serve_s15a_h200.md, gpu_checks/triton_cache_diff_s15.txt; not yet re-measured)
        bases, total = {}, 0
        for k in sorted(counts):
            bases[k], total = total, total + -(-counts[k] // TABLE_ROW_ALIGN) * TABLE_ROW_ALIGN
        self._plane_offset = torch.zeros(total, 8, dtype=torch.int64, device=self.device)
        self._lut_offset = torch.zeros(total, dtype=torch.int64, device=self.device)
        self._bits = torch.zeros(total, dtype=torch.int32, device=self.device)
        for key, base in bases.items():
            end = base + counts[key]
            self._tables[key] = _LayerTables(self._plane_offset[base:end], self._lut_offset[base:end],
                                             self._bits[base:end])
        self.table_row = np.array([bases[(la, "shared" if e == SHARED_EXPERT else "routed")] + r
                                   for (la, e, _), r in zip(self.key, self.row, strict=True)], dtype=np.int64)
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: list[tuple[Any, list[int]]] = []
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        num_layers = self.spec.num_layers
        e_max = max((ls.moe.num_experts for ls in self.spec.layers if ls.moe is not None), default=1)
        # live routing statistics (read and zeroed every few steps), shared expert in column e_max
        # (fp32 for the routing kernel's atomics on CUDA; fp64 sums on the CPU reference path)
        acc_dtype = torch.float32 if use_kernel else torch.float64
        # rows padded to a multiple of TABLE_ROW_ALIGN columns, so each layer's row the routing kernel updates starts
        # 16-byte aligned (Qwen's 61 fp32 columns put 3 of 4 layers off: two compiled variants, as for the tables)
        cols = -(-(e_max + 1) // TABLE_ROW_ALIGN) * TABLE_ROW_ALIGN
        self.mass_acc = torch.zeros(num_layers, cols, dtype=acc_dtype, device=self.device)[:, :e_max + 1]
        self.norm_acc = torch.zeros(num_layers, e_max + 1, 4, dtype=acc_dtype, device=self.device)
        self.observe = True  # the engine turns it off when no planner reads the statistics
        self.e_max = e_max
        self._shared_ids: dict[int, torch.Tensor] = {}
        self._router_gate = _fuse_router_and_gate(model) if use_kernel else {}

    # ---------------------------------------------------------------- placement and movement
    def block_bytes(self) -> np.ndarray:
        """[n, nb] page-rounded M_i^b in bytes (what the pool really spends; SPEC Eq. 3)."""
        return np.stack([self.wpt.pages_at(int(b)) for b in self.table.bits], axis=1) * self.page_bytes

    def _copy(self, orders: list[CopyOrder]) -> None:
        for o in orders:
            src = self.host_planes[o.block][o.index] if o.what == "plane" else self.host_luts[o.block][o.index]
            raw = src.reshape(-1).view(torch.uint8)
            start = o.page * self.page_bytes
            self.memory[start:start + raw.numel()].copy_(raw, non_blocking=True)
            self.bytes_h2d += raw.numel()

    def place(self, q_bits: np.ndarray) -> None:
        """Initial placement at bitwidths ``q_bits`` [n]; raises ``OutOfPages`` if the pool is too small.

        Returns once the planes are on the device: the copies are queued without blocking, and a step queued
        behind them would count the upload as its own time (7.1 GB of 4-bit planes and LUTs for a real-size
        Qwen1.5-MoE, ``weight_bytes_max`` in ``bench/results/serve_s11d_h200.json``; ``bench/serve_speed.py``
        builds an engine and runs it at once, so its prefill figure included whatever of that was still queued)."""
        orders: list[CopyOrder] = []
        for i in range(self.n):
            orders += self.wpt.place(self.pool, i, int(q_bits[i]))
        self._copy(orders)
        self._sync_tables(np.arange(self.n))
        if self.memory.is_cuda:
            torch.cuda.current_stream(self.memory.device).synchronize()

    def lower(self, blocks: np.ndarray, to_bits: np.ndarray) -> int:
        """Commit q_i <- to_bits now (step boundary); returns pool pages freed."""
        before = self.pool.num_free
        self._copy(self.wpt.lower_many(self.pool, blocks, to_bits))
        self._sync_tables(blocks)
        return self.pool.num_free - before

    def begin_raise(self, blocks: np.ndarray, to_bits: np.ndarray) -> list[int]:
        """Start reloading planes for the listed raises (side stream); returns the blocks that got pages."""
        started: list[int] = []
        orders: list[CopyOrder] = []
        for i, b in zip(blocks.tolist(), to_bits.tolist(), strict=True):
            o = self.wpt.begin_raise(self.pool, i, b)
            if o is None:
                break  # no room for this one: later raises are worth less per byte
            started.append(i)
            orders += o
        if not started:
            return started
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                self._copy(orders)
                event = torch.cuda.Event()
                event.record(self.side)
            self._pending.append((event, started))
        else:
            self._copy(orders)
            self._pending.append((None, started))
        return started

    def in_flight_bytes(self) -> int:
        """Bytes of the reloads in flight (their pages at the target minus at the committed bitwidth)."""
        bl = np.array([i for _, blocks in self._pending for i in blocks], dtype=np.int64)
        if not bl.size:
            return 0
        w = self.wpt
        pend, q = w.pending[bl].astype(np.int64), w.q[bl].astype(np.int64)
        pages = (pend - q) * w.plane_pages[bl] + w.lut_pages[bl, pend] - w.lut_pages[bl, q]
        return int(pages.sum()) * self.page_bytes

    def poll(self) -> list[int]:
        """Commit every raise whose copies have completed (step boundary); returns the blocks raised."""
        done: list[int] = []
        keep = []
        for event, blocks in self._pending:
            if event is None or event.query():
                for i in blocks:
                    self.wpt.finish_raise(self.pool, i)
                done += blocks
            else:
                keep.append((event, blocks))
        self._pending = keep
        if done:
            self._sync_tables(np.asarray(done))
        return done

    def movable(self) -> np.ndarray:
        """[n] blocks with no reload in flight (the planner may change them now)."""
        return self.wpt.pending == 0

    def _sync_tables(self, blocks: np.ndarray) -> None:
        """Write the kernels' tables (plane/LUT offsets, bits) of ``blocks`` from the page table."""
        w = self.wpt
        for i in np.asarray(blocks).tolist():
            self._dense.pop(i, None)
        ii = np.asarray(blocks, dtype=np.int64)
        if ii.size == 0:
            return
        wpp, epp = self.page_bytes // 4, self.page_bytes // LUT_BYTES
        starts = w.plane_start[ii]
        offs = np.where((np.arange(8)[None, :] < w.q[ii][:, None]) & (starts >= 0), starts * wpp, 0)
        # one host -> device copy of [m, 11] int64: table row, 8 plane offsets, LUT offset, bits
        packed = self._to_device(np.concatenate([self.table_row[ii][:, None], offs, (w.lut_start[ii] * epp)[:, None],
                                                 w.q[ii][:, None]], axis=1).astype(np.int64))
        rows = packed[:, 0]
        self._plane_offset[rows] = packed[:, 1:9]
        self._lut_offset[rows] = packed[:, 9]
        self._bits[rows] = packed[:, 10].to(torch.int32)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """``a`` on the device without blocking the host: on CUDA through pinned memory, so that a table update
        made while the device computes a step is queued behind it instead of waiting for it (a pageable copy
        waits for the compute stream: 10 ms per reload step on the H200 before this, bench/results/serve_h200.md)."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def experts(self, layer: int, kind: str = "routed") -> Any:
        """The kernel's ``APExperts`` view of one layer's routed (or shared) experts.

        Built once per (layer, kind) and cached: it holds views of the pool and of the table rows, which
        ``_sync_tables`` updates in place, so it always reads the committed state. It is rebuilt only if
        one of those tensors was replaced (an identity check, no device work).
        """
        key = (layer, kind)
        t = self._tables[key]
        ex = self._experts.get(key)
        if ex is None or not (ex.pool is self.words and ex.lut_pool is self.lut_view
                              and ex.plane_offset is t.plane_offset and ex.lut_offset is t.lut_offset
                              and ex.bits is t.bits):
            from kernels.ap_moe import APExperts

            moe = self.spec.layers[layer].moe
            assert moe is not None
            inter = moe.shared_intermediate if kind == "shared" else moe.expert_intermediate
            ex = self._experts[key] = APExperts(self.words, t.plane_offset, self.lut_view, t.lut_offset, t.bits,
                                                self.spec.hidden_size, inter)
        return ex

    # ---------------------------------------------------------------- reference (CPU) weights
    def dense(self, i: int) -> torch.Tensor:
        """Dense weight [N, K] (model dtype) of block i at its committed q, read from its pool pages."""
        w = self._dense.get(i)
        if w is None:
            n, k = self.shape[i]
            q = int(self.wpt.q[i])
            kw = words_per_row(k)
            wpp, epp = self.page_bytes // 4, self.page_bytes // LUT_BYTES
            planes = torch.stack([self.words[s * wpp: s * wpp + n * kw].view(n, kw)
                                  for s in self.wpt.plane_start[i, :q].tolist()])
            ls = int(self.wpt.lut_start[i]) * epp
            lut = self.lut_view[ls: ls + n * 2**q].view(n, 2**q)
            w = dequantize(planes, lut, k, q, self.model.dtype)
            self._dense[i] = w
        return w

    # ---------------------------------------------------------------- the MoE block forward
    def moe(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """MoE output [T, H] for normalised hidden states x [T, H] with the committed AP experts."""
        lw = self.model.weights.layers[layer].moe
        spec = self.spec.layers[layer].moe
        assert lw is not None and spec is not None
        if self.use_kernel:
            return self._moe_kernel(x, layer, lw, spec)
        weights, ids = route(x, lw.router, spec)
        if self.observe:
            self._observe(layer, x, ids, weights, spec.num_experts, lw.shared is not None)
        view = _DenseMoE(self, layer, lw)
        return experts_forward(x, cast(MoEWeights, view), weights, ids, spec.num_experts, layer)

    def _moe_kernel(self, x: torch.Tensor, layer: int, lw: MoEWeights, spec: Any) -> torch.Tensor:
        """CUDA path: router matmul (router and shared gate in one), one routing kernel (top-k, gate,
        statistics), the fused AP kernels for the routed experts and the shared expert (``ap_moe_block``)."""
        from kernels.ap_moe import ap_moe, ap_moe_block
        from kernels.dense_gemv import linear
        from kernels.route_topk import route_topk

        e = spec.num_experts
        has_gate = lw.shared_gate is not None
        weight = self._router_gate.get(layer, lw.router)
        logits = linear(x, weight)
        stats = (self.mass_acc[layer], self.norm_acc[layer]) if self.observe and e == self.e_max else None
        w, ids, shared_w = route_topk(logits, x, e, spec.top_k, spec.norm_topk_prob, has_gate, stats,
                                      has_shared=lw.shared is not None)
        if self.observe and stats is None:
            self._observe(layer, x, ids, w, e, lw.shared is not None)
        if lw.shared is None:
            return ap_moe(x, ids, w, self.experts(layer), check=False)
        t = x.shape[0]
        sid = self._shared_ids.get(t)
        if sid is None:
            sid = self._shared_ids[t] = torch.zeros(t, 1, dtype=torch.int64, device=x.device)
        return ap_moe_block(x, ids, w, self.experts(layer), self.experts(layer, "shared"), shared_w[:, None], sid,
                            check=False)

    def _observe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 shared: bool) -> None:
        from kernels.route_topk import accumulate_routing_stats

        accumulate_routing_stats(self.mass_acc[layer], self.norm_acc[layer], x, ids, weights,
                                 self.mass_acc.shape[1] - 1, shared)

    def take_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """The routing-weight sums [L, E+1] and norm accumulators [L, E+1, 4] since the last call (host)."""
        m, a = self.mass_acc.cpu().numpy().copy(), self.norm_acc.cpu().numpy().copy()
        self.mass_acc.zero_()
        self.norm_acc.zero_()
        return m, a


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
    def __init__(self, store: ExpertStore, layer: int, unit: str) -> None:
        self.store, self.layer, self.unit = store, layer, unit

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.store.dense(self.store.index[(self.layer, e, self.unit)])


class _DenseMoE:
    """Duck-typed ``MoEWeights`` whose expert tensors are the store's dense views (reference path)."""

    def __init__(self, store: ExpertStore, layer: int, lw: MoEWeights) -> None:
        self.router, self.shared_gate = lw.router, lw.shared_gate
        self.gate_up, self.down = _Units(store, layer, "gate_up"), _Units(store, layer, "down")
        self.shared = None if lw.shared is None else MLPWeights(
            store.dense(store.index[(layer, SHARED_EXPERT, "gate_up")]),
            store.dense(store.index[(layer, SHARED_EXPERT, "down")]))
