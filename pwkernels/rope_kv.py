"""RoPE on q and k + the KV-cache write of one step, in one launch (Triton), with its PyTorch reference.

What it computes, for the step's projected queries q [T, Hq, D], keys k and values v [T, Hkv, D]
and positions [T]: the default rotary embedding (rotate-half convention, full head dim; cos/sin
of ``position * theta^(-2i/D)`` computed in fp32 by ``rope_cos_sin_fp32`` and rounded to the model
dtype, as the lean model's eager tables are), applied to q (returned) and to k; the rotated k and v
go straight into the paged KV cache rows at the step's slots. A slot s lives in KV block
``s // block_size``; its key row is ``k_units[block] * block_size + s % block_size`` of
``cache_rows`` (values: ``v_units``), the runtime's pooled KV cache layout.
Eagerly this is ~30 launches per layer (cos/sin, two rotate-halfs, index math, two index_copy).
Rounding: the kernel rotates in fp32 and rounds once; the eager model rounds each product
(differences of one unit in the last place of the model dtype).
What it does not do: qk-norm, partial rotary or scaled RoPE variants (the caller falls back to
the eager ops for families that need them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pwkernels.rounding import round_to


def rope_cos_sin_fp32(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] fp32, not rounded, for positions [T] int64 and inv_freq [D/2] fp32 (rotate-half layout).

    Shared by the lean model's eager tables (which round them to the model dtype) and ``rope_kv_write_ref``
    (which rounds them the same way but rotates in fp32), so both start from the same angles.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rope_kv_write_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      inv_freq: torch.Tensor, cache_rows: torch.Tensor, slots: torch.Tensor,
                      k_units: torch.Tensor, v_units: torch.Tensor, block_size: int) -> torch.Tensor:
    """Reference: rotated q [T, Hq, D]; writes rotated k and v into ``cache_rows`` [R, Hkv, D]."""
    cos32, sin32 = rope_cos_sin_fp32(positions, inv_freq)
    # rounded to the model dtype like the eager tables, then the rotation in fp32 (rounded once)
    cos, sin = cos32.to(q.dtype).float()[:, None, :], sin32.to(q.dtype).float()[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        half = x.shape[-1] // 2
        return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)

    blk, off = slots // block_size, slots % block_size
    cache_rows.index_copy_(0, k_units[blk].long() * block_size + off, rot(k))
    cache_rows.index_copy_(0, v_units[blk].long() * block_size + off, v)
    return rot(q)


@triton.jit
def _rotate(x_ptr, o_ptr, cos, sin, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """Rotate one head (D = 2 * HALF values at x_ptr) by cos/sin [BLOCK] fp32 into o_ptr, rounded once."""
    i = tl.arange(0, BLOCK)
    m = i < HALF
    x1 = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
    ty = o_ptr.dtype.element_ty
    tl.store(o_ptr + i, round_to(x1 * cos - x2 * sin, ty), mask=m)
    tl.store(o_ptr + HALF + i, round_to(x2 * cos + x1 * sin, ty), mask=m)


@triton.jit
def _rope_kv_kernel(
    q_ptr,  # [T, Hq, D] projected queries, token rows stride_qm apart, heads D apart
    k_ptr,  # [T, Hkv, D] keys, token rows stride_km apart
    v_ptr,  # [T, Hkv, D] values, token rows stride_vm apart
    q_out_ptr,  # [T, Hq, D] out: rotated queries (contiguous)
    pos_ptr,  # [T] int64 positions
    inv_freq_ptr,  # [D/2] fp32
    rows_ptr,  # [R, Hkv, D] the cache viewed as rows (one row = one token of one layer's K or V)
    slots_ptr,  # [T] int64 slot = block * BLOCK_SIZE + offset
    k_units_ptr,  # [num_blocks] int64 unit (page) of each KV block's K of this layer
    v_units_ptr,  # [num_blocks] int64 unit of its V
    stride_qm,  # elements between token rows of q
    stride_km,  # elements between token rows of k
    stride_vm,  # elements between token rows of v
    HQ: tl.constexpr,  # query heads
    HKV: tl.constexpr,  # key/value heads
    HALF: tl.constexpr,  # D / 2
    BLOCK: tl.constexpr,  # next power of 2 >= HALF
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d: tl.constexpr = 2 * HALF
    i = tl.arange(0, BLOCK)
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=i < HALF, other=0.0)
    ty = q_out_ptr.dtype.element_ty
    cos = round_to(tl.cos(ang), ty).to(tl.float32)  # rounded like the eager cos/sin tables
    sin = round_to(tl.sin(ang), ty).to(tl.float32)
    if head < HQ:
        _rotate(q_ptr + t * stride_qm + head * d, q_out_ptr + (t * HQ + head) * d, cos, sin, HALF, BLOCK)
    else:
        kh = head - HQ
        slot = tl.load(slots_ptr + t)
        blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        k_row = tl.load(k_units_ptr + blk) * BLOCK_SIZE + off
        v_row = tl.load(v_units_ptr + blk) * BLOCK_SIZE + off
        _rotate(k_ptr + t * stride_km + kh * d, rows_ptr + (k_row * HKV + kh) * d, cos, sin, HALF, BLOCK)
        j = tl.arange(0, 2 * BLOCK)
        val = tl.load(v_ptr + t * stride_vm + kh * d + j, mask=j < d, other=0.0)
        tl.store(rows_ptr + (v_row * HKV + kh) * d + j, val, mask=j < d)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, cache_rows: torch.Tensor, slots: torch.Tensor, k_units: torch.Tensor,
                  v_units: torch.Tensor, block_size: int) -> torch.Tensor:
    """Triton version of ``rope_kv_write_ref`` (see the module docstring); returns rotated q [T, Hq, D].

    q [T, Hq, D], k/v [T, Hkv, D] (each token's heads contiguous, any token stride), positions and
    slots [T] int64, inv_freq [D/2] fp32 (``pwrun.model.ops.rope_inv_freq``), cache_rows [R, Hkv, D]
    contiguous in q's dtype, k_units / v_units [num_blocks] int64. Raises ``ValueError`` on bad
    shapes/dtypes/strides. Slots and units are not range-checked (that would sync with the host).
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (t, hkv, d) or v.shape != k.shape or d % 2 or inv_freq.shape != (d // 2,):
        raise ValueError(f"q [T, Hq, D], k/v [T, Hkv, D], inv_freq [D/2]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(inv_freq.shape)}")
    if cache_rows.dim() != 3 or cache_rows.shape[1:] != (hkv, d) or not cache_rows.is_contiguous():
        raise ValueError(f"cache_rows must be contiguous [R, {hkv}, {d}]; got {tuple(cache_rows.shape)}")
    if len({q.dtype, k.dtype, v.dtype, cache_rows.dtype}) != 1 or inv_freq.dtype != torch.float32:
        raise ValueError("q, k, v and the cache must share one dtype; inv_freq must be float32")
    for z in (q, k, v):
        if z.stride(2) != 1 or z.stride(1) != d:
            raise ValueError("each token's heads must be contiguous ([Hq or Hkv, D] rows of one token)")
    for z in (positions, slots, k_units, v_units):
        if z.dtype != torch.int64 or z.dim() != 1:
            raise ValueError("positions, slots, k_units and v_units must be 1-D int64")
    if positions.shape[0] != t or slots.shape[0] != t:
        raise ValueError("one position and one slot per token")
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    half = d // 2
    _rope_kv_kernel[(t, hq + hkv)](
        q, k, v, q_out, positions, inv_freq, cache_rows, slots, k_units, v_units, q.stride(0), k.stride(0),
        v.stride(0), HQ=hq, HKV=hkv, HALF=half, BLOCK=triton.next_power_of_2(half), BLOCK_SIZE=block_size,
        num_warps=1)
    return q_out
