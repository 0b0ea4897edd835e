"""Decode MoE path (Triton): word-first GEMV kernels for a few tokens per expert (SPEC section 7).

Two launches with no host sync: gate_up with SiLU-and-mul (or GELU-tanh), writing the intermediate word-major,
then down with split-K and the routing weight, writing fp32 partials [SPLIT, T, k, H] that
``pwkernels.moe.layout.combine`` sums and rounds once. Activations are word-major
(``pwkernels.moe.layout.word_major``) and padded to whole K steps, so the lanes (one plane word each) read them
unmasked at constant offsets; weights come from ``pwkernels.moe.decode_dot``.
Two ways to map (token, slot) pairs to programs:
  * token slots (``SLOTS`` 0): the program of an expert's first pair does the expert's work for all its tokens
    (at most 8 per launch; more run as chunks of 8, each reading its experts again);
  * sorted slots (``SLOTS`` = S in 1, 2, 4, 8): pairs sorted by expert on the device (``pwkernels.moe.pair_sort``),
    S consecutive pairs of one expert per program, any number of tokens in one launch; each weight is decoded
    once per S pairs, which wins when a batch's tokens spread over many experts.
Bitwidths are read from the tables at every call, so a runtime may change them in place between calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pwkernels.moe.activation import check_activation, gate_act
from pwkernels.moe.decode_dot import _dot_block
from pwkernels.moe.experts import APExperts
from pwkernels.moe.launch import DecodeConfig
from pwkernels.moe.layout import combine, padded_words, word_major
from pwkernels.moe.pair_sort import _slots_of, sort_pairs

MAX_TOKENS = 8  # token slots: one [BKW, R] accumulator per token


@triton.jit
def _expert_of(ids_ptr, j, T, TOPK: tl.constexpr, T_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """(e, lead, tok [T_PAD], active [T_PAD], row [T_PAD]) for pair j in the token-slot mode.

    e = ids[j]; lead: j is e's first pair (the program does the work); active[t]: lead and token t picked e in
    some slot; row[t]: its first such pair t * TOPK + s (where gate_up puts its intermediate). Masks are built
    from tensors, not from the scalar ``lead``: the interpreter mistypes scalar-bool & tensor-bool.
    """
    e = tl.load(ids_ptr + j)
    tok = tl.arange(0, T_PAD)
    slot = tl.arange(0, K_PAD)
    pair = tok[:, None] * TOPK + slot[None, :]
    ids = tl.load(ids_ptr + pair, mask=(tok[:, None] < T) & (slot[None, :] < TOPK), other=-1)
    match = ids == e
    earlier = tl.sum(tl.where(match & (pair < j), 1, 0))
    first = tl.min(tl.where(match, slot[None, :], K_PAD), axis=1)
    return e, earlier == 0, tok, (first < K_PAD) & (tok * 0 + earlier == 0), tok * TOPK + first


@triton.jit
def _store_pairs(out_ptr, ids_ptr, w_ptr, y, e, tok, active, n, nmask, pid_s, T, H, TOPK: tl.constexpr):
    """Write y [T_PAD, BLOCK_N] (expert e's down rows n for each token) times the routing weight into every
    (token, slot) pair that picked e (a token may pick e twice) of split ``pid_s`` of out [SPLIT, T*k, H]."""
    num_pairs = T * TOPK
    for s in tl.static_range(TOPK):
        pair = tok * TOPK + s
        ids_s = tl.load(ids_ptr + pair, mask=tok < T, other=-1)
        w_s = tl.load(w_ptr + pair, mask=tok < T, other=0.0)
        tl.store(out_ptr + (pid_s * num_pairs + pair[:, None]) * H + n[None, :], y * w_s[:, None],
                 mask=((ids_s == e) & active)[:, None] & nmask[None, :])


def token_pad(num_tokens: int) -> int:
    """T_PAD, the token count the token-slot kernels are compiled for (one specialization per power of 2)."""
    return triton.next_power_of_2(num_tokens)


@triton.jit
def _decode_gate_up_kernel(
    x_ptr,  # [T, 32, KWX] activations (bf16/fp16), word-major and zero-padded (``word_major``)
    inter_ptr,  # [T*k, 32, KWO] out: act(gate) * up in x's dtype, word-major, at each (token, expert)'s 1st pair
    ids_ptr,  # [T*k] expert ids, row-major [T, k] (SORTED: sorted by expert)
    order_ptr,  # SORTED: [T*k] sorted position -> pair (else unused)
    seg_ptr,  # SORTED: [T*k] sorted position -> first position of its expert's run (else unused)
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    T,  # tokens
    H,  # hidden size = K of gate_up
    I,  # noqa: E741 - expert intermediate size
    TOPK: tl.constexpr,
    T_PAD: tl.constexpr,  # next power of 2 >= T (<= 8); SORTED: the slots per program
    K_PAD: tl.constexpr,  # next power of 2 >= TOPK
    SORTED: tl.constexpr,  # sorted-slots mode (``_slots_of``)
    BLOCK_N: tl.constexpr,  # intermediate columns per program (2 * BLOCK_N gate and up rows)
    BKW: tl.constexpr,  # plane words (32 columns each) per K step
    LE: tl.constexpr,  # LUT entries held in registers for shuffles: 32 if BKW >= 32 else 16
    RAW: tl.constexpr,  # shuffles by shfl.sync (inline PTX, BKW 16 or 32, CUDA only), else tl.gather
    KWX: tl.constexpr,  # words of an x row (ceil(H / 32) rounded up to a multiple of BKW)
    KWO: tl.constexpr,  # words of an inter row (down's KWX)
    PAD_O: tl.constexpr,  # power of 2 >= 32 * KWO - I: inter columns the first program of a pair zeroes
    GELU: tl.constexpr,  # GELU-tanh gate activation instead of SiLU (``pwkernels.moe.activation``)
):
    if SORTED:
        e, lead, active, row, tok = _slots_of(ids_ptr, order_ptr, seg_ptr, tl.program_id(0), T * TOPK, TOPK, T_PAD)
        x_off = tok * (32 * KWX)
    else:
        e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
        x_off = tl.minimum(tok, T - 1) * (32 * KWX)  # padded tokens read the last token's (finite) row
    blk = 2 * e
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # 2 * BLOCK_N rows, gate and up interleaved, clamped so that every load is in bounds (stores are masked)
    r = tl.arange(0, 2 * BLOCK_N)
    rows = tl.minimum(tl.program_id(1) * BLOCK_N + r // 2, I - 1) + (r % 2) * I
    kwh = (H + 31) // 32
    acc = _dot_block(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, rows, 0, tl.where(lead, kwh, 0),
                     kwh, x_ptr, x_off, KWX, T_PAD, BKW, LE, RAW)
    g, u = tl.split(tl.reshape(acc, (T_PAD, BLOCK_N, 2)))
    h = gate_act(g, GELU) * u
    tl.store(inter_ptr + row[:, None] * (32 * KWO) + ((n % 32) * KWO + n // 32)[None, :],
             h.to(inter_ptr.dtype.element_ty), mask=active[:, None] & (n < I)[None, :])
    if tl.program_id(1) == 0:  # down reads whole padded rows unmasked: columns I .. 32 * KWO - 1 are 0
        c = I + tl.arange(0, PAD_O)
        tl.store(inter_ptr + row[:, None] * (32 * KWO) + ((c % 32) * KWO + c // 32)[None, :],
                 tl.zeros((T_PAD, PAD_O), dtype=inter_ptr.dtype.element_ty),
                 mask=active[:, None] & (c < 32 * KWO)[None, :])


@triton.jit
def _decode_down_kernel(
    inter_ptr,  # [T*k, 32, KWX] from _decode_gate_up_kernel (word-major, zero-padded)
    out_ptr,  # [SPLIT, T*k, H] fp32: per split, routing-weighted partial expert output of every pair
    ids_ptr,  # [T*k] expert ids (SORTED: sorted by expert)
    order_ptr,  # SORTED: [T*k] sorted position -> pair (else unused)
    seg_ptr,  # SORTED: [T*k] sorted position -> first position of its expert's run (else unused)
    w_ptr,  # [T*k] fp32 routing weights
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    T,  # tokens
    H,  # rows of down
    I,  # noqa: E741 - K of down
    TOPK: tl.constexpr,  # k
    T_PAD: tl.constexpr,  # as in _decode_gate_up_kernel
    K_PAD: tl.constexpr,  # next power of 2 >= TOPK
    SORTED: tl.constexpr,  # sorted-slots mode (``_slots_of``)
    BLOCK_N: tl.constexpr,  # output rows per program
    BKW: tl.constexpr,  # plane words (32 columns each) per K step
    LE: tl.constexpr,  # LUT entries held in registers for shuffles: 32 if BKW >= 32 else 16
    RAW: tl.constexpr,  # shuffles by shfl.sync (inline PTX), else tl.gather
    KWX: tl.constexpr,  # words of an inter row (ceil(I / 32) rounded up so that every split's K steps fit)
):
    if SORTED:  # inactive slots hold p's own pair, whose inter row gate_up wrote
        e, lead, active, row, tok = _slots_of(ids_ptr, order_ptr, seg_ptr, tl.program_id(0), T * TOPK, TOPK, T_PAD)
    else:
        e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
        # tokens with no work read the first active token's row (written by gate_up, finite)
        row = tl.where(active, row, tl.min(tl.where(active, row, T * TOPK)))
    pid_s = tl.program_id(2)
    blk = 2 * e + 1
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    rows = tl.minimum(n, H - 1)
    kwi = (I + 31) // 32
    chunk = tl.cdiv(tl.cdiv(kwi, BKW), tl.num_programs(2)) * BKW
    kw_lo = pid_s * chunk
    kw_hi = tl.where(lead, tl.minimum(kwi, kw_lo + chunk), kw_lo)
    y = _dot_block(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, rows, kw_lo, kw_hi, kwi, inter_ptr,
                   row * (32 * KWX), KWX, T_PAD, BKW, LE, RAW)
    if SORTED:  # one pair per slot
        w_s = tl.load(w_ptr + row)
        tl.store(out_ptr + (pid_s * T * TOPK + row[:, None]) * H + n[None, :], y * w_s[:, None],
                 mask=active[:, None] & nmask[None, :])
    else:
        _store_pairs(out_ptr, ids_ptr, w_ptr, y, e, tok, active, n, nmask, pid_s, T, H, TOPK)


def _raw(asked: bool, bkw: int, x: torch.Tensor) -> bool:
    """Whether a kernel's shuffles are raw ``shfl.sync``: ``asked`` for by its config, on a 32- or 16-word K step (the
    LUT tile's shape, words along the lanes) and on NVIDIA CUDA (the interpreter runs no PTX; ROCm builds of torch
    also report ``is_cuda`` but compile for AMD GPUs, where the tile falls back to ``tl.gather``)."""
    return asked and bkw in (16, 32) and x.is_cuda and torch.version.hip is None


def _entries(bkw: int) -> int:
    """LUT entries kept in registers: one per lane of the words dimension (32 words: q <= 5 by shuffle)."""
    return 32 if bkw >= 32 else 16


def decode_partials(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
                    cfg: DecodeConfig, xw: torch.Tensor | None = None, activation: str = "silu"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing-weighted partial outputs [SPLIT, T, k, H] fp32 of T tokens x [T, H] (ids/weights [T, k],
    checked by ``pwkernels.moe.dispatch``), and the word-major activations [T, 32, KWX] they were computed from
    (``xw``: reuse them, e.g. for the shared expert of the same x, when the gate_up tiles give the same KWX).

    ``cfg``: the gate_up and down tiles and SLOTS (``pwkernels.moe.launch.DecodeConfig``). The word counts of the
    padded activation rows are compile-time constants, so each (H, I) compiles its own kernels.
    More than 8 tokens run as chunks of 8 (the last one holds the rest), one launch pair each, with their partials
    concatenated along T: an expert used in several chunks is read once per chunk (``chunks``).
    ``cfg.SLOTS`` = S > 0 selects the sorted-slots mode instead, for any T in one launch pair: the (token, slot)
    pairs are sorted by expert on the device (``pwkernels.moe.pair_sort``: one launch, no host sync) and each
    program does S consecutive pairs of one expert (``_slots_of``), so an expert with c tokens is read ceil(c / S)
    times and each weight feeds S token slots, not T_PAD (most routed experts get 1-2 of a batch's tokens).
    ``activation``: of the gate half, ``silu`` or ``gelu_tanh`` (``pwkernels.moe.activation``).
    """
    ex = experts
    t, k = topk_ids.shape
    slots = cfg.SLOTS
    gelu = check_activation(activation)
    if t > MAX_TOKENS and not slots:
        return _chunked_partials(x, topk_ids, topk_w, experts, cfg, xw, activation)
    num_pairs = t * k
    gu, dn = cfg.gate_up, cfg.down
    split = dn.SPLIT_K
    bkw_gu, bkw_dn = gu.BLOCK_K // 32, dn.BLOCK_K // 32
    kwx, kwo = padded_words(ex.hidden, bkw_gu), padded_words(ex.inter, bkw_dn, split)
    if xw is None or xw.shape != (t, 32, kwx):
        xw = word_major(x, kwx)
    inter = torch.empty(num_pairs, 32 * kwo, dtype=x.dtype, device=x.device)
    out = torch.empty(split * num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.contiguous().view(-1)
    w = topk_w.contiguous().view(-1).to(torch.float32)
    t_pad, k_pad = token_pad(t), triton.next_power_of_2(k)
    order = seg = ids  # unused unless sorted
    if slots:  # pairs sorted by expert on the device (one launch, no host sync): S pairs of one expert per program
        ids, order, seg = sort_pairs(ids)
        t_pad = slots
    _decode_gate_up_kernel[(num_pairs, triton.cdiv(ex.inter, gu.BLOCK_N))](
        xw, inter, ids, order, seg, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden,
        ex.inter, TOPK=k, T_PAD=t_pad, K_PAD=k_pad, SORTED=bool(slots), BLOCK_N=gu.BLOCK_N, BKW=bkw_gu,
        LE=_entries(bkw_gu),
        RAW=_raw(gu.RAW_SHFL, bkw_gu, x), KWX=kwx, KWO=kwo, PAD_O=triton.next_power_of_2(max(32 * kwo - ex.inter, 1)),
        GELU=gelu, num_warps=gu.num_warps)
    _decode_down_kernel[(num_pairs, triton.cdiv(ex.hidden, dn.BLOCK_N), split)](
        inter, out, ids, order, seg, w, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden,
        ex.inter, TOPK=k, T_PAD=t_pad, K_PAD=k_pad, SORTED=bool(slots), BLOCK_N=dn.BLOCK_N, BKW=bkw_dn,
        LE=_entries(bkw_dn),
        RAW=_raw(dn.RAW_SHFL, bkw_dn, x), KWX=kwo, num_warps=dn.num_warps)
    return out.view(split, t, k, ex.hidden), xw


def chunks(num_tokens: int) -> list[tuple[int, int]]:
    """[start, end) token ranges that the token-slot mode runs one launch pair each: 8 tokens apiece, the rest
    last (so at most one chunk pads to a smaller power of 2)."""
    return [(a, min(a + MAX_TOKENS, num_tokens)) for a in range(0, num_tokens, MAX_TOKENS)]


def launches(num_tokens: int, cfg: DecodeConfig) -> list[tuple[int, int]]:
    """(T_PAD, T) of each launch pair the decode kernels of config ``cfg`` make for ``num_tokens`` tokens: T_PAD is
    a constexpr, T the runtime token count passed (Triton specializes on it too: ``pwkernels.warmup``). In the
    sorted-slots mode one pair (SLOTS, T); else one per chunk of ``chunks``, its tokens padded to a power of 2."""
    if cfg.SLOTS:
        return [(cfg.SLOTS, num_tokens)]
    return [(token_pad(b - a), b - a) for a, b in chunks(num_tokens)]


def _chunked_partials(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
                      cfg: DecodeConfig, xw: torch.Tensor | None, activation: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_partials`` of more than 8 tokens, chunk by chunk (``chunks``): partials [SPLIT, T, k, H] fp32 and
    the word-major activations [T, 32, KWX] of all T tokens (built once, or ``xw`` if it is x's for this tile)."""
    kwx = padded_words(experts.hidden, cfg.gate_up.BLOCK_K // 32)
    if xw is None or xw.shape != (x.shape[0], 32, kwx):  # none, or not x's (e.g. another tile's)
        xw = word_major(x, kwx)
    parts = [decode_partials(x[a:b], topk_ids[a:b], topk_w[a:b], experts, cfg, xw[a:b], activation)[0]
             for a, b in chunks(x.shape[0])]
    return torch.cat(parts, dim=1), xw


def decode_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
               cfg: DecodeConfig, activation: str = "silu") -> torch.Tensor:
    """MoE output y [T, H] in x's dtype for tokens x [T, H] and ids / weights [T, k] (checked by
    ``pwkernels.moe.dispatch``); ``cfg``, ``activation`` and errors as in ``decode_partials``."""
    return combine(decode_partials(x, topk_ids, topk_w, experts, cfg, activation=activation)[0], None, x.dtype)
