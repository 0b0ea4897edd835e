"""The 16-bit MoE on cuBLAS' grouped GEMM (``torch._grouped_mm``), for prompt-sized token counts; twin of
``pwkernels.moe.ref.dense_moe_ref``.

What it computes: the ``pwkernels.moe.dense`` result, from the experts' stacked views of the pool
(``DenseExperts.stacked``): the (token, slot) pairs sorted by expert, one grouped GEMM for every expert's gate_up
rows, the gate activation, one for down, the routing weights applied in fp32 and the k pairs of a token summed
once. Group ends come from ``searchsorted`` (no ``bincount``, which syncs), so a CUDA graph can hold it. On an H200
it took 0.3-0.8x the time of the best Triton grouped-GEMM tile from 8 tokens up on the Qwen1.5-MoE, Mixtral and
Gemma-4 expert shapes (``bench.dense_moe``).
"""

from __future__ import annotations

import torch

from pwkernels.moe.activation import gate_act_ref


def grouped_mm_runs_without_sync(dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None) -> bool:
    """Whether ``torch._grouped_mm`` takes its one-launch path: on CUDA only bf16 on sm90 / sm100 does; any
    other dtype or GPU falls back to a loop over groups that reads the group ends on the host (slow, and a CUDA
    graph cannot hold it). On the CPU it is a reference loop, used by the tests."""
    if device_type == "cpu":
        return True
    return device_type == "cuda" and dtype == torch.bfloat16 and capability is not None and capability[0] in (9, 10)


def grouped_mm_fits(x: torch.Tensor) -> bool:
    """``grouped_mm_runs_without_sync`` for ``x``'s dtype and device (asked once, when the pool's views are made)."""
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    return grouped_mm_runs_without_sync(x.dtype, x.device.type, cap)


def grouped_mm_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """MoE output y [T, H] in x's dtype from x [T, H], topk_ids / topk_w [T, k], gate_up [E, 2I, H] and down
    [E, H, I] (views of the pool, x's dtype; inputs as ``pwkernels.moe.dense.check_dense_inputs`` checks them)."""
    t, k = topk_ids.shape
    num_experts = gate_up.shape[0]
    flat = topk_ids.reshape(-1).to(torch.int64)
    sorted_ids, order = torch.sort(flat, stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(1, num_experts + 1, device=x.device)).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends)
    g, u = h.float().chunk(2, -1)
    inter = (gate_act_ref(g, activation) * u).to(x.dtype)
    y = torch._grouped_mm(inter, down.transpose(1, 2), offs=ends)
    pairs = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    pairs[order] = y.float() * topk_w.reshape(-1).float()[order, None]
    return pairs.view(t, k, -1).sum(1).to(x.dtype)
