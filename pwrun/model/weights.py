"""Tensors of a loaded model, in the canonical layout of ``spec.py``.

What it does: typed containers for the weights the lean model reads. Expert linears are
stacked per layer: ``gate_up`` [E, 2I, H] (gate rows first, then up) and ``down`` [E, H, I],
so that a later stage can swap them for Any-Precision bit-planes block by block (SPEC
section 3: a linear block is (layer, expert, unit)). It does not load or compute anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pwrun.model.inventory import SHARED_EXPERT, LinearBlock


@dataclass
class AttentionWeights:
    """q [Hq*D, H], k/v [Hkv*D, H], o [H, Hq*D]; biases [out] or None; q_norm/k_norm [D] or [Hq*D]/[Hkv*D].

    ``v`` is None where the values are the key projection (``AttentionSpec.k_eq_v``).
    ``qkv`` [(Hq + 2 Hkv) * D, H] (and ``qkv_bias``): q, k and v in one tensor, of which ``q``/``k``/``v`` are
    then views (``fuse_qkv``); None until fused."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qkv: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that hold bytes, each once: q/k/v (views of ``qkv`` when fused) and the rest, not ``qkv``."""
        return [t for k, t in vars(self).items() if t is not None and k not in ("qkv", "qkv_bias")]


@dataclass
class MLPWeights:
    """One SwiGLU MLP: gate_up [2I, H] (gate rows first), down [H, I]."""

    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class MoEWeights:
    """router [E, H]; gate_up [E, 2I, H]; down [E, H, I]; shared expert and its gate [1, H] optional;
    ``router_scale`` [H] and ``expert_scale`` [E] of the Gemma-4 router (``MoESpec.router``)."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    shared: MLPWeights | None = None
    shared_gate: torch.Tensor | None = None
    router_scale: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None


@dataclass
class SandwichNorms:
    """The extra norms [H] of a sandwich layer (``ModelSpec.sandwich``): after attention, after the summed
    feed-forward, after the dense MLP (``mlp_post``), before and after the MoE block; ``scalar`` [1] multiplies
    the layer's output."""

    post_attn: torch.Tensor
    post_ffn: torch.Tensor
    mlp_post: torch.Tensor
    moe_pre: torch.Tensor
    moe_post: torch.Tensor
    scalar: torch.Tensor


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attn: AttentionWeights
    moe: MoEWeights | None = None
    mlp: MLPWeights | None = None
    sandwich: SandwichNorms | None = None


@dataclass
class ModelWeights:
    """embed [V, H]; lm_head [V, H] (the same tensor when tied); final_norm [H]."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    source_digest: str = ""  # xxh3-128 of the checkpoint bytes read (``TensorReader.digest``); "" if not read

    def num_bytes(self) -> int:
        """Bytes of all distinct tensors (a tied lm_head counts once)."""
        seen: dict[int, int] = {}

        def add(t: torch.Tensor | None) -> None:
            if t is not None:
                seen[t.data_ptr()] = t.numel() * t.element_size()

        for t in (self.embed, self.lm_head, self.final_norm):
            add(t)
        for layer in self.layers:
            for t in layer.attn.tensors():
                add(t)
            add(layer.attn_norm)
            add(layer.ffn_norm)
            for block in (layer.moe, layer.mlp, layer.sandwich):
                if block is None:
                    continue
                for t in vars(block).values():
                    if isinstance(t, MLPWeights):
                        add(t.gate_up)
                        add(t.down)
                    else:
                        add(t)
        return sum(seen.values())


def dense_weight(model: Any, block: LinearBlock) -> torch.Tensor:
    """The 16-bit weight [N, K] of expert linear ``block`` of a ``LeanMoEModel`` (shared expert: id -1).

    Raises ``ValueError`` if the block's layer has no MoE block (or no shared expert).
    """
    m = model.weights.layers[block.layer].moe
    if m is None:
        raise ValueError(f"layer {block.layer} has no MoE block")
    if getattr(model, "experts", None) is not None:  # streamed from the checkpoint (``pwrun.model.streamed``)
        m = model.experts.moe(block.layer, m)
    if block.expert == SHARED_EXPERT:
        if m.shared is None:
            raise ValueError(f"layer {block.layer} has no shared expert")
        return getattr(m.shared, block.unit)
    return getattr(m, block.unit)[block.expert]


def fuse_qkv(attn: AttentionWeights) -> None:
    """Concatenate q, k, v (and their biases, if any) into ``attn.qkv`` [(Hq + 2 Hkv) * D, H] and make the three
    views of it, so that a step projects with one GEMM instead of three (no extra memory once the old tensors
    are dropped). Idempotent while q, k, v are still its views; if one was replaced since, fuses again. Raises
    ``ValueError`` if only some of the three have a bias, or they differ in dtype, device or input size."""
    if attn.v is None:  # keys are the values: nothing to fuse
        return
    parts = (attn.q, attn.k, attn.v)
    if attn.qkv is not None and all(t.untyped_storage().data_ptr() == attn.qkv.untyped_storage().data_ptr()
                                    for t in parts):
        return
    biases = (attn.q_bias, attn.k_bias, attn.v_bias)
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("q, k and v must all have a bias or none")
    if len({(t.dtype, t.device, t.shape[1:]) for t in parts}) != 1:
        raise ValueError("q, k and v must share one dtype, device and input size to be fused: "
                         f"{[(t.dtype, str(t.device), tuple(t.shape)) for t in parts]}")
    sizes = [attn.q.shape[0], attn.k.shape[0], attn.v.shape[0]]
    attn.qkv = torch.cat([attn.q, attn.k, attn.v])
    attn.q, attn.k, attn.v = attn.qkv.split(sizes)
    if attn.q_bias is not None:
        attn.qkv_bias = torch.cat(biases)  # type: ignore[arg-type]
        attn.q_bias, attn.k_bias, attn.v_bias = attn.qkv_bias.split(sizes)
