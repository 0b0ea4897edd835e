"""The pieces of a scoring pass over prefix classes (``pwcal.alloc_scoring``): its MoE blocks and its KV.

What it does: ``SplitExperts`` is the ``moe`` callback of one layer whose P input sequences ("parents": one per
window and class of allocations that agree on every earlier layer) leave the block as K >= P sequences
("children": the parents split by this layer's expert bits). Each expert runs once per bits on the routed rows of
the parents that need those bits, and each child takes its parent's rows, so a layer's expert work grows with the
distinct (parent, bits) pairs, not with the allocations. ``WindowsKV`` is the cache ``attention_forward`` writes
and attends through for whole windows of equal length: one batched attention call [C, heads, L, d] per layer,
instead of one per sequence. Neither touches the runtime's page pool.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_block
from pwrun.model.inventory import SHARED_EXPERT, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import route
from pwrun.model.ops import act, add_rows
from pwrun.model.step import StepTensors


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


def _groups(bits: np.ndarray) -> list[tuple[tuple[int, int], np.ndarray]]:
    """The children [k] of each distinct (gate_up, down) bits of one expert, bits [K, 2]."""
    values, inverse = np.unique(bits, axis=0, return_inverse=True)
    inverse = inverse.ravel()
    return [((int(v[0]), int(v[1])), np.flatnonzero(inverse == i)) for i, v in enumerate(values)]


class SplitExperts:
    """The ``moe`` callback of a layer: parents' rows [P * L, H] in, children's [K * L, H] out. ``parent`` [K]: the
    parent of each child; ``bits`` [K, 1 + E, 2]: each child's (gate_up, down) bits of (expert + 1) at this layer
    (index 0: the shared expert). Each token's expert outputs accumulate in ``experts_forward``'s order (experts
    ascending, then the shared expert), so a child equals its allocation's own model up to matmul rounding."""

    def __init__(self, model: LeanMoEModel, weights: WeightCache, seq_len: int, parents: int, parent: np.ndarray,
                 bits: np.ndarray) -> None:
        self.model, self.weights, self.L = model, weights, seq_len
        self.P, self.parent, self.bits = parents, parent, bits
        self.identity = len(parent) == parents  # a refinement with as many classes is the same partition
        self._parent_t = torch.as_tensor(parent, device=model.device)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        """Rows [K * L, ...] of the children from rows [P * L, ...] of the parents."""
        if self.identity:
            return t
        return t.view(self.P, -1).index_select(0, self._parent_t).view(len(self.parent) * self.L, *t.shape[1:])

    def _expert(self, x: torch.Tensor, layer: int, expert: int, b: tuple[int, int], activation: str) -> torch.Tensor:
        gate, up = F.linear(x, self.weights.get(layer, expert, "gate_up", b[0])).chunk(2, dim=-1)
        return F.linear(act(gate, activation) * up, self.weights.get(layer, expert, "down", b[1]))

    def __call__(self, x: torch.Tensor, layer: int, r: torch.Tensor | None = None) -> torch.Tensor:
        """MoE output [K * L, H] for the parents' x [P * L, H]; ``r``: the router's input where it is not x."""
        L, P, K, dev = self.L, self.P, len(self.parent), x.device
        lw, spec = self.model.weights.layers[layer].moe, self.model.spec.layers[layer].moe
        assert lw is not None and spec is not None
        weights, ids = route(x if r is None else r, lw.router, spec, lw.expert_scale)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
        token_of, flat_w = order // spec.top_k, weights.flatten()[order]
        out = x.new_zeros(K * L, x.shape[1])
        start = 0
        for e, n in enumerate(counts):  # experts ascending, as experts_forward accumulates them
            if n == 0:
                continue
            idx, w = token_of[start:start + n], flat_w[start:start + n, None]
            start += n
            for b, kids in _groups(self.bits[:, e + 1]):
                rows, wr = idx, w
                pars = np.unique(self.parent[kids])
                if len(pars) < P:  # only the routed rows of the parents that need these bits
                    need = torch.zeros(P, dtype=torch.bool, device=dev)
                    need[torch.as_tensor(pars, device=dev)] = True
                    sel = need[idx // L]
                    rows, wr = idx[sel], w[sel]
                y = self._expert(x.index_select(0, rows), layer, e, b, spec.activation) * wr
                if self.identity:
                    add_rows(out, rows, y)
                    continue
                for kid_round in _rounds(self.parent, kids):  # each parent at most once per round
                    child = torch.full((P,), -1, dtype=torch.int64, device=dev)
                    child[torch.as_tensor(self.parent[kid_round], device=dev)] = torch.as_tensor(kid_round, device=dev)
                    to = child[rows // L]
                    if len(kid_round) == len(pars):
                        add_rows(out, to * L + rows % L, y)
                    else:
                        m = to >= 0
                        add_rows(out, to[m] * L + rows[m] % L, y[m])
        if lw.shared is None:
            return out
        gate = None if lw.shared_gate is None else torch.sigmoid(F.linear(x, lw.shared_gate))
        shared = x.new_empty(K, L * x.shape[1])
        for b, kids in _groups(self.bits[:, 0]):
            pars = np.unique(self.parent[kids])
            pars_t = torch.as_tensor(pars, device=dev)
            xs = x if len(pars) == P else x.view(P, -1).index_select(0, pars_t).view(-1, x.shape[1])
            y = self._expert(xs, layer, SHARED_EXPERT, b, spec.activation)
            if gate is not None:
                y = (gate if len(pars) == P else gate.view(P, -1).index_select(0, pars_t).view(-1, 1)) * y
            at = torch.as_tensor(np.searchsorted(pars, self.parent[kids]), device=dev)
            shared[torch.as_tensor(kids, device=dev)] = y.view(len(pars), -1).index_select(0, at)
        return out + shared.view(K * L, -1)


def _rounds(parent: np.ndarray, kids: np.ndarray) -> list[np.ndarray]:
    """``kids`` split so that no two children of one round share a parent (round j: each parent's j-th child)."""
    ranks = np.zeros(len(kids), dtype=np.int64)
    seen: dict[int, int] = {}
    for i, p in enumerate(parent[kids].tolist()):
        ranks[i] = seen.get(p, 0)
        seen[p] = ranks[i] + 1
    return [kids[ranks == j] for j in range(int(ranks.max()) + 1)] if len(kids) else []


class WindowsKV:
    """``attention_forward``'s cache for C whole windows of ``seq_len`` tokens (positions 0 .. L-1, slots in row
    order): keeps the layer's keys/values and attends all windows in one call (``varlen_attention``)."""

    def __init__(self, seq_len: int) -> None:
        self.L, self.block_size = seq_len, seq_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("WindowsKV attends through varlen_attention only")

    def varlen_attention(self, layer: int, q: torch.Tensor, step: StepTensors, scale: float,
                         window: int = 0) -> torch.Tensor:
        """Causal attention (within ``window`` tokens where > 0) of q [C * L, hq, d] -> [C * L, hq, d]."""
        assert self.k is not None and self.v is not None
        t, hq, d = q.shape
        c, L = t // self.L, self.L
        qt = q.view(c, L, hq, d).transpose(1, 2)
        kt, vt = (z.view(c, L, -1, d).transpose(1, 2) for z in (self.k, self.v))
        gqa = hq != kt.shape[1]  # query heads share each kv head in SDPA, without copies of k and v
        if window:
            pos = torch.arange(L, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(t, hq, d)


def windows_step(windows: int, seq_len: int, device: torch.device) -> StepTensors:
    """The step of ``windows`` whole windows of ``seq_len`` tokens for ``WindowsKV`` (attention reads positions and
    slots; ``tokens`` only sizes the step, the token ids went into the embeddings)."""
    pos = torch.arange(seq_len, device=device).repeat(windows)
    return StepTensors(tokens=pos, positions=pos, slots=torch.arange(windows * seq_len, device=device),
                       query_start=[i * seq_len for i in range(windows + 1)], context_lens=[seq_len] * windows,
                       block_tables=[])
