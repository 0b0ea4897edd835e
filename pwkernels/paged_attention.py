"""Paged decode attention (Triton), with its PyTorch reference twin.

What it computes: for S sequences with one new (already RoPE'd) query token each,
``out[s, h] = softmax(scale * q[s, h] . K_s^T) V_s`` over the sequence's first ``context_lens[s]``
cached positions (the new token's K/V already written), or only the last ``window`` of them (a
sliding-window layer: units of older blocks are never read), with GQA: query head h reads kv head
``h // (Hq // Hkv)``. It does not write the cache, apply RoPE, or handle prefill (several query
tokens per sequence): ``pwrun.model.attention`` does those.

Memory layout (addressed through the block table, never assumed contiguous):
  * ``k_cache`` / ``v_cache`` [U, block_size, Hkv, D]: U units of block_size rows. The key at
    position p of sequence s is row ``p % block_size`` of unit ``block_tables[s, p // block_size]
    + k_offset`` (value: ``+ v_offset``). K and V may be the same tensor: the runtime stores one KV
    block as a run of 2 * num_layers units (layer l's K at base + 2l, V at base + 2l + 1) and calls
    with ``k_cache is v_cache, k_offset = 2l, v_offset = 2l + 1``.
  * ``block_tables`` int32 [S, max_blocks]: entries past a sequence's last block are never read.

Kernels:
  1. ``_decode_kernel``: one program per (sequence, kv head, context split). The GROUP query heads
     of the kv head are one [BLOCK_G, D] tile, so each K/V row is read from memory once per group;
     with DOT the products run on tensor cores (the tile padded to tl.dot's minimum of 16 rows), without
     it as fp32 broadcast products ([BLOCK_G, BLOCK_N, D] in registers: meant for MHA, GROUP = 1). Keys
     are gathered BLOCK_N positions at a time (a tile may span several cache blocks) and folded into
     an fp32 online softmax (flash decoding, exp2 domain).
  2. ``_merge_kernel`` (only when the context is split): per (sequence, query head), rescales the
     splits' partial (max, denominator, unnormalised output) to a common max and normalises.
Splitting the context keeps the GPU busy when S * Hkv programs are too few (small batches, long
contexts); the split count comes from host-side ints only (no device->host sync).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from pwkernels.config_buckets import pick_bucket

# Launch configs as data (``pwkernels/configs/paged_attention.json``): "default", and per "HqxHkvxD" shape a list of
# buckets by batch size (the largest ``min_seqs`` <= S wins), tuned on a GPU. Keys: BLOCK_N (key positions per
# loop iteration), num_warps, DOT (1: q.K^T and p.V on tensor cores with the group's query heads padded to 16
# rows; 0: fp32 broadcast products, no padding: for MHA, where 15 of the 16 rows would be padding),
# min_split_tokens (no context split shorter), max_splits, programs_per_sm (the split count aims at this many
# programs per SM).
CONFIGS: dict[str, Any] = json.loads((Path(__file__).parent / "configs" / "paged_attention.json").read_text())
LOG2E = 1.4426950408889634


def pick_config(num_seqs: int, hq: int, hkv: int, d: int, configs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The launch config for S = ``num_seqs`` sequences of this head shape: the shape's bucket with the largest
    ``min_seqs`` <= S (the first if none), over the defaults. Read-only (shared)."""
    table = CONFIGS if configs is None else configs
    return {**table["default"], **(pick_bucket(table["by_shape"].get(f"{hq}x{hkv}x{d}", []), num_seqs, "min_seqs")
                                   or {})}


# ----------------------------------------------------------------------------------------------
# Reference (pure PyTorch): gather through the block table, one sequence at a time
# ----------------------------------------------------------------------------------------------
def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               k_offset: int = 0, v_offset: int = 0, out: torch.Tensor | None = None,
                               v_block_tables: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Reference decode attention out [S, Hq, D] in q's dtype (arguments as ``paged_decode_attention``).

    Softmax and the weighted sum of values in fp32. Reads context lengths to the host (a sync), so
    it can also check them: raises ``ValueError`` if a length is < 1 or exceeds the block table.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens, k_offset, v_offset, out)
    hq = q.shape[1]
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    res = torch.empty_like(q) if out is None else out
    for s, ctx in enumerate(context_lens.tolist()):
        if not 1 <= ctx <= block_tables.shape[1] * block_size:
            raise ValueError(f"context_lens[{s}] = {ctx} outside [1, max_blocks * block_size]")
        num_blocks = -(-ctx // block_size)
        lo = 0 if window is None else max(ctx - window, 0)
        first = lo // block_size
        units = block_tables[s, first:num_blocks].long()
        vunits = _check_v_table(v_block_tables, block_tables)[s, first:num_blocks].long()
        k = k_cache[units + k_offset].flatten(0, 1)[lo - first * block_size:ctx - first * block_size]
        v = v_cache[vunits + v_offset].flatten(0, 1)[lo - first * block_size:ctx - first * block_size]
        k = k.float().repeat_interleave(hq // hkv, dim=1)
        v = v.float().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[s].float(), k) * scale, dim=-1)  # [Hq, ctx]
        res[s] = torch.einsum("ht,thd->hd", p, v).to(q.dtype)
    return res


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _decode_kernel(
    q_ptr,  # [S, Hq, D] queries (bf16/fp16)
    k_ptr,  # [U, BLOCK_SIZE, Hkv, D] key units
    v_ptr,  # [U, BLOCK_SIZE, Hkv, D] value units (may be the same tensor as k_ptr)
    bt_ptr,  # int32 [S, max_blocks] base unit of each logical block
    vbt_ptr,  # int32 [S, max_blocks] V's base units (the same table unless the caller passes v_block_tables)
    ctx_ptr,  # int32 [S] positions to attend over
    out_ptr,  # [S, Hq, D] output in q's dtype; written only without SPLIT
    m_ptr,  # fp32 [S, Hq, num_splits] running max of each split (log2 domain); SPLIT only
    l_ptr,  # fp32 [S, Hq, num_splits] softmax denominator of each split
    acc_ptr,  # fp32 [S, Hq, num_splits, D] unnormalised output of each split
    k_offset,  # units added to a table entry to reach the K unit
    v_offset,  # units added to a table entry to reach the V unit
    qk_scale,  # softmax scale * log2(e)
    max_tokens,  # max_blocks * BLOCK_SIZE: lengths are clamped to it, so no read past a table row
    window,  # sliding window: only positions >= ctx - window are read (max_tokens: all)
    split_len,  # positions per split (a multiple of BLOCK_N)
    num_heads,  # Hq
    num_splits,  # context splits (grid dim 2)
    stride_qs, stride_qh,  # q: elements between sequences, heads
    stride_ku, stride_kb, stride_kh,  # k: between units, rows of a unit, heads
    stride_vu, stride_vb, stride_vh,  # v: the same
    stride_bts,  # elements between rows of the block table
    stride_vbts,  # elements between rows of V's block table
    stride_os, stride_oh,  # out: between sequences, heads
    GROUP: tl.constexpr,  # Hq // Hkv: query heads per kv head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two (>= 16 with DOT: tl.dot's minimum)
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_SIZE: tl.constexpr,  # rows per cache unit (power of two)
    BLOCK_N: tl.constexpr,  # positions per iteration (power of two >= 16)
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for _merge_kernel instead of the output
    DOT: tl.constexpr,  # tensor-core products (else fp32 broadcast products)
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong (Triton 3.9), fp32 is exact
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.minimum(tl.load(ctx_ptr + s), max_tokens)
    lo = tl.maximum(ctx - window, 0)
    start = tl.maximum(split * split_len, lo)
    end = tl.minimum(split * split_len + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + s * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    if DOT_FP32 or not DOT:
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        # int64: unit * stride_ku overflows int32 once the cache holds more than 2^31 elements
        unit = tl.load(bt_ptr + s * stride_bts + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
        vunit = tl.load(vbt_ptr + s * stride_vbts + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        k = tl.load(k_ptr + (unit + k_offset)[:, None] * stride_ku + row[:, None] * stride_kb + kvh * stride_kh
                    + d[None, :], mask=pmask[:, None], other=0.0)
        v = tl.load(v_ptr + (vunit + v_offset)[:, None] * stride_vu + row[:, None] * stride_vb + kvh * stride_vh
                    + d[None, :], mask=pmask[:, None], other=0.0)
        if DOT_FP32 or not DOT:
            k, v = k.to(tl.float32), v.to(tl.float32)
        if DOT:
            sc = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N], log2 domain
        else:
            sc = tl.sum(q[:, None, :] * k[None, :, :], 2) * qk_scale
        sc = tl.where(pmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: every iteration has >= 1 valid position (start < end)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new

    if not SPLIT:
        o = acc / l_i[:, None]
        tl.store(out_ptr + s * stride_os + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=gmask[:, None])
    else:
        # splits past the context store (-inf, 0, 0); the merge never reads them; splits before a sliding
        # window store the same and weigh 0 in the merge (a later split of the window has a finite max)
        part = (s * num_heads + heads) * num_splits + split
        tl.store(m_ptr + part, m_i, mask=gmask)
        tl.store(l_ptr + part, l_i, mask=gmask)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _merge_kernel(
    out_ptr,  # [S, Hq, D] output in q's dtype
    m_ptr,  # fp32 [S, Hq, num_splits] from _decode_kernel
    l_ptr,  # fp32 [S, Hq, num_splits]
    acc_ptr,  # fp32 [S, Hq, num_splits, D]
    ctx_ptr,  # int32 [S] positions attended over
    max_tokens,  # as in _decode_kernel
    split_len,  # as in _decode_kernel
    num_splits,  # as in _decode_kernel
    stride_os, stride_oh,  # out: between sequences, heads
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_SPLITS: tl.constexpr,  # num_splits padded to a power of two
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.minimum(tl.load(ctx_ptr + s), max_tokens)
    active = (ctx + split_len - 1) // split_len  # splits holding >= 1 position
    i = tl.arange(0, BLOCK_SPLITS)
    imask = i < active
    d = tl.arange(0, HEAD_DIM)
    part = (s * tl.num_programs(1) + h) * num_splits + i
    m = tl.load(m_ptr + part, mask=imask, other=float("-inf"))
    w = tl.where(imask, tl.exp2(m - tl.max(m, 0)), 0.0)
    l_sum = tl.sum(tl.load(l_ptr + part, mask=imask, other=0.0) * w, 0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=imask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / l_sum
    tl.store(out_ptr + s * stride_os + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, k_offset: int, v_offset: int, out: torch.Tensor | None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [S, Hq, D], got {tuple(q.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q must be float16 or bfloat16, got {q.dtype}")
    num_seqs, hq, d = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[3] != d:
            raise ValueError(f"{name} must be [U, block_size, Hkv, {d}], got {tuple(c.shape)}")
        if c.dtype != q.dtype:
            raise ValueError(f"{name} dtype {c.dtype} must equal q's dtype {q.dtype}")
    if k_cache.shape[1:] != v_cache.shape[1:]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in block shape")
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim must be a power of two >= 16, got {d}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if block_tables.shape[1] < 1:
        raise ValueError("block_tables needs at least one column")
    if context_lens.shape != (num_seqs,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32 [{num_seqs}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if not (0 <= k_offset < k_cache.shape[0] and 0 <= v_offset < v_cache.shape[0]):
        raise ValueError(f"k_offset {k_offset} / v_offset {v_offset} must be unit offsets >= 0 and < U")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    named = [("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
             ("context_lens", context_lens)] + ([("out", out)] if out is not None else [])
    for name, t in named:
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all tensors must share q's device")
    for name, t in [("q", q), *named]:
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)})")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


@functools.lru_cache(maxsize=16)
def _check_v_table(v_block_tables: torch.Tensor | None, block_tables: torch.Tensor) -> torch.Tensor:
    if v_block_tables is None:
        return block_tables
    if v_block_tables.shape != block_tables.shape or v_block_tables.dtype != torch.int32 \
            or v_block_tables.device != block_tables.device or v_block_tables.stride(1) != 1:
        raise ValueError("v_block_tables must be int32 like block_tables (same shape and device, unit stride)")
    return v_block_tables


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, num_sms: int,
                    config: dict[str, Any] | None = None) -> int:
    """Context splits so that about ``programs_per_sm * num_sms`` programs run: 1 when S * Hkv already fills the GPU.

    ``max_tokens``: the positions a block table row can hold (an upper bound of every context, known
    without a sync); no split is shorter than ``min_split_tokens``, and at most ``max_splits`` (``config``,
    default ``CONFIGS["default"]``).
    """
    cfg = CONFIGS["default"] if config is None else config
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    want = -(-int(cfg["programs_per_sm"] * num_sms) // programs)
    return max(1, min(want, -(-max_tokens // cfg["min_split_tokens"]), cfg["max_splits"]))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, k_offset: int = 0, v_offset: int = 0,
                           out: torch.Tensor | None = None, *, num_splits: int | None = None,
                           v_block_tables: torch.Tensor | None = None,
                           config: dict[str, Any] | None = None, window: int | None = None) -> torch.Tensor:
    """Decode attention out [S, Hq, D] in q's dtype, written into ``out`` if given (see module docstring).

    ``q``: [S, Hq, D] bf16/fp16; ``k_cache``, ``v_cache``: [U, block_size, Hkv, D] q's dtype, contiguous;
    ``block_tables``: int32 [S, max_blocks]; ``context_lens``: int32 [S], each in [1, max_blocks * block_size]
    (not checked: that would sync; longer lengths are clamped); ``scale``: softmax scale (usually D^-0.5).
    ``num_splits``: context splits (default: ``pick_num_splits`` on CUDA, 1 elsewhere). A tighter
    ``block_tables`` (max_blocks = the batch's longest sequence) gives a better default split.
    ``v_block_tables``: optional int32 [S, max_blocks] table for V when V's units are not K's plus a
    constant (the runtime's page pool places every page independently). ``config``: a full launch config
    (keys of ``CONFIGS["default"]``; default ``pick_config`` for this batch and head shape). ``window``: attend
    over the last ``window`` positions only (sliding-window layers; the units of older blocks are not read).
    Raises ``ValueError`` on bad shapes, dtypes, devices or strides.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens, k_offset, v_offset, out)
    vbt = _check_v_table(v_block_tables, block_tables)
    num_seqs, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    res = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return res
    max_tokens = block_tables.shape[1] * block_size
    cfg = pick_config(num_seqs, hq, hkv, d) if config is None else config
    if num_splits is None:
        num_splits = pick_num_splits(num_seqs, hkv, max_tokens, _num_sms(q.device), cfg) if q.is_cuda else 1
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_n = max(cfg["BLOCK_N"], triton.next_power_of_2(block_size))
    split_len = -(-max_tokens // (num_splits * block_n)) * block_n
    num_splits = -(-max_tokens // split_len)  # no split that could never hold a position
    group = hq // hkv
    dot = bool(cfg["DOT"])
    if num_splits > 1:
        m = torch.empty(num_seqs, hq, num_splits, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        acc = torch.empty(num_seqs, hq, num_splits, d, dtype=torch.float32, device=q.device)
    else:
        m = lsum = acc = res  # unused by the kernel when NUM_SPLITS == 1
    _decode_kernel[(num_seqs, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, vbt, context_lens, res, m, lsum, acc, k_offset, v_offset, scale * LOG2E,
        max_tokens, min(window or max_tokens, max_tokens), split_len, hq, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        vbt.stride(0),
        res.stride(0), res.stride(1),
        GROUP=group, BLOCK_G=max(16 if dot else 1, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=num_splits > 1, DOT=dot,
        DOT_FP32=os.environ.get("TRITON_INTERPRET") == "1", num_warps=cfg["num_warps"])
    if num_splits > 1:
        _merge_kernel[(num_seqs, hq)](
            res, m, lsum, acc, context_lens, max_tokens, split_len, num_splits, res.stride(0), res.stride(1),
            HEAD_DIM=d, BLOCK_SPLITS=triton.next_power_of_2(num_splits), num_warps=4)
    return res

