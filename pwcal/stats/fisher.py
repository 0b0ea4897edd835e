"""Fisher diagonal of every expert linear block: squared gradients of the calibration loss, one per window.

What it does: runs each calibration window through the lean model with autograd on
(``LeanMoEModel.forward_with_grad``: reference ops), takes the gradient of the window's summed next-token NLL
with respect to the expert weights only, and accumulates its square: ``F_i = sum_w (dL_w / dW_i)^2`` [N, K] per
linear block i = (layer, expert, unit). This is the "Fisher diagonal" importance of SPEC Eq. 2 (SqueezeLLM's
sensitivity, one gradient per sequence). Unlike the input Hessian diagonal it also measures how much an error in
this layer moves the loss downstream, which differs by layer: on the bundled tiny MoE the measured end-to-end KL of
one block's quantization per unit of Hessian sensitivity falls ~20x from layer 0 to layer 3 (medians), and the Fisher
ranks (block, bitwidth) pairs by that KL with Spearman 0.94 at 3 bits against the Hessian's 0.52
(``docs/eval/oracle/``). It does not quantize or compute s_i^b (``pwcal.sensitivity`` does).

Cost: one forward and backward pass per window (batch 1: per-window gradients), and float32 accumulators of the
experts' weight shape plus one gradient on the model's device (``fisher_bytes``: 8 bytes per expert weight, since
``pwcal sensitivity`` loads the model in float32). For Qwen1.5-MoE-A2.7B's 13.3B expert weights that is ~107 GB
beside the 53 GB of float32 experts, more than one H200 holds: more than the free memory is refused up front, and
such models need ``--importance hessian`` (a Fisher pass by layer groups is not built).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pwformat.errors import PagedWeightError
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock
from pwrun.model.lean import LeanMoEModel
from pwrun.runner.prefill import prefill_logits

Key = tuple[int, int, str]


def _expert_tensors(model: LeanMoEModel) -> dict[tuple[int, str, bool], torch.Tensor]:
    """(layer, unit, shared) -> the stacked [E, N, K] routed-expert weight, or the shared expert's [N, K]."""
    out = {}
    for i, lw in enumerate(model.weights.layers):
        if lw.moe is None:
            continue
        out[(i, "gate_up", False)], out[(i, "down", False)] = lw.moe.gate_up, lw.moe.down
        if lw.moe.shared is not None:
            out[(i, "gate_up", True)], out[(i, "down", True)] = lw.moe.shared.gate_up, lw.moe.shared.down
    return out


def fisher_bytes(tensors: dict[tuple[int, str, bool], torch.Tensor]) -> int:
    """Device bytes the Fisher pass adds for these expert weights: float32 accumulators plus one gradient in the
    weights' dtype (activations not counted)."""
    return sum(t.numel() * (4 + t.element_size()) for t in tensors.values())


def check_memory(need: int, dev: torch.device) -> None:
    """Raise ``PagedWeightError`` if ``need`` bytes exceed 90% of the free memory of CUDA device ``dev`` (other
    devices are not checked)."""
    if dev.type != "cuda":
        return
    free = torch.cuda.mem_get_info(dev)[0]
    if need > 0.9 * free:
        raise PagedWeightError(f"the Fisher importance needs {need / 2**30:.1f} GiB on {dev} (float32 accumulators "
                               f"and gradients of every expert weight), {free / 2**30:.1f} GiB are free: use "
                               "--importance hessian")


def fisher_diagonal(model: LeanMoEModel, windows: list[list[int]], blocks: list[LinearBlock],
                    progress: Callable[[str, int, int], None] | None = None, label: str = "fisher"
                    ) -> dict[Key, torch.Tensor]:
    """F_i [N, K] float32 (on the model's device) per block of ``blocks``, summed over ``windows`` (token ids,
    all of one length >= 2). ``progress(label, windows_done, windows_total)`` after each window.

    The model's expert weights require grad only while this runs. Raises ``ValueError`` for an empty window list
    or windows of unequal or < 2 length, ``PagedWeightError`` if on CUDA ``fisher_bytes`` exceeds 90% of the free
    memory.
    """
    if not windows or len({len(w) for w in windows}) != 1 or len(windows[0]) < 2:
        raise ValueError("fisher_diagonal needs windows of one length >= 2")
    tensors = _expert_tensors(model)
    check_memory(fisher_bytes(tensors), next(iter(tensors.values())).device)
    keys = list(tensors)
    acc = {k: torch.zeros(t.shape, dtype=torch.float32, device=t.device) for k, t in tensors.items()}
    try:
        for t in tensors.values():
            t.requires_grad_(True)
        if progress is not None:  # the task starts with the work: its rate and ETA count from here
            progress(label, 0, len(windows))
        for n, w in enumerate(windows, 1):
            # a fresh KV cache per window: the keys/values written into it are nodes of this window's graph
            logits = prefill_logits(model, [w], 16, with_grad=True)
            target = torch.tensor(w[1:], dtype=torch.int64, device=logits.device)
            loss = F.cross_entropy(logits[:-1], target, reduction="sum")
            grads = torch.autograd.grad(loss, [tensors[k] for k in keys])
            for k, g in zip(keys, grads, strict=True):
                acc[k] += g.float().square()
            if progress is not None:
                progress(label, n, len(windows))
    finally:
        for t in tensors.values():
            t.requires_grad_(False)
    out = {}
    for b in blocks:
        if b.expert == SHARED_EXPERT:
            out[(b.layer, b.expert, b.unit)] = acc[(b.layer, b.unit, True)]
        else:
            out[(b.layer, b.expert, b.unit)] = acc[(b.layer, b.unit, False)][b.expert]
    return out
