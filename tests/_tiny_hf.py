"""A tiny random Qwen2-MoE checkpoint in transformers' own classes, for brute-force checks of what the lean model
computes (calibration statistics, Fisher gradients). Routers are scaled up so that routing is far from uniform."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig


def save_tiny_qwen2moe(path: Path) -> torch.nn.Module:
    """Save the model to ``path`` and return it (float32, eval mode): 2 layers, hidden 32, 6 experts of 24 (top-2),
    a shared expert of 20, vocabulary 61."""
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                         shared_expert_intermediate_size=20, intermediate_size=40, max_position_embeddings=64)
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    hf.save_pretrained(path)
    return hf
