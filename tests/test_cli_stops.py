"""CLI stops and writes: SIGTERM and Ctrl-C at every stage of a command (one line, exit 143 / 130, nothing
half-written), atomic writes, and usage errors of the console scripts as one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pwrun.cli import app
from pwrun.data import default_model_dir
from pwrun.generate import kept_aside

MODEL = default_model_dir()
runner = CliRunner()


def test_user_errors_turn_file_system_failures_and_ctrl_c_into_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Disk full (OSError ENOSPC, or safetensors' own write error), and Ctrl-C: one line on stderr, exit 2 / 130."""
    import errno

    from safetensors import SafetensorError

    from pwrun.cli_common import user_errors

    cases: list[tuple[BaseException, int, str]] = [
        (OSError(errno.ENOSPC, "No space left on device", "/x/sensitivity.parquet.tmp"), 2,
         "error: No space left on device: /x/sensitivity.parquet.tmp; free some space or write elsewhere"),
        (PermissionError(errno.EACCES, "Permission denied", "/x/o.jsonl"), 2, "error: Permission denied: /x/o.jsonl"),
        (SafetensorError("Error while serializing: No space left on device (os error 28)"), 2,
         "error: Error while serializing: No space left on device (os error 28)"),
        (KeyboardInterrupt(), 130, "interrupted: nothing half-written was kept"),
    ]
    for exc, code, line in cases:
        with pytest.raises(SystemExit) as e, user_errors():
            raise exc
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == code and len(err) == 1 and err[0].startswith(line), err


def test_write_atomic_leaves_no_tmp_when_it_fails(tmp_path: Path) -> None:
    from pwformat.atomic import write_atomic

    target = tmp_path / "out.jsonl"
    target.mkdir()  # the rename onto a directory fails after the .tmp is written
    with pytest.raises(OSError):
        write_atomic(target, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    write_atomic(tmp_path / "ok.txt", b"data")
    assert (tmp_path / "ok.txt").read_bytes() == b"data" and not (tmp_path / "ok.txt.tmp").exists()


def test_sigterm_runs_cleanup_and_prints_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A real SIGTERM inside ``user_errors``: the work's own cleanup runs (the default action ended the process
    without it, leaving quantize's OUT.partial), one line, exit 143, and the previous handler comes back."""
    import os
    import signal

    from pwrun.cli_common import user_errors

    def ignore(signum: int, frame: object) -> None:  # without user_errors' handler the test fails, pytest lives
        pass

    outer = signal.signal(signal.SIGTERM, ignore)
    try:
        partial = tmp_path / "out.partial"
        with pytest.raises(SystemExit) as e, user_errors():
            partial.mkdir()
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs between bytecodes, at once
                    pass
            except BaseException:
                shutil.rmtree(partial)
                raise
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 143 and len(err) == 1 and err[0].startswith("terminated (SIGTERM)"), err
        # SIGTERM stays ignored until the exit (a second one must not cut the cleanup or the exit code)
        assert not partial.exists() and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.signal(signal.SIGTERM, ignore)
        with user_errors():  # no signal: the previous handler comes back
            pass
        assert signal.getsignal(signal.SIGTERM) is ignore
    finally:
        signal.signal(signal.SIGTERM, outer)


def test_sigterm_during_quantize_leaves_no_partial_artifact(tmp_path: Path) -> None:
    """End to end: ``pwcal quantize`` killed with SIGTERM while it writes ``OUT.partial`` removes it and says so."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "ap"
    cmd = [sys.executable, "-c", "from pwcal.cli import app; app()", "quantize", str(MODEL), "--out", str(out),
           "--samples", "8", "--seq-len", "256", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = out.with_name("ap.partial")
    deadline = time.time() + 120
    while not partial.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if not partial.exists():
        proc.kill()
        pytest.skip("quantize finished (or stalled) before its partial directory could be seen")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err
    assert not partial.exists() and not out.exists()


def test_atomic_path_drops_its_tmp_on_any_exception(tmp_path: Path) -> None:
    """``pwformat.atomic.atomic_path``, behind every writer: an interruption (KeyboardInterrupt / SIGTERM's exception,
    not only OSError) leaves neither a .tmp nor a changed target."""
    from pwformat.atomic import atomic_path, write_atomic

    target = tmp_path / "t.json"
    write_atomic(target, b"old")
    for exc in (KeyboardInterrupt(), OSError(28, "No space left on device"), RuntimeError("x")):
        with pytest.raises(type(exc)), atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise exc
        assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["t.json"]
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_quantize_interrupted_between_its_final_renames_keeps_the_previous_artifact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``quantize --force`` over an existing artifact swaps it by two renames (OUT -> OUT.old, OUT.partial -> OUT); an
    interruption between them puts the previous artifact back, never a half-deleted artifact whose manifest says
    complete."""
    from pwcal.quant.quantize import QuantizeConfig, quantize
    from pwformat.manifest import read_manifest
    from pwrun.signals import Terminated

    out = tmp_path / "ap"
    cfg = QuantizeConfig(samples=4, seq_len=64)
    first = quantize(MODEL, out, cfg, device="cpu")
    files = sorted(p.name for p in out.iterdir())
    real = Path.replace

    def interrupted(self: Path, target: Path) -> Path:  # type: ignore[override]
        if self.name == "ap.partial":
            raise Terminated()
        return real(self, target)

    monkeypatch.setattr(Path, "replace", interrupted)
    with pytest.raises(Terminated):
        quantize(MODEL, out, cfg, device="cpu", force=True)
    monkeypatch.setattr(Path, "replace", real)
    assert sorted(p.name for p in out.iterdir()) == files
    assert read_manifest(out).stage("quantize")["seconds"] == first["stages"]["quantize"]["seconds"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ap"]  # no ap.partial, no ap.old


def test_sigterm_while_a_command_starts_exits_143_with_one_line() -> None:
    """Before a command reaches ``user_errors`` (it imports torch for ~2 s), SIGTERM exits with 143 and one line
    (the entry point's handler), not a silent kill (-15)."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", "from pweval.main import main; main()", "generate", "--prompt",
                             "The river", "--max-new-tokens", "2", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the entry module imports in ~0.1 s; torch and the model take longer
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (proc.returncode, err)
    assert err.strip().splitlines()[-1].startswith("terminated (SIGTERM)") and "Traceback" not in err, err


@pytest.mark.parametrize("entry", ["from pweval.main import main", "from pwcal.main import main"])
def test_ctrl_c_while_a_command_starts_exits_130_with_one_line(entry: str) -> None:
    """Ctrl-C while the console script imports torch and the CLI exits with 130 and one line, not a traceback from
    inside an import (the child restores Python's SIGINT handler, as a terminal's foreground process has it)."""
    import signal
    import subprocess
    import sys
    import time

    child = f"import signal; signal.signal(signal.SIGINT, signal.default_int_handler); {entry}; main()"
    proc = subprocess.Popen([sys.executable, "-c", child, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(0.5)  # inside the CLI's imports (torch alone takes longer)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines() == ["interrupted (Ctrl-C) while starting: nothing was run or written"], err


def test_ctrl_c_after_start_is_a_keyboard_interrupt_again() -> None:
    import signal

    from pwrun.signals import quiet_interrupt_while_starting

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        started = quiet_interrupt_while_starting()
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        started()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's SIGINT stays ignored
        quiet_interrupt_while_starting()()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_write_atomic_keeps_devices_and_links(tmp_path: Path) -> None:
    """A FIFO (like /dev/null, not a regular file) is written through, not replaced by a renamed file; a symbolic
    link keeps pointing where it did, and its target gets the bytes."""
    import threading

    from pwformat.atomic import write_atomic

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_atomic(fifo, b"through")
    reader.join(10)
    assert got == [b"through"] and stat.S_ISFIFO(fifo.lstat().st_mode)
    target, link = tmp_path / "real.txt", tmp_path / "link.jsonl"
    target.write_text("keep")
    link.symlink_to(target.name)
    write_atomic(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == \
        ["fifo", "link.jsonl", "real.txt"]


# A child ``pwrun`` whose engine, once idle before the request an hour away, is sent a real signal (by then every
# request at t=0 has finished): its time.sleep is wrapped before pwrun binds it.


_STOP_CHILD = """
import os, signal, sys, time
# a shell that starts a job in the background (CI's runner, nohup ... &) hands it SIGINT ignored; a terminal's
# Ctrl-C reaches a foreground process with Python's own handler, which this restores
signal.signal(signal.SIGINT, signal.default_int_handler)
sleep = time.sleep
def stop_when_idle(s):
    if s >= 30:
        os.kill(os.getpid(), signal.{sig})
    sleep(s)
time.sleep = stop_when_idle
from pweval.main import main
main()
"""


@pytest.mark.parametrize("sig, code, extra", [
    ("SIGINT", 130, []),
    ("SIGTERM", 143, ["--policy", "16-bit", "--gpu-memory", "120MiB", "--trace", "{tmp}/t.parquet",
                      "--summary-json", "{tmp}/s.json"]),
])
def test_a_stop_writes_the_finished_requests(tmp_path: Path, sig: str, code: int, extra: list[str]) -> None:
    """Ctrl-C / SIGTERM after some requests finished: --output holds exactly those, with the text of an
    uninterrupted run of the same prompts; the stop line says how many of N were written; the summary and trace
    (when asked) are written too; the exit code is the interrupt's. Outputs that exist already (the SIGTERM case)
    are kept: the stopped run writes beside them (NAME.stopped.EXT)."""
    import subprocess
    import sys

    import pyarrow.parquet as pq

    prompts = ["The war ended", "Music", "A small village in the north of England is known for its"]
    timed = tmp_path / "p.jsonl"
    arrivals = zip(prompts, (0, 3600, 0), strict=True)  # the second an hour away: the stop comes before it
    timed.write_text("".join(json.dumps({"prompt": p, "arrival_s": t}) + "\n" for p, t in arrivals))
    ref_in = tmp_path / "ref.jsonl"
    ref_in.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (prompts[0], prompts[2])))
    opts = ["--max-new-tokens", "6", "--device", "cpu", *[x.format(tmp=tmp_path) for x in extra]]
    out = tmp_path / "out.jsonl"
    earlier = ["out.jsonl", "s.json", "t.parquet"] if extra else []
    for name in earlier:
        (tmp_path / name).write_text("complete earlier output\n")
    proc = subprocess.run([sys.executable, "-c", _STOP_CHILD.format(sig=sig), "generate", "--prompts", str(timed),
                           "--output", str(out), *opts], capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("terminated (SIGTERM): " if sig == "SIGTERM" else "interrupted: "), proc.stderr
    for name in earlier:
        assert (tmp_path / name).read_text() == "complete earlier output\n"
    if earlier:
        out = tmp_path / "out.stopped.jsonl"
    kept = " (the existing out.jsonl is kept)" if earlier else ""
    assert f"2 of 3 requests finished and were written to {out}{kept}; the rest (1) were not run to completion" \
        in last, last
    assert "Traceback" not in proc.stderr
    waits = [x for x in proc.stderr.splitlines() if x.startswith("idle: ")]
    assert len(waits) == 1 and re.fullmatch(r"idle: the next request arrives at t=3600 s; the engine waits 3[56]\d\d "
                                            r"s until then", waits[0]), proc.stderr
    ref = tmp_path / "ref_out.jsonl"
    r = runner.invoke(app, ["generate", "--prompts", str(ref_in), "--output", str(ref), *[
        x for x in opts if not x.startswith(("--trace", "--summary", str(tmp_path)))]])
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    want = [json.loads(x) for x in ref.read_text().splitlines()]
    assert [(x["prompt"], x["text"], x["new_tokens"]) for x in rows] == [
        (x["prompt"], x["text"], x["new_tokens"]) for x in want]
    assert all(x["finish_s"] is not None for x in rows)
    if "--summary-json" in extra:
        s = json.loads((tmp_path / "s.stopped.json").read_text())
        assert s["requests_completed"] == 2 and s["requests_unfinished"] == 1
        assert "; 1 more not run to completion (stopped)" in proc.stderr, proc.stderr
        assert pq.read_table(tmp_path / "t.stopped.parquet").num_rows == s["steps"] > 0


def test_a_stopped_run_never_replaces_an_earlier_stopped_runs_output(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert kept_aside(out) == out  # nothing there: the path itself
    out.write_text("complete\n")
    for want in ("out.stopped.jsonl", "out.stopped.1.jsonl", "out.stopped.2.jsonl"):
        aside = kept_aside(out)
        assert aside == tmp_path / want
        aside.write_text("partial\n")
    assert kept_aside(Path("/dev/null")) == Path("/dev/null")


def test_sigterm_inside_native_code_still_ends_with_143(capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM while safetensors reads a tensor: the ``Terminated`` its handler raises comes back out of the native
    code as another exception (seen: ValueError "could not determine the shape ..."); it is still the stop (one
    line, exit 143), while the same error without a SIGTERM keeps its traceback."""
    import signal as sig

    from pwrun.cli_common import user_errors
    from pwrun.signals import Terminated, raise_terminated

    before = sig.getsignal(sig.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stop, user_errors():
            try:
                raise_terminated(sig.SIGTERM, None)
            except Terminated:
                raise ValueError("could not determine the shape of object type") from None
        assert stop.value.code == 143
        assert capsys.readouterr().err.startswith("terminated (SIGTERM): nothing half-written was kept")
        with pytest.raises(ValueError, match="could not determine"), user_errors():
            raise ValueError("could not determine the shape of object type")
    finally:
        sig.signal(sig.SIGTERM, before)


@pytest.mark.parametrize(("script", "args", "words"), [
    ("pweval.main", ["prompts", "--count", "0", "--out", "x.jsonl"], ["'--count'", "`pwrun prompts --help`"]),
    ("pweval.main", ["generate", "--bogus"], ["No such option: --bogus"]),
    ("pwcal.main", ["quantize"], ["Missing argument", "`pwcal quantize --help`"]),
])
def test_console_scripts_print_usage_errors_on_one_line(tmp_path: Path, script: str, args: list[str],
                                                       words: list[str]) -> None:
    """The console scripts (``run_cli``): a bad option is one ``error:`` line and exit 2, as other bad input."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", f"from {script} import main; main()", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert all(w in lines[0] for w in words), lines[0]
