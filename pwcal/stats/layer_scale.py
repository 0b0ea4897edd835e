"""How much one MoE layer's quantization moves the model's output: the per-layer scale of the Hessian sensitivity.

What it does: ``layer_kl`` measures, for every MoE layer l, the mean per-token KL(p_16 || p_l) of the next-token
distribution when only layer l's experts are at ``bits`` (``pwrun.ap.dense.quantized_layer``), over calibration
windows: one 16-bit forward and one forward per MoE layer for each batch of windows, holding one batch's logits.
``layer_scales`` turns it into c_l = KL_l / sum_{i in l} s_i^{bits}, the factor that puts layer l's Hessian
sensitivities (SPEC Eq. 2) in nats of output KL.

Why: the input Hessian of a block only sees the error at the block's own output. How far that error travels
differs by layer: on the bundled tiny MoE the measured output KL per unit of Hessian sensitivity falls ~15x from the
first MoE layer to the last (``docs/eval/oracle/``), so an unscaled Hessian over-protects late layers and
under-protects early ones. One scale per layer keeps the Hessian's ranking inside a layer and fixes the ranking
across layers, at (L + 1) forward passes over a few windows (no backward pass, no gradient memory: it scales to
models whose Fisher does not fit).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pwformat.errors import PagedWeightError
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import quantized_layer
from pwrun.model.lean import LeanMoEModel
from pwrun.runner.prefill import prefill_logits


def _logprobs(model: LeanMoEModel, windows: list[list[int]]) -> torch.Tensor:
    """[tokens, V] float32 next-token log-probabilities of ``windows`` (each window's last position dropped)."""
    seq = len(windows[0])
    logits = prefill_logits(model, windows).view(len(windows), seq, -1)[:, :-1]
    return F.log_softmax(logits.float(), -1).flatten(0, 1)


@torch.no_grad()
def layer_kl(model: LeanMoEModel, art: APArtifact, windows: list[list[int]], bits: int, batch: int = 4,
             progress: Callable[[str, int, int], None] | None = None, label: str = "layer-scale") -> dict[int, float]:
    """Mean per-token KL(p_16 || p_l) (nats) per MoE layer l, with only layer l's experts at ``bits``.

    ``windows``: token ids, all of one length >= 2. ``progress(label, windows_done, windows_total)`` after each
    batch. Raises ``ValueError`` for an empty window list or windows of unequal or < 2 length.
    """
    if not windows or len({len(w) for w in windows}) != 1 or len(windows[0]) < 2:
        raise ValueError("layer_kl needs windows of one length >= 2")
    layers = list(model.spec.moe_layers)
    total = dict.fromkeys(layers, 0.0)
    tokens = 0
    if progress is not None:  # the task starts with the work: its rate and ETA count from here
        progress(label, 0, len(windows))
    for lo in range(0, len(windows), batch):
        part = windows[lo: lo + batch]
        ref = _logprobs(model, part)
        p = ref.exp()
        for layer in layers:
            with quantized_layer(art, model, layer, bits):
                lp = _logprobs(model, part)
            total[layer] += float((p * (ref - lp)).sum())
        tokens += ref.shape[0]
        if progress is not None:
            progress(label, lo + len(part), len(windows))
    return {layer: max(v / tokens, 0.0) for layer, v in total.items()}


def layer_scales(kl: dict[int, float], sens_sum: dict[int, float]) -> dict[int, float]:
    """c_l = KL_l / S_l per MoE layer (``sens_sum[l]``: the layer's summed sensitivity at the measured bitwidth).

    A layer whose KL or S is not positive (a quantization that changes nothing measurable) takes the geometric
    mean scale of the others, so that no layer's sensitivities become zero. Raises ``PagedWeightError`` if no layer
    has a positive KL and S (the measurement says nothing: use ``--no-layer-scale``).
    """
    ok = {la: kl[la] / sens_sum[la] for la in kl if kl[la] > 0 and sens_sum.get(la, 0.0) > 0}
    if not ok:
        raise PagedWeightError("the per-layer scale measured no output change for any layer (all KL 0): use more "
                               "--samples, or --no-layer-scale")
    mean = math.exp(sum(math.log(v) for v in ok.values()) / len(ok))
    return {la: ok.get(la, mean) for la in kl}
