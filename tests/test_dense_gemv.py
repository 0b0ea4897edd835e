"""The decode GEMV of the 16-bit linears vs F.linear (interpreter on CPU, native on GPU), and fused q/k/v.

Ragged shapes (N 1, 37, 130; K 100, 1030), 1..8 tokens, with and without bias, bf16 and fp16, strided
activation rows; the reference is F.linear in fp32 on the same 16-bit inputs, so the kernel may differ
from it by the output's rounding only. ``fuse_qkv`` must leave every projection unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pwkernels.dense_gemv import CONFIGS, MAX_TOKENS, SMALL_N, gemv, gemv_ref, linear, max_tokens, pick_config
from pwrun.model.weights import AttentionWeights, fuse_qkv

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,n,k", [(1, 37, 100), (3, 130, 1030), (8, 1, 64), (5, 64, 2048), (13, 61, 300), (16, 8, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemv_matches_linear(dtype: torch.dtype, t: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(t * n + k)
    xs = torch.randn(t, k + 7, generator=g).to(dtype).to(DEV)[:, 3:k + 3]  # strided rows
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV) if bias else None
    ref = gemv_ref(xs.float(), w.float(), None if b is None else b.float())
    for cfg in ({"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 4}, {"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 2}):
        y = gemv(xs, w, b, cfg)
        assert y.shape == (t, n) and y.dtype == dtype
        # within two units of the output's rounding, relative to the row's largest value
        tol = 2 * torch.finfo(dtype).eps * ref.abs().amax(dim=1, keepdim=True).clamp_min(1e-3)
        assert ((y.float() - ref).abs() <= tol).all(), f"max diff {(y.float() - ref).abs().max():.3g} with {cfg}"
        # rounded to nearest (not truncated): apart from summation order, the reference's own rounding
        assert (y == ref.to(dtype)).float().mean() > 0.9, f"{(y != ref.to(dtype)).float().mean():.2f} differ"


def test_gemv_rejects_bad_input() -> None:
    x = torch.randn(2, 8, dtype=torch.bfloat16, device=DEV)
    w = torch.randn(4, 8, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="same K"):
        gemv(x, w[:, :6].contiguous())
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(MAX_TOKENS + 1, 8, dtype=torch.bfloat16, device=DEV), w)
    with pytest.raises(ValueError, match="16-bit"):
        gemv(x.float(), w.float())
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(3, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="contiguous columns"):
        gemv(x, torch.randn(8, 4, dtype=torch.bfloat16, device=DEV).T)
    with pytest.raises(ValueError, match="powers of 2"):
        gemv(x, w, None, {"BLOCK_N": 3, "BLOCK_K": 64})
    with pytest.raises(ValueError, match="powers of 2"):
        gemv(x, w, None, {"BLOCK_N": 2})
    # K = 0 reads nothing: F.linear's zeros plus the bias
    b = torch.randn(4, dtype=torch.bfloat16, device=DEV)
    empty = {"dtype": torch.bfloat16, "device": DEV}
    y = gemv(torch.empty(2, 0, **empty), torch.empty(4, 0, **empty), b)
    assert torch.equal(y, b.expand(2, 4))


def test_gemv_names_the_device_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEV == "cuda":
        pytest.skip("CPU tensors only")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA device"):
        gemv(x, w)


def test_pick_config_and_linear_dispatch() -> None:
    assert pick_config(61, 2048)["BLOCK_N"] >= 1 and pick_config(6144, 2048)["BLOCK_N"] >= 1
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))  # off CUDA: F.linear itself
    # routers (N < SMALL_N rows) have their own token limit; both within what the kernel takes
    assert max_tokens(SMALL_N - 1, 64) == CONFIGS["max_tokens_small_n"]
    assert max_tokens(SMALL_N, 64) == CONFIGS["max_tokens"]
    # a measured shape's own limit wins over its class (Qwen's router + gate to 16 tokens, Mixtral's not)
    assert max_tokens(61, 2048) == CONFIGS["max_tokens_by_shape"]["61x2048"] > CONFIGS["max_tokens_small_n"]
    assert max_tokens(8, 4096) == CONFIGS["max_tokens_small_n"]
    assert all(1 <= max_tokens(n, k) <= MAX_TOKENS for n, k in [(SMALL_N, 64), (61, 2048), (8, 4096), (61, 64)])


def test_fuse_qkv_keeps_projections() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 32, generator=g) for n in (64, 16, 16))
    qb, kb, vb = (torch.randn(n, generator=g) for n in (64, 16, 16))
    a = AttentionWeights(q.clone(), k.clone(), v.clone(), torch.randn(32, 64, generator=g), qb.clone(), kb.clone(),
                         vb.clone())
    fuse_qkv(a)
    assert a.qkv is not None and a.qkv.shape == (96, 32) and a.qkv_bias is not None
    assert torch.equal(a.q, q) and torch.equal(a.k, k) and torch.equal(a.v, v) and torch.equal(a.v_bias, vb)
    assert a.q.untyped_storage().data_ptr() == a.qkv.untyped_storage().data_ptr()  # views, no copy
    x = torch.randn(3, 32, generator=g)
    qkv = F.linear(x, a.qkv, a.qkv_bias)
    torch.testing.assert_close(qkv[:, 64:80], F.linear(x, k, kb))
    with pytest.raises(ValueError, match="bias"):
        fuse_qkv(AttentionWeights(q, k, v, q, qb, None, None))
    with pytest.raises(ValueError, match="one dtype"):
        fuse_qkv(AttentionWeights(q, k.double(), v, q))
    # replacing a projection after fusing: the next fuse_qkv takes the new one (the fused weight is not stale)
    new_k = torch.randn(16, 32, generator=g)
    a.k = new_k.clone()
    fuse_qkv(a)
    assert torch.equal(a.qkv[64:80], new_k) and torch.equal(a.q, q)
    assert a.k.untyped_storage().data_ptr() == a.qkv.untyped_storage().data_ptr()


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: ``linear``'s dispatch sees a CUDA call, ``F.linear`` still runs."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_linear_leaves_malformed_weights_to_f_linear() -> None:
    """A 1-D weight and a K mismatch go to ``F.linear`` (its result, or its own error), not to the GEMV's checks
    (a 1-D weight once crashed in ``max_tokens``)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, generator=g).to(torch.bfloat16).as_subclass(_FakeCuda)
    w1 = torch.randn(8, generator=g).to(torch.bfloat16)
    assert x.is_cuda and torch.equal(linear(x, w1).as_subclass(torch.Tensor), F.linear(x, w1).as_subclass(torch.Tensor))
    with pytest.raises(RuntimeError):  # F.linear's own shape error, not gemv's ValueError
        linear(x, torch.randn(3, 9, generator=g).to(torch.bfloat16))
