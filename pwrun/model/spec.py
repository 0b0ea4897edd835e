"""The canonical description of an MoE model, consumed by every other module.

What it does: frozen dataclasses that describe a decoder-only MoE transformer in one
family-independent vocabulary: attention (GQA, optional qkv bias, optional qk-norm), and per
layer either a routed MoE block (router, experts as ``gate_up`` [2I, H] / ``down`` [H, I],
optional always-active shared expert with an optional sigmoid gate) or a dense MLP.
Family-specific parsing lives in ``families.py``; nothing else needs to know the family.
It does not hold tensors and imports no torch (control plane).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

QKNorm = Literal["none", "per_head", "full"]


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention of one layer.

    ``qk_norm``: ``"per_head"`` = RMSNorm over head_dim (Qwen3-MoE), ``"full"`` = RMSNorm over
    the whole projected q / k vectors (OLMoE), ``"none"`` otherwise.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    qk_norm: QKNorm
    clip_qkv: float | None
    rope_theta: float

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError("attention sizes must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")


@dataclass(frozen=True)
class MoESpec:
    """A routed MoE block: softmax router over ``num_experts``, top-k, SwiGLU experts.

    ``norm_topk_prob``: renormalise the top-k routing weights to sum to 1 (Mixtral always does).
    ``shared_intermediate``: width of the always-active shared expert, 0 if none.
    ``shared_gate``: the shared expert's output is scaled by ``sigmoid(x @ w_gate)`` (Qwen2-MoE).
    """

    num_experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool
    shared_intermediate: int = 0
    shared_gate: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.expert_intermediate <= 0:
            raise ValueError("expert_intermediate must be positive")
        if self.shared_gate and not self.shared_intermediate:
            raise ValueError("shared_gate needs a shared expert")


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: attention then either ``moe`` or a dense MLP of ``dense_intermediate``."""

    index: int
    attention: AttentionSpec
    moe: MoESpec | None
    dense_intermediate: int = 0

    def __post_init__(self) -> None:
        if (self.moe is None) == (self.dense_intermediate == 0):
            raise ValueError(f"layer {self.index} must have exactly one of an MoE block or a dense MLP")


@dataclass(frozen=True)
class ModelSpec:
    """A whole model. ``family`` is kept for messages and manifests only."""

    family: str
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...]
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one layer")
        if any(layer.index != i for i, layer in enumerate(self.layers)):
            raise ValueError("layer indices must be 0..L-1 in order")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.moe is not None)
