"""The engine's kernel wiring: ``EngineConfig.use_kernels`` runs the Triton kernels (MoE, paged decode attention,
fused norm / RoPE + KV write / routing) at tiny shapes, in Triton's interpreter on the CPU (CI) and natively on a
GPU, and scores what the reference path scores (bf16: log-probabilities equal up to rounding)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

from pwrun.core.config import EngineConfig
from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.core.policy import Policy
from pwrun.core.request import SamplingParams
from pwrun.engine.build import ServeConfig, assemble_engine, strip_experts
from pwrun.model.inventory import expert_blocks
from pwrun.model.loader import load_model
from pwrun.model.spec import ModelSpec

BITS = (3, 4, 5, 6, 7, 8)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/conftest.py sets TRITON_INTERPRET


class RandomAP:
    """Random AP planes [8, N, ceil(K / 32)] int32 and sorted LUTs [N, 2^b] for every expert block of ``spec``."""

    def __init__(self, spec: ModelSpec) -> None:
        self.bits = list(BITS)
        g = torch.Generator().manual_seed(0)
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        for b in expert_blocks(spec):
            name = f"{'shared' if b.expert < 0 else b.expert}.{b.unit}"
            d = self.tensors.setdefault(b.layer, {})
            d[f"{name}.planes"] = torch.randint(-2**31, 2**31 - 1, (8, b.n, -(-b.k // 32)), dtype=torch.int32,
                                                generator=g)
            for q in BITS:
                d[f"{name}.lut{q}"] = torch.sort(torch.randn(b.n, 2**q, generator=g) * 0.3, dim=1)[0]

    def layer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        return self.tensors[layer]


def _table(spec: ModelSpec) -> BlockTable:
    blocks = sorted(expert_blocks(spec), key=lambda b: (b.layer, b.expert, b.unit))
    bits = np.asarray(BITS)
    return BlockTable(bits=bits, layer=np.array([b.layer for b in blocks]), expert=np.array([b.expert for b in blocks]),
                      unit=np.array([UNITS.index(b.unit) for b in blocks]), sens=np.zeros((len(blocks), bits.size)),
                      bytes=np.zeros((len(blocks), bits.size), np.int64), tokens=np.zeros(len(blocks), np.int64),
                      mass=np.ones(len(blocks)))


def _save_tiny(path: Path) -> None:
    """A random 2-layer Qwen2-MoE at the kernels' smallest shapes (head dim 16, hidden 64, 4 experts of 32)."""
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=61, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, intermediate_size=64, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(path)


# (prompts, forced continuations, max_step_tokens): a prefill, then one decode step; and chunked prompts whose
# chunks run beside the other requests' decodes (mixed steps through the variable-length attention kernel)
CASES = {
    "prefill_decode": ([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], [[20, 21], [30, 31]], 512),
    "mixed_chunks": ([list(range(3, 12)), [12, 13, 14], list(range(30, 37))], [[20, 21], [30, 31], [40, 41]], 4),
}


def _save_tiny_gemma4(path: Path) -> None:
    """A random 2-layer Gemma-4 MoE at the kernels' smallest shapes: a sliding layer (window 4: decode steps and
    chunks attend over part of the context) of head dim 16 and a global one of 32 (keys as values, partial RoPE),
    GELU-tanh experts (4 of 32), the dense MLP beside them."""
    from tests._tiny_gemma4 import save_tiny_gemma4

    save_tiny_gemma4(path, vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=4, num_experts=4,
                     moe_intermediate_size=32)


# Gemma-4 in fp16: its attention logits are not scaled by head_dim^-0.5 (q and k are RMS-normalised), so bf16's
# rounding of q and k alone moves its log-probabilities by ~0.05 (fp16's 3 more mantissa bits: ~0.007)
@pytest.mark.parametrize(("case", "family", "dtype"), [("prefill_decode", "qwen2_moe", "bfloat16"),
                                                        ("mixed_chunks", "qwen2_moe", "bfloat16"),
                                                        ("mixed_chunks", "gemma4", "float16")])
def test_kernel_path_scores_what_the_reference_path_scores(tmp_path: Path, case: str, family: str,
                                                           dtype: str) -> None:
    (_save_tiny if family == "qwen2_moe" else _save_tiny_gemma4)(tmp_path)
    prompts, forced, step_tokens = CASES[case]
    lps = {}
    mixed = 0
    for kernels in (False, True):
        model = strip_experts(load_model(tmp_path, device=DEV, dtype=dtype), torch.device(DEV))
        cfg = ServeConfig(2**28, Policy.named("uniform", 4),
                          EngineConfig(use_kernels=kernels, cuda_graphs=False, precompile_workers=0, debug_checks=True,
                                       max_step_tokens=step_tokens))
        e = assemble_engine(model, RandomAP(model.spec), _table(model.spec), BucketPolicy.neutral(3), None, None, cfg,
                            SamplingParams(max_new_tokens=1), prompts, set(), forced)
        assert e.runner.use_kernels is kernels and model.fused is kernels
        outs = e.run_until_done()
        lps[kernels] = np.concatenate([o.logprobs for o in outs.values()])
        assert lps[kernels].size == sum(map(len, forced)) and np.isfinite(lps[kernels]).all()
        mixed = sum(r.prefill_tokens > 0 and r.step_tokens > r.prefill_tokens for r in e.trace)
    np.testing.assert_allclose(lps[True], lps[False], atol=0.05)
    if case == "mixed_chunks":
        assert mixed > 0  # some step ran a prompt chunk beside decodes
