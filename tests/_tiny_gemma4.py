"""A tiny random Gemma-4 MoE checkpoint in transformers' own classes, keeping every layer type and flag of the real
one: sliding (window 6) and global layers with their own head dims and KV heads (8 x 16 / 1 x 32: a global layer's
K and V share one pool page), keys as values on the global layers, proportional partial RoPE, the dense MLP beside
the MoE block with its norms, GELU-tanh experts, the scaled router, tied embeddings and a logit soft cap (3, so
that it bends the logits). Norms, router scales and layer scalars are randomised so that each is really tested."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma4TextConfig

WINDOW = 6


def tiny_gemma4_config(**over: object) -> Gemma4TextConfig:
    kw: dict[str, object] = dict(
        vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=WINDOW, attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=24, hidden_size_per_layer_input=0, final_logit_softcapping=3.0,
        max_position_embeddings=256, tie_word_embeddings=True)
    kw.update(over)
    cfg = Gemma4TextConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def save_tiny_gemma4(path: Path, seed: int = 0, **over: object) -> torch.nn.Module:
    """Save the model (``Gemma4ForCausalLM``, float32) to ``path`` and return it in eval mode."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(tiny_gemma4_config(**over)).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("scale"):
                p.add_(0.3 * torch.randn_like(p))
            elif "router.proj" in n:
                p.normal_(0, 0.5)
            elif "embed_tokens" in n:
                p.normal_(0, 0.5)
        for n, b in hf.named_buffers():
            if n.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    hf.save_pretrained(path)
    return hf
