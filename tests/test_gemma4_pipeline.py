"""The calibration pipeline and the runtime on a tiny random Gemma-4 checkpoint (``_tiny_gemma4``, with the bundled
tokenizer): ``pwcal inspect`` says that the dense MLP stays 16-bit, the four stages write their tables, and
``pwrun generate`` serves it with the artifact under a budget, its sliding-window layers giving KV pages back
(the trace splits KV pages by layer type)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from typer.testing import CliRunner

from pwcal.alloc_scoring import score_allocations
from pwcal.cli import app as pwcal_app
from pwformat.tables import read_table
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_model
from pwrun.cli import app as pwrun_app
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.data import default_model_dir
from pwrun.model.loader import load_model
from pwrun.ppl import perplexity
from tests._tiny_gemma4 import save_tiny_gemma4

runner = CliRunner()
CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def test_pipeline_and_generate(tmp_path: Path) -> None:
    model = tmp_path / "gemma4"
    save_tiny_gemma4(model, vocab_size=4096, sliding_window=20)
    # as a multimodal checkpoint's config (the real one's vision tower, which is not served), text model inside
    real = json.loads((CONFIGS / "google__gemma-4-26B-A4B" / "config.json").read_text())
    text_config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**real, "text_config": text_config}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / f, model / f)
    out, cpu = tmp_path / "ap", ["--device", "cpu"]
    r = runner.invoke(pwcal_app, ["inspect", str(model)])
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "family gemma4" in text and "gelu_tanh" in text and "kept at 16 bits like attention" in text
    assert "2 sliding-window layers (window 20 tokens" in text and "vision tower is not served" in text
    for args in (["quantize", str(model), "--out", str(out), "--samples", "4", "--seq-len", "64", *cpu],
                 ["sensitivity", str(model), "--artifacts", str(out), "--samples", "4", "--seq-len", "64", *cpu],
                 ["fit-residual", str(model), "--artifacts", str(out), "--prompts", "8", *cpu],
                 ["search-buckets", str(model), "--artifacts", str(out), "--candidates", "2", "--heldout-windows",
                  "2", "--confirm-windows", "2", *cpu]):
        r = runner.invoke(pwcal_app, args)
        assert r.exit_code == 0, (args[0], r.stderr)
    for name in ("sensitivity", "routing", "residual_heads", "buckets"):
        assert (out / f"{name}.parquet").is_file()
    _batched_scores_equal_one_model_per_allocation(model, out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(manifest["stages"][s]["complete"] for s in ("quantize", "sensitivity", "fit-residual",
                                                           "search-buckets"))
    r = runner.invoke(pwrun_app, ["generate", "--model", str(model), "--artifacts", str(out), "--gpu-memory", "48MiB",
                                  "--prompt", "The river", "--max-new-tokens", "60", "--trace",
                                  str(tmp_path / "t.parquet"), "--summary-json", str(tmp_path / "s.json"), *cpu])
    assert r.exit_code == 0, r.stderr
    assert "note: the checkpoint's vision tower is not served (text model only)" in r.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["decode_tokens"] + summary["prefill_tokens"] >= 60 and summary["policy"] == "pagedweight"
    trace = pq.read_table(tmp_path / "t.parquet").to_pandas()
    assert (trace.kv_pages_global + trace.kv_pages_sliding == trace.kv_pages).all()
    # 16-token blocks, a window of 20: blocks 0 and 1 leave the window during the 60 decode steps
    assert trace.trimmed_blocks.sum() == 2 and trace.kv_pages_sliding.iloc[-2] < 2 * trace.kv_pages_global.iloc[-2]


def _batched_scores_equal_one_model_per_allocation(model: Path, out: Path) -> None:
    """search-buckets' batched scoring (the Gemma-4 router reads the residual stream; GELU-tanh experts) equals the
    perplexity of one dense model per allocation."""
    art = APArtifact(out)
    base = load_model(model, device="cpu", dtype="float32")
    table = BlockTable.from_frames(read_table(out / "sensitivity.parquet", "sensitivity"),
                                   read_table(out / "routing.parquet", "routing"))
    rng = np.random.default_rng(0)
    qs = [rng.choice(art.bits, size=len(table.layer)) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, base.spec.vocab_size, (30,), generator=g).tolist() for _ in range(2)]
    got = score_allocations(art, base, table, qs, windows)
    for q, row in zip(qs, got, strict=True):
        bits = {(int(la), int(e), UNITS[u]): int(b) for la, e, u, b in zip(table.layer, table.expert, table.unit, q,
                                                                             strict=True)}
        flat = [t for w in windows for t in w]
        want = perplexity(dense_model(art, base, bits), flat, seq_len=len(windows[0])).window_nll
        np.testing.assert_allclose(row, want, rtol=0, atol=2e-5)
