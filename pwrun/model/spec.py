"""The canonical description of an MoE model, consumed by every other module.

What it does: frozen dataclasses that describe a decoder-only MoE transformer in one
family-independent vocabulary: attention (GQA, optional qkv bias, optional qk-norm, optional sliding
window, partial RoPE, keys reused as values), and per layer a routed MoE block (router, experts as
``gate_up`` [2I, H] / ``down`` [H, I], optional always-active shared expert with an optional sigmoid
gate), a dense MLP, or both side by side (Gemma-4).
Family-specific parsing lives in ``families.py``; nothing else needs to know the family.
It does not hold tensors and imports no torch (control plane).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

QKNorm = Literal["none", "per_head", "full"]
Activation = Literal["silu", "gelu_tanh"]
Router = Literal["softmax", "gemma4"]


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention of one layer.

    ``qk_norm``: ``"per_head"`` = RMSNorm over head_dim (Qwen3-MoE, Gemma-4), ``"full"`` = RMSNorm over
    the whole projected q / k vectors (OLMoE), ``"none"`` otherwise.
    ``window``: sliding window in tokens (query p sees keys p - window + 1 .. p), None for global attention.
    ``rotary_dim``: leading dims rotated by RoPE with frequencies theta^(-2i/head_dim) (proportional partial
    RoPE; the rest pass through), None for all of head_dim. ``scale``: softmax scale, None for head_dim^-0.5.
    ``k_eq_v``: values are the key projection (no v_proj); ``v_norm``: RMSNorm without weight over each value
    head (Gemma-4).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    qk_norm: QKNorm
    clip_qkv: float | None
    rope_theta: float
    window: int | None = None
    rotary_dim: int | None = None
    scale: float | None = None
    k_eq_v: bool = False
    v_norm: bool = False

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError("attention sizes must be positive")
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window must be >= 1 token, got {self.window}")
        if self.rotary_dim is not None and not (0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale


@dataclass(frozen=True)
class MoESpec:
    """A routed MoE block: softmax router over ``num_experts``, top-k, gated experts.

    ``norm_topk_prob``: renormalise the top-k routing weights to sum to 1 (Mixtral always does).
    ``shared_intermediate``: width of the always-active shared expert, 0 if none.
    ``shared_gate``: the shared expert's output is scaled by ``sigmoid(x @ w_gate)`` (Qwen2-MoE).
    ``activation``: of the gate half (``silu``: SwiGLU; ``gelu_tanh``: GeGLU with tanh GELU, Gemma-4).
    ``router``: ``softmax`` over ``x @ router^T``; ``gemma4``: the router reads the residual stream, RMS-normalised
    without weight, times a learned [H] scale and H^-0.5, and each top-k weight is multiplied by a learned
    per-expert scale after renormalisation.
    """

    num_experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool
    shared_intermediate: int = 0
    shared_gate: bool = False
    activation: Activation = "silu"
    router: Router = "softmax"

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.expert_intermediate <= 0:
            raise ValueError("expert_intermediate must be positive")
        if self.shared_gate and not self.shared_intermediate:
            raise ValueError("shared_gate needs a shared expert")


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: attention then ``moe``, a dense MLP of ``dense_intermediate``, or both (``sandwich``
    models: the two outputs, each after its own post-norm, are summed)."""

    index: int
    attention: AttentionSpec
    moe: MoESpec | None
    dense_intermediate: int = 0

    def __post_init__(self) -> None:
        if self.moe is None and self.dense_intermediate == 0:
            raise ValueError(f"layer {self.index} needs an MoE block or a dense MLP")


@dataclass(frozen=True)
class ModelSpec:
    """A whole model. ``family`` is kept for messages and manifests only.

    ``sandwich``: Gemma-style layers (norms after attention and after the feed-forward, a dense MLP beside the
    MoE block, a learned per-layer output scalar); ``mlp_activation``: of the dense MLPs; ``embed_scale``:
    embeddings are multiplied by it (in the weights' dtype); ``logit_softcap``: logits become
    ``cap * tanh(logits / cap)``; ``notes``: what of the checkpoint is not served (one line each).
    """

    family: str
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layers: tuple[LayerSpec, ...]
    eos_token_ids: tuple[int, ...] = ()
    sandwich: bool = False
    mlp_activation: Activation = "silu"
    embed_scale: float = 1.0
    logit_softcap: float | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one layer")
        if not self.sandwich and any(ls.moe is not None and ls.dense_intermediate for ls in self.layers):
            raise ValueError("a dense MLP beside an MoE block needs sandwich layers")
        if any(layer.index != i for i, layer in enumerate(self.layers)):
            raise ValueError("layer indices must be 0..L-1 in order")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global attention)."""
        return tuple(ls.attention.window for ls in self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.moe is not None)
