# ruff: noqa: B023  (the timed closures run inside their loop iteration)
"""Probe: where the AP decode GEMV spends its time (issue #4), by timing variants that leave stages out.

What it does (GPU only): on the gate_up block shape of a Qwen1.5-MoE layer (4 experts, 2I = 2816 rows,
K = 2048, q = 4, T = 1), times a probe kernel with the decode GEMV's grid and loop, in stages:
  * ``load``: plane words only (xor-reduced, stored once per row);
  * ``codes``: + q-bit codes (SPREAD multiply), summed as floats times x (no LUT);
  * ``full``: + the per-row LUT gather and FMA (what ``kernels/ap_moe_gemv.py`` does);
each with and without 16-byte plane loads (``ALIGN``: the plane offset and row stride are declared
multiples of 4 words) and a software prefetch of the next K tile (``PREFETCH``), over a few tiles.
Prints one row per variant: GPU time of a CUDA-graph replay (median), GB/s of plane bytes, % of the
copy bandwidth. The difference between stages places the time (H200.md: "time variants that leave one
stage out"). The real kernel's time is printed first, for the same block.

Usage: ``PYTHONPATH=$PWD python bench/gemv_probe.py [--quick]``
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from kernels.ap_tile import _merge


@triton.jit
def _bits_to(w, j: tl.constexpr, s: tl.constexpr, W: tl.constexpr):
    """Bits j, j+W, j+2W, ... of uint32 ``w`` moved to bits s, s+W, s+2W, ... (others 0), W = 4 or 8: one shift,
    one and (ptxas fuses the and with the caller's or into one LOP3)."""
    if W == 4:
        if j >= s:
            return (w >> (j - s)) & (0x11111111 << s)
        else:
            return (w << (s - j)) & (0x11111111 << s)
    else:
        if j >= s:
            return (w >> (j - s)) & (0x01010101 << s)
        else:
            return (w << (s - j)) & (0x01010101 << s)


@triton.jit
def _probe_kernel(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, x_ptr, out_ptr, N, K,
                  STAGE: tl.constexpr, ALIGN: tl.constexpr, PREFETCH: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    blk = 2 * tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    q = tl.load(bits_ptr + blk)
    lut = lut_ptr + tl.load(lut_off_ptr + blk) + rows * (1 << q)
    poff = plane_off_ptr + blk * 8
    BKW: tl.constexpr = BLOCK_K // 32
    if ALIGN:
        kw4 = (K + 127) // 128
        rbase = (rows * kw4) * 4
    else:
        kw4 = 0
        rbase = rows * ((K + 31) // 32)
    kwn = (K + 31) // 32
    offs0 = tl.load(poff + 0)
    offs1 = tl.load(poff + 1)
    offs2 = tl.load(poff + 2)
    offs3 = tl.load(poff + 3)
    if ALIGN:
        offs0 = tl.multiple_of(offs0, 4)
        offs1 = tl.multiple_of(offs1, 4)
        offs2 = tl.multiple_of(offs2, 4)
        offs3 = tl.multiple_of(offs3, 4)
    accw = tl.zeros((BLOCK_N, BKW), dtype=tl.int32)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    kwi = tl.arange(0, BKW)
    word = rbase[:, None] + kwi[None, :]
    m = rmask[:, None] & (kwi[None, :] < kwn)
    n0 = tl.load(pool_ptr + offs0 + word, mask=m, other=0)
    n1 = tl.load(pool_ptr + offs1 + word, mask=m, other=0)
    n2 = tl.load(pool_ptr + offs2 + word, mask=m, other=0)
    n3 = tl.load(pool_ptr + offs3 + word, mask=m, other=0)
    for k0 in range(0, K, BLOCK_K):
        w0, w1, w2, w3 = n0, n1, n2, n3
        if PREFETCH:
            kk = (k0 + BLOCK_K) // 32 + kwi
            word = rbase[:, None] + kk[None, :]
            m = rmask[:, None] & (kk[None, :] < kwn)
            n0 = tl.load(pool_ptr + offs0 + word, mask=m, other=0)
            n1 = tl.load(pool_ptr + offs1 + word, mask=m, other=0)
            n2 = tl.load(pool_ptr + offs2 + word, mask=m, other=0)
            n3 = tl.load(pool_ptr + offs3 + word, mask=m, other=0)
        else:
            if k0 > 0:
                kk = k0 // 32 + kwi
                word = rbase[:, None] + kk[None, :]
                m = rmask[:, None] & (kk[None, :] < kwn)
                w0 = tl.load(pool_ptr + offs0 + word, mask=m, other=0)
                w1 = tl.load(pool_ptr + offs1 + word, mask=m, other=0)
                w2 = tl.load(pool_ptr + offs2 + word, mask=m, other=0)
                w3 = tl.load(pool_ptr + offs3 + word, mask=m, other=0)
        if STAGE == 0:
            accw ^= w0 ^ w1 ^ w2 ^ w3
        else:
            code = _merge(tl.zeros((BLOCK_N, BKW, 8), dtype=tl.int32), w0, 3, 1)
            code = _merge(code, w1, 2, 1)
            code = _merge(code, w2, 1, 1)
            code = _merge(code, w3, 0, 1)
            byte = tl.arange(0, 4) * 8
            idx = tl.reshape((code[:, :, :, None] >> byte[None, None, None, :]) & 0xFF, (BLOCK_N, BLOCK_K))
            cols = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            if STAGE == 1:
                acc += idx.to(tl.float32) * xk[None, :]
            else:
                w = tl.load(lut[:, None] + idx, mask=rmask[:, None], other=0.0)
                acc += w.to(tl.float32) * xk[None, :]
    if STAGE == 0:
        tl.store(out_ptr + rows, tl.sum(accw, axis=1).to(tl.float32), mask=rmask)
    else:
        tl.store(out_ptr + tl.program_id(0) * N + rows, tl.sum(acc, axis=1), mask=rmask)


@triton.jit
def _wm_plane(pool_ptr, poff, p: tl.constexpr, q, word, m):
    off = tl.multiple_of(tl.load(poff + p), 4)
    return tl.load(pool_ptr + off + word, mask=m & (word * 0 + p < q), other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _wm_kernel(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, x_ptr, out_ptr, N, K,
               STAGE: tl.constexpr, XPERM: tl.constexpr, HALF: tl.constexpr,
               BLOCK_N: tl.constexpr, BKW: tl.constexpr):
    """Word-major probe: a thread keeps its plane words and makes all 32 weights of each word itself."""
    blk = 2 * tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows = tl.minimum(rows, N - 1)
    q = tl.load(bits_ptr + blk)
    lut_row = lut_ptr + tl.load(lut_off_ptr + blk) + rows * (1 << q)
    poff = plane_off_ptr + blk * 8
    kwn = (K + 127) // 128 * 4
    acc = tl.zeros((BLOCK_N, BKW), dtype=tl.float32)
    for kw0 in range(0, kwn, BKW):
        kw = kw0 + tl.arange(0, BKW)
        word = rows[:, None] * kwn + kw[None, :]
        m = kw[None, :] < kwn
        w0 = _wm_plane(pool_ptr, poff, 0, q, word, m)
        w1 = _wm_plane(pool_ptr, poff, 1, q, word, m)
        w2 = _wm_plane(pool_ptr, poff, 2, q, word, m)
        w3 = _wm_plane(pool_ptr, poff, 3, q, word, m)
        if HALF:
            w4, w5, w6, w7 = w0 * 0, w0 * 0, w0 * 0, w0 * 0
            if q > 4:
                w4 = _wm_plane(pool_ptr, poff, 4, q, word, m)
                w5 = _wm_plane(pool_ptr, poff, 5, q, word, m)
                w6 = _wm_plane(pool_ptr, poff, 6, q, word, m)
                w7 = _wm_plane(pool_ptr, poff, 7, q, word, m)
        else:
            w4 = _wm_plane(pool_ptr, poff, 4, q, word, m)
            w5 = _wm_plane(pool_ptr, poff, 5, q, word, m)
            w6 = _wm_plane(pool_ptr, poff, 6, q, word, m)
            w7 = _wm_plane(pool_ptr, poff, 7, q, word, m)
        for j in tl.static_range(8):
            c = _bits_to(w0, j, 7, 8) | _bits_to(w1, j, 6, 8) | _bits_to(w2, j, 5, 8) | _bits_to(w3, j, 4, 8)
            c = c | _bits_to(w4, j, 3, 8) | _bits_to(w5, j, 2, 8) | _bits_to(w6, j, 1, 8) | _bits_to(w7, j, 0, 8)
            c = c >> (8 - q).to(tl.uint32)
            for b in tl.static_range(4):
                code = ((c >> (8 * b)) & 0xFF).to(tl.int32)
                if XPERM:
                    xv = tl.load(x_ptr + (j + 8 * b) * kwn + kw, mask=kw < kwn, other=0.0).to(tl.float32)
                else:
                    xv = tl.load(x_ptr + kw * 32 + (j + 8 * b), mask=kw < kwn, other=0.0).to(tl.float32)
                if STAGE == 1:
                    acc += code.to(tl.float32) * xv[None, :]
                else:
                    acc += tl.load(lut_row[:, None] + code).to(tl.float32) * xv[None, :]
    tl.store(out_ptr + tl.program_id(0) * N + rows, tl.sum(acc, axis=1), mask=rmask)


def graph_ms(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 10)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--wm-only", action="store_true", help="only the word-major probe")
    ap.add_argument("--ncu", action="store_true", help="only call the real kernel 6 times (for ncu) and exit")
    args = ap.parse_args()
    from bench.ap_moe_speed import SHAPES, copy_bandwidth, fake_experts, routed
    from kernels.ap_moe import ap_moe

    s = SHAPES["qwen1.5-moe"]
    bw = copy_bandwidth()  # bytes/s of a copy, read + write counted (the floor's convention)
    ex = fake_experts(s, 4)
    print(f"copy read bandwidth {bw / 1e12:.3f} TB/s; plane offsets % 4 words:",
          sorted({int(o) % 4 for o in ex.plane_offset[ex.plane_offset >= 0].tolist()}))
    x, ids, w = routed(s, 1, 0)
    ids = torch.arange(4, device="cuda").view(1, 4)
    if args.ncu:
        for _ in range(6):
            ap_moe(x, ids, w, ex, check=False)
        torch.cuda.synchronize()
        return
    full = graph_ms(lambda: ap_moe(x, ids, w, ex, check=False))
    n, k = 2 * s["inter"], s["hidden"]
    plane_bytes = 4 * n * k * 4 / 8  # 4 experts, q = 4 bits per weight
    print(f"real ap_moe (gate_up + down, 4 experts) {full * 1e3:.1f} us; "
          f"gate_up plane bytes {plane_bytes / 1e6:.1f} MB "
          f"-> floor {plane_bytes / bw * 1e6:.1f} us")
    out = torch.empty(4 * n, device="cuda")
    xv = x[0].contiguous()
    kwn = -(-k // 128) * 4
    xperm = torch.zeros(32 * kwn, device="cuda", dtype=x.dtype)
    xperm.view(32, kwn)[:, : k // 32] = xv.view(-1, 32).T
    from pwrun.ap.format import dequantize
    planes, lut, _, kk = ex.block(0)
    ref = dequantize(planes, lut, kk, planes.shape[0], torch.float32) @ xv.float()
    hdr = (f"{'kernel':4} {'stage':6} {'xp':>2} {'half':>4} {'BN':>3} {'BK':>5} {'warps':>5} {'us':>8} {'GB/s':>7} "
           f"{'% bw':>5} err")
    print(hdr)
    wm_tiles = [(16, 16, 4), (32, 8, 4), (8, 32, 4), (16, 32, 8), (64, 8, 8), (4, 64, 4), (32, 16, 8), (128, 4, 4)]
    for stage, xp, half, (bn, bkw, nw) in itertools.product((2, 1), (1, 0), (1, 0), wm_tiles):
        if args.quick and (bn, bkw, nw) != (16, 16, 4):
            continue
        def fwm() -> None:
            _wm_kernel[(4, triton.cdiv(n, bn))](ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits,
                                                xperm if xp else xv, out, n, k, STAGE=stage, XPERM=xp, HALF=half,
                                                BLOCK_N=bn, BKW=bkw, num_warps=nw)
        try:
            ms = graph_ms(fwm)
        except Exception as err:  # a variant that does not compile is reported, not fatal
            print(f"wm {stage} {xp} {half} {bn} {bkw} {nw}: {type(err).__name__} {str(err)[:160]}")
            continue
        fwm()
        rel = float((out[:n] - ref).abs().max() / ref.abs().max()) if stage == 2 else float("nan")
        gbs = plane_bytes / (ms / 1e3) / 1e9
        print(f"wm   {('load', 'codes', 'full')[stage]:6} {xp:2} {half:4} {bn:3} {bkw * 32:5} {nw:5} {ms * 1e3:8.1f} "
              f"{gbs:7.0f} {gbs * 1e9 / bw * 100:5.1f} {rel:.1e}", flush=True)
    if args.wm_only:
        return
    tiles = [(8, 256, 4), (16, 256, 4), (16, 512, 4), (32, 256, 8), (16, 1024, 8), (4, 1024, 4)]
    if args.quick:
        tiles = tiles[:3]
    for stage, align, pref, (bn, bk, nw) in itertools.product((0, 1, 2), (0, 1), (0, 1), tiles):
        def fn() -> None:
            _probe_kernel[(4, triton.cdiv(n, bn))](ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, xv,
                                                   out, n, k, STAGE=stage, ALIGN=align, PREFETCH=pref, BLOCK_N=bn,
                                                   BLOCK_K=bk, num_warps=nw)
        try:
            ms = graph_ms(fn)
        except Exception as err:  # a variant that does not compile is reported, not fatal
            print(f"{stage} {align} {pref} {bn} {bk} {nw}: {type(err).__name__} {str(err)[:120]}")
            continue
        gbs = plane_bytes / (ms / 1e3) / 1e9
        print(f"old  {('load', 'codes', 'full')[stage]:6} {align:2} {pref:4} {bn:3} {bk:5} {nw:5} {ms * 1e3:8.1f} "
              f"{gbs:7.0f} {gbs * 1e9 / bw * 100:5.1f}", flush=True)


if __name__ == "__main__":
    main()
