"""The per-layer scale of the Hessian sensitivity (``pwcal sensitivity --layer-scale``, the default).

- ``quantized_layer`` runs one layer's experts at b bits and gives the 16-bit weights back, loaded or streamed.
- ``layer_kl`` equals the KL that transformers' own model gives with that layer's expert weights replaced by the
  artifact's dequantized ones (an independent forward pass).
- ``layer_scales``: a layer that measured nothing takes the others' geometric mean; all nothing is an error.
- the stage: the scaled table is the plain Hessian table times the recorded c_l = KL_l / S_l, ``unscaled`` (and
  fit-residual's reference) gives the plain table back, and manifests from before the scale count as unscaled.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from pwcal.residual import hessian_reference
from pwcal.sensitivity import SensitivityConfig, run_sensitivity, unscaled
from pwcal.stats.layer_scale import layer_kl, layer_scales
from pwformat.errors import PagedWeightError
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_block, quantized_layer
from pwrun.model.inventory import SHARED_EXPERT, expert_blocks
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.runner.prefill import prefill_logits
from tests._artifacts import MODEL, SENSITIVITY, quantize_fast

WINDOWS = [torch.randint(0, 4000, (33,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]


def _logits(model, windows):  # type: ignore[no-untyped-def]
    return prefill_logits(model, windows).view(len(windows), len(windows[0]), -1)


@pytest.mark.parametrize("experts", ["load", "stream"])
def test_quantized_layer_swaps_one_layer_and_restores(calibrated_artifacts: Path, experts: str) -> None:
    art = APArtifact(calibrated_artifacts)
    model = load_model(MODEL, device="cpu", dtype="float32", experts=experts)
    before = _logits(model, WINDOWS[:2])
    with quantized_layer(art, model, 2, 3):
        during = _logits(model, WINDOWS[:2])
    assert torch.equal(_logits(model, WINDOWS[:2]), before)
    assert not torch.allclose(during, before, atol=1e-3)
    # the same as a model whose every block is 16-bit but layer 2's, built block by block from the artifact
    ref = load_model(MODEL, device="cpu", dtype="float32")
    t = art.layer_tensors(2)
    moe = ref.weights.layers[2].moe
    assert moe is not None and moe.shared is not None
    for b in (x for x in expert_blocks(ref.spec) if x.layer == 2):
        w = dense_block(art, t, b, 3, torch.float32)
        if b.expert == SHARED_EXPERT:
            setattr(moe.shared, b.unit, w)
        else:
            getattr(moe, b.unit)[b.expert] = w
    torch.testing.assert_close(during, _logits(ref, WINDOWS[:2]), rtol=1e-5, atol=1e-5)


def test_layer_kl_matches_transformers(calibrated_artifacts: Path) -> None:
    art = APArtifact(calibrated_artifacts)
    bits = min(art.bits)
    ours = layer_kl(load_model(MODEL, device="cpu", dtype="float32", experts="stream"), art, WINDOWS, bits, batch=2)
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = torch.tensor(WINDOWS)
    blocks = expert_blocks(load_model(MODEL, device="cpu", dtype="float32", experts="skip").spec)
    with torch.no_grad():
        ref = F.log_softmax(hf(input_ids=ids).logits[:, :-1].float(), -1)
        for layer in sorted({b.layer for b in blocks}):
            mlp = hf.model.layers[layer].mlp
            saved = {n: p.detach().clone() for n, p in mlp.named_parameters()}
            t = art.layer_tensors(layer)
            for b in (x for x in blocks if x.layer == layer):
                w = dense_block(art, t, b, bits, torch.float32)
                if b.expert != SHARED_EXPERT:
                    getattr(mlp.experts, f"{b.unit}_proj")[b.expert].copy_(w)
                elif b.unit == "gate_up":
                    half = w.shape[0] // 2
                    mlp.shared_expert.gate_proj.weight.copy_(w[:half])
                    mlp.shared_expert.up_proj.weight.copy_(w[half:])
                else:
                    mlp.shared_expert.down_proj.weight.copy_(w)
            lp = F.log_softmax(hf(input_ids=ids).logits[:, :-1].float(), -1)
            want = float((ref.exp() * (ref - lp)).sum(-1).mean())
            for n, p in mlp.named_parameters():
                p.copy_(saved[n])
            assert want > 0
            assert ours[layer] == pytest.approx(want, rel=2e-3), (layer, ours[layer], want)


def test_layer_scales_fallback_and_refusal() -> None:
    c = layer_scales({0: 2.0, 1: 8.0, 2: 0.0}, {0: 1.0, 1: 1.0, 2: 5.0})
    assert c[0] == 2.0 and c[1] == 8.0 and c[2] == pytest.approx(4.0)  # geometric mean of 2 and 8
    assert layer_scales({0: 1.0, 1: 3.0}, {0: 0.0, 1: 1.5})[0] == pytest.approx(2.0)
    with pytest.raises(PagedWeightError, match="no-layer-scale"):
        layer_scales({0: 0.0, 1: 0.0}, {0: 1.0, 1: 1.0})
    with pytest.raises(PagedWeightError, match="scale-samples"):
        SensitivityConfig(scale_samples=0)
    # what the manifest records: a scale that does not apply is recorded off (no spurious "other parameters")
    assert SensitivityConfig().record()["layer_scale"] is True
    assert SensitivityConfig(importance="fisher").record()["layer_scale"] is False
    assert SensitivityConfig(layer_scale=False, scale_samples=3).record()["scale_samples"] == 16


def test_sensitivity_stage_scales_by_layer_and_unscales(tmp_path: Path) -> None:
    plain, scaled = tmp_path / "plain", tmp_path / "scaled"
    quantize_fast(plain)
    shutil.copytree(plain, scaled)
    run_sensitivity(MODEL, plain, SensitivityConfig(**{**SENSITIVITY.__dict__, "layer_scale": False}), "cpu")
    run_sensitivity(MODEL, scaled, SENSITIVITY, "cpu")
    p, s = APArtifact(plain), APArtifact(scaled)
    rec = s.manifest.stage("sensitivity")["layer_scale"]
    assert p.manifest.stage("sensitivity")["layer_scale"] == {}
    assert s.manifest.stage("sensitivity")["layer_scale_windows"] == min(SENSITIVITY.scale_samples,
                                                                         SENSITIVITY.samples)
    a, b = p.table("sensitivity"), s.table("sensitivity")
    key = ["layer", "expert", "unit", "bits"]
    m = a.merge(b, on=key, suffixes=("_p", "_s"))
    assert len(m) == len(a) == len(b)
    low = min(p.bits)
    for layer, g in m.groupby("layer"):
        r = rec[str(layer)]
        assert r["sensitivity"] == pytest.approx(float(g[g.bits == low].sensitivity_p.sum()), rel=1e-9)
        assert r["scale"] == pytest.approx(r["kl"] / r["sensitivity"], rel=1e-9) and r["kl"] > 0
        assert (g.sensitivity_s / g.sensitivity_p).to_numpy() == pytest.approx(r["scale"], rel=1e-9)
    # the measured KL is the output change with the layer at the lowest bitwidth on the first scale_samples windows
    from pwcal.calib_data import calibration_windows
    windows = calibration_windows(load_tokenizer(MODEL), SENSITIVITY.dataset, SENSITIVITY.samples,
                                  SENSITIVITY.seq_len, SENSITIVITY.seed)[: SENSITIVITY.scale_samples]
    kl = layer_kl(load_model(MODEL, device="cpu", dtype="float32", experts="stream"), s, windows, low)
    assert {str(k): pytest.approx(v, rel=1e-6) for k, v in kl.items()} == {k: v["kl"] for k, v in rec.items()}
    # the scale changes the ranking across layers, never within one
    assert not math.isclose(min(v["scale"] for v in rec.values()), max(v["scale"] for v in rec.values()))
    back = unscaled(b, s.manifest.stage("sensitivity")).merge(a, on=key, suffixes=("_u", "_p"))
    assert back.sensitivity_u.to_numpy() == pytest.approx(back.sensitivity_p.to_numpy(), rel=1e-9)
    sens_cfg = SENSITIVITY
    ref = hessian_reference(load_model(MODEL, device="cpu", dtype="float32", experts="stream"), s,
                            load_tokenizer(MODEL), sens_cfg, b)
    pd.testing.assert_series_equal(ref.sort_values(key).sensitivity.reset_index(drop=True),
                                   a.sort_values(key).sensitivity.reset_index(drop=True), rtol=1e-9,
                                   check_names=False)


def test_a_manifest_from_before_the_scale_counts_as_unscaled(tmp_path: Path) -> None:
    art = tmp_path / "ap"
    quantize_fast(art)
    off = SensitivityConfig(**{**SENSITIVITY.__dict__, "layer_scale": False})
    run_sensitivity(MODEL, art, off, "cpu")
    m = json.loads((art / "manifest.json").read_text())
    for k in ("layer_scale", "scale_samples"):
        del m["stages"]["sensitivity"]["config"][k]
    del m["stages"]["sensitivity"]["layer_scale"]
    (art / "manifest.json").write_text(json.dumps(m))
    assert run_sensitivity(MODEL, art, off, "cpu") == {"skipped": True}
    with pytest.raises(PagedWeightError, match="layer_scale: False -> True"):
        run_sensitivity(MODEL, art, SENSITIVITY, "cpu")
    a = APArtifact(art)
    assert unscaled(a.table("sensitivity"), a.manifest.stage("sensitivity")) is not None
