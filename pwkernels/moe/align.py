"""(token, slot) pairs sorted by expert and padded per expert to whole tiles, in one launch (the tiled MoE paths).

What it computes (``align_by_expert``): for expert ids [T, k] and a tile height ``block_m``, ``sorted_pairs``
[num_tiles * block_m] int32 (pair ids t * k + j, each expert's pairs in pair order, its segment padded to a
multiple of ``block_m`` with T*k) and ``tile_expert`` [num_tiles] int32 (tile -> expert), where num_tiles =
min(E, T*k) + T*k // block_m is an upper bound known without a host sync: experts without pairs get no tile and the
spare tiles at the end have expert E and only padding. The mid-size, word-first and 16-bit grouped-GEMM MoE
kernels (SPEC section 7's expert-grouped paths) read tiles of one expert from it.

Why a kernel: the reference (``torch.sort``, two ``searchsorted``, a ``cumsum``, a fill and a scatter) is about
fifteen launches per MoE call, each a few us, on a path whose layer takes ~0.5 ms at decode batch sizes. Here
every program counts the pairs per expert itself (P x E comparisons), ranks its own pairs among those of their
expert (P comparisons each, as ``pwkernels.moe.pair_sort``), and writes its share of the pairs, of the padding
(the positions of each expert's last tile past its pairs, and the spare tiles) and of the tile map: disjoint
positions, so no program waits for another. No host sync.

Reference twin: ``align_by_expert_ref`` (also the path off CUDA and the interpreter, and above ``MAX_PAIRS``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK = 128  # positions (pairs, padded slots, tiles) per program
BLOCK_J = 64  # pairs compared per step
# above: the reference. Every program counts all P pairs per expert (and ranks its own among those before them):
# its time grows with P: ~50 us at 2,048 pairs by the pair sort's measured rate (pwkernels.moe.pair_sort; not
# measured for this kernel).
MAX_PAIRS = 2048


# P and num_tiles change with every step's token count; specialized, each of their Triton int classes (1, multiple
# of 16, other) would be its own compile, met first inside a run (``pwkernels.warmup`` covers the pair count's
# class, not the tile count's). One compile serves every count.
@triton.jit(do_not_specialize=["P", "num_tiles"])
def _align_kernel(
    ids_ptr,  # [P] expert ids (row-major [T, k])
    sorted_ptr,  # [num_tiles * BLOCK_M] int32 out: pair ids, padded with P
    tile_expert_ptr,  # [num_tiles] int32 out: expert of each tile (E for the spare ones)
    P,  # pairs
    E,  # experts
    num_tiles,  # tiles
    BLOCK_M: tl.constexpr,  # tile height
    E_P2: tl.constexpr,  # E rounded up to a power of 2, at least 16 (no 1-wide reductions to compile)
    BLOCK: tl.constexpr,  # positions per program
    BLOCK_J: tl.constexpr,  # pairs compared per step
):
    ev = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for j0 in range(0, P, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        e_j = tl.load(ids_ptr + j, mask=j < P, other=-1)
        counts += tl.sum((e_j[None, :] == ev[:, None]).to(tl.int32), axis=1)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    tile_start = tile_end - tiles
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # pairs: position = first slot of the expert's segment + rank among the expert's pairs (stable)
    if tl.program_id(0) * BLOCK < P:
        im = i < P
        e_i = tl.load(ids_ptr + i, mask=im, other=0)
        before = tl.zeros((BLOCK,), dtype=tl.int32)
        for j0 in range(0, tl.minimum(P, (tl.program_id(0) + 1) * BLOCK), BLOCK_J):  # only j < i counts
            j = j0 + tl.arange(0, BLOCK_J)
            e_j = tl.load(ids_ptr + j, mask=j < P, other=-1)
            before += tl.sum(((e_j[None, :] == e_i[:, None]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
        start = tl.sum(tl.where(ev[None, :] == e_i[:, None], tile_start[None, :], 0), axis=1)
        pos = start * BLOCK_M + before
        tl.store(sorted_ptr + pos, i.to(tl.int32), mask=im & (pos < num_tiles * BLOCK_M))
    # padding: slots past an expert's pairs in its last tile, and every slot of the spare tiles
    tile = i // BLOCK_M
    pm = i < num_tiles * BLOCK_M
    owner = tl.sum(((tile_end[None, :] <= tile[:, None]) & (ev[None, :] < E)).to(tl.int32), axis=1)
    hit = ev[None, :] == owner[:, None]
    rank = i - tl.sum(tl.where(hit, tile_start[None, :], 0), axis=1) * BLOCK_M
    pad = (owner >= E) | (rank >= tl.sum(tl.where(hit, counts[None, :], 0), axis=1))
    tl.store(sorted_ptr + i, (i * 0 + P).to(tl.int32), mask=pm & pad)
    # tile map: tiles whose end is at or before a tile belong to earlier experts
    tm = i < num_tiles
    te = tl.sum(((tile_end[None, :] <= i[:, None]) & (ev[None, :] < E)).to(tl.int32), axis=1)
    tl.store(tile_expert_ptr + i, te, mask=tm)


def num_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles of ``align_by_expert``'s layout: an upper bound on what ``num_pairs`` pairs of ``num_experts`` fill."""
    return min(num_experts, num_pairs) + num_pairs // block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``sorted_pairs``, ``tile_expert``) as the module says, in one Triton launch on CUDA or in the interpreter
    (up to ``MAX_PAIRS`` pairs), else ``align_by_expert_ref``. Ids must lie in [0, num_experts) (not checked:
    that would sync); an id outside leaves its pair out."""
    flat = topk_ids.flatten()
    p = flat.numel()
    if (not flat.is_cuda and os.environ.get("TRITON_INTERPRET") != "1") or p > MAX_PAIRS or p == 0:
        return align_by_expert_ref(topk_ids, num_experts, block_m)
    n = num_tiles(p, num_experts, block_m)
    sorted_pairs = torch.empty(n * block_m, dtype=torch.int32, device=flat.device)
    tile_expert = torch.empty(n, dtype=torch.int32, device=flat.device)
    _align_kernel[(triton.cdiv(n * block_m, BLOCK),)](
        flat.contiguous(), sorted_pairs, tile_expert, p, num_experts, n, BLOCK_M=block_m,
        E_P2=max(16, triton.next_power_of_2(num_experts)), BLOCK=BLOCK, BLOCK_J=BLOCK_J)
    return sorted_pairs, tile_expert


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int,
                        block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_by_expert`` by ``torch.sort(stable=True)``, ``searchsorted`` and a scatter (no host sync)."""
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs, dev = flat.numel(), flat.device
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=dev))
    tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    max_tiles = num_tiles(num_pairs, num_experts, block_m)
    tile_expert = torch.searchsorted(tile_end, torch.arange(max_tiles, device=dev), right=True)
    rank = torch.arange(num_pairs, device=dev) - bounds[sorted_ids]
    sorted_pairs = torch.full((max_tiles * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[(tile_end - tiles)[sorted_ids] * block_m + rank] = order.to(torch.int32)
    return sorted_pairs, tile_expert.to(torch.int32)
