"""Dense b-bit expert weights from an AP artifact: the reference path of the runtime on CPU and the
uniform-precision baselines (SPEC section 2, reference dequantization of ``pwformat.ap``)."""

from __future__ import annotations

import copy

import torch

from pwformat.ap import dequantize
from pwformat.errors import PagedWeightError
from pwrun.ap.artifact import APArtifact
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel


def dense_block(artifact: APArtifact, tensors: dict[str, torch.Tensor], block: LinearBlock, bits: int,
                dtype: torch.dtype) -> torch.Tensor:
    """One block's weight [n, k] at ``bits`` in ``dtype`` from its layer's ``tensors`` (``layer_tensors``).

    Raises ``PagedWeightError`` for a bitwidth the artifact does not hold.
    """
    if bits not in artifact.bits:
        raise PagedWeightError(f"bitwidth {bits} is not in this artifact's {artifact.bits}")
    k = artifact.key(block)
    return dequantize(tensors[f"{k}.planes"], tensors[f"{k}.lut{bits}"], block.k, bits, dtype)


def dense_model(artifact: APArtifact, model: LeanMoEModel,
                bits: int | dict[tuple[int, int, str], int]) -> LeanMoEModel:
    """A copy of ``model`` whose expert weights are ``artifact``'s weights dequantized to ``model.dtype``.

    ``bits``: one bitwidth for every block, or a map (layer, expert, unit) -> bitwidth.
    Raises ``PagedWeightError`` for a bitwidth the artifact does not hold.
    """
    out = LeanMoEModel(model.spec, copy.copy(model.weights))
    out.weights.layers = [copy.copy(layer) for layer in model.weights.layers]
    blocks = expert_blocks(model.spec)
    for layer in sorted({b.layer for b in blocks}):
        lw = out.weights.layers[layer]
        assert lw.moe is not None
        moe = copy.copy(lw.moe)
        moe.gate_up, moe.down = moe.gate_up.clone(), moe.down.clone()
        if moe.shared is not None:
            moe.shared = copy.copy(moe.shared)
        lw.moe = moe
        t = artifact.layer_tensors(layer, model.device)
        for b in (x for x in blocks if x.layer == layer):
            q = bits if isinstance(bits, int) else bits[(b.layer, b.expert, b.unit)]
            w = dense_block(artifact, t, b, q, model.dtype)
            if b.expert == SHARED_EXPERT:
                assert moe.shared is not None
                setattr(moe.shared, b.unit, w)
            else:
                getattr(moe, b.unit)[b.expert] = w
    return out
