"""(token, slot) pairs sorted by expert in one launch, for the decode path's sorted-slots mode (SPEC section 7:
routing-aware batching at decode).

What it does: for the expert ids of P pairs (``topk_ids`` flattened, [P] integer), returns ``sorted_ids`` [P] (the
ids in ascending order, ties in pair order: a stable sort), ``order`` [P] int32 (sorted position -> pair) and
``seg`` [P] int32 (sorted position -> first position of its expert's run), what ``pwkernels.moe.decode`` reads.

Why a kernel: ``torch.sort`` followed by ``torch.searchsorted`` is two or more launches per MoE call; at decode
(P = 4..512) a call's routed layer takes ~20-100 us on an H200, so each launch of ~2 us counts. Here one launch
ranks every pair by counting: pos_i = #{j : e_j < e_i} + #{j < i : e_j = e_i} (P^2 comparisons in tiles, negligible
for P <= 512), and the first count is also the start of e_i's run. No host sync.

``_slots_of`` (Triton, called by the decode kernels) reads the sorted pairs: S consecutive pairs of one expert per
program.

``group_pairs`` gives the prefill path's grouping (``pwkernels.moe.prefill``): the order, each expert's end in it
(grouped GEMM offsets) and the inverse permutation (pair -> sorted position), from the same launch plus one
``searchsorted``; up to ``MAX_PAIRS`` pairs (above, the P^2 comparisons cost more than ``torch.sort``'s passes).

Reference twins: ``sort_pairs_ref`` (``torch.sort(stable=True)`` + ``torch.searchsorted``), also the CPU path, and
``group_pairs_ref`` (the same and a scatter).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_I = 64  # pairs ranked per program
BLOCK_J = 64  # pairs compared per step
# group_pairs above this: the reference. A program's time grows with P (it compares its pairs with all P): 142 us
# per call at 8,192 pairs on an H100 (bench/results/decode_profile.jsonl, a 2,048-token mixed step), where
# torch.sort's radix passes took ~50 us (ca40f78's profile); by that rate ~36 us at 2,048 pairs (not measured).
MAX_PAIRS = 2048


@triton.jit
def _sort_pairs_kernel(
    ids_ptr,  # [P] expert ids
    sorted_ptr,  # [P] out: ids in ascending order (stable)
    order_ptr,  # [P] int32 out: sorted position -> pair
    seg_ptr,  # [P] int32 out: sorted position -> first position of its expert's run
    inv_ptr,  # [P] int32 out (with HAS_INV): pair -> sorted position
    P,  # pairs
    BLOCK_I: tl.constexpr,  # pairs ranked per program
    BLOCK_J: tl.constexpr,  # pairs compared per step
    HAS_INV: tl.constexpr,  # write inv
):
    """Rank pairs i of this program among all P (stable, by expert id) and scatter them to their sorted positions."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    im = i < P
    e_i = tl.load(ids_ptr + i, mask=im, other=0)
    less = tl.zeros((BLOCK_I,), dtype=tl.int32)
    before = tl.zeros((BLOCK_I,), dtype=tl.int32)
    for j0 in range(0, P, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        jm = (j < P)[None, :]
        e_j = tl.load(ids_ptr + j, mask=j < P, other=0)
        less += tl.sum(((e_j[None, :] < e_i[:, None]) & jm).to(tl.int32), axis=1)
    for j0 in range(0, tl.minimum(P, (tl.program_id(0) + 1) * BLOCK_I), BLOCK_J):  # ties: only j < i counts
        j = j0 + tl.arange(0, BLOCK_J)
        e_j = tl.load(ids_ptr + j, mask=j < P, other=-1)
        before += tl.sum(((e_j[None, :] == e_i[:, None]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
    pos = less + before
    tl.store(sorted_ptr + pos, e_i, mask=im)
    tl.store(order_ptr + pos, i, mask=im)
    tl.store(seg_ptr + pos, less, mask=im)
    if HAS_INV:
        tl.store(inv_ptr + i, pos, mask=im)


def sort_pairs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [P] in ids' dtype, order [P] int32, seg [P] int32) of expert ids [P] (1-D, integer, contiguous
    or not), in one Triton launch on CUDA or in the interpreter, else ``sort_pairs_ref``. Raises ``ValueError``
    for ids that are not 1-D integers."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be 1-D integer expert ids, got {tuple(ids.shape)} {ids.dtype}")
    if not _kernel_runs(ids):
        return sort_pairs_ref(ids)
    sorted_ids, order, seg, _ = _launch(ids, False)
    return sorted_ids, order, seg


def _kernel_runs(ids: torch.Tensor) -> bool:
    return ids.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _launch(ids: torch.Tensor, inverse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = ids.contiguous()
    p = ids.numel()
    sorted_ids = torch.empty_like(ids)
    order, seg, inv = (torch.empty(p if inverse or n < 2 else 0, dtype=torch.int32, device=ids.device)
                       for n in range(3))
    if p:
        _sort_pairs_kernel[(triton.cdiv(p, BLOCK_I),)](ids, sorted_ids, order, seg, inv if inverse else seg, p,
                                                      BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J, HAS_INV=inverse)
    return sorted_ids, order, seg, inv


def sort_pairs_ref(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sort_pairs`` by ``torch.sort(stable=True)`` and ``torch.searchsorted`` (the reference, and the path off
    CUDA and the interpreter)."""
    sorted_ids, order = torch.sort(ids.contiguous(), stable=True)
    seg = torch.searchsorted(sorted_ids, sorted_ids)
    return sorted_ids, order.to(torch.int32), seg.to(torch.int32)


def group_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [P] int32: sorted position -> pair, a stable sort by expert; ends [E] int32: the end of each expert's
    run in it (a cumulative count, the offsets of a grouped GEMM); inv [P] int32: pair -> sorted position) of expert
    ids [P] (1-D, integer, each in [0, num_experts)), without a host sync: one Triton launch and a ``searchsorted``
    on CUDA or in the interpreter up to ``MAX_PAIRS`` pairs, else ``group_pairs_ref``: the expert grouping of SPEC
    section 7's prefill path. Raises ``ValueError`` for ids that are not 1-D integers."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be 1-D integer expert ids, got {tuple(ids.shape)} {ids.dtype}")
    if not _kernel_runs(ids) or ids.numel() > MAX_PAIRS:
        return group_pairs_ref(ids, num_experts)
    sorted_ids, order, _, inv = _launch(ids, True)
    return order, _ends(sorted_ids, num_experts), inv


def group_pairs_ref(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``group_pairs`` by ``torch.sort(stable=True)``, ``searchsorted`` and a scatter."""
    sorted_ids, order = torch.sort(ids.contiguous(), stable=True)
    inv = torch.empty(ids.numel(), dtype=torch.int32, device=ids.device)
    inv[order] = torch.arange(ids.numel(), dtype=torch.int32, device=ids.device)
    return order.to(torch.int32), _ends(sorted_ids, num_experts), inv


_EXPERT_ENDS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # 1..E per (E, dtype, device)


def _ends(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    key = (num_experts, sorted_ids.dtype, sorted_ids.device)
    upto = _EXPERT_ENDS.get(key)
    if upto is None:
        upto = _EXPERT_ENDS[key] = torch.arange(1, num_experts + 1, dtype=sorted_ids.dtype, device=sorted_ids.device)
    return torch.searchsorted(sorted_ids, upto, out_int32=True)


@triton.jit
def _slots_of(sorted_ids_ptr, order_ptr, seg_ptr, p, NP, TOPK: tl.constexpr, S: tl.constexpr):
    """(e, lead, active [S], pair [S], tok [S]) for program p in the sorted-slots mode (``SLOTS``): the (token, slot)
    pairs sorted by expert (``order``: sorted position -> pair t * TOPK + s; ``seg``: sorted position -> first
    position of its expert's run), e = the expert of sorted position p; lead: p starts a group of S consecutive
    positions of e's run (its rank in the run is a multiple of S), and this program does the group's work;
    pair[s] = order[p + s] and tok[s] = pair[s] // TOPK; active[s]: lead and position p + s is e's. Inactive slots
    point at p's own pair (its rows are finite: every pair is active in exactly one group)."""
    e = tl.load(sorted_ids_ptr + p)
    rank = p - tl.load(seg_ptr + p)
    slot = tl.arange(0, S)
    pos = p + slot
    ids = tl.load(sorted_ids_ptr + pos, mask=pos < NP, other=-1)
    active = (ids == e) & (slot * 0 + rank % S == 0)  # a tensor mask: the interpreter mistypes scalar & tensor bools
    pair = tl.where(active, tl.load(order_ptr + pos, mask=pos < NP, other=0), tl.load(order_ptr + p))
    return e, rank % S == 0, active, pair, pair // TOPK
