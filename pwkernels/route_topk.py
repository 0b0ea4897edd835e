"""MoE routing in one launch (Triton): softmax top-k, shared-expert gate, live routing statistics.

What it computes, per token t, from the router logits [T, E] (x's dtype; a column E may hold the
shared expert's gate logit, when ``has_gate``), the softmax over the E experts in fp32, the top-k
experts (ties: lowest id), optionally renormalised to sum 1, optionally times a per-expert scale (Gemma-4's
``per_expert_scale``, in fp32 before the one rounding); weights are rounded to x's dtype
(as ``pwrun.model.moe.route`` returns them) and handed out as fp32 [T, k] with ids int64 [T, k];
the shared expert's weight is ``sigmoid(gate logit)`` (fp32 [T]) or 1.
With ``stats`` it also adds the live routing statistics of SPEC section 6 for this layer
(what ``pwrun.runner.experts.store.ExpertStore`` reads every few steps): ``mass[e] += w`` and
``acc[e] += (w, w*n, w*n^2)``, ``acc[e, 3] = max(acc[e, 3], n)`` for n = ||x_t||_2 (fp32), and for
the shared expert (column E) weight 1 per token. Atomic adds: the sums are not bit-deterministic. The atomics
are relaxed: fire-and-forget REDG on sm_90 (nothing in this launch reads them back). Triton's default
acq_rel put a MEMBAR.ALL.GPU, an L1 invalidation and a returning ATOMG around each of the 12; the launch
with statistics took 7.6 us against 1.6 us without, at one token on the H200.
Eagerly this is ~25 launches per layer (softmax, topk, renorm, casts, index_add in float64...).
What it does not do: the router matmul (cuBLAS does it), or grouped / biased routers
(families with those keep the eager ``route``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pwkernels.rounding import round_to


def accumulate_routing_stats(mass: torch.Tensor, acc: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                             w: torch.Tensor, shared_col: int, has_shared: bool) -> None:
    """Add one step's live routing statistics (SPEC section 6) in place, in ``mass``'s dtype.

    mass [E+1], acc [E+1, 4] (sum w, sum w*n, sum w*n^2, max n), n = ||x_t||_2 for x [T, H]; ids / w [T, k] the
    routed experts and weights; the shared expert (column ``shared_col``, weight 1 per token) only if
    ``has_shared``. The eager twin of the routing kernel's statistics and the runtime's CPU path.
    """
    dt = mass.dtype
    n = x.to(dt).norm(dim=-1)
    e, r, nn = ids.flatten(), w.to(dt).flatten(), n.repeat_interleave(ids.shape[1])
    mass.index_add_(0, e, r)
    acc[:, 0].index_add_(0, e, r)
    acc[:, 1].index_add_(0, e, r * nn)
    acc[:, 2].index_add_(0, e, r * nn * nn)
    acc[:, 3].scatter_reduce_(0, e, nn, reduce="amax")
    if has_shared and x.shape[0]:
        mass[shared_col] += x.shape[0]
        acc[shared_col, 0] += x.shape[0]
        acc[shared_col, 1] += n.sum()
        acc[shared_col, 2] += (n * n).sum()
        acc[shared_col, 3] = torch.maximum(acc[shared_col, 3], n.max())


def route_topk_ref(logits: torch.Tensor, x: torch.Tensor, num_experts: int, top_k: int, renorm: bool,
                   has_gate: bool, stats: tuple[torch.Tensor, torch.Tensor] | None = None, has_shared: bool = True,
                   scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: (weights [T, k] fp32, ids [T, k] int64, shared weight [T] fp32); see module docstring.

    logits [T, >= E(+1)] in x's dtype; x [T, H]; stats = (mass [E+1] fp32, acc [E+1, 4] fp32), updated in place
    (column E, the shared expert, only if ``has_shared``) with the scaled weights; ``scale`` [E] multiplies each
    (renormalised) weight before it is rounded.
    """
    probs = torch.softmax(logits[:, :num_experts].float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    if scale is not None:
        w = w * scale.float()[ids]
    w = w.to(x.dtype).float()
    t = logits.shape[0]
    shared = torch.sigmoid(logits[:, num_experts].float()) if has_gate else torch.ones(t, device=x.device)
    if stats is not None:
        accumulate_routing_stats(stats[0], stats[1], x, ids, w, num_experts, has_shared)
    return w, ids, shared


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, >= E(+1)] router logits (x's dtype), rows stride_lm apart
    x_ptr,  # [T, H] the MoE input (for the norm statistic), rows stride_xm apart
    w_ptr,  # [T, TOPK] out: fp32 weights (rounded to x's dtype)
    ids_ptr,  # [T, TOPK] out: int64 expert ids
    shared_ptr,  # [T] out: fp32 shared-expert weight
    mass_ptr,  # [E+1] fp32 routing-mass accumulator of this layer (when STATS)
    acc_ptr,  # [E+1, 4] fp32 (sum w, sum w*n, sum w*n^2, max n) accumulator (when STATS)
    scale_ptr,  # [E] per-expert scale of the weights (when SCALE)
    E,  # routed experts
    H,  # hidden size
    stride_lm,  # elements between rows of logits
    stride_xm,  # elements between rows of x
    TOPK: tl.constexpr,  # experts per token
    RENORM: tl.constexpr,  # renormalise the top-k weights to sum to 1
    HAS_GATE: tl.constexpr,  # logits column E is the shared expert's gate
    STATS: tl.constexpr,  # accumulate routing statistics
    HAS_SHARED: tl.constexpr,  # the family has a shared expert: add its statistics in column E
    SCALE: tl.constexpr,  # multiply each weight by scale[id] before rounding
    K_PAD: tl.constexpr,  # next power of 2 >= TOPK
    BLOCK_E: tl.constexpr,  # next power of 2 >= E
    BLOCK_H: tl.constexpr,  # H chunk for the norm
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    lg = tl.load(logits_ptr + t * stride_lm + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(lg - tl.max(lg, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < E, p, -1.0)
    kk = tl.arange(0, K_PAD)
    km = kk < TOPK
    top_w = tl.zeros((K_PAD,), dtype=tl.float32)
    top_i = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(TOPK):
        m = tl.max(p, axis=0)
        i = tl.min(tl.where(p == m, e, BLOCK_E), axis=0)
        top_w = tl.where(kk == j, m, top_w)
        top_i = tl.where(kk == j, i.to(tl.int64), top_i)
        p = tl.where(e == i, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    if SCALE:
        top_w = top_w * tl.load(scale_ptr + top_i, mask=km, other=0.0).to(tl.float32)
    top_w = round_to(top_w, x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(w_ptr + t * TOPK + kk, top_w, mask=km)
    tl.store(ids_ptr + t * TOPK + kk, top_i, mask=km)
    if HAS_GATE:
        g = tl.load(logits_ptr + t * stride_lm + E).to(tl.float32)
        tl.store(shared_ptr + t, 1.0 / (1.0 + tl.exp(-g)))
    else:
        tl.store(shared_ptr + t, 1.0)
    if STATS:
        sq = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            c = h0 + tl.arange(0, BLOCK_H)
            xv = tl.load(x_ptr + t * stride_xm + c, mask=c < H, other=0.0).to(tl.float32)
            sq += xv * xv
        n = tl.sqrt(tl.sum(sq, axis=0))
        tl.atomic_add(mass_ptr + top_i, top_w, mask=km, sem="relaxed")
        tl.atomic_add(acc_ptr + top_i * 4, top_w, mask=km, sem="relaxed")
        tl.atomic_add(acc_ptr + top_i * 4 + 1, top_w * n, mask=km, sem="relaxed")
        tl.atomic_add(acc_ptr + top_i * 4 + 2, top_w * n * n, mask=km, sem="relaxed")
        tl.atomic_max(acc_ptr + top_i * 4 + 3, top_w * 0 + n, mask=km, sem="relaxed")
        if HAS_SHARED:
            tl.atomic_add(mass_ptr + E, 1.0, sem="relaxed")
            tl.atomic_add(acc_ptr + E * 4, 1.0, sem="relaxed")
            tl.atomic_add(acc_ptr + E * 4 + 1, n, sem="relaxed")
            tl.atomic_add(acc_ptr + E * 4 + 2, n * n, sem="relaxed")
            tl.atomic_max(acc_ptr + E * 4 + 3, n, sem="relaxed")


def route_topk(logits: torch.Tensor, x: torch.Tensor, num_experts: int, top_k: int, renorm: bool,
               has_gate: bool, stats: tuple[torch.Tensor, torch.Tensor] | None = None, has_shared: bool = True,
               scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of ``route_topk_ref`` (same arguments and results; stats sums use atomics).

    Raises ``ValueError`` on bad shapes, dtypes or a top-k outside [1, E].
    """
    t = logits.shape[0]
    cols = num_experts + (1 if has_gate else 0)
    if logits.dim() != 2 or logits.shape[1] < cols or x.dim() != 2 or x.shape[0] != t:
        raise ValueError(f"logits must be [T, >= {cols}] and x [T, H]; got {tuple(logits.shape)}, {tuple(x.shape)}")
    if logits.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("rows of logits and x must be contiguous")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}]; got {top_k}")
    if scale is not None:
        if scale.shape != (num_experts,) or scale.device != logits.device:
            raise ValueError(f"scale must be a [{num_experts}] tensor on {logits.device}")
        scale = scale.contiguous()
    if stats is not None:
        mass, acc = stats
        if mass.shape != (num_experts + 1,) or acc.shape != (num_experts + 1, 4) or not acc.is_contiguous() \
                or mass.dtype != torch.float32 or acc.dtype != torch.float32:
            raise ValueError(f"stats must be (mass [{num_experts + 1}], acc [{num_experts + 1}, 4]) float32")
    dev = logits.device
    w = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    shared = torch.empty(t, dtype=torch.float32, device=dev)
    if t == 0:
        return w, ids, shared
    mass, acc = stats if stats is not None else (w, w)
    block_h = min(1024, triton.next_power_of_2(x.shape[1]))
    _route_kernel[(t,)](logits, x, w, ids, shared, mass, acc, w if scale is None else scale, num_experts,
                        x.shape[1], logits.stride(0), x.stride(0), TOPK=top_k, K_PAD=triton.next_power_of_2(top_k),
                        RENORM=renorm,
                        HAS_GATE=has_gate, STATS=stats is not None, HAS_SHARED=has_shared, SCALE=scale is not None,
                        BLOCK_E=triton.next_power_of_2(num_experts),
                        BLOCK_H=block_h, num_warps=1)
    return w, ids, shared
