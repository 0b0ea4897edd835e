"""CLI tests on the bundled real tiny MoE: generation, batching, perplexity and bad input."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pwrun.cli
import pwrun.serve.server
from pwcal.calib_data import calibration_windows
from pwcal.cli import app as pwcal_app
from pwformat.errors import PagedWeightError
from pwrun.cli import app
from pwrun.cli_common import idle_cores
from pwrun.data import default_model_dir
from pwrun.engine.build import ServeConfig
from pwrun.model.loader import load_tokenizer

MODEL = default_model_dir()


runner = CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    """Invoke pwrun; on CPU in fp32 unless the test names a device (bit-exact comparisons need it)."""
    extra = [] if "--device" in args or args[0] not in ("generate", "ppl") else ["--device", "cpu"]
    r = runner.invoke(app, [*args, *extra])
    return r.exit_code, r.stdout, r.stderr


def test_generate_greedy_is_deterministic_and_streams_text() -> None:
    code, out1, _ = run("generate", "--prompt", "The river", "--max-new-tokens", "12")
    assert code == 0, out1
    code, out2, _ = run("generate", "--prompt", "The river", "--max-new-tokens", "12")
    assert out1 == out2 and out1.startswith("The river") and len(out1.strip()) > len("The river") + 5


def test_sampling_is_seeded() -> None:
    a = run("generate", "--prompt", "In 1900", "--max-new-tokens", "16", "--temperature", "1.0", "--seed", "5")[1]
    b = run("generate", "--prompt", "In 1900", "--max-new-tokens", "16", "--temperature", "1.0", "--seed", "5")[1]
    c = run("generate", "--prompt", "In 1900", "--max-new-tokens", "16", "--temperature", "1.0", "--seed", "6")[1]
    assert a == b and a != c


def test_batched_prompts_match_single_prompt_runs(tmp_path: Path) -> None:
    prompts = ["The war ended", "A small village in the north of England is known for its", "Music"]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    code, _, err = run("generate", "--prompts", str(f), "--max-new-tokens", "10", "--output", str(out))
    assert code == 0, err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    for r in rows:  # ragged batch in one step == each prompt alone
        single = run("generate", "--prompt", r["prompt"], "--max-new-tokens", "10")[1]
        assert single.rstrip("\n") == r["prompt"] + r["text"]


def test_ppl_json_on_bundled_text() -> None:
    code, out, err = run("ppl", "--dataset", "wikitext2", "--max-windows", "4", "--seq-len", "256", "--json")
    assert code == 0, err
    row = json.loads(out)
    assert row["windows"] == 4 and row["tokens"] == 4 * 255 and row["dtype"] == "float32"  # the CPU default
    assert 10 < row["ppl"] < 1000  # the oracle unigram perplexity of this text is ~ 1,000+


def test_pwcal_inspect(tmp_path: Path) -> None:
    r = runner.invoke(pwcal_app, ["inspect", str(MODEL)])
    assert r.exit_code == 0 and "qwen2_moe" in r.stdout and "routed_experts" in r.stdout
    # a checkpoint with a truncated shard, then with one missing: one error line each, exit 2
    for f in MODEL.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, tmp_path / f.name)
    shards = sorted(MODEL.glob("*.safetensors"))
    for f in shards[:-1]:
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / shards[-1].name).write_bytes(shards[-1].read_bytes()[:4096])
    r = runner.invoke(pwcal_app, ["inspect", str(tmp_path)])
    assert r.exit_code == 2 and "is not a readable safetensors file" in r.stderr, r.stderr
    (tmp_path / shards[0].name).unlink()
    r = runner.invoke(pwcal_app, ["inspect", str(tmp_path)])
    assert r.exit_code == 2 and "listed in the index are missing" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--prompt", "x", "--model", "/nonexistent/model"], "does not exist"),
        (["generate", "--prompt", "word " * 3000], "context of"),
        (["generate", "--prompt", "hi", "--max-batch", "1000000"], "GiB of step workspace (a lower --max-batch"),
        (["generate"], "exactly one of --prompt"),
        (["ppl", "--dataset", "nonexistent.txt"], "neither a bundled name"),
        (["ppl", "--seq-len", "100000"], "--seq-len 100000"),
        (["ppl", "--seq-len", "0"], "--seq-len must be >= 2"),
        (["ppl", "--max-windows", "-3"], "--max-windows >= 1"),
        (["ppl", "--uniform-bits", "4"], "--uniform-bits 4 needs --artifacts DIR"),
        (["ppl", "--artifacts", "/nonexistent/ap"], "--artifacts needs --uniform-bits N"),
        (["generate", "--prompt", "x", "--device", "cuda:0"], None),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str | None) -> None:
    code, out, err = run(*args)
    if message is None:  # cuda: fine where a GPU exists, a clear error otherwise
        assert code == 0 or "no CUDA GPU" in err
        return
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_bad_prompts_file_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    code, _, err = run("generate", "--prompts", str(f))
    assert code == 2 and f"{f}:2" in err


def test_prompt_fields_that_are_not_read_are_named() -> None:
    """A line's fields beyond 'prompt' and 'arrival_s' (e.g. a per-request max_tokens) get one warning naming
    them and their first line; the run goes on."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "p.jsonl"
        f.write_text('{"prompt": "The river", "arrival_s": 0}\n{"prompt": "A cat", "max_tokens": 50, "arrival_s": 0}\n')
        code, out, err = run("generate", "--prompts", str(f), "--max-new-tokens", "2")
        assert code == 0 and len([x for x in out.splitlines() if x.startswith("{")]) == 2, err
        assert f"warning: {f}:2: field(s) max_tokens are not read" in err and "--max-new-tokens" in err, err
        f.write_text('{"prompt": "The river", "arrival_s": 0}\n')
        code, out, err = run("generate", "--prompts", str(f), "--max-new-tokens", "2")
        assert "are not read" not in err
        # a one-line file still gives a JSON line per request (streamed text is for --prompt only)
        lines = out.strip().splitlines()
        assert code == 0 and len(lines) == 1 and json.loads(lines[0])["prompt"] == "The river", out


def test_missing_tokenizer_and_wrong_weights(tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()
    code, _, err = run("generate", "--prompt", "x", "--model", str(d))
    assert code == 2 and "no tokenizer" in err
    shutil.copy(MODEL / "tokenizer.json", d / "tokenizer.json")
    shutil.copy(MODEL / "tokenizer_config.json", d / "tokenizer_config.json")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = run("generate", "--prompt", "x", "--model", str(d))
    assert code == 2 and "belong to another config" in err


def test_a_tokenizer_of_another_model_is_refused(tmp_path: Path) -> None:
    """A checkpoint whose tokenizer has more tokens than its embedding rows (a tokenizer copied from another model)
    gets one line saying so, before any text reaches the model (it was an IndexError from the embedding)."""
    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (d / "config.json").write_text(json.dumps(cfg))
    code, _, err = run("generate", "--prompt", "x", "--model", str(d))
    assert code == 2 and "has 4096 tokens but the model embeds only 1000" in err and len(err.strip().splitlines()) == 1


def test_added_tokens_the_model_does_not_embed(tmp_path: Path) -> None:
    """A tokenizer may add special tokens past the embedding rows: the checkpoint loads and plain text serves, but a
    prompt or a perplexity text holding one is refused in one line (it was an IndexError from the embedding)."""
    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 4096, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (d / "tokenizer.json").write_text(json.dumps(tok))
    code, _, err = run("generate", "--prompt", "plain text", "--max-new-tokens", "2", "--model", str(d))
    assert code == 0, err
    code, _, err = run("generate", "--prompt", "a <|extra|> b", "--max-new-tokens", "2", "--model", str(d))
    assert code == 2 and "token id 4096 ('<|extra|>')" in err and len(err.strip().splitlines()) == 1
    text = tmp_path / "t.txt"
    text.write_text("some words <|extra|> and more words here\n")
    code, _, err = run("ppl", "--model", str(d), "--dataset", str(text), "--seq-len", "4")
    assert code == 2 and "token id 4096" in err and len(err.strip().splitlines()) == 1
    tok = load_tokenizer(d)  # pwcal's calibration windows, from a text holding it
    assert calibration_windows(tok, str(text), 2, 4)  # without the model's rows nothing is checked
    with pytest.raises(PagedWeightError, match=r"calibration text .* token id 4096"):
        calibration_windows(tok, str(text), 2, 4, vocab_size=4096)


def test_unwritable_output_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "no" / "o.jsonl"
    code, _, err = run("generate", "--prompt", "x", "--max-new-tokens", "2", "--output", str(out))
    assert code == 2 and "cannot write --output" in err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(layer_types=c["layer_types"][:2]), "number of `layer_types` (2)"),
        (lambda c: c.update(num_hidden_layers="four"), "'num_hidden_layers' expected int"),
        (lambda c: c.pop("model_type"), "has no model_type"),
        (lambda c: c.update(num_experts=10**12), "num_experts 1000000000000 is outside 1..16384"),
        (lambda c: c.update(vocab_size=0), "vocab_size 0 is outside 1.."),
    ],
    ids=["layer_types-length", "wrong-type", "no-model_type", "huge", "zero"],
)
def test_malformed_config_is_one_line_naming_the_file(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    for r in (runner.invoke(app, ["generate", "--prompt", "x", "--model", str(d), "--device", "cpu"]),
              runner.invoke(pwcal_app, ["inspect", str(d)])):
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"error: {d / 'config.json'}") and message in lines[0], lines[0]


def test_a_config_that_is_not_text_is_one_line(tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    (d / "config.json").write_bytes(bytes(range(128, 256)) * 4)
    r = runner.invoke(pwcal_app, ["inspect", str(d)])
    assert r.exit_code == 2 and r.stderr.strip() == f"error: {d / 'config.json'} is not UTF-8 text: restore " \
        "config.json from the original checkpoint", r.stderr


NO_MODEL = ["--model", "/nonexistent/model"]  # an error about the model would mean it was loaded before the check


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "x", "--temperature", "inf"], "--temperature inf is not allowed"),
        (["--prompt", "x", "--temperature", "nan"], "--temperature nan is not allowed"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature -1.0 is not allowed"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "nan"], "--top-p nan is not allowed"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "0"], "--top-p 0.0 is not allowed"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "1.5"], "--top-p 1.5 is not allowed"),
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "  \n"], "--prompt is empty"),
        (["--prompt", "caf\udce9 river"], "--prompt is not valid UTF-8"),  # what Python makes of a latin-1 argv byte
        (["--prompt", "x", "--seed", "99999999999999999999"], "--seed 99999999999999999999 is out of range"),
        (["--prompt", "x", "--seed", "-1"], "--seed -1 is out of range"),
        (["--prompt", "x", "--policy", "16-bit", "--gpu-memory", ""], "--gpu-memory is empty"),  # an unset variable
        (["--prompt", "x", "--gpu-memory", " "], "--gpu-memory is empty"),
        (["--prompt", "x", "--reload-reserve", "-1"], "--reload-reserve '-1' is not allowed"),
        (["--prompt", "x", "--reload-reserve", "soon"], "give a number of tokens >= 0 (default 32) or 'last'"),
        (["--prompt", "x", "--reload-reserve", "\u0663"], "is not allowed"),  # a digit, but not 0-9
    ],
)
def test_bad_generate_options_are_refused_before_loading(args: list[str], message: str) -> None:
    code, out, err = run("generate", *args, *NO_MODEL)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (out, err)


def test_prompts_file_empty_or_not_utf8_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    code, _, err = run("generate", "--prompts", str(f), *NO_MODEL)
    assert code == 2 and f"error: {f}:2 has an empty 'prompt'" in err, err
    f.write_bytes('{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    code, _, err = run("generate", "--prompts", str(f), *NO_MODEL)
    assert code == 2 and f"error: {f}:3 (byte 0xe9) is not UTF-8" in err and "re-encode it as UTF-8" in err, err
    t = tmp_path / "t.txt"
    t.write_bytes("caf\xe9".encode("latin-1"))
    code, _, err = run("ppl", "--dataset", str(t))
    assert code == 2 and f"error: {t}:1 (byte 0xe9) is not UTF-8" in err, err


def test_output_path_errors_say_what_is_wrong(tmp_path: Path) -> None:
    for flag, extra in (("--output", []), ("--summary-json", ["--artifacts", str(tmp_path)])):
        code, _, err = run("generate", "--prompt", "x", flag, str(tmp_path), *extra, *NO_MODEL)
        eg = f"{flag} {tmp_path / ('out.jsonl' if flag == '--output' else 'summary.json')}"
        assert code == 2 and f"cannot write {flag} {tmp_path}: it is a directory; give a file path, e.g. {eg}" in err
        missing = tmp_path / "no" / "o.jsonl"
        code, _, err = run("generate", "--prompt", "x", flag, str(missing), *extra, *NO_MODEL)
        assert code == 2 and f"the directory {missing.parent} does not exist; create it" in err, err
    code, _, err = run("prompts", "--out", str(tmp_path))
    assert code == 2 and "it is a directory" in err, err
    # a directory whose file system refuses new files even to root (os.access says yes there): refused up front
    for flag, cmd in (("--out", ["prompts"]), ("--trace", ["generate", "--prompt", "x", *NO_MODEL])):
        code, _, err = run(*cmd, flag, "/proc/out.parquet")
        assert code == 2 and f"cannot write {flag} /proc/out.parquet: /proc is not writable" in err, err
    assert run("prompts", "--out", os.devnull, "--count", "2")[0] == 0  # a device is written in place


def test_progress_bar_only_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    import pwrun.cli

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["The war", "Music is"]))
    args = ("generate", "--prompts", str(f), "--max-new-tokens", "4", "--output", str(tmp_path / "o.jsonl"))
    code, _, err = run(*args)  # stderr is not a terminal here: plain progress lines, no bar
    assert code == 0 and "━" not in err, err
    assert re.search(r"^serving requests: 2/2 \(\d+ s\) [\d.]+ generated tokens/s$", err, re.M), err
    tty = io.StringIO()
    monkeypatch.setattr(pwrun.cli, "console", Console(file=tty, force_terminal=True, color_system=None, width=120))
    code, _, err = run(*args)
    assert code == 0, err
    assert re.search(r"serving .* 2/2 requests [\d.]+ generated tokens/s", tty.getvalue()), tty.getvalue()


def test_piped_output_is_not_wrapped_at_80_columns() -> None:
    r = runner.invoke(pwcal_app, ["inspect", str(MODEL)])  # stdout is not a terminal here
    assert r.exit_code == 0 and any("family qwen2_moe" in line and "context 2048" in line
                                    for line in r.stdout.splitlines()), r.stdout
    code, _, err = run("generate", "--prompt", "The river", "--max-new-tokens", "3")
    assert code == 0 and any("policy 16-bit on cpu" in line and "what this run needs" in line
                            for line in err.splitlines()), err
    # the CPU's default float32 is named as what it is: the experts' share is of their 16-bit bytes
    assert "(float32: experts held at 32 bits; --dtype bfloat16 holds them at 16)" in err
    assert "= 200.0% of their 16-bit" in err
    code, _, err = run("generate", "--prompt", "The river", "--max-new-tokens", "3", "--dtype", "bfloat16")
    assert code == 0 and "(bfloat16)" in err and "= 100.0% of their 16-bit" in err, err


def test_budget_sizes_beyond_any_device_are_refused() -> None:
    from pwformat.errors import PagedWeightError
    from pwrun.engine.budget import parse_size
    assert parse_size("48MiB") == 48 * 2**20 and parse_size("1024TiB") == 2**50 and parse_size("2.0") == 2
    for text, why in (("99999999999999999999999GiB", "larger than any device"), ("1.5", "a fraction of a byte")):
        with pytest.raises(PagedWeightError, match=why):
            parse_size(text)


def test_pwcal_out_of_range_options_are_refused_before_work(tmp_path: Path) -> None:
    """Values a stage would silently clamp or misuse: one error line, nothing written."""
    from pwcal.bucket_search import SearchConfig
    from pwformat.errors import PagedWeightError

    cases = [
        (["quantize", str(MODEL), "--out", str(tmp_path / "a"), "--seq-len", "100000"],
         "--seq-len 100000 is longer than the model's context of"),
        (["quantize", str(MODEL), "--out", str(tmp_path / "a"), "--min-tokens", "0"], "--min-tokens 0 must be >= 1"),
        (["quantize", str(MODEL), "--out", str(tmp_path / "a"), "--method", "awq"], "--method 'awq' is not one of"),
        (["quantize", str(MODEL), "--out", str(tmp_path / "a"), "--damp", "0"], "--damp 0.0 must be in (0, 1)"),
        (["quantize", str(MODEL), "--out", str(tmp_path / "a"), "--feedback-bits", "9"],
         "--feedback-bits 9 must be in [2, 8]"),
        (["quantize", str(MODEL), "--out", str(tmp_path / "a"), "--method", "gptq", "--feedback-bits", "2"],
         "--feedback-bits 2 is below --seed-bits 3"),
        (["quantize", str(MODEL), "--out", str(tmp_path / "a"), "--hessian-memory", "inf"],
         "--hessian-memory inf must be a finite number of GiB > 0"),
        (["quantize", str(MODEL), "--out", str(tmp_path / "a"), "--method", "gptq", "--hessian-memory", "0.0001",
          "--device", "cpu", "--samples", "2", "--seq-len", "16"], "full Hessians need 0.02 GiB, more than"),
        (["sensitivity", str(MODEL), "--artifacts", str(tmp_path), "--min-tokens", "0"], "--min-tokens 0 must be >= 1"),
        (["eval-uniform", str(MODEL), "--artifacts", str(tmp_path), "--out", str(tmp_path)],
         f"cannot write --out {tmp_path}: it is a directory"),
    ]
    for args, message in cases:
        r = runner.invoke(pwcal_app, args)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and message in lines[0], r.stderr
    assert not (tmp_path / "a").exists()
    for z in (float("nan"), float("inf"), -1.0):
        with pytest.raises(PagedWeightError, match=r"--gain-z .* must be a finite number >= 0"):
            SearchConfig(gain_z=z)
    with pytest.raises(PagedWeightError, match=r"^--budget-bits \[4.0, nan\] must be finite numbers of bits$"):
        SearchConfig(budgets_bits=(4.0, float("nan")))
    with pytest.raises(PagedWeightError, match=r"^--heldout-windows 0 must be >= 1$"):
        SearchConfig(heldout_windows=0)


def test_messages_name_the_right_thing(tmp_path: Path) -> None:
    """A manifest that is valid JSON but not an object, a model path that is a file, tiny sizes, and the
    calibration-window shortfall naming the caller's own options."""
    from pwcal.calib_data import calibration_windows
    from pwformat.errors import PagedWeightError
    from pwformat.manifest import Manifest, ModelRecord, read_manifest
    from pwrun.engine.budget import format_size
    from pwrun.model.loader import load_tokenizer

    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(PagedWeightError, match="corrupt \\(not the JSON object pwcal writes\\)"):
        read_manifest(tmp_path)
    from pwrun.ap.artifact import APArtifact

    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(PagedWeightError, match="is corrupt \\(not the JSON object pwcal writes\\)"):
        APArtifact(tmp_path)
    good = Manifest("pagedweight-ap", 1, 8, 3, [3, 4, 5, 6, 7, 8], ModelRecord("m", "qwen2_moe", "c", "q"), {"0": "l0"},
                    {"quantize": {"complete": True}}, schema_version=1).to_dict()  # schema 1: no checksums
    assert Manifest.from_dict(json.loads(json.dumps(good)), "m") == Manifest.from_dict(good, "m")
    bad_fields = (("model", []), ("stages", []), ("bits", "3-8"), ("seed_bits", "3"), ("model.config_sha256", 1))
    for field, value in bad_fields:
        bad = copy.deepcopy(good)
        if field.startswith("model."):
            bad["model"][field.split(".")[1]] = value
        else:
            bad[field] = value
        (tmp_path / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(PagedWeightError, match=f"field '{field}' is"):
            APArtifact(tmp_path)
    del good["files"]
    (tmp_path / "manifest.json").write_text(json.dumps(good))
    with pytest.raises(PagedWeightError, match="field 'files' is missing"):
        APArtifact(tmp_path)
    f = tmp_path / "afile"
    f.write_text("x")
    r = runner.invoke(pwcal_app, ["inspect", str(f)])
    assert r.exit_code == 2 and "is a file, not a model directory" in r.stderr, r.stderr
    assert (format_size(1024), format_size(512), format_size(3 * 2**20)) == ("1.00 KiB", "512 B", "3.00 MiB")
    short = tmp_path / "short.txt"
    short.write_text("only a few words here\n")
    with pytest.raises(PagedWeightError, match="lower --prompts, or give more text"):
        calibration_windows(load_tokenizer(MODEL), str(short), 4, 64, flags="--prompts")


def test_too_long_prompt_in_a_file_is_named_one_based_with_its_first_words(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "short one"}) + "\n\n" + json.dumps({"prompt": "Long river " * 2000}) + "\n")
    code, _, err = run("generate", "--prompts", str(f))
    assert code == 2 and "prompt 2 of 2 (its first words: 'Long river Long river Long river')" in err, err
    assert "context of" in err and err.count("\n") == 1


def test_a_missing_bundle_says_how_to_point_at_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-editable install has no ``artifacts/``: the default model and bundled datasets then fail with a line
    naming PAGEDWEIGHT_ARTIFACTS, not only a path inside site-packages."""
    monkeypatch.setenv("PAGEDWEIGHT_ARTIFACTS", str(tmp_path / "nowhere"))
    code, _, err = run("generate", "--prompt", "The river", "--max-new-tokens", "2")
    assert code == 2 and "PAGEDWEIGHT_ARTIFACTS" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run("prompts", "--dataset", "c4", "--count", "2", "--out", str(tmp_path / "p.jsonl"))
    assert code == 2 and "bundled dataset 'c4' is missing" in err and "PAGEDWEIGHT_ARTIFACTS" in err, err
    monkeypatch.setenv("PAGEDWEIGHT_ARTIFACTS", str(MODEL.parents[1]))  # the real bundle: no hint, it works
    code, _, err = run("prompts", "--dataset", "c4", "--count", "2", "--out", str(tmp_path / "p.jsonl"))
    assert code == 0, err


def test_threads_option_sets_torch_threads_and_refuses_zero() -> None:
    """``--threads N`` (generate, ppl, serve): torch runs on N CPU threads; 0 is refused before anything loads."""
    import torch

    before = torch.get_num_threads()
    try:
        code, _, err = run("generate", "--prompt", "The river", "--max-new-tokens", "2", "--threads", "1")
        assert code == 0 and torch.get_num_threads() == 1, err
    finally:
        torch.set_num_threads(before)
    for cmd in (["generate", "--prompt", "x"], ["ppl"]):
        for bad in ("0", "100000"):  # none, or far more than the cores (thread pools run out of memory)
            code, _, err = run(*cmd, "--threads", bad, *NO_MODEL)
            assert code == 2 and "--threads" in err and "/nonexistent" not in err, err


@pytest.mark.parametrize(("cores", "load", "want"), [(2, 0.0, 2), (2, 0.8, 1), (2, 1.4, 1), (2, 5.0, 1),
                                                     (16, 3.2, 13), (1, 0.0, 1)])
def test_default_threads_are_the_idle_cores(cores: int, load: float, want: int) -> None:
    """Without --threads: the cores the load average leaves idle, at least 1 (2 threads beside another job on 2
    cores wait on each other)."""
    assert idle_cores(cores, load) == want


@pytest.mark.parametrize(("cli", "args", "sentence"), [
    (app, ["generate", "--help"], "Tokens to generate per prompt."),
    (app, ["serve", "--help"], "past that the server"),
    (pwcal_app, ["search-buckets", "--help"], "Memory budgets as uniform-equivalent bits per"),
])
def test_help_reads_at_80_columns(cli, args: list[str], sentence: str) -> None:  # type: ignore[no-untyped-def]
    """Help text keeps most of an 80-column terminal (rich's option panels left it ~17 columns there)."""
    r = CliRunner().invoke(cli, args, env={"COLUMNS": "80"})
    assert r.exit_code == 0 and max(map(len, r.stdout.splitlines())) <= 80, r.stdout
    assert sentence in r.stdout, r.stdout


@pytest.mark.parametrize(("value", "tokens"), [("last", None), ("7", 7), (" LAST ", None)])
def test_reload_reserve_reaches_the_engine(calibrated_artifacts: Path, monkeypatch: pytest.MonkeyPatch, value: str,
                                           tokens: int | None) -> None:
    """``--reload-reserve`` of generate and serve becomes ``EngineConfig.reload_reserve_tokens`` (default 32)."""
    seen = []

    def generate(_model: object, _artifacts: object, _texts: object, _tok: object, cfg: ServeConfig,
                 *args: object, **kwargs: object) -> None:
        seen.append(cfg.engine.reload_reserve_tokens)
        raise KeyboardInterrupt

    def server(build: functools.partial[object], *args: object) -> None:  # the engine's builder, cfg its 3rd arg
        seen.append(build.args[2].engine.reload_reserve_tokens)
        raise KeyboardInterrupt

    monkeypatch.setattr(pwrun.cli, "serve_prompts", generate)
    monkeypatch.setattr(pwrun.serve.server, "Server", server)
    art = ["--artifacts", str(calibrated_artifacts), "--device", "cpu"]
    for extra in ([], ["--reload-reserve", value]):
        runner.invoke(app, ["generate", "--prompt", "x", *art, *extra])
        runner.invoke(app, ["serve", "--port", "0", *art, *extra])
    assert seen == [32, 32, tokens, tokens]
