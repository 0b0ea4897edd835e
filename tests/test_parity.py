"""Lean model vs transformers: logits of tiny random configs of every supported family.

Through the engine core and the model runner: prefill of two ragged prompts in one step, then several
decode steps feeding forced tokens, and a prompt prefilled in 4-token chunks (the causal attention of a
chunked prefill over its cached prefix), compared with
transformers' eager forward on the full sequences. Tolerance (fp32): max |diff| <= 2e-4 on
logits of magnitude ~1 (accumulation-order differences only).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pwformat.cost import kv_page_bytes
from pwrun.core.config import EngineConfig
from pwrun.core.engine_core import EngineCore
from pwrun.core.pool import PagePool, PoolConfig
from pwrun.core.request import Request
from pwrun.model.loader import load_model
from pwrun.runner.model_runner import ModelRunner

ATOL = 2e-4
COMMON = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)

CONFIGS = {
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                                        shared_expert_intermediate_size=56, intermediate_size=64,
                                        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                        intermediate_size=64, head_dim=16, norm_topk_prob=True),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, intermediate_size=40),
    "olmoe": lambda: OlmoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2, intermediate_size=40,
                                 clip_qkv=3.0, eos_token_id=1, pad_token_id=0),
    "qwen2_moe_tied_normtopk": lambda: Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2,
                                                      moe_intermediate_size=40, shared_expert_intermediate_size=32,
                                                      norm_topk_prob=True, tie_word_embeddings=True),
}


def _save(tmp_path, name: str) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(hash(name) % 1000)
    cfg = CONFIGS[name]()
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # give norms and biases non-trivial values so they are really tested
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
            elif "gate.weight" in n and "shared" not in n:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    return model, str(tmp_path)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _engine(model, max_step_tokens: int):  # type: ignore[no-untyped-def]
    """Engine core and model runner over a KV-only pool of 32 blocks of 4 tokens (no kernels: the reference path)."""
    cfg = EngineConfig(block_size=4, max_batch=2, max_step_tokens=max_step_tokens, use_kernels=False,
                       cuda_graphs=False)
    layers = model.spec.num_layers
    a = model.spec.layers[0].attention
    page = kv_page_bytes(4, a.num_kv_heads, a.head_dim, model.dtype.itemsize)
    core = EngineCore(cfg, PagePool(PoolConfig(32 * 2 * layers, page)), layers)
    return core, ModelRunner(model, cfg, 32 * 2 * layers, page)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_and_decode_match_transformers(tmp_path, name: str, device: str) -> None:
    hf, path = _save(tmp_path, name)
    hf = hf.to(device)
    ours = load_model(path, device=device, dtype="float32")
    gen = torch.Generator().manual_seed(1)
    prompts = {s: torch.randint(0, 97, (n,), generator=gen).tolist() for s, n in ((0, 11), (1, 6))}
    fed = {s: torch.randint(0, 97, (5,), generator=gen).tolist() for s in prompts}

    def ref(toks: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([toks], device=device)).logits[0]

    # both prompts prefilled in one step, then 4 decode steps feeding forced tokens
    core, runner = _engine(ours, 64)
    for sid, toks in prompts.items():
        req = Request(sid, tuple(toks), forced=tuple(fed[sid]))
        core.add_request(req)
        runner.add_request(req)
    decision = core.step()
    logits = runner.execute(decision, logits_for="all")
    offset = 0
    for sid, toks in prompts.items():
        got = logits[offset:offset + len(toks)]
        offset += len(toks)
        assert (got - ref(toks)).abs().max().item() <= ATOL, f"{name} prefill seq {sid}"
    core.update(decision, *runner.sample(decision, logits[[len(prompts[0]) - 1, offset - 1]]))
    for step in range(4):
        decision = core.step()
        last = runner.execute(decision)  # [S, V]
        for row, c in enumerate(decision.chunks):
            seq = prompts[c.rid] + fed[c.rid][:step + 1]
            assert c.token_ids == (seq[-1],) and c.start == len(seq) - 1
            assert (last[row] - ref(seq)[-1]).abs().max().item() <= ATOL, f"{name} decode step {step} seq {c.rid}"
        core.update(decision, *runner.sample(decision, last))

    # chunked prefill: 4 tokens per step, each chunk attending to its cached prefix
    core, runner = _engine(ours, 4)
    toks = prompts[0]
    core.add_request(Request(0, tuple(toks), forced=(1,)))
    want = ref(toks)
    for start in range(0, len(toks), 4):
        decision = core.step()
        (c,) = decision.chunks
        assert c.start == start and c.token_ids == tuple(toks[start:start + 4])
        got = runner.execute(decision, logits_for="all")
        assert (got - want[start:start + 4]).abs().max().item() <= ATOL, f"{name} chunk at {start}"
        core.update(decision, [c.forced if c.last else None], [0.0 if c.last else None])
