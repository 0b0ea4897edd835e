"""`pwcal quantize` on the bundled real tiny MoE: artifact contents, quality, idempotence, bad input.

One quantization (small calibration) is shared by the module's tests.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from pwcal.cli import app
from pwformat.ap import unpack_codes
from pwformat.cost import block_bytes
from pwformat.errors import PagedWeightError
from pwformat.manifest import Manifest, check_same_model, read_manifest
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_model
from pwrun.cli import app as pwrun_app
from pwrun.data import default_model_dir, read_text
from pwrun.model.inventory import expert_blocks
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.ppl import perplexity

MODEL = default_model_dir()
runner = CliRunner()
ARGS = ["--samples", "8", "--seq-len", "256", "--device", "cpu"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ap") / "tiny-ap"
    r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(out), *ARGS])
    assert r.exit_code == 0, r.stderr
    return out


def test_manifest_and_files(artifact: Path) -> None:
    m = json.loads((artifact / "manifest.json").read_text())
    assert m["format"] == "pagedweight-ap" and m["bits"] == [3, 4, 5, 6, 7, 8]
    assert m["model"]["family"] == "qwen2_moe" and len(m["model"]["weights_sha256"]) == 64
    q = m["stages"]["quantize"]
    assert q["complete"] and q["calibration_tokens"] == 8 * 256 and q["config"]["samples"] == 8
    assert not (artifact.parent / "tiny-ap.partial").exists()


def test_artifact_is_nested_and_sizes_match(artifact: Path) -> None:
    art = APArtifact(artifact)
    spec = load_model(MODEL, device="cpu").spec
    blocks = [b for b in expert_blocks(spec) if b.layer == 1]
    t = art.layer_tensors(1)
    for b in blocks[:6]:
        key = art.key(b)
        planes = t[f"{key}.planes"]
        full = unpack_codes(planes, b.k, 8)
        for bits in art.bits:
            lut = t[f"{key}.lut{bits}"]
            assert torch.equal(unpack_codes(planes, b.k, bits), full >> (8 - bits))
            assert block_bytes(b.n, b.k, bits) == bits * planes[0].numel() * 4 + lut.numel() * 2


def test_8bit_is_within_half_a_percent_and_3bit_is_worse(artifact: Path) -> None:
    tok = load_tokenizer(MODEL)
    base = load_model(MODEL, device="cpu")
    ids = tok(read_text("wikitext2"), add_special_tokens=False, verbose=False).input_ids
    art = APArtifact(artifact)
    p16 = perplexity(base, ids, 512, max_windows=24).ppl
    p8 = perplexity(dense_model(art, base, 8), ids, 512, max_windows=24).ppl
    p3 = perplexity(dense_model(art, base, 3), ids, 512, max_windows=24).ppl
    assert abs(p8 / p16 - 1) < 0.005
    assert p3 > p8 * 1.005


@pytest.mark.slow
def test_gptq_beats_kmeans_at_3_bits_and_8_bits_stays_lossless(artifact: Path, tmp_path: Path) -> None:
    """``--method gptq`` (error feedback, ``pwcal.quant.gptq``) against the default k-means on the same calibration.

    With enough calibration tokens (half the default here): with the module's 8 x 256 tokens (~500 per expert for
    256 input columns) error feedback overfits and loses to k-means at 3 bits (measured: +24% against +19%).
    """
    assert json.loads((artifact / "manifest.json").read_text())["stages"]["quantize"]["config"]["method"] == "kmeans"
    outs = {}
    for method in ("gptq", "kmeans"):
        outs[method] = tmp_path / method
        r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(outs[method]), "--samples", "32", "--device",
                                "cpu", "--method", method])
        assert r.exit_code == 0, r.stderr
        cfg = json.loads((outs[method] / "manifest.json").read_text())["stages"]["quantize"]["config"]
        assert cfg["method"] == method
    tok = load_tokenizer(MODEL)
    base = load_model(MODEL, device="cpu")
    ids = tok(read_text("wikitext2"), add_special_tokens=False, verbose=False).input_ids
    p = {(m, b): perplexity(dense_model(APArtifact(a), base, b), ids, 512, max_windows=16).ppl
         for m, a in outs.items() for b in (3, 8)}
    p16 = perplexity(base, ids, 512, max_windows=16).ppl
    assert p[("gptq", 3)] < p[("kmeans", 3)] - 0.02 * p16  # default calibration, 96 windows: +9.4% against +16%
    assert abs(p[("gptq", 8)] / p16 - 1) < 0.005


def test_rerun_is_a_noop_and_other_model_is_refused(artifact: Path, tmp_path: Path) -> None:
    before = (artifact / "manifest.json").read_text()
    r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(artifact), *ARGS])
    assert r.exit_code == 0 and "nothing to do" in r.stderr
    assert (artifact / "manifest.json").read_text() == before
    old = tmp_path / "old"  # an artifact from before --method: still a k-means one with today's defaults
    shutil.copytree(artifact, old)
    m = json.loads(before)
    for key in ("method", "damp", "feedback_bits", "hessian_memory_gib"):
        del m["stages"]["quantize"]["config"][key]
    (old / "manifest.json").write_text(json.dumps(m))
    r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(old), *ARGS])
    assert r.exit_code == 0 and "nothing to do" in r.stderr
    r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(old), *ARGS, "--method", "gptq"])
    assert r.exit_code == 2 and "--force" in r.stderr
    # options that do not change a k-means artifact do not block a rerun
    r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(old), *ARGS, "--damp", "0.2", "--hessian-memory", "1"])
    assert r.exit_code == 0 and "nothing to do" in r.stderr
    r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(artifact), *ARGS[:1], "9", *ARGS[2:]])
    assert r.exit_code == 2 and "--force" in r.stderr
    other = tmp_path / "other"
    shutil.copytree(MODEL, other)
    cfg = json.loads((other / "config.json").read_text())
    # the same config re-saved (keys reordered, indented, another transformers version) is the same model
    (other / "config.json").write_text(json.dumps({**dict(reversed(cfg.items())), "transformers_version": "9.9"},
                                                  indent=4))
    APArtifact(artifact).check_model(other)
    check_same_model(read_manifest(artifact), other, artifact, full=True)
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    with pytest.raises(PagedWeightError, match=r"made for another model: these weights with another config\.json"):
        APArtifact(artifact).check_model(other)
    # a fine-tune: the same config.json, file names and sizes, every float tensor changed a little
    tuned = tmp_path / "tuned"
    shutil.copytree(MODEL, tuned)
    for shard in sorted(tuned.glob("*.safetensors")):
        size = shard.stat().st_size
        tensors = load_file(shard)
        save_file({k: v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v for k, v in tensors.items()},
                  shard, metadata={"format": "pt"})
        assert shard.stat().st_size == size
    APArtifact(artifact).check_model(MODEL)  # its own model passes
    with pytest.raises(PagedWeightError, match="made for another model"):
        APArtifact(artifact).check_model(tuned)
    # only one expert matrix fine-tuned: the sampled fingerprint probes every tensor
    one = tmp_path / "one"
    shutil.copytree(MODEL, one)
    shard = sorted(one.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(k for k in sorted(tensors) if ".experts.5.down_proj" in k)
    tensors[name] = tensors[name] + 1e-3 * torch.randn_like(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(PagedWeightError, match="made for another model"):
        APArtifact(artifact).check_model(one)
    # an artifact from before the sampled fingerprint: the runtime checks names and sizes only; the pwcal stages
    # (full=True) compare every byte's sha256
    raw = json.loads((artifact / "manifest.json").read_text())
    del raw["model"]["weights_sample"]
    old = Manifest.from_dict(raw, artifact / "manifest.json")
    check_same_model(old, tuned, artifact)
    with pytest.raises(PagedWeightError, match="made for another model"):
        check_same_model(old, tuned, artifact, full=True)
    check_same_model(old, MODEL, artifact, full=True)
    # an artifact from before the content hash recorded config.json's bytes: those still match
    raw["model"]["config_sha256"] = hashlib.sha256((MODEL / "config.json").read_bytes()).hexdigest()
    check_same_model(Manifest.from_dict(raw, artifact / "manifest.json"), MODEL, artifact, full=True)
    assert raw["model"]["config_sha256"] != read_manifest(artifact).model.config_sha256


def _rewrite_header(shard: Path, mutate: Callable[[dict[str, Any]], Any]) -> None:
    """``shard`` with its header replaced by ``mutate(header)`` (JSON, or bytes as they are; the tensor data after
    it unchanged)."""
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    new = mutate(json.loads(data[8:8 + n]))
    head = new if isinstance(new, bytes) else json.dumps(new).encode()
    shard.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n:])


def _first_tensor(h: dict[str, Any], offsets: Any) -> dict[str, Any]:
    name = next(k for k in h if k != "__metadata__")
    return {**h, name: {**h[name], "data_offsets": offsets(h[name]["data_offsets"])}}


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {  # name: (what is done to a shard, the error's words)
    "cut": (lambda f: f.write_bytes(f.read_bytes()[:-1000]), "is cut short"),
    "garbled": (lambda f: f.write_bytes(f.read_bytes()[:8] + b"{not json" + f.read_bytes()[17:]),
                "no readable safetensors header"),
    "nested": (lambda f: _rewrite_header(f, lambda h: b"[" * 3000 + b"]" * 3000), "no readable"),
    "three offsets": (lambda f: _rewrite_header(f, lambda h: _first_tensor(h, lambda o: [*o, 0])), "no readable"),
    "negative offset": (lambda f: _rewrite_header(f, lambda h: _first_tensor(h, lambda o: [-8, o[1]])),
                        "no readable"),
    "string offsets": (lambda f: _rewrite_header(f, lambda h: _first_tensor(h, lambda o: [str(x) for x in o])),
                       "no readable"),
    "missing": (lambda f: f.unlink(), "listed in the index are missing"),
    "extra": (lambda f: shutil.copy(f, f.with_name("extra.safetensors")), "extra.safetensors not listed in"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_not_called_another_model(artifact: Path, tmp_path: Path, damage: str) -> None:
    """A shard cut short (a stopped copy), with a header that is not one, missing, or a safetensors file the index
    does not list fails the fingerprint like another model would; the error says what is wrong instead, in one
    line, and pwcal quantize reading the same copy ends with one line too (no traceback)."""
    copy = tmp_path / "m"
    shutil.copytree(MODEL, copy)
    shard = sorted(copy.glob("*.safetensors"))[1]
    act, want = DAMAGE[damage]
    act(shard)
    with pytest.raises(PagedWeightError, match=want) as err:
        APArtifact(artifact).check_model(copy)
    assert "another model" not in str(err.value)
    assert ("extra.safetensors" if damage == "extra" else shard.name) in str(err.value)
    r = CliRunner().invoke(pwrun_app, ["generate", "-m", str(copy), "--artifacts", str(artifact), "--policy",
                                       "uniform", "--bits", "4", "--prompt", "The", "--max-new-tokens", "2",
                                       "--device", "cpu"])
    assert r.exit_code == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    if damage != "extra":  # quantize reads the files the index lists
        r = runner.invoke(app, ["quantize", str(copy), "--out", str(tmp_path / "o"), *ARGS])
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "o").exists()


def test_a_config_with_nan_is_refused(tmp_path: Path) -> None:
    """Python's json reads NaN and Infinity; config.json may hold neither (a NaN epsilon serves empty text)."""
    copy = tmp_path / "m"
    shutil.copytree(MODEL, copy)
    text = (copy / "config.json").read_text()
    cfg = json.loads(text)
    (copy / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": float("nan")}))
    r = runner.invoke(app, ["quantize", str(copy), "--out", str(tmp_path / "o"), *ARGS])
    assert r.exit_code == 2 and "holds NaN, not a number" in r.stderr and "restore config.json" in r.stderr, r.stderr
    (copy / "config.json").write_text("\ufeff" + text, encoding="utf-8")  # transformers cannot read it
    r = runner.invoke(app, ["quantize", str(copy), "--out", str(tmp_path / "o"), *ARGS])
    assert r.exit_code == 2 and "byte-order mark: save it as UTF-8 without one" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_nan_in_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(MODEL, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(k for k in tensors if ".experts.3.down_proj" in k)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    r = runner.invoke(app, ["quantize", str(bad), "--out", str(tmp_path / "o"), *ARGS])
    assert r.exit_code == 2 and "NaN or Inf" in r.stderr and f"tensor '{name}'" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_out_that_is_not_an_artifact_is_never_overwritten(tmp_path: Path) -> None:
    f = tmp_path / "notes.json"
    f.write_text("{}")
    d = tmp_path / "mydir"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    for out in (f, d):
        r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(out), *ARGS, "--force"])
        assert r.exit_code == 2 and "not a PagedWeight artifact" in r.stderr
    assert f.read_text() == "{}" and (d / "keep.txt").read_text() == "mine"


def test_an_artifact_path_that_is_missing_or_not_an_artifact_is_named_so(tmp_path: Path) -> None:
    with pytest.raises(PagedWeightError, match=f"{tmp_path / 'gone'} does not exist: give the directory"):
        APArtifact(tmp_path / "gone")
    with pytest.raises(PagedWeightError, match=r"is not a PagedWeight artifact \(no manifest.json\)"):
        APArtifact(tmp_path)


def test_a_second_writer_of_the_same_out_is_refused_and_loses_nothing(artifact: Path, tmp_path: Path) -> None:
    """While one run writes OUT (it holds OUT.lock, here taken by the test), another `pwcal quantize` to the same OUT
    stops with a one-line error before touching anything: the first run's OUT.partial/ and the complete artifact
    at OUT stay as they were; after a normal run no lock file is left."""
    from pwformat.writer_lock import lock_path, writer_lock

    out = tmp_path / "tiny-ap"
    shutil.copytree(artifact, out)
    partial = tmp_path / "tiny-ap.partial"
    partial.mkdir()
    (partial / "layer_000.safetensors").write_bytes(b"first run's half-written layer")
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    with writer_lock(out):
        r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(out), *ARGS, "--force"])
        assert r.exit_code == 2 and "is writing" in r.stderr and "another --out" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert (partial / "layer_000.safetensors").read_bytes() == b"first run's half-written layer"
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before
    assert not lock_path(out).exists()
    shutil.rmtree(partial)
    r = runner.invoke(app, ["quantize", str(MODEL), "--out", str(out), *ARGS])  # complete and same: a no-op
    assert r.exit_code == 0, r.stderr
    assert not lock_path(out).exists() and not partial.exists()


def test_out_that_is_the_current_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--out .` (or `--out ..`) would rename the directory the user stands in: one-line error, nothing written."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    r = runner.invoke(app, ["quantize", str(MODEL), "--out", ".", *ARGS])
    assert r.exit_code == 2 and "current directory" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == [work] and not any(work.iterdir())


def test_writer_lock_taken_over_from_a_run_that_just_finished(tmp_path: Path) -> None:
    """A run that opens OUT.lock just before the holder finishes (the holder removes the file, then releases)
    must take the lock on a fresh file, not report the finished run as still writing; a lock file that is a
    directory gets an error that says to remove it."""
    import os
    import threading

    import pwformat.writer_lock as wl

    out = tmp_path / "OUT"
    opened, released = threading.Event(), threading.Event()

    def holder() -> None:
        with wl.writer_lock(out):
            opened.wait(10)
        released.set()

    real_open = os.open

    def open_then_wait(*args, **kwargs):  # type: ignore[no-untyped-def]
        fd = real_open(*args, **kwargs)
        opened.set()
        released.wait(10)
        return fd

    th = threading.Thread(target=holder)
    th.start()
    while not wl.lock_path(out).exists():
        pass
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(wl.os, "open", open_then_wait)
    try:
        with wl.writer_lock(out):
            monkeypatch.undo()
            assert wl.lock_path(out).exists()
    finally:
        monkeypatch.undo()
        th.join()
    assert not wl.lock_path(out).exists()
    wl.lock_path(out).mkdir()
    with pytest.raises(PagedWeightError, match=r"remove .*OUT\.lock"), wl.writer_lock(out):
        pass


def test_a_full_disk_while_saving_a_layer_is_an_os_error_naming_the_file(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors reports a failed write as its own error; the layer writer turns it into the OSError every other
    write gives (the CLI's one line then names the file and says to free some space)."""
    import errno

    from safetensors import SafetensorError

    import pwcal.quant.quantize as q

    def full(*_: object, **__: object) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(q, "save_file", full)
    with pytest.raises(OSError) as info:
        q._save_layer({"x": torch.zeros(2)}, tmp_path / "layer_000.safetensors", {})
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "layer_000.safetensors")
