"""The decode step's fused elementwise kernels vs their references (interpreter on CPU, native on GPU).

add_rms_norm (residual add + RMSNorm), rope_kv_write (RoPE on q/k + paged KV write) and route_topk
(softmax top-k, shared gate, live statistics). Each reference is itself checked against the eager
math of the lean model (transformers' RMSNorm written out, ``pwrun.model.ops``, ``pwrun.model.moe.route``), so
the kernels are pinned to the model's math, not only to a twin written beside them. Odd sizes (H 1408+8, 96,
E 60, top-k 1..8), bf16 and fp16, strided inputs, outputs poisoned with NaN before the call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pwkernels.norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_heads, rms_norm_ref, rms_unit_ref
from pwkernels.rope_kv import rope_kv_write, rope_kv_write_ref
from pwkernels.route_topk import route_topk, route_topk_ref
from pwrun.model.moe import route
from pwrun.model.ops import apply_rope, norm, rope_cos_sin, rope_inv_freq
from pwrun.model.spec import MoESpec

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's epsilon times the magnitude (relative, robust near 0)."""
    eps = torch.finfo(a.dtype).eps
    d = (a.float() - b.float()).abs()
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-3)
    return float((d / scale).max()) / eps


def _abs_ulps(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference in units of eps times the largest |ref| (for sums that can cancel, as in RoPE)."""
    return float((a.float() - b.float()).abs().max()) / (torch.finfo(a.dtype).eps * float(ref.float().abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 96), (3, 1416), (17, 256)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype: torch.dtype, t: int, h: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(t * h)
    big = torch.randn(t, h + 5, generator=g).to(dtype).to(DEV)
    hs = big[:, 2:h + 2]  # strided rows
    delta = torch.randn(t, h, generator=g).to(dtype).to(DEV) if with_delta else None
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(DEV)
    h_ref, x_ref = add_rms_norm_ref(hs, delta, w, 1e-6)
    # the reference is transformers' RMSNorm math (fp32 mean and rsqrt, cast back, times the weight)
    h_eager = hs + delta if delta is not None else hs
    assert torch.equal(h_ref, h_eager)
    hf = h_eager.float()
    assert torch.equal(x_ref, w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype))
    h_k, x_k = add_rms_norm(hs, delta, w, 1e-6)
    assert torch.equal(h_k, h_ref)
    assert _ulps(x_k, x_ref) <= 2.0, "normalised rows differ by more than bf16/fp16 rounding"


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2816), (5, 704), (3, 8, 256), (4, 2, 512), (2, 3, 96)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_of_rows_and_strided_heads(dtype: torch.dtype, shape: tuple[int, ...], weighted: bool) -> None:
    """Rows [T, D], and heads [T, G, D] viewed in a wider projection output (as q / k / v are split from one),
    with and without a weight: the kernel gives the eager norm up to the rounding of its fp32 sum."""
    g = torch.Generator().manual_seed(sum(shape))
    t, d = shape[0], shape[-1]
    heads = shape[1] if len(shape) == 3 else 1
    wide = (3 * torch.randn(t, heads * d + 40, generator=g)).to(dtype).to(DEV)
    x = wide[:, 40:].view(t, heads, d) if len(shape) == 3 else wide[:, 40:]
    assert t == 1 or not x.is_contiguous()
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEV) if weighted else None
    ref = rms_norm_ref(x, w, 1e-6) if w is not None else rms_unit_ref(x, 1e-6)
    xf = x.float()
    unit = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(ref, w * unit if w is not None else unit)  # the eager math of transformers' norms
    got = rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    assert _ulps(got, ref) <= 2.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 96), (5, 1416)])
@pytest.mark.parametrize("with_scale", [True, False])
def test_rms_norm_with_residual_and_scale(dtype: torch.dtype, t: int, d: int, with_scale: bool) -> None:
    """A sandwich layer's post-norm in one launch: ``(residual + norm(x)) * scale`` equals the eager ops on the
    kernel's own norm bit for bit (each op rounded to the dtype), and ``pwrun.model.ops.norm``'s eager path is
    those ops. Also Gemma-4's router input: ``norm(x) * weight * number`` (no residual)."""
    g = torch.Generator().manual_seed(t + d)
    x = (3 * torch.randn(t, d + 8, generator=g)).to(dtype).to(DEV)[:, 8:]  # strided rows
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEV)
    res = torch.randn(t, d, generator=g).to(dtype).to(DEV)
    scale = torch.tensor([0.37], dtype=dtype, device=DEV) if with_scale else None
    y = rms_norm(x, w, 1e-6)
    want = res + y if scale is None else (res + y) * scale
    assert torch.equal(rms_norm(x, w, 1e-6, res, scale), want)
    eager = res + rms_norm_ref(x, w, 1e-6)
    assert torch.equal(norm(x, w, 1e-6, False, res, scale), eager if scale is None else eager * scale)
    assert _ulps(norm(x, w, 1e-6, True, res, scale), norm(x, w, 1e-6, False, res, scale)) <= 4.0
    c = d ** -0.5  # a number: multiplied in fp32, as eager bf16 * float
    assert torch.equal(rms_norm(x, w, 1e-6, None, c), y * c)
    assert torch.equal(rms_norm(x, w, 1e-6, None, np.float32(2.0)), y * 2.0)  # any real number
    # a residual the kernel cannot take (strided): the norm still in the kernel, the add eager
    strided = torch.zeros(t, 2 * d, dtype=dtype, device=DEV)[:, ::2]
    assert torch.equal(norm(x, w, 1e-6, True, strided, scale), y if scale is None else y * scale)
    unit = rms_unit_ref(x, 1e-6)
    assert torch.equal(norm(x, w, 1e-6, False, scale=c), unit * w * c)  # the router input's eager ops, any order
    assert _ulps(norm(x, w, 1e-6, True, scale=c), unit * w * c) <= 4.0
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, res[:, :-1])
    with pytest.raises(ValueError, match="scale"):
        rms_norm(x, w, 1e-6, res, torch.ones(2, dtype=dtype, device=DEV))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 32), (5, 6, 1, 72)])
def test_rms_norm_heads_equals_one_norm_per_part(dtype: torch.dtype, t: int, hq: int, hkv: int, d: int) -> None:
    """q, k and v heads of one fused projection normalised in one launch: bit for bit the three separate norms
    (q and k with their weights, v without), read from the projection's strided views."""
    g = torch.Generator().manual_seed(t * hq + d)
    qkv = (3 * torch.randn(t, (hq + 2 * hkv) * d, generator=g)).to(dtype).to(DEV)
    wq, wk = ((1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEV) for _ in range(2))
    q, k, v = (z.view(t, -1, d) for z in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))
    out = rms_norm_heads(qkv.view(t, hq + 2 * hkv, d), wq, hq, wk, hq + hkv, 1e-6)
    assert out.is_contiguous() and out.shape == (t, hq + 2 * hkv, d)
    assert torch.equal(out[:, :hq], rms_norm(q, wq, 1e-6)) and torch.equal(out[:, hq:hq + hkv], rms_norm(k, wk, 1e-6))
    assert torch.equal(out[:, hq + hkv:], rms_norm(v, None, 1e-6))
    assert _ulps(out[:, :hq], rms_norm_ref(q, wq, 1e-6)) <= 2.0 and _ulps(out[:, hq + hkv:], rms_unit_ref(v, 1e-6)) <= 2
    with pytest.raises(ValueError, match="row bounds"):
        rms_norm_heads(qkv.view(t, hq + 2 * hkv, d), wq, hq + 1, wk, hq, 1e-6)


def test_rms_norm_rejects_bad_input() -> None:
    x = torch.randn(2, 8, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm(x.t(), None, 1e-6)
    with pytest.raises(ValueError, match=r"\[T, D\] or \[T, G, D\]"):
        rms_norm(x.view(2, 2, 2, 2), None, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(8, device=DEV), 1e-6)  # fp32 weight for a bf16 x
    assert rms_norm(x[:0], None, 1e-6).shape == (0, 8)


def test_add_rms_norm_rejects_bad_input() -> None:
    h = torch.randn(2, 8, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(h, None, torch.ones(7, dtype=torch.bfloat16, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(h, h.half(), torch.ones(8, dtype=torch.bfloat16, device=DEV), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d,bs", [(1, 4, 2, 64, 16), (5, 6, 6, 32, 8), (9, 8, 2, 128, 4)])
def test_rope_kv_write(dtype: torch.dtype, t: int, hq: int, hkv: int, d: int, bs: int) -> None:
    g = torch.Generator().manual_seed(t + hq * d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 3, generator=g).to(dtype).to(DEV)  # one projection, token stride
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:(hq + 2 * hkv) * d].view(t, hkv, d)
    positions = torch.randint(0, 5000, (t,), generator=g).to(DEV)
    num_blocks, units = 6, 20
    perm = torch.randperm(units, generator=g).to(DEV)  # K and V pages are distinct pages of one pool
    k_units, v_units = perm[:num_blocks], perm[num_blocks:2 * num_blocks]
    slots = torch.randperm(num_blocks * bs, generator=g)[:t].to(DEV)
    inv = rope_inv_freq(d, 10000.0, DEV)
    rows_ref = torch.full((units * bs, hkv, d), float("nan"), dtype=dtype, device=DEV)
    rows_k = rows_ref.clone()
    q_ref = rope_kv_write_ref(q, k, v, positions, inv, rows_ref, slots, k_units, v_units, bs)
    q_k = rope_kv_write(q, k, v, positions, inv, rows_k, slots, k_units, v_units, bs)
    # the reference agrees with the model's eager RoPE (which rounds every product: a few ulps)
    cos, sin = rope_cos_sin(positions, d, 10000.0, dtype)
    assert _abs_ulps(q_ref, apply_rope(q, cos, sin), q) <= 4.0
    assert _ulps(q_k, q_ref) <= 2.0
    written = torch.zeros(units * bs, dtype=torch.bool)
    blk, off = (slots // bs).cpu(), (slots % bs).cpu()
    written[k_units.cpu()[blk] * bs + off] = True
    written[v_units.cpu()[blk] * bs + off] = True
    assert torch.isnan(rows_k[~written.to(DEV)].float()).all(), "a row outside the step's slots was written"
    vrow = v_units[slots // bs] * bs + slots % bs
    assert torch.equal(rows_k[vrow], v) and torch.equal(rows_ref[vrow], v)
    krow = k_units[slots // bs] * bs + slots % bs
    assert _ulps(rows_k[krow], rows_ref[krow]) <= 2.0
    assert _abs_ulps(rows_ref[krow], apply_rope(k, cos, sin), k) <= 4.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_ref_uses_the_eager_tables(dtype: torch.dtype) -> None:
    """Rotating unit vectors e_i gives back cos[:, i] and sin[:, i] exactly (1 * c is exact in fp32 and c is
    already in the model dtype), so the reference's cos/sin are the eager ``rope_cos_sin`` tables bit for bit."""
    t, d, bs, theta = 7, 48, 4, 1_000_000.0
    half = d // 2
    positions = torch.tensor([0, 1, 17, 255, 4095, 32767, 131071], device=DEV)
    eye = torch.eye(half, d, dtype=dtype, device=DEV)  # rows e_0 .. e_{D/2-1}
    q = eye.expand(t, half, d).contiguous()
    k, v = q[:, :1].clone(), q[:, :1].clone()
    rows = torch.zeros(2 * t * bs, 1, d, dtype=dtype, device=DEV)
    units, slots = torch.arange(2 * t, device=DEV), torch.arange(t, device=DEV) * bs
    out = rope_kv_write_ref(q, k, v, positions, rope_inv_freq(d, theta, DEV), rows, slots, units[:t], units[t:], bs)
    cos, sin = rope_cos_sin(positions, d, theta, dtype)
    idx = torch.arange(half, device=DEV)
    assert torch.equal(out[:, idx, idx], cos[:, :half]) and torch.equal(out[:, idx, idx + half], sin[:, :half])
    assert torch.equal(out, apply_rope(q, cos, sin))


ROUTE_CASES = [(1, 60, 4, False, True), (7, 8, 2, True, False), (33, 16, 8, True, False), (4, 5, 1, False, True),
               (3, 12, 3, True, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k,renorm,gate", ROUTE_CASES)
def test_route_topk(dtype: torch.dtype, t: int, e: int, k: int, renorm: bool, gate: bool) -> None:
    g = torch.Generator().manual_seed(t * e + k)
    h = 72
    x = torch.randn(t, h, generator=g).to(dtype).to(DEV)
    # distinct logits per token (multiples of 1/16, exact in bf16/fp16) so that top-k has no ties to break
    cols = e + int(gate)
    logits = torch.stack([(torch.randperm(cols, generator=g) - cols / 2) / 16 for _ in range(t)]).to(dtype).to(DEV)
    stats_ref = (torch.zeros(e + 1, device=DEV), torch.zeros(e + 1, 4, device=DEV))
    stats_k = (torch.full((e + 1,), 0.5, device=DEV), torch.full((e + 1, 4), 0.5, device=DEV))
    stats_ref[0].fill_(0.5)
    stats_ref[1].fill_(0.5)
    w_ref, ids_ref, s_ref = route_topk_ref(logits, x, e, k, renorm, gate, stats_ref)
    # the reference is the model's eager router
    spec = MoESpec(num_experts=e, top_k=k, norm_topk_prob=renorm, expert_intermediate=8)
    one_hot = torch.eye(t, dtype=dtype, device=DEV)  # x = e_t, router[:, t] = logits[t]: linear gives the logits
    w_eager, ids_eager = route(one_hot, logits[:, :e].T.contiguous(), spec)
    assert torch.equal(ids_ref, ids_eager) and torch.equal(w_ref, w_eager.float())
    if gate:
        assert torch.allclose(s_ref, torch.sigmoid(logits[:, e].float()))
    w_k, ids_k, s_k = route_topk(logits, x, e, k, renorm, gate, stats_k)
    assert torch.equal(ids_k, ids_ref)
    assert torch.allclose(w_k, w_ref, rtol=2 * torch.finfo(dtype).eps, atol=0)
    assert torch.allclose(s_k, s_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(stats_k, stats_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    expected = 0.5 * (e + 1) + float(w_ref.sum()) + t  # routing mass: the weights, plus 1 per token (shared)
    assert float(stats_ref[0].sum()) == pytest.approx(expected, rel=1e-5)
    assert float(stats_k[0].sum()) == pytest.approx(expected, rel=1e-4)


def test_route_topk_stats_without_a_shared_expert() -> None:
    """Families without a shared expert leave column E alone (kernel and reference)."""
    x = torch.randn(5, 24, dtype=torch.bfloat16, device=DEV)
    logits = (torch.stack([torch.randperm(8) for _ in range(5)]).float() / 16).to(torch.bfloat16).to(DEV)
    for fn in (route_topk, route_topk_ref):
        mass, acc = torch.zeros(9, device=DEV), torch.zeros(9, 4, device=DEV)
        fn(logits, x, 8, 2, True, False, (mass, acc), has_shared=False)
        assert float(mass[8]) == 0.0 and float(acc[8].abs().sum()) == 0.0
        assert float(mass[:8].sum()) == pytest.approx(5.0, rel=1e-2)  # renormalised top-2 weights sum to 1


def test_route_topk_without_stats_and_bad_input() -> None:
    x = torch.randn(2, 16, dtype=torch.bfloat16, device=DEV)
    logits = torch.randn(2, 6, dtype=torch.bfloat16, device=DEV)
    w, ids, s = route_topk(logits, x, 6, 2, True, False)
    assert ids.shape == (2, 2) and torch.equal(s, torch.ones(2, device=DEV))
    assert torch.allclose(w.sum(1), torch.ones(2, device=DEV), atol=1e-2)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, x, 6, 7, True, False)
    with pytest.raises(ValueError, match="logits"):
        route_topk(logits, x, 6, 2, True, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (9, 12, 3)])
def test_route_topk_expert_scale(dtype: torch.dtype, t: int, e: int, k: int) -> None:
    """Gemma-4's per-expert scale: the kernel and its reference equal the model's eager router (one rounding after
    the scale), and the statistics take the scaled weights."""
    g = torch.Generator().manual_seed(t + e)
    x = torch.randn(t, 40, generator=g).to(dtype).to(DEV)
    logits = torch.stack([(torch.randperm(e, generator=g) - e / 2) / 16 for _ in range(t)]).to(dtype).to(DEV)
    scale = (0.5 + torch.rand(e, generator=g)).to(dtype).to(DEV)
    spec = MoESpec(num_experts=e, top_k=k, norm_topk_prob=True, expert_intermediate=8)
    w_eager, ids_eager = route(torch.eye(t, dtype=dtype, device=DEV), logits.T.contiguous(), spec, scale)
    unscaled, _, _ = route_topk_ref(logits, x, e, k, True, False)
    assert not torch.equal(unscaled, w_eager.float())  # the scale changes the weights
    for fn in (route_topk_ref, route_topk):
        mass, acc = torch.zeros(e + 1, device=DEV), torch.zeros(e + 1, 4, device=DEV)
        w, ids, _ = fn(logits, x, e, k, True, False, (mass, acc), has_shared=False, scale=scale)
        assert torch.equal(ids, ids_eager)
        assert torch.allclose(w, w_eager.float(), rtol=torch.finfo(dtype).eps, atol=0)
        assert float(mass.sum()) == pytest.approx(float(w_eager.float().sum()), rel=1e-3)
    with pytest.raises(ValueError, match="scale"):
        route_topk(logits, x, e, k, True, False, scale=scale[:-1])
