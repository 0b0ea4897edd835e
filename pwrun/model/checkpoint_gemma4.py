"""Read a Gemma-4 MoE checkpoint's text model into ``ModelWeights`` (the tensor names of transformers' Gemma-4).

What it does: finds the text model's prefix (``model.language_model.`` in a multimodal checkpoint,
``model.`` in a text-only one; the vision and audio towers are not read), and per layer reads the sandwich
norms, the attention (no ``v_proj`` where keys are the values; ``v_norm`` has no weight), the dense MLP,
the router (``router.proj``, its ``scale`` and ``per_expert_scale``) and the fused experts
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]). Shapes are checked against the spec
by ``TensorReader``. It does not parse the config (``families.gemma4`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pwformat.errors import PagedWeightError
from pwrun.model.spec import LayerSpec, ModelSpec
from pwrun.model.weights import AttentionWeights, LayerWeights, MLPWeights, ModelWeights, MoEWeights, SandwichNorms

if TYPE_CHECKING:
    from pwrun.model.checkpoint import TensorReader

PREFIXES = ("model.language_model.", "model.")


def text_prefix(has: Callable[[str], bool]) -> str:
    """The prefix under which the text model's tensors live; ``has(name) -> bool``."""
    for p in PREFIXES:
        if has(p + "embed_tokens.weight"):
            return p
    raise PagedWeightError("no Gemma-4 text model in the checkpoint (no model.language_model.embed_tokens.weight "
                           "nor model.embed_tokens.weight): the weights do not match config.json")


def _attention(r: TensorReader, p: str, layer: LayerSpec, h: int) -> AttentionWeights:
    a = layer.attention
    qd, kd = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    get = r.get
    return AttentionWeights(
        q=get(p + "q_proj.weight", (qd, h)), k=get(p + "k_proj.weight", (kd, h)),
        v=None if a.k_eq_v else get(p + "v_proj.weight", (kd, h)), o=get(p + "o_proj.weight", (h, qd)),
        q_norm=get(p + "q_norm.weight", (a.head_dim,)), k_norm=get(p + "k_norm.weight", (a.head_dim,)))


def load_gemma4(r: TensorReader, spec: ModelSpec) -> ModelWeights:
    """Every tensor the lean model needs from a ``TensorReader`` ``r`` over a Gemma-4 checkpoint."""
    get = r.get
    pre = text_prefix(r.has)
    h, v = spec.hidden_size, spec.vocab_size
    embed = get(pre + "embed_tokens.weight", (v, h))
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight", (v, h))
    layers = []
    for layer in spec.layers:
        p = f"{pre}layers.{layer.index}."
        m = layer.moe
        assert m is not None
        e, i, d = m.num_experts, m.expert_intermediate, layer.dense_intermediate

        def norm(name: str, p: str = p) -> torch.Tensor:
            return get(p + name + ".weight", (h,))

        mlp = MLPWeights(gate_up=torch.cat([get(p + "mlp.gate_proj.weight", (d, h)),
                                            get(p + "mlp.up_proj.weight", (d, h))]),
                         down=get(p + "mlp.down_proj.weight", (h, d)))
        moe = MoEWeights(router=get(p + "router.proj.weight", (e, h)),
                         gate_up=get(p + "experts.gate_up_proj", (e, 2 * i, h)),
                         down=get(p + "experts.down_proj", (e, h, i)),
                         router_scale=get(p + "router.scale", (h,)),
                         expert_scale=get(p + "router.per_expert_scale", (e,)))
        sandwich = SandwichNorms(post_attn=norm("post_attention_layernorm"),
                                 post_ffn=norm("post_feedforward_layernorm"),
                                 mlp_post=norm("post_feedforward_layernorm_1"),
                                 moe_pre=norm("pre_feedforward_layernorm_2"),
                                 moe_post=norm("post_feedforward_layernorm_2"), scalar=get(p + "layer_scalar", (1,)))
        layers.append(LayerWeights(attn_norm=norm("input_layernorm"), ffn_norm=norm("pre_feedforward_layernorm"),
                                   attn=_attention(r, p + "self_attn.", layer, h), moe=moe, mlp=mlp,
                                   sandwich=sandwich))
    return ModelWeights(embed=embed, lm_head=lm_head, final_norm=get(pre + "norm.weight", (h,)), layers=layers)
