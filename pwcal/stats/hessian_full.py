"""Full input Hessians H = X^T X of expert linear blocks, for the error-feedback quantizer.

What it does: implements ``MoEObserver.expert_inputs`` like ``HessianDiag`` but keeps the whole [K, K] matrix of
each block i = (layer, expert, unit) over the calibration tokens routed to it (gate_up: the layer input; down:
silu(gate) * up; the shared expert: every token), optionally for some layers only, since all of a large model's
matrices do not fit at once (Qwen1.5-MoE-A2.7B: ~2.9 GB per layer in float64). ``layer_groups`` cuts the layers
into groups whose matrices fit a byte budget, one calibration pass per group. Sums are float64 on the observed
device. It does not quantize (``pwcal.quant.gptq``).
"""

from __future__ import annotations

import torch

from pwcal.stats.hessian import kmeans_weights
from pwformat.errors import PagedWeightError
from pwrun.model.inventory import LinearBlock


class HessianFull:
    """Per-block sums ``h[(layer, expert, unit)]`` [K, K] float64 and token counts ``tokens[(layer, expert)]``.

    ``layers``: the layers observed (None: all).
    """

    def __init__(self, layers: set[int] | None = None) -> None:
        self.layers = layers
        self.h: dict[tuple[int, int, str], torch.Tensor] = {}
        self.tokens: dict[tuple[int, int], int] = {}

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Not needed here (routing mass has its own observer)."""

    def expert_inputs(self, layer: int, expert: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        if self.layers is not None and layer not in self.layers:
            return
        for unit, inp in (("gate_up", x), ("down", h)):
            key = (layer, expert, unit)
            a = inp.double()
            g = a.T @ a
            if key in self.h:
                self.h[key] += g
            else:
                self.h[key] = g
        self.tokens[(layer, expert)] = self.tokens.get((layer, expert), 0) + x.shape[0]

    def matrix_for(self, block: LinearBlock, min_tokens: int) -> tuple[torch.Tensor | None, int]:
        """H [K, K] float64 of ``block`` and its token count; ``None`` when it saw fewer than ``min_tokens``."""
        n = self.tokens.get((block.layer, block.expert), 0)
        m = self.h.get((block.layer, block.expert, block.unit))
        if m is None or n < min_tokens:
            return None, n
        return m, n


    def weights_for(self, block: LinearBlock, min_tokens: int) -> tuple[torch.Tensor | None, int]:
        """k-means weights [K] float64 from the diagonal (as ``HessianDiag.weights_for``) and the token count."""
        m, n = self.matrix_for(block, min_tokens)
        return (None if m is None else kmeans_weights(m.diagonal())), n


def hessian_bytes(blocks: list[LinearBlock]) -> int:
    """Bytes of the float64 [K, K] matrices of ``blocks``."""
    return sum(8 * b.k * b.k for b in blocks)


def layer_groups(blocks: list[LinearBlock], max_bytes: int) -> list[list[int]]:
    """Consecutive layers in groups whose blocks' matrices take at most ``max_bytes`` each.

    Raises ``PagedWeightError`` if one layer alone needs more (the message gives the bytes it needs).
    """
    layers = sorted({b.layer for b in blocks})
    per_layer = {layer: hessian_bytes([b for b in blocks if b.layer == layer]) for layer in layers}
    groups: list[list[int]] = []
    used = 0
    for layer in layers:
        need = per_layer[layer]
        if need > max_bytes:
            raise PagedWeightError(f"layer {layer}'s full Hessians need {need / 2**30:.2f} GiB, more than "
                                   f"--hessian-memory {max_bytes / 2**30:.2f} GiB: raise it, or use --method kmeans "
                                   "(diagonal Hessians only)")
        if groups and used + need <= max_bytes:
            groups[-1].append(layer)
            used += need
        else:
            groups.append([layer])
            used = need
    return groups
