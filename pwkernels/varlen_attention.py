"""Variable-length paged attention for prefill and mixed steps (Triton), with its PyTorch reference twin.

What it computes: one step holds S sequences, sequence s running the n_s newest query tokens of its context of
``context_lens[s]`` positions (a prompt chunk: n_s > 1; a decode: n_s = 1), their queries packed as rows
``query_start[s] .. query_start[s + 1] - 1`` of q [T, Hq, D] (already RoPE'd; their K/V already written).
Query i of sequence s sits at position ``ctx_s - n_s + i`` and attends causally to positions 0 .. its own
(``window`` > 0: only to the last ``window`` positions up to its own, a sliding-window layer), GQA as in
``pwkernels.paged_attention`` (query head h reads kv head ``h // (Hq // Hkv)``). K and V are read through
per-sequence page tables (``k_tables`` / ``v_tables`` int32 [S, max_blocks]: the page of each KV block, pages
[P, block_size, Hkv, D]; K and V may be the same tensor), never assumed contiguous. Every sequence of the step
runs in one launch: no Python loop over sequences and no host synchronisation (the grid comes from host ints).

Kernel: one program per (sequence, tile of BLOCK_M query rows, query head); keys BLOCK_N positions at a time
(a tile may span several pages), folded into an fp32 online softmax (flash attention, exp2 domain), the loop
ending at the tile's last query position (and starting at its window's first, with ``window``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _varlen_kernel(
    q_ptr,  # [T, Hq, D] queries
    k_ptr,  # [P, BLOCK_SIZE, Hkv, D] key pages
    v_ptr,  # [P, BLOCK_SIZE, Hkv, D] value pages (may be k_ptr)
    kt_ptr,  # int32 [S, max_blocks] key page of each KV block
    vt_ptr,  # int32 [S, max_blocks] value page of each KV block
    qs_ptr,  # int32 [S + 1] query row offsets
    ctx_ptr,  # int32 [S] context length (positions, the step's tokens included)
    out_ptr,  # [T, Hq, D]
    qk_scale,  # softmax scale * log2(e)
    window,  # > 0: positions a query sees (its own included); WINDOW only
    stride_qt, stride_qh,
    stride_kp, stride_kb, stride_kh,
    stride_vp, stride_vb, stride_vh,
    stride_kts, stride_vts,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,  # Hq // Hkv
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # rows per page
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # key positions per iteration
    WINDOW: tl.constexpr,  # sliding-window masking
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, fp32 is exact
):
    s = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(qs_ptr + s)
    n = tl.load(qs_ptr + s + 1) - q0
    if tile * BLOCK_M < n:
        ctx = tl.load(ctx_ptr + s)
        kvh = h // GROUP
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < n
        qpos = ctx - n + m  # absolute position of each query row
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + (q0 + m).to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        hi = tl.minimum(ctx, ctx - n + (tile + 1) * BLOCK_M)  # keys below this position
        lo = 0
        first = 0  # the tile's first query's window starts here: older blocks may have gone back to the pool
        if WINDOW:
            first = tl.maximum(ctx - n + tile * BLOCK_M - window + 1, 0)
            lo = first // BLOCK_N * BLOCK_N
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = (pos < hi) & (pos >= first)
            page = tl.load(kt_ptr + s * stride_kts + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
            vpage = tl.load(vt_ptr + s * stride_vts + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
            row = pos % BLOCK_SIZE
            kv_mask = pmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + page[:, None] * stride_kp + row[:, None] * stride_kb + kvh * stride_kh + d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + vpage[:, None] * stride_vp + row[:, None] * stride_vb + kvh * stride_vh + d[None, :],
                        mask=kv_mask, other=0.0)
            if DOT_FP32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            sc = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
            see = (pos[None, :] <= qpos[:, None]) & pmask[None, :]
            if WINDOW:
                see &= qpos[:, None] - pos[None, :] < window
            sc = tl.where(see, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sc - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q0 + m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def pick_blocks(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a head dim: smaller tiles for wide heads keep the fp32 accumulator
    [BLOCK_M, D] and the key tile in registers."""
    if head_dim <= 64:
        return 64, 64, 4
    if head_dim <= 128:
        return 64, 64, 4
    if head_dim <= 256:
        return 32, 32, 4
    return 16, 32, 8


def _check(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, k_tables: torch.Tensor,
           v_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor) -> None:
    if q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be a [T, Hq, D] float tensor, got {q.dtype} {tuple(q.shape)}")
    hq, d = q.shape[1], q.shape[2]
    for name, c in (("k_pages", k_pages), ("v_pages", v_pages)):
        if c.dim() != 4 or c.shape[3] != d or c.dtype != q.dtype or c.stride(-1) != 1:
            raise ValueError(f"{name} must be [P, block_size, Hkv, {d}] {q.dtype} with unit last stride, got "
                             f"{c.dtype} {tuple(c.shape)}")
    block_size, hkv = k_pages.shape[1], k_pages.shape[2]
    if v_pages.shape[1:] != k_pages.shape[1:]:
        raise ValueError("k_pages and v_pages differ in page shape")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    s = context_lens.shape[0]
    for name, t in (("k_tables", k_tables), ("v_tables", v_tables)):
        if t.dim() != 2 or t.shape[0] != s or t.dtype != torch.int32 or t.stride(1) != 1:
            raise ValueError(f"{name} must be int32 [{s}, max_blocks] with unit last stride, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if query_start.shape != (s + 1,) or query_start.dtype != torch.int32:
        raise ValueError(f"query_start must be int32 [{s + 1}], got {query_start.dtype} {tuple(query_start.shape)}")
    if context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be int32, got {context_lens.dtype}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages), ("k_tables", k_tables), ("v_tables", v_tables),
                    ("query_start", query_start), ("context_lens", context_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def varlen_paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, k_tables: torch.Tensor,
                           v_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                           max_query_len: int, scale: float, window: int = 0) -> torch.Tensor:
    """Attention out [T, Hq, D] in q's dtype (see the module docstring).

    ``query_start`` int32 [S + 1], ``context_lens`` int32 [S] (each >= its query count; not checked: that would
    sync), ``max_query_len``: the longest n_s (a host int: it sizes the grid), ``window``: 0 (full causal) or the
    sliding window in positions. Raises ``ValueError`` on bad shapes, dtypes or devices.
    """
    _check(q, k_pages, v_pages, k_tables, v_tables, query_start, context_lens)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    out = torch.empty_like(q)
    t, hq, d = q.shape
    s = context_lens.shape[0]
    if t == 0 or s == 0 or max_query_len <= 0:
        return out
    block_m, block_n, warps = pick_blocks(d)
    grid = (s, triton.cdiv(max_query_len, block_m), hq)
    _varlen_kernel[grid](
        q, k_pages, v_pages, k_tables, v_tables, query_start, context_lens, out, scale * LOG2E, window,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        k_tables.stride(0), v_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // k_pages.shape[2], HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=k_pages.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=window > 0,
        DOT_FP32=os.environ.get("TRITON_INTERPRET") == "1" or q.dtype == torch.float32, num_warps=warps)
    return out


def varlen_paged_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               k_tables: torch.Tensor, v_tables: torch.Tensor, query_start: list[int],
                               context_lens: list[int], scale: float, window: int = 0) -> torch.Tensor:
    """Reference twin of ``varlen_paged_attention``: per sequence, gather its K/V through its page tables and
    attend with an explicit causal (and window) mask in fp32. Host lists for the offsets and lengths."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_pages.shape[2]
    bs = k_pages.shape[1]
    for s, ctx in enumerate(context_lens):
        lo, hi = query_start[s], query_start[s + 1]
        n = hi - lo
        nb = -(-ctx // bs)
        k = k_pages[k_tables[s, :nb].long()].flatten(0, 1)[:ctx].float()  # [ctx, Hkv, D]
        v = v_pages[v_tables[s, :nb].long()].flatten(0, 1)[:ctx].float()
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        qs = q[lo:hi].float()  # [n, Hq, D]
        sc = torch.einsum("nhd,chd->hnc", qs, k) * scale
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        see = kpos <= qpos
        if window > 0:
            see &= qpos - kpos < window
        sc = sc.masked_fill(~see, float("-inf"))
        out[lo:hi] = torch.einsum("hnc,chd->nhd", sc.softmax(-1), v).to(q.dtype)
    return out
