"""Dense b-bit expert weights from an AP artifact: the reference path of the runtime on CPU and the
uniform-precision baselines (SPEC section 2, reference dequantization of ``pwformat.ap``)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from pwformat.ap import dequantize
from pwformat.errors import PagedWeightError
from pwrun.ap.artifact import APArtifact
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.weights import MoEWeights


def dense_block(artifact: APArtifact, tensors: dict[str, torch.Tensor], block: LinearBlock, bits: int,
                dtype: torch.dtype) -> torch.Tensor:
    """One block's weight [n, k] at ``bits`` in ``dtype`` from its layer's ``tensors`` (``layer_tensors``).

    Raises ``PagedWeightError`` for a bitwidth the artifact does not hold.
    """
    if bits not in artifact.bits:
        raise PagedWeightError(f"bitwidth {bits} is not in this artifact's {artifact.bits}")
    k = artifact.key(block)
    return dequantize(tensors[f"{k}.planes"], tensors[f"{k}.lut{bits}"], block.k, bits, dtype)


def dense_layer(artifact: APArtifact, model: LeanMoEModel, base: MoEWeights, layer: int,
                bits: int | dict[tuple[int, int, str], int]) -> MoEWeights:
    """A copy of MoE layer ``layer``'s weights ``base`` (router etc. shared) whose expert blocks are ``artifact``'s
    dequantized to ``model.dtype``: gate_up [E, 2I, H], down [E, H, I] and the shared expert, new tensors.

    ``bits``: one bitwidth for every block, or a map (layer, expert, unit) -> bitwidth. Raises
    ``PagedWeightError`` for a bitwidth the artifact does not hold.
    """
    moe = replace(base, gate_up=base.gate_up.clone(), down=base.down.clone(),
                  shared=None if base.shared is None else replace(base.shared))
    t = artifact.layer_tensors(layer, model.device)
    for b in (x for x in expert_blocks(model.spec) if x.layer == layer):
        q = bits if isinstance(bits, int) else bits[(b.layer, b.expert, b.unit)]
        w = dense_block(artifact, t, b, q, model.dtype)
        if b.expert == SHARED_EXPERT:
            assert moe.shared is not None
            setattr(moe.shared, b.unit, w)
        else:
            getattr(moe, b.unit)[b.expert] = w
    return moe


def dense_model(artifact: APArtifact, model: LeanMoEModel,
                bits: int | dict[tuple[int, int, str], int]) -> LeanMoEModel:
    """A copy of ``model`` whose expert weights are ``artifact``'s weights dequantized to ``model.dtype``.

    ``bits``: one bitwidth for every block, or a map (layer, expert, unit) -> bitwidth.
    Raises ``PagedWeightError`` for a bitwidth the artifact does not hold.
    """
    out = LeanMoEModel(model.spec, copy.copy(model.weights))
    out.weights.layers = [copy.copy(layer) for layer in model.weights.layers]
    for layer in sorted({b.layer for b in expert_blocks(model.spec)}):
        lw = out.weights.layers[layer]
        assert lw.moe is not None
        lw.moe = dense_layer(artifact, model, lw.moe, layer, bits)
    return out


class _OneLayerReplaced:
    """Streamed experts (``pwrun.model.streamed``) with MoE layer ``layer`` served from ``moe`` instead."""

    def __init__(self, inner: Any, layer: int, moe: MoEWeights) -> None:
        self.inner, self.layer, self.replaced = inner, layer, moe

    def moe(self, index: int, base: MoEWeights) -> MoEWeights:
        return self.replaced if index == self.layer else self.inner.moe(index, base)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextmanager
def quantized_layer(artifact: APArtifact, model: LeanMoEModel, layer: int, bits: int) -> Iterator[None]:
    """While inside, MoE layer ``layer`` of ``model`` runs with every expert block dequantized at ``bits`` from
    ``artifact`` (all other layers unchanged); the original weights come back on exit. Works on a loaded or a
    streamed model, and holds one extra layer of experts in ``model.dtype``. Raises ``PagedWeightError`` for a
    bitwidth the artifact does not hold, ``ValueError`` for a layer without experts."""
    lw = model.weights.layers[layer]
    if lw.moe is None:
        raise ValueError(f"layer {layer} has no MoE block")
    base = lw.moe if model.experts is None else model.experts.moe(layer, lw.moe)
    moe = dense_layer(artifact, model, base, layer, bits)
    if model.experts is None:
        lw.moe = moe
        try:
            yield
        finally:
            lw.moe = base
    else:
        streamed = model.experts
        model.experts = _OneLayerReplaced(streamed, layer, moe)  # type: ignore[assignment]
        try:
            yield
        finally:
            model.experts = streamed
