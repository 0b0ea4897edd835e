"""Held-out NLL of many expert-bit allocations in batched passes (the scoring of ``pwcal search-buckets``).

What it does: ``score_allocations`` gives, for each allocation q [n] (bits per row of a ``BlockTable``), the mean
NLL of each window: what ``perplexity(dense_model(artifact, base, q), windows)`` gives, without building a model per
allocation. Allocations that agree on every layer before layer l feed it the same hidden states (at layer 0 all of
them do), so one pass over windows runs each layer once per (window, such prefix class): attention, norms and the
router once per class, each expert once per distinct bits among the class's children (``SplitExperts``), and the
classes split at each MoE block by its bits, until the LM head and the NLL run once per distinct allocation. A
block's dequantized weight at a bitwidth is made once (an LRU of ``cache_bytes``), not once per allocation.
Equivalence: every op is the reference's on the same rows (the lean model's own layers), so the scores equal the
one-model-per-allocation reference up to the rounding of matmuls of other row counts (tests/test_alloc_scoring.py
compares them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pwcal.split_experts import SplitExperts, WeightCache, WindowsKV, windows_step
from pwrun.ap.artifact import APArtifact
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.model.lean import LeanMoEModel

LOGIT_ELEMENTS = 1 << 20  # logits held at once by the NLL: 4 MiB in fp32 stays in cache from LM head to loss (2x
# faster on the CPU than 64 MiB)
CACHE_BYTES = 2 << 30  # dense expert weights kept between passes (the WeightCache's LRU bound)
MIN_LOGIT_ROWS = 256  # rows per LM-head call however large the vocabulary (matmuls of a useful size)


def allocation_bits(table: BlockTable, allocations: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``bits`` [A, layers, 1 + E, 2]: each allocation's (gate_up, down) bits of (layer, expert + 1) (index 0: the
    shared expert), for allocations [n] each; ``prefix`` [A, layers + 1]: equal ids where two allocations agree on
    every layer before (column ``layers``: on all of them)."""
    layers, experts = int(table.layer.max()) + 1, int(table.expert.max()) + 2
    bits = np.zeros((len(allocations), layers, experts, len(UNITS)), dtype=np.int64)
    for a, q in enumerate(allocations):
        bits[a, table.layer, table.expert + 1, table.unit] = q
    prefix = np.zeros((len(allocations), layers + 1), dtype=np.int64)
    for la in range(1, layers + 1):
        prefix[:, la] = np.unique(bits[:, :la].reshape(len(allocations), -1), axis=0, return_inverse=True)[1].ravel()
    return bits, prefix


def prefix_classes(prefix: np.ndarray, seq_alloc: np.ndarray, seq_window: np.ndarray, layers: int
                   ) -> list[np.ndarray]:
    """``classes[l]`` [S]: the class of each sequence (allocation ``seq_alloc``, window ``seq_window``) entering
    layer l (l = ``layers``: leaving the last one); equal where the window and every earlier layer's bits are
    equal. Ids 0.. in order of first appearance, so each layer's classes refine the previous layer's."""
    out = []
    for la in range(layers + 1):
        col = prefix[:, min(la, prefix.shape[1] - 1)]  # layers past the last MoE block split nothing
        keys = seq_window * (int(col.max()) + 1) + col[seq_alloc]
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first)] = np.arange(len(first))
        out.append(rank[inverse.ravel()])
    return out


def _nll_sums(model: LeanMoEModel, h: torch.Tensor, delta: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """Summed NLL [C] (fp64, nats) of C windows ids [C, L] from the last layer's h, delta [C * L, H]; the last
    position predicts nothing, so its logits are not made. Rows go to the LM head in chunks of ``LOGIT_ELEMENTS``
    logits (at least ``MIN_LOGIT_ROWS`` rows)."""
    c, L = ids.shape
    hs = h.view(c, L, -1)[:, :-1].reshape(c * (L - 1), -1)
    ds = None if delta is None else delta.view(c, L, -1)[:, :-1].reshape(c * (L - 1), -1)
    targets = ids[:, 1:].reshape(-1)
    per = max(MIN_LOGIT_ROWS, LOGIT_ELEMENTS // model.spec.vocab_size)
    loss = torch.empty(c * (L - 1), dtype=torch.float32, device=h.device)
    for lo in range(0, c * (L - 1), per):
        logits = model.head(hs[lo:lo + per], None if ds is None else ds[lo:lo + per])
        loss[lo:lo + per] = F.cross_entropy(logits, targets[lo:lo + per], reduction="none")
    return loss.view(c, L - 1).double().sum(1)


def score_pass(base: LeanMoEModel, weights: WeightCache, bits: np.ndarray, prefix: np.ndarray,
               seq_alloc: np.ndarray, seq_window: np.ndarray, windows: list[list[int]],
               on_layer: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Summed NLL [S] (nats) of each sequence s: allocation ``seq_alloc[s]`` on window ``seq_window[s]``;
    ``on_layer(layers_done, layers)`` after each layer (a pass can take a minute)."""
    L, dev, spec = len(windows[0]), base.device, base.spec
    classes = prefix_classes(prefix, seq_alloc, seq_window, len(spec.layers))
    first = [np.unique(c, return_index=True)[1] for c in classes]  # a sequence of each class
    tokens = torch.tensor([windows[w] for w in seq_window[first[0]]], dtype=torch.int64, device=dev)
    h, delta = base.embed(tokens.flatten()), None
    for la, (ls, lw) in enumerate(zip(spec.layers, base.weights.layers, strict=True)):
        kids = first[la + 1]
        kid_bits = bits[seq_alloc[kids], min(la, bits.shape[1] - 1)]
        moe = SplitExperts(base, weights, L, len(first[la]), classes[la][kids], kid_bits)
        h, delta = base.layer(h, delta, ls, lw, windows_step(len(first[la]), L, dev), WindowsKV(L), moe=moe,
                              split=moe.split)
        if on_layer is not None:
            on_layer(la + 1, len(spec.layers))
    last = first[-1]
    ids = torch.tensor([windows[w] for w in seq_window[last]], dtype=torch.int64, device=dev)
    return _nll_sums(base, h, delta, ids).cpu().numpy()[classes[-1]]


def _tick(progress: Callable[[int, int], None], done: int, seqs: int, total: int, layers_done: int,
          layers: int) -> None:
    progress(done + seqs * layers_done // layers, total)


def score_allocations(artifact: APArtifact, base: LeanMoEModel, table: BlockTable, allocations: list[np.ndarray],
                      windows: list[list[int]], max_step_tokens: int = 1 << 16, cache_bytes: int = CACHE_BYTES,
                      progress: Callable[[int, int], None] | None = None, weights: WeightCache | None = None
                      ) -> np.ndarray:
    """Mean NLL [A, W] (nats/token) of each allocation (bits [n] per ``table`` row) on each window (equal lengths).

    ``max_step_tokens``: tokens of one pass (sequences = allocations x windows, as many rows as its last layer
    has at most); ``cache_bytes``: dense weights kept between passes; ``progress(done, total)``: sequences scored,
    after each layer of a pass (its sequences counted in proportion);
    ``weights``: a cache to use (and keep) across calls instead of a new one of ``cache_bytes``.
    ``base``'s expert weights are not used.
    """
    seq_len, n_alloc = len(windows[0]), len(allocations)
    bits, prefix = allocation_bits(table, allocations)
    order = np.lexsort(bits.reshape(n_alloc, -1).T[::-1])  # neighbours share layer prefixes and weights
    per_step = max(1, max_step_tokens // seq_len)
    group = min(n_alloc, per_step)
    win_group = max(1, per_step // group)
    cache = WeightCache(artifact, base, cache_bytes) if weights is None else weights
    sums = np.zeros((n_alloc, len(windows)))
    done, total = 0, n_alloc * len(windows)
    for lo in range(0, n_alloc, group):
        allocs = order[lo:lo + group]
        for wlo in range(0, len(windows), win_group):
            wins = np.arange(wlo, min(len(windows), wlo + win_group))
            seq_alloc, seq_window = np.repeat(allocs, len(wins)), np.tile(wins, len(allocs))
            tick = None if progress is None else functools.partial(_tick, progress, done, len(seq_alloc), total)
            sums[seq_alloc, seq_window] = score_pass(base, cache, bits, prefix, seq_alloc, seq_window, windows,
                                                     tick)
            done += len(seq_alloc)
    return sums / (seq_len - 1)
