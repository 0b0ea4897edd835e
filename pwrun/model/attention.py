"""Paged self-attention, pure-PyTorch reference (prefill and decode, any mix in one step).

What it does: projects q/k/v, applies qk-norm and RoPE, writes the step's keys/values into the
paged KV cache, then for each sequence gathers its keys/values through its block table and
attends causally (query at position p sees keys 0..p, or p - window + 1..p on a sliding-window layer,
which gathers only the blocks its window covers: the older ones may have returned to the pool) with
GQA. This is the reference twin of the Triton kernels a cache may offer: ``decode_attention``
(``pwkernels/paged_attention.py``) for pure decode steps and ``varlen_attention``
(``pwkernels/varlen_attention.py``) for any step, prompt chunks beside decodes (the runtime's pooled cache
does where the kernels run). It does not allocate blocks.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pwkernels.dense_gemv import linear
from pwkernels.norm import rms_norm_heads
from pwrun.model.ops import apply_rope, norm, rope_cos_sin
from pwrun.model.spec import AttentionSpec
from pwrun.model.step import StepTensors
from pwrun.model.weights import AttentionWeights


class PagedKVCache(Protocol):
    """What attention needs from a paged KV store (``pwrun.runner.kv_store.PooledKVCache``): ``write`` k, v
    [T, Hkv, D] at slots [T]; ``gather`` positions 0..length-1 of one sequence through its block table [nb]
    (a table that starts at logical block j gives positions j * block_size ..)."""

    block_size: int

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, fused: bool = False) -> torch.Tensor:
    if fused:
        return linear(x, w, b)
    return F.linear(x, w, b)


def _window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                      ctx: int) -> torch.Tensor:
    """Sliding-window attention of queries q [n, heads, d] at positions ctx - n .. ctx - 1 over keys k, v
    [m, heads, d] at positions ctx - m .. ctx - 1: query p sees keys p - window + 1 .. p. Returns [heads, n, d]."""
    n, m = q.shape[0], k.shape[0]
    qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
    kpos = torch.arange(ctx - m, ctx, device=q.device)[None, :]
    mask = (kpos <= qpos) & (kpos > qpos - window)
    qt, kt, vt = (z.transpose(0, 1).unsqueeze(0) for z in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)[0]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a sequence's n newest positions q [n, heads, d] over its whole context k, v [ctx, heads, d]
    (n <= ctx; the queries are positions ctx - n .. ctx - 1, as ``StepTensors.build`` makes every step): query i
    sees keys 0 .. ctx - n + i. Returns [heads, n, d]. A whole prompt (n == ctx) runs SDPA's ``is_causal``
    (flash attention on CUDA), a chunk of a longer context a lower-right causal [n, ctx] boolean mask (torch's
    ``causal_lower_right`` bias would spare it, but its module imports torch._dynamo: ~0.9 s of every command's
    start-up), one token no mask at all. The inputs go to SDPA as 4-D [1, heads, len, d]: its flash and
    memory-efficient backends take only 4-D tensors, and 3-D ones fall back to the math backend, which on CUDA
    upcasts to fp32 and builds the [heads, n, ctx] scores."""
    n, ctx = q.shape[0], k.shape[0]
    qt, kt, vt = (z.transpose(0, 1).unsqueeze(0) for z in (q, k, v))
    if n == ctx or n == 1:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=n > 1, scale=scale)[0]
    mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)[0]


def attention_forward(x: torch.Tensor, w: AttentionWeights, spec: AttentionSpec, eps: float, layer: int,
                      step: StepTensors, cache: PagedKVCache, fused: bool = False) -> torch.Tensor:
    """Self-attention output [T, H] for normalised hidden states x [T, H] of one step.

    The step's keys/values are written to ``cache`` at ``step.slots`` before attending. ``fused``:
    RoPE and the KV write in one kernel where the cache offers ``write_rope``, and the decode GEMV of
    ``pwkernels.dense_gemv`` for the projections of few tokens (CUDA runtime). With ``w.qkv`` (``fuse_qkv``)
    q, k and v come from one projection.
    """
    t = x.shape[0]
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if (fused and w.qkv is not None and spec.qk_norm == "per_head" and spec.v_norm and spec.clip_qkv is None
            and w.q_norm is not None and w.k_norm is not None and w.q_norm.dtype == w.k_norm.dtype == x.dtype):
        # q, k and v normalised per head in one launch (Gemma-4's sliding layers)
        qkv = _linear(x, w.qkv, w.qkv_bias, fused).view(t, hq + 2 * hkv, d)
        qkv = rms_norm_heads(qkv, w.q_norm, hq, w.k_norm, hq + hkv, eps)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        return _attend(x, q, k, v, w, spec, layer, step, cache, fused)
    if w.qkv is not None:
        q, k, v = _linear(x, w.qkv, w.qkv_bias, fused).split((hq * d, hkv * d, hkv * d), dim=-1)
    else:
        q, k = _linear(x, w.q, w.q_bias), _linear(x, w.k, w.k_bias)
        v = k if w.v is None else _linear(x, w.v, w.v_bias)
    if spec.qk_norm == "full":
        assert w.q_norm is not None and w.k_norm is not None
        q, k = norm(q, w.q_norm, eps, fused), norm(k, w.k_norm, eps, fused)
    if spec.clip_qkv is not None:
        q, k, v = (z.clamp(-spec.clip_qkv, spec.clip_qkv) for z in (q, k, v))
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if spec.qk_norm == "per_head":
        assert w.q_norm is not None and w.k_norm is not None
        q, k = norm(q, w.q_norm, eps, fused), norm(k, w.k_norm, eps, fused)
    if spec.v_norm:
        v = norm(v, None, eps, fused)
    return _attend(x, q, k, v, w, spec, layer, step, cache, fused)


def _attend(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: AttentionWeights,
            spec: AttentionSpec, layer: int, step: StepTensors, cache: PagedKVCache, fused: bool) -> torch.Tensor:
    """RoPE, the KV write and attention of the normalised q [T, Hq, D], k / v [T, Hkv, D]; the output projection."""
    t = x.shape[0]
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    write_rope = getattr(cache, "write_rope", None) if fused else None
    rotated = write_rope(layer, step, q, k, v, spec.rope_theta, spec.rotary_dim) if write_rope is not None else None
    if rotated is not None:
        q = rotated
    else:
        cos, sin = rope_cos_sin(step.positions, d, spec.rope_theta, x.dtype, spec.rotary_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(layer, step.slots, k, v)
    scale = spec.softmax_scale
    fast = getattr(cache, "decode_attention", None)
    if fast is not None and step.decode_only:
        o = fast(layer, q, step, scale, spec.window)
        if o is not None:
            return _linear(o.reshape(t, hq * d), w.o, None, fused)

    varlen = getattr(cache, "varlen_attention", None)
    if varlen is not None:
        o = varlen(layer, q, step, scale, spec.window or 0)
        if o is not None:
            return _linear(o.reshape(t, hq * d), w.o, None, fused)

    out = torch.empty_like(q)
    groups = hq // hkv
    for s in range(step.num_seqs):
        lo, hi = step.query_start[s], step.query_start[s + 1]
        ctx = step.context_lens[s]
        first = 0 if spec.window is None else max(0, ctx - (hi - lo) - spec.window + 1) // cache.block_size
        ks, vs = cache.gather(layer, step.block_tables[s][first:], ctx - first * cache.block_size)
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        if spec.window is None:
            o = _causal_attention(q[lo:hi], ks, vs, scale)
        else:
            o = _window_attention(q[lo:hi], ks, vs, scale, spec.window, ctx)
        out[lo:hi] = o.transpose(0, 1)
    return F.linear(out.reshape(t, hq * d), w.o)
