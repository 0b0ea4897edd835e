"""Model families: turn a Hugging Face config into the canonical ``ModelSpec``.

What it does: one adapter per supported family (``qwen2_moe``, ``mixtral``, ``qwen3_moe``,
``olmoe``, ``gemma4``) reads the family's config fields and says where its tensors live in a checkpoint
(``CheckpointNames``). It does not read tensors (``checkpoint.py`` does) and imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pwformat.errors import PagedWeightError
from pwrun.model.spec import AttentionSpec, LayerSpec, ModelSpec, MoESpec, QKNorm


@dataclass(frozen=True)
class CheckpointNames:
    """Where a family keeps its MoE tensors, relative to ``model.layers.{l}.``.

    ``moe_prefix``: the MoE block's module name; ``expert_*``: the per-expert projection names
    (hub checkpoints store ``experts.{e}.{name}.weight``); gate/up are concatenated into our
    ``gate_up`` [2I, H] with gate rows first. ``gemma4``: the Gemma-4 names (``checkpoint_gemma4.py``).
    """

    moe_prefix: str = "mlp"
    expert_gate: str = "gate_proj"
    expert_up: str = "up_proj"
    expert_down: str = "down_proj"
    gemma4: bool = False


QWEN_NAMES = CheckpointNames()
MIXTRAL_NAMES = CheckpointNames(moe_prefix="block_sparse_moe", expert_gate="w1", expert_up="w3", expert_down="w2")
GEMMA4_NAMES = CheckpointNames(moe_prefix="experts", gemma4=True)

UNSUPPORTED: dict[str, str] = {}
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def _rope_theta(cfg: Any) -> float:
    params = _get(cfg, "rope_parameters") or {}
    if isinstance(params, dict) and params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise PagedWeightError(f"RoPE scaling '{rope_type}' is not supported yet: "
                                   "use a checkpoint with default RoPE")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    theta = _get(cfg, "rope_theta")
    if theta is None:
        raise PagedWeightError("config.json has no rope_theta: add it (10000.0 is the usual default)")
    return float(theta)


def _check_common(cfg: Any) -> None:
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise PagedWeightError(f"hidden_act '{act}' is not supported: PagedWeight runs SwiGLU (silu) experts")
    use_sw = _get(cfg, "use_sliding_window", None)
    window = _get(cfg, "sliding_window", None)
    if (use_sw is None and window) or use_sw:
        raise PagedWeightError("sliding-window attention is not supported yet: set use_sliding_window false "
                               "or sliding_window null in config.json if the model does not need it")


def _attention(cfg: Any, qkv_bias: bool, qk_norm: QKNorm) -> AttentionSpec:
    heads = int(cfg.num_attention_heads)
    head_dim = _get(cfg, "head_dim") or cfg.hidden_size // heads
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads") or heads),
        head_dim=int(head_dim),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        clip_qkv=_get(cfg, "clip_qkv"),
        rope_theta=_rope_theta(cfg),
    )


def _eos(cfg: Any) -> tuple[int, ...]:
    eos = _get(cfg, "eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list | tuple) else (int(eos),)


def _model(cfg: Any, family: str, layers: list[LayerSpec]) -> ModelSpec:
    return ModelSpec(
        family=family,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        rms_norm_eps=float(cfg.rms_norm_eps),
        max_position_embeddings=int(cfg.max_position_embeddings),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        layers=tuple(layers),
        eos_token_ids=_eos(cfg),
    )


def _qwen_layers(cfg: Any, attn: AttentionSpec, moe: MoESpec) -> list[LayerSpec]:
    sparse_step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
    mlp_only = set(_get(cfg, "mlp_only_layers", None) or [])
    out = []
    for i in range(int(cfg.num_hidden_layers)):
        if i not in mlp_only and moe.num_experts > 0 and (i + 1) % sparse_step == 0:
            out.append(LayerSpec(i, attn, moe))
        else:
            out.append(LayerSpec(i, attn, None, dense_intermediate=int(cfg.intermediate_size)))
    return out


def qwen2_moe(cfg: Any) -> ModelSpec:
    _check_common(cfg)
    attn = _attention(cfg, qkv_bias=bool(_get(cfg, "qkv_bias", True)), qk_norm="none")
    shared = int(_get(cfg, "shared_expert_intermediate_size", 0) or 0)
    moe = MoESpec(int(cfg.num_experts), int(cfg.num_experts_per_tok), int(cfg.moe_intermediate_size),
                  bool(cfg.norm_topk_prob), shared_intermediate=shared, shared_gate=shared > 0)
    return _model(cfg, "qwen2_moe", _qwen_layers(cfg, attn, moe))


def qwen3_moe(cfg: Any) -> ModelSpec:
    _check_common(cfg)
    attn = _attention(cfg, qkv_bias=bool(_get(cfg, "attention_bias", False)), qk_norm="per_head")
    moe = MoESpec(int(cfg.num_experts), int(cfg.num_experts_per_tok), int(cfg.moe_intermediate_size),
                  bool(cfg.norm_topk_prob))
    return _model(cfg, "qwen3_moe", _qwen_layers(cfg, attn, moe))


def mixtral(cfg: Any) -> ModelSpec:
    _check_common(cfg)
    attn = _attention(cfg, qkv_bias=False, qk_norm="none")
    moe = MoESpec(int(cfg.num_local_experts), int(cfg.num_experts_per_tok), int(cfg.intermediate_size),
                  norm_topk_prob=True)
    return _model(cfg, "mixtral", [LayerSpec(i, attn, moe) for i in range(int(cfg.num_hidden_layers))])


def _gemma4_rope(cfg: Any, layer_type: str, head_dim: int) -> tuple[float, int]:
    """(theta, rotary_dim) of one Gemma-4 layer type: ``default`` rotates all of head_dim, ``proportional`` the
    first ``int(partial_rotary_factor * head_dim // 2)`` frequency pairs (as transformers computes them)."""
    params = (_get(cfg, "rope_parameters") or {}).get(layer_type) or {}
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return theta, head_dim
    if kind == "proportional" and float(params.get("factor", 1.0)) == 1.0:
        return theta, 2 * int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    raise PagedWeightError(f"RoPE '{kind}' of Gemma-4 {layer_type} layers is not supported: use default or "
                           "proportional RoPE without a factor")


def _gemma4_heads(text: Any, layer: int, sliding: bool, k_eq_v: bool) -> tuple[int, int]:
    """(head_dim, KV heads) of a Gemma-4 layer: from transformers' per-layer config where it has one (5.24), else
    from ``global_head_dim`` / ``num_global_key_value_heads`` on the global layers (the fields of config.json)."""
    per_layer = _get(text, "per_layer_config")
    if per_layer is not None:
        per = per_layer[layer]
        return int(per.head_dim), int(per.num_key_value_heads)
    head_dim, kv_heads = int(text.head_dim), int(text.num_key_value_heads)
    if sliding:
        return head_dim, kv_heads
    global_kv = _get(text, "num_global_key_value_heads")
    return int(_get(text, "global_head_dim") or head_dim), int(global_kv) if k_eq_v and global_kv else kv_heads


def gemma4(cfg: Any) -> ModelSpec:
    """Gemma-4 MoE text model (a multimodal config's ``text_config``; its other towers get a note)."""
    notes = tuple(f"the checkpoint's {kind} tower is not served (text model only)"
                  for kind in ("vision", "audio") if _get(cfg, f"{kind}_config") is not None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not _get(text, "enable_moe_block", False):
        raise PagedWeightError("this Gemma-4 checkpoint has no MoE block (enable_moe_block false): PagedWeight "
                               "serves MoE models")
    for name, ok in (("hidden_size_per_layer_input", 0), ("num_kv_shared_layers", 0),
                     ("use_double_wide_mlp", False)):
        if (_get(text, name) or ok) != ok:
            raise PagedWeightError(f"Gemma-4 {name}={_get(text, name)} is not supported: PagedWeight serves the "
                                   "MoE models without per-layer inputs or shared KV layers")
    if _get(text, "use_bidirectional_attention") == "all" or _get(text, "attention_bias"):
        raise PagedWeightError("Gemma-4 with bidirectional attention or attention biases is not supported")
    act = ACTIVATIONS.get(str(_get(text, "hidden_activation")))
    if act is None:
        raise PagedWeightError(f"Gemma-4 hidden_activation '{_get(text, 'hidden_activation')}' is not supported: "
                               f"use one of {', '.join(ACTIVATIONS)}")
    heads, k_eq_v = int(text.num_attention_heads), bool(_get(text, "attention_k_eq_v", False))
    moe = MoESpec(int(text.num_experts), int(text.top_k_experts), int(text.moe_intermediate_size), True,
                  activation=act, router="gemma4")  # type: ignore[arg-type]
    layers = []
    for i, kind in enumerate(text.layer_types):
        sliding = kind == "sliding_attention"
        head_dim, kv_heads = _gemma4_heads(text, i, sliding, k_eq_v)
        theta, rotary = _gemma4_rope(text, kind, head_dim)
        attn = AttentionSpec(heads, kv_heads, head_dim, qkv_bias=False, qk_norm="per_head", clip_qkv=None,
                             rope_theta=theta, window=int(text.sliding_window) if sliding else None,
                             rotary_dim=None if rotary == head_dim else rotary, scale=1.0,
                             k_eq_v=k_eq_v and not sliding, v_norm=True)
        layers.append(LayerSpec(i, attn, moe, dense_intermediate=int(text.intermediate_size)))
    return ModelSpec(
        family="gemma4", vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
        rms_norm_eps=float(text.rms_norm_eps), max_position_embeddings=int(text.max_position_embeddings),
        tie_word_embeddings=bool(_get(text, "tie_word_embeddings", True)), layers=tuple(layers),
        eos_token_ids=_eos(text), sandwich=True, mlp_activation=act,  # type: ignore[arg-type]
        embed_scale=float(text.hidden_size) ** 0.5, logit_softcap=_get(text, "final_logit_softcapping"),
        notes=notes)


def olmoe(cfg: Any) -> ModelSpec:
    _check_common(cfg)
    attn = _attention(cfg, qkv_bias=bool(_get(cfg, "attention_bias", False)), qk_norm="full")
    moe = MoESpec(int(cfg.num_experts), int(cfg.num_experts_per_tok), int(cfg.intermediate_size),
                  bool(_get(cfg, "norm_topk_prob", False)))
    return _model(cfg, "olmoe", [LayerSpec(i, attn, moe) for i in range(int(cfg.num_hidden_layers))])


FAMILIES: dict[str, tuple[Callable[[Any], ModelSpec], CheckpointNames]] = {
    "qwen2_moe": (qwen2_moe, QWEN_NAMES),
    "qwen3_moe": (qwen3_moe, QWEN_NAMES),
    "mixtral": (mixtral, MIXTRAL_NAMES),
    "olmoe": (olmoe, QWEN_NAMES),
    "gemma4": (gemma4, GEMMA4_NAMES),
    "gemma4_text": (gemma4, GEMMA4_NAMES),
}


def spec_from_config(cfg: Any) -> tuple[ModelSpec, CheckpointNames]:
    """Canonical spec and checkpoint names for a transformers ``PretrainedConfig``.

    Raises ``PagedWeightError`` for unsupported families or features, naming what is missing.
    """
    model_type = str(_get(cfg, "model_type", ""))
    if model_type in UNSUPPORTED:
        raise PagedWeightError(UNSUPPORTED[model_type])
    if model_type not in FAMILIES:
        raise PagedWeightError(f"unknown architecture '{model_type}' in config.json: supported families are "
                               f"{', '.join(sorted(FAMILIES))}")
    parse, names = FAMILIES[model_type]
    try:
        spec = parse(cfg)
    except (AttributeError, TypeError, ValueError) as exc:
        raise PagedWeightError(f"config.json of family {model_type} is incomplete or inconsistent: {exc}") from exc
    _check_sizes(spec, model_type)
    return spec, names


# Sizes past these are no model this runtime can hold (a damaged or hand-edited config.json): refused before any
# structure of that size is built.
SIZE_LIMITS = {"layers": 1024, "vocab_size": 1 << 22, "hidden_size": 1 << 17, "max_position_embeddings": 1 << 24,
               "num_experts": 1 << 14, "expert_intermediate": 1 << 18, "num_heads": 1 << 10, "head_dim": 1 << 12}


def _check_sizes(spec: ModelSpec, model_type: str) -> None:
    """Raise ``PagedWeightError`` naming the first size of ``spec`` outside [1, ``SIZE_LIMITS``]."""
    sizes = {"layers": len(spec.layers), "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
             "max_position_embeddings": spec.max_position_embeddings}
    for layer in spec.layers:
        sizes["num_heads"] = max(sizes.get("num_heads", 0), layer.attention.num_heads)
        sizes["head_dim"] = max(sizes.get("head_dim", 0), layer.attention.head_dim)
        if layer.moe is not None:
            sizes["num_experts"] = max(sizes.get("num_experts", 0), layer.moe.num_experts)
            sizes["expert_intermediate"] = max(sizes.get("expert_intermediate", 0), layer.moe.expert_intermediate)
    for name, value in sizes.items():
        if not 1 <= value <= SIZE_LIMITS[name]:
            raise PagedWeightError(f"config.json of family {model_type}: {name} {value} is outside "
                                   f"1..{SIZE_LIMITS[name]} (a damaged or hand-edited config): restore it from the "
                                   "original checkpoint")
