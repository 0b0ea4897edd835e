"""Held-out NLL of many expert-bit allocations in batched passes (the scoring of ``pwcal search-buckets``).

What it does: ``score_allocations`` gives, for each allocation q [n] (bits per row of a ``BlockTable``), the mean
NLL of each window: what ``perplexity(dense_model(artifact, base, q), windows)`` gives, without building a model per
allocation. One prefill step (``prefill_logits``, the runtime's reference path) holds the windows of many
allocations, and its MoE blocks run through ``BatchedExperts``: an expert's tokens of every allocation that gives it
the same (gate_up, down) bits go through one matmul; a block's dequantized weight at a bitwidth is made once (an LRU
of ``cache_bytes``), not once per allocation; and allocations that agree on every earlier layer feed a layer the same
hidden states (at layer 0 all of them do), so that layer's experts run once for them and only the bits differ.
Equivalence: each token's expert outputs are accumulated in ``experts_forward``'s order (experts ascending, then the
shared expert), so the scores equal the one-model-per-allocation reference up to the rounding of matmuls of other
row counts (tests/test_alloc_scoring.py compares them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_block
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.model.inventory import SHARED_EXPERT, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import route
from pwrun.model.ops import act
from pwrun.ppl import window_nll_sums
from pwrun.runner.prefill import prefill_logits


class WeightCache:
    """Dense expert weights (layer, expert, unit, bits) -> [n, k], least recently used evicted past ``max_bytes``."""

    def __init__(self, artifact: APArtifact, model: LeanMoEModel, max_bytes: int) -> None:
        self.artifact, self.model, self.max_bytes = artifact, model, max_bytes
        self.blocks = {(b.layer, b.expert, b.unit): b for b in expert_blocks(model.spec)}
        self.items: OrderedDict[tuple[int, int, str, int], torch.Tensor] = OrderedDict()
        self.bytes = 0
        self._layer: tuple[int, dict[str, torch.Tensor]] | None = None  # the last layer's planes and LUTs

    def get(self, layer: int, expert: int, unit: str, bits: int) -> torch.Tensor:
        key = (layer, expert, unit, bits)
        w = self.items.get(key)
        if w is not None:
            self.items.move_to_end(key)
            return w
        if self._layer is None or self._layer[0] != layer:
            self._layer = (layer, self.artifact.layer_tensors(layer, self.model.device))
        w = dense_block(self.artifact, self._layer[1], self.blocks[(layer, expert, unit)], bits, self.model.dtype)
        self.items[key] = w
        self.bytes += w.numel() * w.element_size()
        while self.bytes > self.max_bytes and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        return w


class BatchedExperts:
    """The ``moe`` callback of one prefill step whose sequence s (rows s*L .. s*L+L-1) runs allocation
    ``seq_alloc[s]`` on window ``seq_window[s]``. ``bits`` [A, layers, 1 + E, 2]: the bits of each allocation's
    (layer, expert + 1, unit) (index 0: the shared expert); ``prefix`` [A, layers]: equal ids where two allocations
    agree on every layer before (so their sequences on the same window enter that layer with equal states)."""

    def __init__(self, model: LeanMoEModel, weights: WeightCache, bits: np.ndarray, prefix: np.ndarray,
                 seq_alloc: np.ndarray, seq_window: np.ndarray, seq_len: int) -> None:
        self.model, self.weights, self.bits, self.prefix = model, weights, bits, prefix
        self.seq_alloc, self.seq_window, self.L = seq_alloc, seq_window, seq_len

    def _expert(self, x: torch.Tensor, layer: int, expert: int, b: tuple[int, int], activation: str) -> torch.Tensor:
        gate, up = F.linear(x, self.weights.get(layer, expert, "gate_up", b[0])).chunk(2, dim=-1)
        return F.linear(act(gate, activation) * up, self.weights.get(layer, expert, "down", b[1]))

    def __call__(self, x: torch.Tensor, layer: int, r: torch.Tensor | None = None) -> torch.Tensor:
        """MoE output [T, H] of the step's sequences for x [T, H]; ``r``: the router's input where it is not x
        (``LeanMoEModel``'s ``moe`` callback)."""
        L, dev = self.L, x.device
        lw, spec = self.model.weights.layers[layer].moe, self.model.spec.layers[layer].moe
        assert lw is not None and spec is not None
        r = x if r is None else r
        alloc = self.seq_alloc
        # one representative sequence per (window, prefix class): the others enter this layer with its states
        keys = self.seq_window * (int(self.prefix[:, layer].max()) + 1) + self.prefix[alloc, layer]
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first)] = np.arange(len(first))
        first, rep_of = np.sort(first), rank[inverse.ravel()]  # representatives in sequence order
        rep_seqs = torch.as_tensor(first, device=dev)
        rep_rows = (rep_seqs[:, None] * L + torch.arange(L, device=dev)).flatten()
        xr = x if len(first) == len(alloc) else x.index_select(0, rep_rows)
        rr = r if len(first) == len(alloc) else r.index_select(0, rep_rows)
        weights, ids = route(rr, lw.router, spec, lw.expert_scale)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
        token_of, flat_w = order // spec.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        pos = torch.arange(L, device=dev)
        start = 0
        for e, n in enumerate(counts):  # experts ascending, as experts_forward accumulates them
            if n == 0:
                continue
            idx, w = token_of[start:start + n], flat_w[start:start + n, None]
            start += n
            seg = idx // L  # representative of each routed row
            pairs = self.bits[alloc, layer, e + 1]  # [S, 2] (gate_up, down) bits of each sequence
            for b in {(int(p[0]), int(p[1])) for p in pairs}:
                members = np.flatnonzero((pairs == b).all(1))
                need = torch.zeros(len(first), dtype=torch.bool, device=dev)
                need[torch.as_tensor(rep_of[members], device=dev)] = True
                sel = need[seg]
                y = self._expert(xr.index_select(0, idx[sel]), layer, e, b, spec.activation) * w[sel]
                src_seg, src_pos = seg[sel], idx[sel] % L
                src, dst = [], []
                for s in members:  # each member sequence takes its representative's rows
                    m = torch.nonzero(src_seg == int(rep_of[s])).flatten()
                    src.append(m)
                    dst.append(int(s) * L + src_pos[m])
                out.index_add_(0, torch.cat(dst), y.index_select(0, torch.cat(src)))
        if lw.shared is None:
            return out
        shared = torch.empty_like(x)
        pairs = self.bits[alloc, layer, 0]
        gate = None if lw.shared_gate is None else torch.sigmoid(F.linear(xr, lw.shared_gate))
        for b in {(int(p[0]), int(p[1])) for p in pairs}:
            members = np.flatnonzero((pairs == b).all(1))
            reps = np.unique(rep_of[members])
            rows = (torch.as_tensor(reps, device=dev)[:, None] * L + pos).flatten()
            y = self._expert(xr.index_select(0, rows), layer, SHARED_EXPERT, b, spec.activation)
            if gate is not None:
                y = gate.index_select(0, rows) * y
            where = {int(r): i for i, r in enumerate(reps)}
            for mem in members:
                i = where[int(rep_of[mem])]
                shared[int(mem) * L:(int(mem) + 1) * L] = y[i * L:(i + 1) * L]
        return out + shared


def allocation_bits(table: BlockTable, allocations: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``BatchedExperts``' ``bits`` [A, layers, 1 + E, 2] and ``prefix`` [A, layers] of allocations [n] each."""
    layers, experts = int(table.layer.max()) + 1, int(table.expert.max()) + 2
    bits = np.zeros((len(allocations), layers, experts, len(UNITS)), dtype=np.int64)
    for a, q in enumerate(allocations):
        bits[a, table.layer, table.expert + 1, table.unit] = q
    prefix = np.zeros((len(allocations), layers), dtype=np.int64)
    for la in range(1, layers):
        prefix[:, la] = np.unique(bits[:, :la].reshape(len(allocations), -1), axis=0, return_inverse=True)[1].ravel()
    return bits, prefix


def score_allocations(artifact: APArtifact, base: LeanMoEModel, table: BlockTable, allocations: list[np.ndarray],
                      windows: list[list[int]], max_step_tokens: int = 8192, cache_bytes: int = 2 << 30,
                      progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Mean NLL [A, W] (nats/token) of each allocation (bits [n] per ``table`` row) on each window (equal lengths).

    ``max_step_tokens``: tokens of one prefill step (sequences = allocations x windows); ``cache_bytes``: dense
    weights kept between steps; ``progress(done, total)``: sequences scored, after each step. ``base``'s expert
    weights are not used.
    """
    seq_len, n_alloc = len(windows[0]), len(allocations)
    bits, prefix = allocation_bits(table, allocations)
    order = np.lexsort(bits.reshape(n_alloc, -1).T[::-1])  # neighbours share layer prefixes and weights
    per_step = max(1, max_step_tokens // seq_len)
    group = min(n_alloc, per_step)
    win_group = max(1, per_step // group)
    cache = WeightCache(artifact, base, cache_bytes)
    sums = np.zeros((n_alloc, len(windows)))
    done, total = 0, n_alloc * len(windows)
    for lo in range(0, n_alloc, group):
        allocs = order[lo:lo + group]
        for wlo in range(0, len(windows), win_group):
            wins = np.arange(wlo, min(len(windows), wlo + win_group))
            seq_alloc, seq_window = np.repeat(allocs, len(wins)), np.tile(wins, len(allocs))
            moe = BatchedExperts(base, cache, bits, prefix, seq_alloc, seq_window, seq_len)
            tokens = [windows[w] for w in seq_window]
            logits = prefill_logits(base, tokens, moe=moe)
            sums[seq_alloc, seq_window] = window_nll_sums(logits, torch.tensor(tokens, dtype=torch.int64))
            done += len(tokens)
            if progress is not None:
                progress(done, total)
    return sums / (seq_len - 1)
