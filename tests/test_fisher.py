"""The Fisher importance of ``pwcal sensitivity`` (``--importance fisher``; the default is ``hessian``).

- ``fisher_diagonal`` equals the squared per-window gradients that transformers' own model gives (autograd through
  an independent implementation of the same network), routed and shared experts; weights stop requiring grad.
- ``weighted_sensitivities`` equals sum F (W - W^b)^2 computed from the dequantized weights, and with a [K]
  importance the Hessian formula h . e^b of ``column_errors``.
- the rare-expert fallback: a typical per-token column profile counted at the expert's frequency, flagged.
- fit-residual's reference is the Hessian table whatever the importance (same heads' inputs either way).
- manifests from before ``--importance`` count as Hessian runs; a bad ``--importance`` is one error line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from pwcal.cli import app
from pwcal.residual import hessian_reference
from pwcal.sensitivity import SensitivityConfig, column_errors, unscaled, weighted_sensitivities, with_fallback
from pwcal.stages import recorded_config
from pwcal.stats.fisher import _expert_tensors, check_memory, fisher_bytes, fisher_diagonal
from pwformat.ap import dequantize
from pwformat.errors import PagedWeightError
from pwformat.tables import read_table
from pwrun.ap.artifact import APArtifact
from pwrun.data import default_model_dir
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.model.weights import dense_weight
from tests._tiny_hf import save_tiny_qwen2moe

MODEL = default_model_dir()
runner = CliRunner()
SMALL = ["--device", "cpu"]


def test_fisher_matches_transformers_gradients(tmp_path: Path) -> None:
    hf = save_tiny_qwen2moe(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    windows = [torch.randint(0, 61, (11,)).tolist() for _ in range(3)]
    model = load_model(tmp_path, device="cpu", dtype="float32")
    blocks = expert_blocks(model.spec)
    ours = fisher_diagonal(model, windows, blocks)
    assert not any(t.requires_grad for lw in model.weights.layers if lw.moe is not None
                   for t in (lw.moe.gate_up, lw.moe.down))

    params = {}
    for i, layer in enumerate(hf.model.layers):
        moe = layer.mlp
        params[(i, "gate_up")], params[(i, "down")] = moe.experts.gate_up_proj, moe.experts.down_proj
        se = moe.shared_expert
        params[(i, "s_gate")], params[(i, "s_up")], params[(i, "s_down")] = (
            se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight)
    names = list(params)
    ref = {k: torch.zeros_like(v) for k, v in params.items()}
    for w in windows:
        ids = torch.tensor([w])
        logits = hf(input_ids=ids).logits[0].float()
        loss = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
        for k, g in zip(names, torch.autograd.grad(loss, [params[k] for k in names]), strict=True):
            ref[k] += g.square()
    for b in blocks:
        got = ours[(b.layer, b.expert, b.unit)]
        if b.expert == SHARED_EXPERT:
            want = (torch.cat([ref[(b.layer, "s_gate")], ref[(b.layer, "s_up")]]) if b.unit == "gate_up"
                    else ref[(b.layer, "s_down")])
        else:
            want = ref[(b.layer, b.unit)][b.expert]
        assert got.shape == (b.n, b.k)
        scale = want.abs().max().clamp_min(1e-12)
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-4 * float(scale)), (b, float((got - want).abs().max()))
    assert sum(float(v.sum()) for v in ours.values()) > 0
    n = sum(b.n * b.k for b in blocks if b.expert == SHARED_EXPERT) + sum(
        lw.moe.gate_up.numel() + lw.moe.down.numel() for lw in model.weights.layers if lw.moe is not None)
    assert fisher_bytes(_expert_tensors(model)) == n * (4 + 4)  # float32 weights: accumulator + gradient


def test_weighted_sensitivities_match_explicit_formulas(calibrated_artifacts: Path) -> None:
    art = APArtifact(calibrated_artifacts)
    model = load_model(MODEL, device="cpu", dtype="float32")
    blocks = [b for b in expert_blocks(model.spec) if b.layer == 1 and b.expert in (SHARED_EXPERT, 2, 7)]
    g = torch.Generator().manual_seed(3)
    fisher = {(b.layer, b.expert, b.unit): (torch.rand(b.n, b.k, generator=g, dtype=torch.float64), 5, False)
              for b in blocks}
    diag = {(b.layer, b.expert, b.unit): (torch.rand(b.k, generator=g, dtype=torch.float64), 5, False)
            for b in blocks}
    s_f = weighted_sensitivities(model, art, blocks, fisher)
    s_h = weighted_sensitivities(model, art, blocks, diag)
    errors = column_errors(model, art, blocks)
    t = art.layer_tensors(1)
    for b in blocks:
        key = (b.layer, b.expert, b.unit)
        w = dense_weight(model, b).double()
        for i, q in enumerate(art.bits):
            wq = dequantize(t[f"{art.key(b)}.planes"], t[f"{art.key(b)}.lut{q}"], b.k, q, torch.float64)
            assert s_f[key][i] == pytest.approx(float((fisher[key][0] * (w - wq) ** 2).sum()), rel=1e-9)
        assert s_h[key] == pytest.approx((errors[key] @ diag[key][0]).tolist(), rel=1e-9)


def test_fallback_takes_the_typical_column_profile() -> None:
    blocks = [LinearBlock(0, e, "down", 3, 4) for e in range(3)]
    imp = {(0, 0, "down"): torch.ones(3, 4) * 2.0, (0, 1, "down"): torch.ones(3, 4) * 6.0,
           (0, 2, "down"): torch.zeros(3, 4)}
    out = with_fallback(imp, {(0, 0): 20, (0, 1): 30, (0, 2): 2}, blocks, min_tokens=16)
    assert not out[(0, 0, "down")][2] and out[(0, 0, "down")][1] == 20
    f, n, fb = out[(0, 2, "down")]
    assert fb and n == 2 and f.shape == (4,)
    assert torch.allclose(f, torch.full((4,), (2.0 / 20 + 6.0 / 30) / 2 * 2))  # mean per-token profile x n
    # an all-zero importance (a Fisher from last-of-window tokens only) is a fallback too, never a silent zero
    imp[(0, 1, "down")] = torch.zeros(3, 4)
    out = with_fallback(imp, {(0, 0): 20, (0, 1): 30, (0, 2): 2}, blocks, min_tokens=16)
    f, n, fb = out[(0, 1, "down")]
    assert fb and n == 30 and torch.allclose(f, torch.full((4,), 2.0 / 20 * 30))
    with pytest.raises(PagedWeightError, match="no expert with >= 16"):
        with_fallback(imp, {(0, 0): 1, (0, 1): 1, (0, 2): 1}, blocks, min_tokens=16)


def test_residual_reference_is_the_hessian_table(tmp_path: Path, calibrated_artifacts: Path) -> None:
    """The session pipeline ran the default (Hessian) sensitivity; on a Fisher run of the same windows,
    fit-residual's reference recomputes that Hessian table."""
    cfg = json.loads((calibrated_artifacts / "manifest.json").read_text())["stages"]["sensitivity"]["config"]
    assert cfg["importance"] == "hessian"
    fis = tmp_path / "ap"
    shutil.copytree(calibrated_artifacts, fis)
    args = ["sensitivity", str(MODEL), "--artifacts", str(fis), "--samples", str(cfg["samples"]), "--seq-len",
            str(cfg["seq_len"])]
    r = runner.invoke(app, [*args, "--importance", "fisher", "--force", *SMALL])
    assert r.exit_code == 0, r.stderr
    # the default table is the Hessian's times a per-layer scale; the reference is the Hessian's own
    want = unscaled(read_table(calibrated_artifacts / "sensitivity.parquet", "sensitivity"),
                    APArtifact(calibrated_artifacts).manifest.stage("sensitivity"))
    fisher = read_table(fis / "sensitivity.parquet", "sensitivity")
    fcfg = json.loads((fis / "manifest.json").read_text())["stages"]["sensitivity"]["config"]
    assert fcfg["importance"] == "fisher"
    model = load_model(MODEL, device="cpu", dtype="float32")
    got = hessian_reference(model, APArtifact(fis), load_tokenizer(MODEL),
                            recorded_config(fis, "sensitivity", SensitivityConfig), fisher)
    keys = ["layer", "expert", "unit", "bits"]
    m = got.merge(want, on=keys, suffixes=("", "_want"))
    assert len(m) == len(want)
    assert ((m.sensitivity - m.sensitivity_want).abs() <= 1e-9 * m.sensitivity_want.abs().clip(lower=1e-30)).all()
    assert (m.fallback == m.fallback_want).all() and (m.tokens == m.tokens_want).all()
    # the Fisher table weighs the later layers' errors less than the Hessian one does
    f = fisher.merge(want, on=keys, suffixes=("", "_h"))
    ratio = (f.sensitivity / f.sensitivity_h)[~f.fallback].groupby(f.layer).median()
    assert ratio.iloc[0] > 3 * ratio.iloc[-1], ratio
    # fit-residual runs on the Fisher artifact
    r = runner.invoke(app, ["fit-residual", str(MODEL), "--artifacts", str(fis), "--prompts", "16", *SMALL])
    assert r.exit_code == 0, r.stderr
    # an old manifest (no importance or layer scale recorded) was an unscaled Hessian run: those parameters are a
    # no-op, the default (scaled) is not
    m2 = json.loads((fis / "manifest.json").read_text())
    for k in ("importance", "layer_scale", "scale_samples"):
        m2["stages"]["sensitivity"]["config"].pop(k)
    (fis / "manifest.json").write_text(json.dumps(m2))
    r = runner.invoke(app, [*args, "--no-layer-scale", *SMALL])
    assert r.exit_code == 0 and "nothing to do" in r.stderr, r.stderr
    r = runner.invoke(app, [*args, *SMALL])
    assert r.exit_code == 2 and "layer_scale: False -> True" in r.stderr, r.stderr
    r = runner.invoke(app, [*args, "--importance", "fisher", *SMALL])
    assert r.exit_code == 2 and "--force" in r.stderr and "importance: 'hessian' -> 'fisher'" in r.stderr, r.stderr


def test_bad_importance_is_one_line(calibrated_artifacts: Path) -> None:
    r = runner.invoke(app, ["sensitivity", str(MODEL), "--artifacts", str(calibrated_artifacts), "--importance",
                            "curvature", *SMALL])
    assert r.exit_code == 2 and "--importance 'curvature' is not one of fisher, hessian" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_no_silent_zero_from_last_tokens(tmp_path: Path, calibrated_artifacts: Path) -> None:
    """Windows of 2 tokens: the second has no target, so experts routed only there get no gradient; they must take
    the fallback (not sensitivity 0 with fallback False)."""
    a = tmp_path / "ap"
    shutil.copytree(calibrated_artifacts, a)
    r = runner.invoke(app, ["sensitivity", str(MODEL), "--artifacts", str(a), "--importance", "fisher", "--samples",
                            "2", "--seq-len", "2", "--min-tokens", "1", "--force", *SMALL])
    assert r.exit_code == 0, r.stderr
    s = read_table(a / "sensitivity.parquet", "sensitivity")
    assert (s.sensitivity > 0).all(), s[s.sensitivity <= 0]
    assert s.fallback.any()


def test_fisher_refuses_more_than_the_free_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10 * 2**30, 80 * 2**30))
    check_memory(9 * 2**30, torch.device("cuda:0"))  # fits
    with pytest.raises(PagedWeightError, match=r"needs 9\.5 GiB on cuda:0 .* 10\.0 GiB are free: use --importance"):
        check_memory(int(9.5 * 2**30), torch.device("cuda:0"))
    check_memory(10**15, torch.device("cpu"))  # not checked off CUDA

