"""Calibration statistics and the pwcal pipeline on the real tiny MoE (small settings).

- Hessian diagonals and routing mass equal a brute-force per-token loop over transformers' own
  hidden states (captured with forward hooks on its MoE blocks).
- sensitivity.parquet: s_i^b non-increasing in b, g >= 0, bytes == the artifact tensors' sizes.
- residual heads beat the constant predictor on held-out prompts (R^2 > 0).
- tables round-trip with their schema; truncated/corrupted files and stage misuse give clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from pwcal.cli import app
from pwcal.stats.collect import Tee, observe
from pwcal.stats.hessian import HessianDiag
from pwcal.stats.routing import RoutingMass
from pwformat.errors import PagedWeightError
from pwformat.tables import read_table, write_table
from pwrun.ap.artifact import APArtifact
from pwrun.core.planner.tables import BlockTable
from pwrun.data import default_model_dir
from pwrun.model.inventory import SHARED_EXPERT
from pwrun.model.loader import load_model
from tests._tiny_hf import save_tiny_qwen2moe

MODEL = default_model_dir()
runner = CliRunner()
SMALL = ["--device", "cpu"]


def test_hessian_and_routing_mass_match_brute_force(tmp_path: Path) -> None:
    hf = save_tiny_qwen2moe(tmp_path)
    windows = [torch.randint(0, 61, (9,)).tolist() for _ in range(3)]
    hess, mass = HessianDiag(), RoutingMass(2, 6)
    observe(load_model(tmp_path, device="cpu"), windows, Tee(hess, mass), batch=2)

    captured: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    hooks = [hf.model.layers[i].mlp.register_forward_pre_hook(
        lambda _m, args, i=i: captured[i].append(args[0].reshape(-1, 32))) for i in range(2)]
    with torch.no_grad():
        for w in windows:
            hf(input_ids=torch.tensor([w]))
    for h in hooks:
        h.remove()
    for layer in range(2):
        moe = hf.model.layers[layer].mlp
        gu, dn = moe.experts.gate_up_proj, moe.experts.down_proj
        h_gu, h_dn, cnt, m = torch.zeros(6, 32), torch.zeros(6, 24), torch.zeros(6), torch.zeros(6)
        s_gu, s_dn = torch.zeros(32), torch.zeros(20)
        for x in torch.cat(captured[layer]):  # one token at a time
            p = torch.softmax(moe.gate.weight @ x, -1)
            top = torch.topk(p, 2)
            for wt, e in zip(top.values, top.indices.tolist(), strict=True):
                g, u = (gu[e] @ x).chunk(2)
                h_gu[e] += x * x
                h_dn[e] += (F.silu(g) * u) ** 2
                cnt[e] += 1
                m[e] += wt
            sg, su = moe.shared_expert.gate_proj.weight @ x, moe.shared_expert.up_proj.weight @ x
            s_gu += x * x
            s_dn += (F.silu(sg) * su) ** 2
        for e in range(6):
            n = hess.tokens.get((layer, e), 0)
            assert n == cnt[e]
            if n:
                assert torch.allclose(hess.diag[(layer, e, "gate_up")].float(), h_gu[e], rtol=1e-4, atol=1e-5)
                assert torch.allclose(hess.diag[(layer, e, "down")].float(), h_dn[e], rtol=1e-4, atol=1e-5)
        assert torch.allclose(hess.diag[(layer, SHARED_EXPERT, "down")].float(), s_dn, rtol=1e-4, atol=1e-5)
        assert np.allclose(mass.mass()[layer], (m / m.sum()).detach().numpy(), atol=1e-5)
        assert dn.shape[-1] == 24


@pytest.fixture(scope="module")
def pipeline(calibrated_artifacts: Path) -> Path:
    return calibrated_artifacts


def test_sensitivity_table(pipeline: Path) -> None:
    s = read_table(pipeline / "sensitivity.parquet", "sensitivity")
    assert (s.sensitivity >= 0).all() and s.tokens.ge(0).all()
    for _, g in s.groupby(["layer", "expert", "unit"]):
        assert (np.diff(g.sort_values("bits").sensitivity.to_numpy()) <= 0).all()
    t = BlockTable.from_frames(s, read_table(pipeline / "routing.parquet", "routing"))
    assert (t.global_damage() >= 0).all()
    art = APArtifact(pipeline)
    tensors = art.layer_tensors(2)
    for _, row in s[(s.layer == 2) & (s.expert.isin([-1, 3]))].iterrows():
        key = f"{'shared' if row.expert == -1 else row.expert}.{row.unit}"
        planes, lut = tensors[f"{key}.planes"], tensors[f"{key}.lut{row.bits}"]
        assert row.bytes == planes[: row.bits].numel() * 4 + lut.numel() * 2
    r = read_table(pipeline / "routing.parquet", "routing")
    assert np.allclose(r.groupby("layer").mass.sum(), 1.0)


def test_residual_heads_beat_constant_predictor(pipeline: Path) -> None:
    h = read_table(pipeline / "residual_heads.parquet", "residual_heads")
    assert len(h) == 2 * 15  # 2 units x all transitions among 3..8
    assert h.r2_heldout.mean() > 0 and (h.r2_heldout > 0).mean() >= 0.8
    assert ((h.confidence >= 0) & (h.confidence <= 1)).all() and (h.rho_min < h.rho_max).all()


def test_buckets_written_and_stages_skip(pipeline: Path) -> None:
    b = read_table(pipeline / "buckets.parquet", "buckets")
    assert b.mass_quantile_hi.iloc[-1] == 1.0 and (b.floor_stage1 <= b.floor_stage0).all()
    log = read_table(pipeline / "bucket_search.parquet", "bucket_search")
    assert log.candidate.nunique() == 3 and (log.expert_bytes <= log.budget_bytes).all()
    r = runner.invoke(app, ["sensitivity", str(MODEL), "--artifacts", str(pipeline), "--samples", "16",
                            "--seq-len", "256", *SMALL])
    assert r.exit_code == 0 and "nothing to do" in r.stderr
    r = runner.invoke(app, ["sensitivity", str(MODEL), "--artifacts", str(pipeline), *SMALL])
    assert r.exit_code == 2 and "--force" in r.stderr
    r = runner.invoke(app, ["search-buckets", str(MODEL), "--artifacts", str(pipeline), "--candidates", "2",
                            "--heldout-windows", "4", "--confirm-windows", "2", *SMALL])  # tuple config: still a no-op
    assert r.exit_code == 0 and "nothing to do" in r.stderr


def test_search_buckets_names_the_text_of_its_perplexity(tmp_path: Path, pipeline: Path) -> None:
    import json
    import shutil

    again = tmp_path / "ap"
    shutil.copytree(pipeline, again)
    r = runner.invoke(app, ["search-buckets", str(MODEL), "--artifacts", str(again), "--candidates", "1",
                            "--heldout-windows", "2", "--confirm-windows", "2", "--force", *SMALL])
    assert r.exit_code == 0, r.stderr
    assert "perplexity on held-out c4-calib text (512 tokens past the calibration ones)" in r.stderr, r.stderr
    info = json.loads((again / "manifest.json").read_text())["stages"]["search-buckets"]
    assert info["heldout_dataset"] == "c4-calib" and info["heldout_tokens"] == 512


def test_an_interrupt_while_a_stage_writes_waits_for_its_record(tmp_path: Path, pipeline: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C / SIGTERM arriving once search-buckets began writing (start_writing marked it incomplete) are deferred
    until its tables and manifest record are written: the stage stays complete with the new tables, then the
    command stops as interrupted. Before, the stage was left incomplete (or its new tables under the old record)."""
    import os
    import shutil
    import signal

    import pwcal.bucket_search as bs
    from pwcal.verify import artifact_problems

    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        again = tmp_path / f"ap{sig}"
        shutil.copytree(pipeline, again)
        real = bs.write_table

        def write_and_signal(*args, sig=sig, real=real, **kwargs):  # type: ignore[no-untyped-def]
            os.kill(os.getpid(), sig)  # arrives between the stage's writes
            return real(*args, **kwargs)

        monkeypatch.setattr(bs, "write_table", write_and_signal)
        # Ctrl-C as a terminal's foreground process has it (a background job, e.g. CI under nohup, ignores SIGINT)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            r = runner.invoke(app, ["search-buckets", str(MODEL), "--artifacts", str(again), "--candidates", "1",
                                    "--heldout-windows", "2", "--confirm-windows", "2", "--seed", "3", "--force",
                                    *SMALL])
        finally:
            signal.signal(signal.SIGINT, previous)
        monkeypatch.setattr(bs, "write_table", real)
        assert r.exit_code == code, (r.exit_code, r.stderr)
        stage = json.loads((again / "manifest.json").read_text())["stages"]["search-buckets"]
        assert stage["complete"] and stage["config"]["seed"] == 3
        assert artifact_problems(again) == []  # the recorded checksums are those of the tables on disk


def test_refused_force_run_leaves_the_manifest_as_it_was(tmp_path: Path, pipeline: Path) -> None:
    """Bad input found while a --force stage prepares (a dataset with no window) changes nothing: the stage and
    later ones stay complete; start_writing is what marks them incomplete."""
    import shutil

    from pwcal.stages import start_writing

    again = tmp_path / "ap"
    shutil.copytree(pipeline, again)
    before = (again / "manifest.json").read_text()
    short = tmp_path / "short.txt"
    short.write_text("too short\n")
    r = runner.invoke(app, ["sensitivity", str(MODEL), "--artifacts", str(again), "--force", "--dataset", str(short),
                            *SMALL])
    assert r.exit_code == 2 and "window" in r.stderr, r.stderr
    assert (again / "manifest.json").read_text() == before
    start_writing(again, "sensitivity")
    stages = json.loads((again / "manifest.json").read_text())["stages"]
    assert stages["quantize"]["complete"] and not stages["sensitivity"]["complete"]
    assert not stages["fit-residual"]["complete"]
    assert not stages["search-buckets"]["complete"] and "did not finish" in stages["search-buckets"]["stale_because"]


def test_stage_order_is_enforced(tmp_path: Path, pipeline: Path) -> None:
    import shutil

    fresh = tmp_path / "ap"
    shutil.copytree(pipeline, fresh)
    import json

    m = json.loads((fresh / "manifest.json").read_text())
    del m["stages"]["sensitivity"]
    (fresh / "manifest.json").write_text(json.dumps(m))
    r = runner.invoke(app, ["fit-residual", str(MODEL), "--artifacts", str(fresh), *SMALL])
    assert r.exit_code == 2 and "run `pwcal sensitivity`" in r.stderr


def test_the_residual_stage_neither_gates_nor_invalidates_search_buckets(tmp_path: Path, pipeline: Path) -> None:
    """fit-residual is a side stage (the bucket search never uses the heads): search-buckets runs on an artifact
    whose fit-residual never ran, or ran and did not complete; finishing fit-residual later leaves the buckets
    complete; re-running sensitivity still marks both out of date."""
    import shutil

    from pwcal.stages import finish_stage, start_writing

    art = tmp_path / "ap"
    shutil.copytree(pipeline, art)
    m = json.loads((art / "manifest.json").read_text())
    del m["stages"]["fit-residual"]
    m["checksums"].pop("residual_heads.parquet")
    (art / "manifest.json").write_text(json.dumps(m))
    (art / "residual_heads.parquet").unlink()
    buckets = ["--candidates", "2", "--heldout-windows", "4", "--confirm-windows", "2", *SMALL]
    r = runner.invoke(app, ["search-buckets", str(MODEL), "--artifacts", str(art), "--force", *buckets])
    assert r.exit_code == 0, r.stderr
    stages = json.loads((art / "manifest.json").read_text())["stages"]
    assert stages["search-buckets"]["complete"] and "fit-residual" not in stages
    assert not (art / "residual_heads.parquet").exists() and (art / "buckets.parquet").is_file()
    finish_stage(art, "fit-residual", {"files": []})
    start_writing(art, "fit-residual")  # a fit-residual re-run interrupted: its record incomplete, the buckets not
    stages = json.loads((art / "manifest.json").read_text())["stages"]
    assert not stages["fit-residual"]["complete"] and stages["search-buckets"]["complete"]
    r = runner.invoke(app, ["search-buckets", str(MODEL), "--artifacts", str(art), "--force", *buckets])
    assert r.exit_code == 0, r.stderr
    finish_stage(art, "fit-residual", {"files": []})
    stages = json.loads((art / "manifest.json").read_text())["stages"]
    assert stages["fit-residual"]["complete"] and stages["search-buckets"]["complete"]
    finish_stage(art, "sensitivity", {"files": []})
    stages = json.loads((art / "manifest.json").read_text())["stages"]
    assert not stages["fit-residual"]["complete"] and not stages["search-buckets"]["complete"]


@pytest.mark.parametrize("heads", [False, True])
def test_run_all_fits_residual_heads_only_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     heads: bool) -> None:
    from pwcal import cli_calib, cli_quant

    ran: list[str] = []
    for mod, name in ((cli_quant, "quantize"), (cli_calib, "sensitivity"), (cli_calib, "fit_residual"),
                      (cli_calib, "search_buckets")):
        monkeypatch.setattr(mod, name, lambda *a, name=name, **k: ran.append(name))
    r = runner.invoke(app, ["run-all", str(MODEL), "--out", str(tmp_path), *(["--residual-heads"] if heads else [])])
    assert r.exit_code == 0, r.stderr
    assert ran == ["quantize", "sensitivity", *(["fit_residual"] if heads else []), "search_buckets"]


def test_tables_round_trip_and_corruption(tmp_path: Path) -> None:
    df = pd.DataFrame({"layer": [0, 1], "expert": [-1, 4], "mass": [0.5, 0.25], "tokens": [10, 3]})
    p = tmp_path / "routing.parquet"
    write_table(df, p, "routing")
    back = read_table(p, "routing")
    pd.testing.assert_frame_equal(back, df.astype({"layer": "int32", "expert": "int32"}))
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises(PagedWeightError, match="truncated or corrupted"):
        read_table(p, "routing")
    write_table(df, p, "routing")
    with pytest.raises(PagedWeightError, match="schema"):
        read_table(p, "sensitivity")
    with pytest.raises(PagedWeightError, match="missing"):
        read_table(tmp_path / "nope.parquet", "routing")


def test_bucket_search_band_and_sample_rules() -> None:
    from pwcal.bucket_search import budget_z, neutral_from, policy_frame, sample, shows_gain
    from pwrun.core.planner.buckets import BucketPolicy

    budgets = [3.5, 4.0, 4.5, 5.0, 6.0]
    yes, no = True, False
    assert neutral_from(budgets, [yes, yes, no, no, no]) == 4.5  # no gain from 4.5 on
    assert neutral_from(budgets, [yes, no, yes, no, no]) == 4.0  # the first budget without a gain ends the band
    assert neutral_from(budgets, [no, no, no, no, yes]) == 3.5  # a gain at the largest alone is not applied below
    assert neutral_from(budgets, [yes] * 5) is None and neutral_from(budgets, [no] * 5) == 3.5
    assert neutral_from([6.0, 3.5, 5.0], [no, yes, no]) == 5.0  # budgets in any order
    rng = np.random.default_rng(0)
    base = 4.7 + rng.normal(0, 0.3, 24)
    assert shows_gain(base, base - 0.01 + rng.normal(0, 0.002, 24), 1.645)  # consistent small gain
    assert not shows_gain(base, base - 0.001 + rng.normal(0, 0.02, 24), 1.645)  # gain far inside the noise
    assert not shows_gain(base, base + 0.01, 1.645) and not shows_gain(base[:1], base[:1] - 1, 1.645)
    # the family of budgets holds at gain_z: each budget's one-sided tail is the family's / budgets
    assert budget_z(1.645, 1) == pytest.approx(1.645, abs=1e-3) and budget_z(1.645, 5) == pytest.approx(2.326, abs=1e-3)
    assert budget_z(3.0, 4) > budget_z(3.0, 2) > 3.0
    assert set(sample(64, 8, 0)) <= set(sample(64, 12, 0)) and sample(64, None, 0) == list(range(64))
    pol = BucketPolicy((0.75,), (1.0, 8.0), ((3, 5), (3, 4)), (1, 1), neutral_from_bits=4.5)
    assert BucketPolicy.from_frame(policy_frame(pol)) == pol
    assert BucketPolicy.from_frame(policy_frame(pol.without_band())) == pol.without_band()
