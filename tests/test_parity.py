"""Lean model vs transformers: logits of tiny random configs of every supported family.

Prefill of two ragged prompts in one step, then several decode steps and a 3-token chunk of each
(the causal attention of a chunked prefill), compared with
transformers' eager forward on the full sequences. Tolerance (fp32): max |diff| <= 2e-4 on
logits of magnitude ~1 (accumulation-order differences only).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pwrun.model.loader import load_model
from pwrun.runner import ModelRunner

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_and_decode_match_transformers(tmp_path, name: str, device: str) -> None:
    hf, path = _save(tmp_path, name)
    hf = hf.to(device)
    ours = load_model(path, device=device, dtype="float32")
    runner = ModelRunner(ours, num_blocks=32, block_size=4)
    gen = torch.Generator().manual_seed(1)
    prompts = {s: torch.randint(0, 97, (n,), generator=gen).tolist() for s, n in ((0, 11), (1, 6))}

    logits = runner.run(prompts, logits_for="all")
    offset = 0
    for sid, toks in prompts.items():
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([toks], device=device)).logits[0]
        got = logits[offset:offset + len(toks)]
        offset += len(toks)
        assert (got - ref).abs().max().item() <= ATOL, f"{name} prefill seq {sid}"

    seqs = {k: list(v) for k, v in prompts.items()}
    for step in range(4):
        new = {sid: [int(torch.randint(0, 97, (1,), generator=gen))] for sid in seqs}
        last = runner.run(new)  # [S, V]
        for row, sid in enumerate(seqs):
            seqs[sid] += new[sid]
            with torch.no_grad():
                ref = hf(input_ids=torch.tensor([seqs[sid]], device=device)).logits[0, -1]
            assert (last[row] - ref).abs().max().item() <= ATOL, f"{name} decode step {step} seq {sid}"

    # a chunk of a longer context (chunked prefill): 3 new tokens per sequence attend to their cached prefix
    chunk = {sid: torch.randint(0, 97, (3,), generator=gen).tolist() for sid in seqs}
    got_all = runner.run(chunk, logits_for="all")
    for row, sid in enumerate(seqs):
        seqs[sid] += chunk[sid]
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([seqs[sid]], device=device)).logits[0, -3:]
        assert (got_all[3 * row:3 * row + 3] - ref).abs().max().item() <= ATOL, f"{name} chunk seq {sid}"
