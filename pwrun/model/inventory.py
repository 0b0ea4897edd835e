"""Inventory of a model's linear blocks and parameter counts (control plane, no torch).

What it does: lists every expert linear block i = (layer, expert, unit) of SPEC section 3
(routed experts' ``gate_up`` [2I, H] and ``down`` [H, I]; the shared expert as expert id -1,
an always-active block) with its shape, and counts parameters by kind from a ``ModelSpec``.
It does not know about bitwidths (the AP format stage adds M_i^b).
"""

from __future__ import annotations

from dataclasses import dataclass

from pwformat.cost import HostMemory, MoELayerShape, artifact_bytes
from pwformat.kv_layout import KVLayout
from pwrun.model.spec import ModelSpec

SHARED_EXPERT = -1


@dataclass(frozen=True)
class LinearBlock:
    """One expert linear: rows ``n`` (out features) x cols ``k`` (in features)."""

    layer: int
    expert: int  # SHARED_EXPERT for the shared expert
    unit: str  # "gate_up" or "down"
    n: int
    k: int


def expert_blocks(spec: ModelSpec) -> list[LinearBlock]:
    """Every expert linear block of the model, in (layer, expert, unit) order; shared expert first."""
    out = []
    h = spec.hidden_size
    for layer in spec.layers:
        m = layer.moe
        if m is None:
            continue
        if m.shared_intermediate:
            out.append(LinearBlock(layer.index, SHARED_EXPERT, "gate_up", 2 * m.shared_intermediate, h))
            out.append(LinearBlock(layer.index, SHARED_EXPERT, "down", h, m.shared_intermediate))
        for e in range(m.num_experts):
            out.append(LinearBlock(layer.index, e, "gate_up", 2 * m.expert_intermediate, h))
            out.append(LinearBlock(layer.index, e, "down", h, m.expert_intermediate))
    return out


def kv_layout(spec: ModelSpec) -> KVLayout:
    """How a KV block of ``spec`` splits into pool pages (per layer: Hkv * head_dim, sliding window)."""
    return KVLayout.of([(ls.attention.num_kv_heads, ls.attention.head_dim, ls.attention.window)
                        for ls in spec.layers])


def moe_layer_shapes(spec: ModelSpec) -> list[MoELayerShape]:
    """The expert shapes of every MoE layer, as the cost model (``pwformat.cost``) takes them."""
    return [MoELayerShape(spec.hidden_size, ls.moe.expert_intermediate, ls.moe.num_experts, ls.moe.top_k,
                          ls.moe.shared_intermediate) for ls in spec.layers if ls.moe is not None]


def parameter_counts(spec: ModelSpec) -> dict[str, int]:
    """Parameters by kind: routed_experts, shared_experts, dense_mlp, attention, embeddings, other."""
    h, v = spec.hidden_size, spec.vocab_size
    c = {"routed_experts": 0, "shared_experts": 0, "dense_mlp": 0, "attention": 0, "embeddings": 0, "other": 0}
    c["embeddings"] = v * h * (1 if spec.tie_word_embeddings else 2)
    c["other"] = h
    for layer in spec.layers:
        a = layer.attention
        qd, kd = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        kv = 1 if a.k_eq_v else 2
        c["attention"] += h * (qd + kv * kd) + qd * h + (qd + kv * kd if a.qkv_bias else 0)
        c["attention"] += {"none": 0, "per_head": 2 * a.head_dim, "full": qd + kd}[a.qk_norm]
        c["other"] += (7 * h + 1) if spec.sandwich else 2 * h  # the norms (and a sandwich layer's scalar)
        if layer.moe is not None:
            m = layer.moe
            c["routed_experts"] += m.num_experts * 3 * h * m.expert_intermediate
            c["shared_experts"] += 3 * h * m.shared_intermediate + (h if m.shared_gate else 0)
            c["other"] += m.num_experts * h + ((h + m.num_experts) if m.router == "gemma4" else 0)
        c["dense_mlp"] += 3 * h * layer.dense_intermediate
    return c


def host_memory(spec: ModelSpec, bits: list[int], compute_bytes: int, file_bytes: int = 2) -> HostMemory:
    """The ``pwformat.cost.HostMemory`` of ``spec`` for an artifact of ``bits`` (LUTs held in 16 bits), weights
    computed in ``compute_bytes`` per parameter (4 for calibration, the serving dtype's size) and stored in
    ``file_bytes`` per parameter in the checkpoint."""
    counts = parameter_counts(spec)
    experts = sum(b.n * b.k for b in expert_blocks(spec))
    non_expert = sum(counts.values()) - experts
    per_layer = [sum(b.n * b.k for b in expert_blocks(spec) if b.layer == la.index) for la in spec.layers]
    largest = max(per_layer, default=0)
    return HostMemory(artifact=artifact_bytes([(b.n, b.k) for b in expert_blocks(spec)], bits),
                      non_expert=non_expert * compute_bytes, layer_experts=largest * compute_bytes,
                      layer_file=largest * file_bytes, experts=experts * compute_bytes)
