"""Gemma-4 MoE: the lean model through the engine core and the model runner against transformers' Gemma-4.

A tiny random checkpoint with every layer type and flag (``_tiny_gemma4``): two ragged prompts prefilled in one
step, one longer than the sliding window; decode steps past the window; a prompt prefilled in 4-token chunks
across the window edge. Logits (fp32) within 2e-4 of transformers' eager forward on the whole sequence and the
same greedy tokens. Along the way the sliding layers' pages of blocks outside the window go back to the pool and
pages stay conserved. Also: the real config's spec, and a multimodal checkpoint's text model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pwrun.core.config import EngineConfig
from pwrun.core.engine_core import EngineCore
from pwrun.core.pool import KV, PagePool, PoolConfig
from pwrun.core.request import Request
from pwrun.model.inventory import expert_blocks, kv_layout, parameter_counts
from pwrun.model.loader import load_model, load_spec
from pwrun.runner.model_runner import ModelRunner
from tests._tiny_gemma4 import WINDOW, save_tiny_gemma4

ATOL = 2e-4
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
REAL = Path(__file__).parent / "fixtures" / "configs" / "google__gemma-4-26B-A4B"


def test_real_config_spec(tmp_path: Path) -> None:
    shutil.copy(REAL / "config.json", tmp_path / "config.json")
    spec, names = load_spec(tmp_path)
    assert spec.family == "gemma4" and names.gemma4 and spec.num_layers == 30 and spec.sandwich
    assert spec.vocab_size == 262144 and spec.tie_word_embeddings and spec.logit_softcap == 30.0
    assert any("vision" in n for n in spec.notes)
    sliding, full = spec.layers[0].attention, spec.layers[5].attention
    assert (sliding.window, sliding.num_kv_heads, sliding.head_dim, sliding.rotary_dim, sliding.k_eq_v) == \
        (1024, 8, 256, None, False)
    assert (full.window, full.num_kv_heads, full.head_dim, full.rotary_dim, full.k_eq_v) == (None, 2, 512, 128, True)
    assert sliding.rope_theta == 1e4 and full.rope_theta == 1e6 and full.softmax_scale == 1.0
    m = spec.layers[0].moe
    assert m is not None and (m.num_experts, m.top_k, m.expert_intermediate, m.activation, m.router) == \
        (128, 8, 704, "gelu_tanh", "gemma4")
    assert spec.layers[0].dense_intermediate == 2112
    layout = kv_layout(spec)  # a global layer's K and V (2 x 512) share one page of a sliding layer's K (8 x 256)
    assert layout.pages_per_block == 25 * 2 + 5 and len(layout.sliding_pages) == 50 and layout.window == 1024
    assert len(expert_blocks(spec)) == 30 * 128 * 2
    counts = parameter_counts(spec)
    assert abs(counts["routed_experts"] / 1e9 - 30 * 128 * 3 * 2816 * 704 / 1e9) < 1e-9
    assert 24.5 < sum(counts.values()) / 1e9 < 26.0  # the text model: 25.2B


def _engine(model, max_step_tokens: int, blocks: int = 40) -> tuple[EngineCore, ModelRunner]:  # type: ignore[no-untyped-def]
    cfg = EngineConfig(block_size=4, max_batch=2, max_step_tokens=max_step_tokens, use_kernels=False,
                       cuda_graphs=False, debug_checks=True)
    layout = kv_layout(model.spec)
    pages, page = blocks * layout.pages_per_block, layout.page_bytes(4, model.dtype.itemsize)
    return EngineCore(cfg, PagePool(PoolConfig(pages, page)), layout), ModelRunner(model, cfg, pages, page)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("gemma4")
    return save_tiny_gemma4(path), path


def _on(tiny, device: str):  # type: ignore[no-untyped-def]
    """transformers' model and ours on ``device`` (fp32)."""
    hf, path = tiny
    return hf.to(device), load_model(path, device=device, dtype="float32")


def _ref(hf: torch.nn.Module, toks: list[int]) -> torch.Tensor:
    dev = next(hf.parameters()).device
    with torch.no_grad():
        return hf(input_ids=torch.tensor([toks], device=dev)).logits[0]


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_and_decode_past_the_window(tiny, device: str) -> None:  # type: ignore[no-untyped-def]
    hf, ours = _on(tiny, device)
    layout = kv_layout(ours.spec)
    assert layout.pages_per_block == 2 * 2 + 2 and layout.window == WINDOW  # global K and V: one page
    gen = torch.Generator().manual_seed(1)
    prompts = {s: torch.randint(0, 97, (n,), generator=gen).tolist() for s, n in ((0, 13), (1, 5))}
    core, runner = _engine(ours, 64)
    for sid, toks in prompts.items():
        req = Request(sid, tuple(toks))
        core.add_request(req)
        runner.add_request(req)
    decision = core.step()
    logits = runner.execute(decision, logits_for="all")
    offset, worst = 0, 0.0
    for toks in prompts.values():
        worst = max(worst, (logits[offset:offset + len(toks)] - _ref(hf, toks)).abs().max().item())
        offset += len(toks)
    assert worst <= ATOL
    seqs = {sid: list(t) for sid, t in prompts.items()}
    sampled, lps = runner.sample(decision, logits[[len(prompts[0]) - 1, offset - 1]])
    core.update(decision, sampled, lps)
    core.check()
    # 13 tokens with a window of 6: keys 8.. are read from now on, so block 0 and 1 (tokens 0..7) gave back their
    # sliding pages (2 per block), the short prompt's none
    assert core.alloc.num_trimmed == 2 and core.pool.count(KV) == core.alloc.kv_pages
    for sid, tok in zip(prompts, sampled, strict=True):
        assert tok == int(_ref(hf, seqs[sid])[-1].argmax())
        seqs[sid].append(tok)
    for _ in range(10):
        decision = core.step()
        last = runner.execute(decision)
        for row, c in enumerate(decision.chunks):
            want = _ref(hf, seqs[c.rid])[-1]
            assert (last[row] - want).abs().max().item() <= ATOL, f"decode at {c.start} seq {c.rid}"
        sampled, lps = runner.sample(decision, last)
        for c, tok in zip(decision.chunks, sampled, strict=True):
            assert tok == int(_ref(hf, seqs[c.rid])[-1].argmax())  # greedy tokens match
            seqs[c.rid].append(tok)  # type: ignore[arg-type]
        core.update(decision, sampled, lps)
        core.check()
    # both sequences decoded past the window: every block wholly before the window holds only global pages
    for sid, s in seqs.items():
        table = core.tables.table(sid)
        behind = (len(s) - 1 - WINDOW + 1) // 4
        assert all(core.alloc.trimmed(b) for b in table[:behind])
        assert not any(core.alloc.trimmed(b) for b in table[behind:])


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_across_the_window_edge(tiny, device: str) -> None:  # type: ignore[no-untyped-def]
    hf, ours = _on(tiny, device)
    toks = torch.randint(0, 97, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    want = _ref(hf, toks)
    core, runner = _engine(ours, 4)
    core.add_request(Request(0, tuple(toks), forced=(1,)))
    for start in range(0, len(toks), 4):
        decision = core.step()
        (c,) = decision.chunks
        assert c.start == start
        got = runner.execute(decision, logits_for="all")
        assert (got - want[start:start + 4]).abs().max().item() <= ATOL, f"chunk at {start}"
        core.update(decision, [c.forced if c.last else None], [0.0 if c.last else None])
        core.check()
        assert core.alloc.num_trimmed == max(0, (c.end - WINDOW + 1) // 4) or c.last


def test_multimodal_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """A Gemma4ForConditionalGeneration's tensors live under model.language_model.; the towers are left alone."""
    from safetensors.torch import load_file, save_file

    hf = save_tiny_gemma4(tmp_path / "text", seed=3)
    (tmp_path / "mm").mkdir()
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in
               load_file(str(tmp_path / "text" / "model.safetensors")).items()}
    tensors["model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "mm" / "model.safetensors"))
    shutil.copy(tmp_path / "text" / "config.json", tmp_path / "mm" / "config.json")
    ours = load_model(tmp_path / "mm", device="cpu", dtype="float32")
    toks = [5, 17, 3, 88, 41, 9, 60, 2, 33]
    core, runner = _engine(ours, 64)
    core.add_request(Request(0, tuple(toks)))
    got = runner.execute(core.step(), logits_for="all")
    assert (got - _ref(hf, toks)).abs().max().item() <= ATOL


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in _tensors(o)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for v in vars(obj).values() for t in _tensors(v)]
    return []


def test_serving_moves_every_non_expert_tensor(tmp_path: Path) -> None:
    """``strip_experts`` (the build of a serving engine) puts every tensor the forward reads on the device, the
    sandwich norms and router scales too (checked on the meta device)."""
    from pwrun.engine.build import strip_experts

    save_tiny_gemma4(tmp_path)
    model = strip_experts(load_model(tmp_path, device="cpu", dtype="float32"), torch.device("meta"))
    tensors = _tensors(model.weights)
    assert len(tensors) > 50 and all(t.device.type == "meta" for t in tensors)


def test_spec_without_per_layer_configs(tmp_path: Path) -> None:
    """A transformers whose Gemma-4 config keeps ``global_head_dim`` / ``num_global_key_value_heads`` as plain fields
    (no per-layer configs) gives the same spec as the per-layer configs of transformers 5.24."""
    import json
    from types import SimpleNamespace

    from pwrun.model.families import gemma4

    shutil.copy(REAL / "config.json", tmp_path / "config.json")
    want, _ = load_spec(tmp_path)
    raw = json.loads((REAL / "config.json").read_text())
    text = SimpleNamespace(**raw["text_config"])
    got = gemma4(SimpleNamespace(text_config=text, vision_config=raw["vision_config"], audio_config=None,
                                 get_text_config=lambda: text))
    assert got == want


def test_warm_up_shapes(tiny) -> None:  # type: ignore[no-untyped-def]
    """The warm-up compiles the GELU-tanh MoE kernels and the decode GEMVs of the dense MLP beside each MoE block."""
    from pwrun.engine.build import linear_shapes, moe_shapes

    _, model = _on(tiny, "cpu")
    (shape,) = moe_shapes(model)
    assert (shape.hidden, shape.inter, shape.topk, shape.activation) == (48, 24, 2, "gelu_tanh")
    dims = {(s.n, s.k) for s in linear_shapes(model)}
    assert {(80, 48), (48, 40)} <= dims  # gate_up [2 x 40, 48] and down [48, 40]
