"""Config -> canonical spec on the real configs of the seed models, and clear errors for the rest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pwformat.errors import PagedWeightError
from pwrun.model.inventory import SHARED_EXPERT, expert_blocks, parameter_counts
from pwrun.model.loader import load_model, load_spec

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def _dir_with(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(CONFIGS / name / "config.json", d / "config.json")
    return d


def test_qwen15_moe_a27b_shape(tmp_path: Path) -> None:
    spec, names = load_spec(_dir_with(tmp_path, "Qwen__Qwen1.5-MoE-A2.7B"))
    assert spec.family == "qwen2_moe" and spec.num_layers == 24 and names.moe_prefix == "mlp"
    m = spec.layers[0].moe
    assert m is not None
    assert (m.num_experts, m.top_k, m.expert_intermediate, m.shared_intermediate) == (60, 4, 1408, 5632)
    assert m.shared_gate and not m.norm_topk_prob
    a = spec.layers[0].attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.qkv_bias, a.rope_theta) == (16, 16, 128, True, 1e6)
    total = sum(parameter_counts(spec).values())
    assert abs(total / 1e9 - 14.3) < 0.05  # the model card's 14.3B
    blocks = expert_blocks(spec)
    assert len(blocks) == 24 * (60 + 1) * 2
    assert sum(b.expert == SHARED_EXPERT for b in blocks) == 48
    gu = next(b for b in blocks if b.expert == 0 and b.unit == "gate_up")
    assert (gu.n, gu.k) == (2 * 1408, 2048)


def test_mixtral_8x7b_shape(tmp_path: Path) -> None:
    spec, names = load_spec(_dir_with(tmp_path, "mistralai__Mixtral-8x7B-v0.1"))
    assert spec.family == "mixtral" and names.expert_gate == "w1" and names.expert_up == "w3"
    m = spec.layers[0].moe
    assert m is not None and (m.num_experts, m.top_k, m.expert_intermediate) == (8, 2, 14336) and m.norm_topk_prob
    assert abs(sum(parameter_counts(spec).values()) / 1e9 - 46.7) < 0.05


def test_unknown_architecture(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PagedWeightError, match=r"unknown architecture .llama.*supported families"):
        load_spec(d)


def test_missing_dir_config_and_weights(tmp_path: Path) -> None:
    with pytest.raises(PagedWeightError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(PagedWeightError, match=r"no config\.json"):
        load_model(tmp_path)
    d = _dir_with(tmp_path, "Qwen__Qwen1.5-MoE-A2.7B")
    with pytest.raises(PagedWeightError, match=r"no \*.safetensors"):
        load_model(d, device="cpu")
    (d / "config.json").write_text("{not json")
    with pytest.raises(PagedWeightError, match="not valid JSON"):
        load_model(d)


def test_sliding_window_and_rope_scaling_are_refused(tmp_path: Path) -> None:
    d = _dir_with(tmp_path, "Qwen__Qwen1.5-MoE-A2.7B")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "sliding_window": 4096}))
    with pytest.raises(PagedWeightError, match="sliding-window"):
        load_spec(d)
    (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(PagedWeightError, match=r"RoPE scaling .yarn."):
        load_spec(d)
