"""Mid-size MoE path with word-first dequantization (Triton): the decode kernels' codes fed to tensor cores.

Tiles as in ``pwkernels.moe.mid`` (BLOCK_M (token, slot) pairs of one expert, pairs sorted by expert and padded per
expert, ``align_by_expert``), but weights are decoded as the decode kernels do it (``pwkernels.moe.decode_dot``):
plane words along the lanes, a bit-matrix transpose gives 32 columns' codes per word, and each code picks its
weight from its row's LUT in registers by warp shuffle (q <= 5) or by a 16-bit load (q >= 6). Each of the 32
column phases of a K step is one [BKW, R] weight tile, multiplied on tensor cores with the activations of the same
columns (word-major, ``pwkernels.moe.layout.word_major``): a weight costs a few integer ops once per tile of
pairs, where the tile dequantization of ``pwkernels.moe.tile`` costs tens. The intermediate is word-major like
the decode path's; down writes fp32 per pair, summed over the top-k slots by ``combine``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pwkernels.moe.activation import check_activation, gate_act
from pwkernels.moe.align import align_by_expert
from pwkernels.moe.bit_transpose import _transpose4, _transpose8
from pwkernels.moe.decode import _entries, _raw
from pwkernels.moe.experts import APExperts
from pwkernels.moe.launch import MidConfig
from pwkernels.moe.layout import combine, padded_words, word_major
from pwkernels.moe.lut_shuffle import _lut, _shfl
from pwkernels.moe.tile import _plane


@triton.jit
def _phase(acc, w, x_ptr, x_off, c, kw, KWX: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [R, BM] + W_c [R, BKW] @ X_c [BKW, BM]: column phase c (column 32 kw + c) of every word of the step;
    w [BKW, R] fp32 weights, activations word-major at x_ptr + x_off [BM] (unmasked: rows padded)."""
    xc = tl.load(x_ptr + x_off[None, :] + c * KWX + kw[:, None])
    if DOT_FP32:
        return tl.dot(tl.trans(w), xc.to(tl.float32), acc)
    return tl.dot(tl.trans(w.to(xc.dtype)), xc, acc)


@triton.jit
def _nibble(acc, o, k, i: tl.constexpr, lut_t, x_ptr, x_off, kw, KWX: tl.constexpr, RAW: tl.constexpr,
            DOT_FP32: tl.constexpr):
    """acc + the phase of the weights whose codes are nibble k of o (column 4 k + i of each word)."""
    if RAW:
        w = _shfl(lut_t, o >> (4 * k))
    else:
        w = tl.gather(lut_t, ((o >> (4 * k)) & 15).to(tl.int32), 0)
    return _phase(acc, w, x_ptr, x_off, 4 * k + i, kw, KWX, DOT_FP32)


@triton.jit
def _byte(acc, o, k, i: tl.constexpr, lut_t, lut_row, x_ptr, x_off, kw, KWX: tl.constexpr, NPL: tl.constexpr,
          RAW: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + the phase of the weights whose codes are byte k of o (column 8 k + i of each word): by shuffle (q 5)
    or by a 16-bit load at the row's LUT (q >= 6)."""
    if NPL == 5 and RAW and lut_t.shape[0] == 32:
        w = _shfl(lut_t, o >> (8 * k))
    elif NPL == 5 and lut_t.shape[0] == 32:
        w = tl.gather(lut_t, ((o >> (8 * k)) & 0xFF).to(tl.int32), 0)
    else:
        w = tl.load(lut_row + ((o >> (8 * k)) & 0xFF).to(tl.int32)).to(tl.float32)
    return _phase(acc, w, x_ptr, x_off, 8 * k + i, kw, KWX, DOT_FP32)


@triton.jit
def _step(acc, pool_ptr, poff, lut_t, lut_row, q, rows, kw, KW, x_ptr, x_off, KWX: tl.constexpr, W: tl.constexpr,
          NPL: tl.constexpr, RAW: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [R, BM] + W[rows, columns of words kw] @ X: one K step of BKW plane words (codes as in
    ``pwkernels.moe.decode_dot._dot_words``: W-bit fields from a bit-matrix transpose of NPL planes)."""
    wmask = (kw < KW)[:, None] & (rows >= 0)[None, :]
    word = kw[:, None] + rows[None, :] * KW
    w0 = _plane(pool_ptr, poff, 0, q, word, wmask).to(tl.uint32, bitcast=True)
    w1 = _plane(pool_ptr, poff, 1, q, word, wmask).to(tl.uint32, bitcast=True)
    w2 = _plane(pool_ptr, poff, 2, q, word, wmask).to(tl.uint32, bitcast=True)
    w3 = _plane(pool_ptr, poff, 3, q, word, wmask).to(tl.uint32, bitcast=True)
    if W == 4:
        o = _transpose4(w3, w2, w1, w0)
        shift = (4 - q).to(tl.uint32)
        o0, o1, o2, o3 = o[0] >> shift, o[1] >> shift, o[2] >> shift, o[3] >> shift
        for k in range(8):  # a loop, not unrolled: Triton's pipeliner prefetches the next activations
            acc = _nibble(acc, o0, k, 0, lut_t, x_ptr, x_off, kw, KWX, RAW, DOT_FP32)
            acc = _nibble(acc, o1, k, 1, lut_t, x_ptr, x_off, kw, KWX, RAW, DOT_FP32)
            acc = _nibble(acc, o2, k, 2, lut_t, x_ptr, x_off, kw, KWX, RAW, DOT_FP32)
            acc = _nibble(acc, o3, k, 3, lut_t, x_ptr, x_off, kw, KWX, RAW, DOT_FP32)
    else:
        w4 = _plane(pool_ptr, poff, 4, q, word, wmask).to(tl.uint32, bitcast=True)
        z = tl.zeros_like(w0)
        if NPL == 5:
            o = _transpose8(z, z, z, w4, w3, w2, w1, w0)
        else:
            w5 = _plane(pool_ptr, poff, 5, q, word, wmask).to(tl.uint32, bitcast=True)
            w6 = _plane(pool_ptr, poff, 6, q, word, wmask).to(tl.uint32, bitcast=True)
            w7 = _plane(pool_ptr, poff, 7, q, word, wmask).to(tl.uint32, bitcast=True)
            o = _transpose8(w7, w6, w5, w4, w3, w2, w1, w0)
        shift = (8 - q).to(tl.uint32)
        o0, o1, o2, o3 = o[0] >> shift, o[1] >> shift, o[2] >> shift, o[3] >> shift
        o4, o5, o6, o7 = o[4] >> shift, o[5] >> shift, o[6] >> shift, o[7] >> shift
        for k in range(4):
            acc = _byte(acc, o0, k, 0, lut_t, lut_row, x_ptr, x_off, kw, KWX, NPL, RAW, DOT_FP32)
            acc = _byte(acc, o1, k, 1, lut_t, lut_row, x_ptr, x_off, kw, KWX, NPL, RAW, DOT_FP32)
            acc = _byte(acc, o2, k, 2, lut_t, lut_row, x_ptr, x_off, kw, KWX, NPL, RAW, DOT_FP32)
            acc = _byte(acc, o3, k, 3, lut_t, lut_row, x_ptr, x_off, kw, KWX, NPL, RAW, DOT_FP32)
            acc = _byte(acc, o4, k, 4, lut_t, lut_row, x_ptr, x_off, kw, KWX, NPL, RAW, DOT_FP32)
            acc = _byte(acc, o5, k, 5, lut_t, lut_row, x_ptr, x_off, kw, KWX, NPL, RAW, DOT_FP32)
            acc = _byte(acc, o6, k, 6, lut_t, lut_row, x_ptr, x_off, kw, KWX, NPL, RAW, DOT_FP32)
            acc = _byte(acc, o7, k, 7, lut_t, lut_row, x_ptr, x_off, kw, KWX, NPL, RAW, DOT_FP32)
    return acc


@triton.jit
def _loop(acc, pool_ptr, poff, lut_t, lut_row, q, rows, kw_hi, KW, x_ptr, x_off, KWX: tl.constexpr,
          BKW: tl.constexpr, W: tl.constexpr, NPL: tl.constexpr, RAW: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + the K steps of plane words 0 .. kw_hi - 1 (``_step``)."""
    for kw0 in range(0, kw_hi, BKW):
        acc = _step(acc, pool_ptr, poff, lut_t, lut_row, q, rows, kw0 + tl.arange(0, BKW), KW, x_ptr, x_off, KWX, W,
                    NPL, RAW, DOT_FP32)
    return acc


@triton.jit
def _in_class(q, QCLASS: tl.constexpr):
    """Whether bitwidth q is this launch's: QCLASS 0 all, 4 q <= 4, 5 q == 5, 8 q >= 6."""
    if QCLASS == 4:
        mine = q <= 4
    elif QCLASS == 5:
        mine = q == 5
    elif QCLASS == 8:
        mine = q >= 6
    else:
        mine = q >= 0
    return mine


@triton.jit
def _block(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, rows, kw_hi, KW, x_ptr, x_off,
           BM: tl.constexpr, KWX: tl.constexpr, BKW: tl.constexpr, LE: tl.constexpr, RAW: tl.constexpr,
           DOT_FP32: tl.constexpr, QCLASS: tl.constexpr):
    """[R, BM] fp32: rows ``rows`` [R] of linear block ``blk`` times the BM activation rows at x_ptr + x_off over
    plane words 0 .. kw_hi - 1, at the block's committed q: QCLASS 0 one uniform runtime branch per program, else
    the class's code path only (the launch of one class of bitwidths, ``_in_class``; fewer registers)."""
    q = tl.load(bits_ptr + blk)
    lut = lut_ptr + tl.load(lut_off_ptr + blk)
    rbase = (rows * (1 << q)).to(tl.uint32)
    lut_t = _lut(lut, rbase, q, LE)
    lut_row = lut + rbase[None, :]
    poff = plane_off_ptr + blk * 8
    acc = tl.zeros((rows.shape[0], BM), dtype=tl.float32)
    if QCLASS == 0:  # one uniform runtime branch per program
        if q <= 4:
            acc = _loop(acc, pool_ptr, poff, lut_t, lut_row, q, rows, kw_hi, KW, x_ptr, x_off, KWX, BKW, 4, 4, RAW,
                        DOT_FP32)
        elif q == 5:
            acc = _loop(acc, pool_ptr, poff, lut_t, lut_row, q, rows, kw_hi, KW, x_ptr, x_off, KWX, BKW, 8, 5, RAW,
                        DOT_FP32)
        else:
            acc = _loop(acc, pool_ptr, poff, lut_t, lut_row, q, rows, kw_hi, KW, x_ptr, x_off, KWX, BKW, 8, 8, RAW,
                        DOT_FP32)
    else:  # a launch of one class: its code path only (NPL = the class, 4-bit fields for q <= 4)
        acc = _loop(acc, pool_ptr, poff, lut_t, lut_row, q, rows, kw_hi, KW, x_ptr, x_off, KWX, BKW,
                    4 if QCLASS == 4 else 8, QCLASS, RAW, DOT_FP32)
    return acc


@triton.jit
def _words_gate_up_kernel(
    xw_ptr,  # [T, 32, KWX] activations, word-major and zero-padded (``word_major``)
    inter_ptr,  # [T*k, 32, KWO] out: act(gate) * up per pair, word-major, zero past I
    sorted_ptr,  # [num_tiles * BLOCK_M] int32 pair ids, padded with T*k (``align_by_expert``)
    tile_expert_ptr,  # [num_tiles] int32 expert of each tile (num_experts: spare tile, no work)
    pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr,  # the experts' tables (``APExperts``)
    num_pairs,  # T * k
    num_experts,  # E
    H, I,  # noqa: E741 - hidden size (K of gate_up), expert intermediate size
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # pairs per tile
    BLOCK_N: tl.constexpr,  # intermediate columns per program (2 * BLOCK_N gate and up rows)
    BKW: tl.constexpr,  # plane words per K step (16 or 32)
    LE: tl.constexpr,  # LUT entries in registers: 32 if BKW >= 32 else 16
    RAW: tl.constexpr,  # shuffles by shfl.sync (CUDA only), else tl.gather
    KWX: tl.constexpr,  # words of an x row
    KWO: tl.constexpr,  # words of an inter row
    PAD_O: tl.constexpr,  # power of 2 >= 32 * KWO - I
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, fp32 is exact
    GELU: tl.constexpr,
    QCLASS: tl.constexpr,  # 0: every bitwidth; 4, 5, 8: only blocks of that class (``_in_class``)
):
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    blk = 2 * tl.minimum(e, num_experts - 1)
    pairs = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    x_off = tl.where(pmask, pairs // TOPK, 0) * (32 * KWX)  # padding reads token 0 (finite), never stored
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, 2 * BLOCK_N)
    rows = tl.minimum(tl.program_id(1) * BLOCK_N + r // 2, I - 1) + (r % 2) * I  # gate and up rows interleaved
    kwh = (H + 31) // 32
    mine = _in_class(tl.load(bits_ptr + blk), QCLASS) & (e < num_experts)
    pmask = pmask & (pairs * 0 + mine.to(tl.int32) != 0)  # a tensor mask (the interpreter mistypes bool & bool)
    acc = _block(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, rows, tl.where(mine, kwh, 0), kwh,
                 xw_ptr, x_off, BLOCK_M, KWX, BKW, LE, RAW, DOT_FP32, QCLASS)
    g, u = tl.split(tl.reshape(tl.trans(acc), (BLOCK_M, BLOCK_N, 2)))
    h = gate_act(g, GELU) * u
    out_row = tl.where(pmask, pairs, 0) * (32 * KWO)
    tl.store(inter_ptr + out_row[:, None] + ((n % 32) * KWO + n // 32)[None, :], h.to(inter_ptr.dtype.element_ty),
             mask=pmask[:, None] & (n < I)[None, :])
    if tl.program_id(1) == 0:  # down reads whole padded rows unmasked: columns I .. 32 * KWO - 1 are 0
        c = I + tl.arange(0, PAD_O)
        tl.store(inter_ptr + out_row[:, None] + ((c % 32) * KWO + c // 32)[None, :],
                 tl.zeros((BLOCK_M, PAD_O), dtype=inter_ptr.dtype.element_ty),
                 mask=pmask[:, None] & (c < 32 * KWO)[None, :])


@triton.jit
def _words_down_kernel(
    inter_ptr,  # [T*k, 32, KWI] from _words_gate_up_kernel
    out_ptr,  # [T*k, H] fp32 out: routing-weighted expert output per pair
    w_ptr,  # [T*k] fp32 routing weights
    sorted_ptr, tile_expert_ptr,  # as in _words_gate_up_kernel
    pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr,  # the experts' tables
    num_pairs, num_experts,
    H, I,  # noqa: E741 - rows of down, K of down
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output rows per program
    BKW: tl.constexpr,
    LE: tl.constexpr,
    RAW: tl.constexpr,
    KWI: tl.constexpr,  # words of an inter row
    DOT_FP32: tl.constexpr,
    QCLASS: tl.constexpr,
):
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    blk = 2 * tl.minimum(e, num_experts - 1) + 1
    pairs = tl.load(sorted_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    row0 = tl.where(pmask, pairs, 0)  # pair 0's inter row is written for every call (finite)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kwi = (I + 31) // 32
    mine = _in_class(tl.load(bits_ptr + blk), QCLASS) & (e < num_experts)
    pmask = pmask & (pairs * 0 + mine.to(tl.int32) != 0)  # a tensor mask (the interpreter mistypes bool & bool)
    acc = _block(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, tl.minimum(n, H - 1),
                 tl.where(mine, kwi, 0), kwi, inter_ptr, row0 * (32 * KWI), BLOCK_M, KWI, BKW, LE, RAW, DOT_FP32,
                 QCLASS)
    wt = tl.load(w_ptr + row0, mask=pmask, other=0.0)
    tl.store(out_ptr + row0[:, None] * H + n[None, :], tl.trans(acc) * wt[:, None],
             mask=pmask[:, None] & (n < H)[None, :])


def words_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
              cfg: MidConfig, activation: str = "silu") -> torch.Tensor:
    """MoE output y [T, H] in x's dtype, ``pwkernels.moe.ref.ap_moe_ref`` (SPEC section 7) for x [T, H] and ids /
    weights [T, k] (as checked by ``pwkernels.moe.dispatch``) on the word-first mid path: K steps of
    ``cfg.BLOCK_K`` columns (16 or 32 plane words), ``cfg.BLOCK_M`` pairs per tile, ``cfg.BLOCK_N`` intermediate
    columns (gate_up) and ``cfg.BLOCK_N_DOWN`` output rows (down) per program; with ``cfg.SPLIT_Q`` one launch per
    class of bitwidths (q <= 4, 5, >= 6), each computing the blocks of its class only.
    No host sync. Raises ``ValueError`` for an unknown ``activation`` (``silu`` or ``gelu_tanh``)."""
    gelu = check_activation(activation)
    ex = experts
    t, k = topk_ids.shape
    num_pairs = t * k
    bm, bn, bkw = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K // 32
    le = _entries(bkw)
    kwx, kwi = padded_words(ex.hidden, bkw), padded_words(ex.inter, bkw)
    xw = word_major(x, kwx)
    sorted_pairs, tile_expert = align_by_expert(topk_ids, ex.num_experts, bm)
    inter = torch.empty(num_pairs, 32 * kwi, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    tiles = tile_expert.numel()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    raw = _raw(cfg.RAW_SHFL, bkw, x)
    classes = (4, 5, 8) if cfg.SPLIT_Q else (0,)
    bnd = cfg.BLOCK_N_DOWN or bn
    for qc in classes:  # one launch per class of bitwidths: each compiles only its code path (fewer registers)
        _words_gate_up_kernel[(tiles, triton.cdiv(ex.inter, bn))](
            xw, inter, sorted_pairs, tile_expert, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits,
            num_pairs, ex.num_experts, ex.hidden, ex.inter, TOPK=k, BLOCK_M=bm, BLOCK_N=bn, BKW=bkw, LE=le, RAW=raw,
            KWX=kwx, KWO=kwi, PAD_O=triton.next_power_of_2(max(32 * kwi - ex.inter, 1)), DOT_FP32=interp, GELU=gelu,
            QCLASS=qc, num_warps=cfg.num_warps)
    for qc in classes:
        _words_down_kernel[(tiles, triton.cdiv(ex.hidden, bnd))](
            inter, out, topk_w.flatten().float().contiguous(), sorted_pairs, tile_expert, ex.pool, ex.plane_offset,
            ex.lut_pool, ex.lut_offset, ex.bits, num_pairs, ex.num_experts, ex.hidden, ex.inter, BLOCK_M=bm,
            BLOCK_N=bnd, BKW=bkw, LE=le, RAW=raw, KWI=kwi, DOT_FP32=interp, QCLASS=qc, num_warps=cfg.num_warps)
    return combine(out.view(1, t, k, ex.hidden), None, x.dtype)
