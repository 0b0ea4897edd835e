"""Per-row LUTs held in registers and read by warp shuffle (Triton), for the word-first AP decode kernels.

What it does: ``_lut`` loads the first 16 or 32 entries of R rows' LUTs as an fp32 [LE, R] tile, one entry per
lane; ``_shfl`` fetches entry ``idx`` of each element's row from the lane that holds it with one
``shfl.sync.idx`` (inline PTX, NVIDIA only). ``pwkernels.moe.decode_dot`` looks codes up this way for q <= 5 instead
of loading each weight from its LUT (SPEC section 7: the decode cost is instructions per weight).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lut(lut_blk, rbase, q, LE: tl.constexpr):
    """[LE, R] fp32: entries 0..LE-1 of the LUTs of R rows (entry e of row r at [e, r], 0 past 2^q), read once per
    program for the warp-shuffle gathers of codes < LE (``tl.gather`` along dim 0). LE is 32 for 32-word tiles
    (q <= 5) and 16 for 16-word ones (q <= 4): then the codes are already in the layout of Triton's warp-local
    gather, one lane per entry, and no layout conversion is made (check the TTGIR when tiles or Triton change)."""
    ent = tl.arange(0, LE)
    ent = tl.where(q <= 4, ent & 15, ent)  # q <= 4: lanes 16..31 hold a copy of entries 0..15 (see ``_shfl``)
    return tl.load(lut_blk + rbase[None, :] + ent[:, None], mask=ent[:, None] + 0 * rbase[None, :] < (1 << q),
                   other=0.0).to(tl.float32)


@triton.jit
def _shfl(lut_t, idx):
    """[LE, R] fp32 (LE = 32 or 16): element [w, r] = lut_t[idx[w, r] mod LE, r], fetched from the lane that holds it
    by one ``shfl.sync.idx`` (inline PTX). The instruction reads only the low 5 bits of the index (4 within a
    16-lane segment), so the codes need no mask and no bounds check (``tl.gather`` adds both: 0.9-1.8 instructions
    per weight at q <= 4). Needs lut_t and idx in one layout with the entries / words along the lanes: [32, R]
    tiles get threadsPerWarp [32, 1] (one word per lane), [16, R] tiles [16, 2] (two rows per warp, one per
    16-lane segment, hence the segment mask 0x10 in the shuffle's c operand); sizePerThread 1 (Triton 3.6's
    layouts for these loads; check the TTGIR when tiles or Triton change)."""
    v, i = lut_t.to(tl.int32, bitcast=True), idx.to(tl.int32, bitcast=True)
    if lut_t.shape[0] == 32:
        w = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [v, i], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        w = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x100f, -1;", "=r,r,r", [v, i], dtype=tl.int32,
                                      is_pure=True, pack=1)
    return w.to(tl.float32, bitcast=True)
