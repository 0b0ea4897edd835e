"""bench/ap_moe_speed.fake_experts: the synthetic experts every kernel benchmark times (a shadowed loop variable once
made it build the wrong number of bitwidths for any n but the default, which only showed on the GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.ap_moe_speed import fake_experts


@pytest.mark.parametrize("n", [None, 1, 3])
def test_fake_experts_shapes_and_bits(n: int | None) -> None:
    s = {"hidden": 70, "inter": 40, "experts": 8, "topk": 2}
    ex = fake_experts(s, 5, n, "cpu")
    blocks = 2 * (s["topk"] if n is None else n)
    assert ex.bits.tolist() == [5] * blocks
    for b in range(blocks):
        planes, lut, _, k = ex.block(b)
        rows = 2 * s["inter"] if b % 2 == 0 else s["hidden"]
        assert k == (s["hidden"] if b % 2 == 0 else s["inter"])
        assert planes.shape[-2:] == (rows, -(-k // 32)) and lut.shape == (rows, 2**5)
        assert lut.dtype == torch.bfloat16


def test_dense_grouped_baseline_matches_the_per_expert_loop() -> None:
    """The grouped-GEMM bf16 baseline (its group ends now come from searchsorted so a CUDA graph can hold it) is the
    same MoE as the per-expert loop: experts with no token, all tokens on one expert, top-k 1 and 4."""
    from bench.ap_moe_speed import dense_grouped, dense_loop

    g = torch.Generator().manual_seed(5)
    e, h, i = 6, 64, 48
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g) * i**-0.5).to(torch.bfloat16)
    for t, k, ids in ((5, 4, None), (3, 1, torch.full((3, 1), 2)), (7, 2, None)):
        if ids is None:
            ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])  # expert e-1 unused
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        w = torch.rand(t, k, generator=g)
        got = dense_grouped(x, ids, w, gate_up, down).float()
        ref = dense_loop(x, ids, w, gate_up, down).float()
        assert (got - ref).abs().max() <= 2**-6 * ref.abs().max()


def test_serve_report_renders_failed_rows_and_skips_them_in_ratios() -> None:
    """bench/serve_speed.py records a row that raised (e.g. out of memory at a new batch size) and goes on; the
    report lists it and leaves it out of the PagedWeight-vs-uniform ratios."""
    from bench.serve_report import render

    ok = {"decode_tps_measured": 100.0, "decode_step_ms_median": 10.0, "bits_read_per_token": 4.0}
    rows = [{"system": "ours uniform 4-bit", "batch": 1, "rep": 0, **ok},
            {"system": "PagedWeight under pressure", "batch": 1, "rep": 0, **ok, "decode_tps_measured": 95.0},
            {"system": "ours uniform 4-bit", "batch": 16, "rep": 0, "error": "OutOfMemoryError: CUDA out of memory"},
            {"system": "PagedWeight under pressure", "batch": 16, "rep": 0, "error": "BudgetTooSmall: too small"}]
    text = render({"command": "x"}, rows)
    assert "Rows that failed" in text and "batch 16 (repeat 0): OutOfMemoryError" in text
    assert "| 1 | 0 | 95.0 | 100.0 | -5.0% |" in text and "| 16 | 0 |" not in text


def test_serve_report_names_runs_that_compiled_kernels(tmp_path, monkeypatch) -> None:
    """A timed run during which Triton's cache grew is named (its prefill and capture figures include JIT time);
    runs that compiled nothing are not; the cache count reads $TRITON_CACHE_DIR."""
    from bench.serve_report import render
    from bench.triton_cache import kernel_names, triton_cache_dirs, triton_cache_entries

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_entries() == 0
    (tmp_path / "abc").mkdir()
    before = triton_cache_dirs()
    (tmp_path / "def").mkdir()
    (tmp_path / "stray.lock").write_text("")
    assert triton_cache_entries() == 2 and triton_cache_dirs() - before == {"def"}
    for name in ("_gemv1_down_kernel.json", "__grp___gemv1_down_kernel.json", "_gemv1_down_kernel.cubin"):
        (tmp_path / "def" / name).write_text("{}")
    (tmp_path / "abc" / "_route_kernel.json").write_text("{}")
    assert kernel_names({"def"}) == ["_gemv1_down_kernel"]
    assert kernel_names({"abc", "def"}) == ["_gemv1_down_kernel", "_route_kernel"]
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".triton" / "cache" / "k1").mkdir(parents=True)
    assert triton_cache_entries() == 1
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "stray.lock"))
    assert triton_cache_entries() == 0
    ok = {"decode_tps_measured": 100.0, "decode_step_ms_median": 10.0, "bits_read_per_token": 4.0}
    rows = [{"system": "ours uniform 4-bit", "batch": 4, "rep": 0, **ok, "triton_compiles_in_run": 3,
             "triton_kernels_compiled_in_run": ["_fused_kernel", "_route_kernel", "_fused_kernel"]},
            {"system": "ours uniform 4-bit", "batch": 4, "rep": 1, **ok, "triton_compiles_in_run": 0},
            {"system": "ours uniform 4-bit", "batch": 4, "rep": 2, **ok, "triton_compiles_in_run": -1}]
    text = render({"command": "x"}, rows)
    assert "compiled inside a timed run" in text and "batch 4 (repeat 0): 3 (_fused_kernel, _route_kernel)" in text
    assert "(repeat 1)" not in text and "(repeat 2)" not in text
    assert "compiled inside" not in render({"command": "x"}, rows[1:])


def test_first_uses_records_specializations_and_restores_the_hook() -> None:
    """first_uses installs Triton's jit_cache_hook for the block only, chains to a hook already set (whose True,
    'skip the compile', it passes on; its own answer is False), names constexprs by parameter, survives an
    undescribable call; missed_specializations keeps the uses of the kernels a run compiled, by name."""
    triton = pytest.importorskip("triton")
    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook")
    from types import SimpleNamespace

    from bench.triton_cache import first_uses, missed_specializations

    runtime = triton.knobs.runtime
    calls: list[str] = []

    def outer(**kw):  # type: ignore[no-untyped-def]
        calls.append(kw["repr"])
        return kw["repr"].startswith("skip")

    saved = runtime.jit_cache_hook
    runtime.jit_cache_hook = outer
    try:
        fn = SimpleNamespace(jit_function=SimpleNamespace(arg_names=["x_ptr", "T", "T_PAD"]))
        base = dict(key=None, is_manual_warmup=False, already_compiled=False)
        with first_uses() as uses:
            hook = runtime.jit_cache_hook
            assert hook is not outer
            assert hook(repr="kernels.dense_gemv._gemv_kernel[num_warps=4](x_ptr: *bf16, T: i32)", fn=fn,
                        compile={"constants": {(2,): 4}}, **base) is False
            assert hook(repr="skip_kernel[num_warps=1]()", fn=fn, compile={}, **base) is True
            assert hook(repr="_gemv1_down_kernel[num_warps=8](a: i32)", fn=None,
                        compile={"constants": {(7,): 1}}, **base) is False
            assert hook(repr="odd_kernel[]()", fn=fn, compile={"constants": 5}, **base) is False
            # another Triton's keywords: an extra one, none for fn / compile
            assert hook(repr="new_kernel[]()", key=None, specialization_data="x") is False
        assert runtime.jit_cache_hook is outer
        assert calls == ["kernels.dense_gemv._gemv_kernel[num_warps=4](x_ptr: *bf16, T: i32)",
                         "skip_kernel[num_warps=1]()", "_gemv1_down_kernel[num_warps=8](a: i32)", "odd_kernel[]()",
                         "new_kernel[]()"]
        assert uses[4] == "new_kernel[]() constexprs={}"
        assert uses[0].endswith("constexprs={'T_PAD': 4}") and "(7,)" in uses[2]
        assert "not described" in uses[3]
        assert missed_specializations(uses, ["_gemv_kernel"]) == [uses[0]]
        assert missed_specializations(uses, ["_gemv1_down_kernel", "_route_kernel"]) == [uses[2]]
        assert missed_specializations(uses, []) == []
        runtime.jit_cache_hook = None
        with first_uses() as uses:
            assert runtime.jit_cache_hook(repr="k[]()", fn=fn, compile={}, **base) is False
        assert runtime.jit_cache_hook is None and uses == ["k[]() constexprs={}"]
    finally:
        runtime.jit_cache_hook = saved


_REAL_SPECIALIZATION = """
import inspect, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from bench.triton_cache import _describe
from tests._triton_probe_kernel import probe_kernel as k
try:
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(k.signature, k.params, backend)
    kw = {"debug": False}
    if "instrumentation_mode" in inspect.getsource(k.run):
        kw.update(instrumentation_mode=triton.knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=triton.knobs.compilation.fpsan_homomorphic_casts)
    x = torch.empty(64, dtype=torch.bfloat16)
    y = torch.empty(64, dtype=torch.float32)[1:]  # 4-byte offset: not 16-byte aligned
    bound, spec, options = binder(x, y, 64, 1, (3, 32), BLOCK=32, **kw)
    _, signature, constexprs, attrs = k._pack_args(backend, kw | {"BLOCK": 32}, bound, spec, options)
except Exception as err:
    print("SKIP", repr(err)); sys.exit(0)
print(_describe("probe_kernel[num_warps=4](x_ptr: (", None,
                {"signature": signature, "constants": constexprs, "configs": [attrs]}))
"""


def test_describe_reads_a_real_specialization() -> None:
    """_describe on what this Triton's launcher builds for a real kernel (an sm_90 target, no GPU needed; in a child
    process without the interpreter, which replaces JIT functions): argument types from the signature, 16-byte
    alignment and divisibility marks per argument (also inside a tuple argument), an int equal to 1 and the
    constexpr as constexprs by name. Skips where Triton's launcher internals differ."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _REAL_SPECIALIZATION], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    if line.startswith("SKIP"):
        pytest.skip(f"this Triton's launcher internals differ: {line}")
    assert line == ("probe_kernel[num_warps=4](x_ptr: *bf16 [div16], y_ptr: *fp32, n: i32 [div16], "
                    "pair: (i32, i32) [pair[1] div16]) constexprs={'m': 1, 'BLOCK': 32}")


def test_serve_report_lists_missed_specializations_and_reloaded_bytes() -> None:
    """The report adds, under the compiled-kernel line, each specialization a run compiled (once), and a column of
    the bytes reloaded CPU -> GPU in GiB."""
    from bench.serve_report import render

    ok = {"decode_tps_measured": 100.0, "decode_step_ms_median": 10.0, "bits_read_per_token": 4.0}
    spec = "_gemv_kernel[num_warps=4](T: i32) constexprs={'T_PAD': 4}"
    rows = [{"system": "PagedWeight under pressure", "batch": 4, "rep": 0, **ok, "bytes_host_to_device": 3 * 2**29,
             "triton_compiles_in_run": 1, "triton_kernels_compiled_in_run": ["_gemv_kernel"],
             "triton_specializations_compiled_in_run": [spec]},
            {"system": "PagedWeight under pressure", "batch": 4, "rep": 1, **ok, "bytes_host_to_device": 0,
             "triton_compiles_in_run": 1, "triton_kernels_compiled_in_run": ["_gemv_kernel"],
             "triton_specializations_compiled_in_run": [spec]}]
    text = render({"command": "x"}, rows)
    assert text.count(f"- `{spec}`") == 1 and "Their specializations:" in text
    head = next(line for line in text.splitlines() if line.startswith("| system"))
    first = next(line for line in text.splitlines() if line.startswith("| PagedWeight under pressure | 4 |"))
    cells = [c.strip() for c in first.split("|")]
    assert cells[head.split("|").index(" reloaded GiB (CPU -> GPU) ")] == "1.50"
    assert len(cells) == len(head.split("|"))
    assert "Their specializations" not in render({"command": "x"}, [{**rows[0], "triton_compiles_in_run": 0}])


def test_equal_memory_takes_the_highest_uniform_bitwidth_that_fits() -> None:
    """serve_speed.highest_that_fits: 4 bits if it fits PagedWeight's budget, else 3; BudgetTooSmall from the last
    one propagates (the row's error), other errors at once."""
    import sys

    sys.path.insert(0, "bench")
    from bench.serve_speed import highest_that_fits
    from pwrun.errors import BudgetTooSmall

    tried: list[int] = []

    def run(fits: set[int]):  # type: ignore[no-untyped-def]
        def go(q: int) -> dict:
            tried.append(q)
            if q not in fits:
                raise BudgetTooSmall("too small", 1)
            return {"q": q}
        return go

    assert highest_that_fits((4, 3), run({3, 4})) == (4, {"q": 4}) and tried == [4]
    tried.clear()
    assert highest_that_fits((4, 3), run({3})) == (3, {"q": 3}) and tried == [4, 3]
    with pytest.raises(BudgetTooSmall):
        highest_that_fits((4, 3), run(set()))

    def oom(q: int) -> dict:
        raise RuntimeError("out of memory")
    with pytest.raises(RuntimeError):
        highest_that_fits((4, 3), oom)


def test_serve_report_interpolates_equal_bits_read_or_says_n_a() -> None:
    """The equal-bits-read ratio interpolates uniform runs linearly in bits (4 and 8 bits: 10 and 18 ms, so 5 bits
    read -> 12 ms; PagedWeight at 12.5 ms is 4% slower); with one uniform bitwidth it is "n/a", never "+nan%"."""
    from bench.serve_report import ratio_lines

    def rows(bits: list[int]) -> list[dict]:
        uni = [{"system": f"ours uniform {q}-bit", "batch": 1, "rep": rep, "decode_step_ms_median": 2.0 + 2 * q,
                "decode_tps_measured": 100.0 if q == 4 else 50.0} for q in bits for rep in (0, 1)]
        pw = [{"system": "PagedWeight under pressure", "batch": 1, "rep": rep, "decode_tps_measured": 80.0,
               "decode_step_ms_median": 12.5, "bits_read_per_token": 5.0} for rep in (0, 1)]
        return uni + pw

    both = "\n".join(ratio_lines(rows([4, 8])))
    assert "| 1 | 0 | 80.0 | 100.0 | -20.0% | 5.00 | -4.0% | n/a |" in both
    assert "| 1 | 2 | -20.0% (-20.0 .. -20.0) | -4.0% (-4.0 .. -4.0) |" in both
    one = "\n".join(ratio_lines(rows([4])))
    assert "nan" not in one and "| 1 | 0 | 80.0 | 100.0 | -20.0% | 5.00 | n/a | n/a |" in one
    # whole-run tokens/s against uniform 4-bit in PagedWeight's budget, matched by batch and repeat
    eq = [{"system": f"uniform {q}-bit, PagedWeight's budget", "bits": q, "batch": 1, "rep": rep,
           "served_tokens_per_second": t, "tokens_per_second": 9e9}  # served, not processed, tokens count
          for rep, t, q in ((0, 400.0, 4), (1, 250.0, 3))]
    pw_run = [dict(r, served_tokens_per_second=500.0) if r["system"].startswith("Paged") else r for r in rows([4])]
    text = "\n".join(ratio_lines(pw_run + eq))
    assert "| 1 | 0 | 80.0 | 100.0 | -20.0% | 5.00 | n/a | 500 / 400 at 4 bits (+25.0%) |" in text
    assert "| 1 | 1 | 80.0 | 100.0 | -20.0% | 5.00 | n/a | 500 / 250 at 3 bits (+100.0%) |" in text
    refused = [eq[0], {"system": "uniform, PagedWeight's budget", "batch": 1, "rep": 1,
                       "error": "BudgetTooSmall: --gpu-memory 11.13 GiB is too small"}]
    text = "\n".join(ratio_lines(pw_run + refused))
    assert "| 1 | 1 | 80.0 | 100.0 | -20.0% | 5.00 | n/a | 500 / uniform does not fit |" in text
    assert "| 1 | 0 | 80.0 | 100.0 | -20.0% | 5.00 | n/a | 500 / 400 at 4 bits (+25.0%) |" in text
    assert "| 1 | 2 | -20.0% (-20.0 .. -20.0) | n/a |" in one


def test_gemv_compare_write_configs_buckets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bench/gemv_compare.write_configs: a winner at T = 16 owns tokens 9..16 (an old bucket inside that range, e.g.
    a fused one at 16, must go), a T that lost keeps its old config, and 33+ tokens keep theirs."""
    import json

    from bench.gemv_compare import write_configs
    from kernels.ap_moe import pick_config

    old = [{"min_tokens": 1, "config": {"path": "gemv1", "tag": "t1"}},
           {"min_tokens": 5, "config": {"path": "gemv", "tag": "g5"}},
           {"min_tokens": 16, "config": {"path": "fused", "tag": "f16"}},
           {"min_tokens": 256, "config": {"path": "dequant", "tag": "d256"}}]
    path = tmp_path / "ap_moe.json"
    path.write_text(json.dumps({"default": old[:1], "by_shape": {"2048x1408": old}}))
    win = {"path": "gemv1", "tag": "new16"}
    rows = [{"shape": "qwen1.5-moe", "q": 4, "T": 16, "speedup": 1.8, "new_cfg": win},
            {"shape": "qwen1.5-moe", "q": 4, "T": 4, "speedup": 0.9, "new_cfg": {"path": "gemv1", "tag": "lost"}},
            {"shape": "qwen1.5-moe", "q": 5, "T": 32, "speedup": 2.0, "new_cfg": {"path": "gemv1", "tag": "q5"}}]
    write_configs(str(path), rows)
    table = json.loads(path.read_text())
    tag = {t: pick_config(t, 2048, 1408, table)["tag"] for t in (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 255, 256)}
    assert tag == {1: "t1", 2: "t1", 4: "t1", 5: "g5", 8: "g5", 9: "new16", 16: "new16", 17: "f16", 32: "f16",
                   33: "f16", 255: "f16", 256: "d256"}


def test_gemv_compare_write_configs_keeps_one_token_where_the_old_list_starts_later(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A shape whose old buckets start above 1 token (its first bucket covers T = 1 too): a winner at T = 4 owns
    2..4 only, and T = 1 keeps the old first bucket."""
    import json

    from bench.gemv_compare import write_configs
    from kernels.ap_moe import pick_config

    old = [{"min_tokens": 2, "config": {"path": "gemv", "tag": "g2"}},
           {"min_tokens": 16, "config": {"path": "fused", "tag": "f16"}}]
    path = tmp_path / "ap_moe.json"
    path.write_text(json.dumps({"default": old, "by_shape": {"4096x14336": old}}))
    write_configs(str(path), [{"shape": "mixtral-8x7b", "q": 4, "T": 4, "speedup": 2.8,
                               "new_cfg": {"path": "gemv1", "tag": "w4"}}])
    table = json.loads(path.read_text())
    tag = {t: pick_config(t, 4096, 14336, table)["tag"] for t in (1, 2, 4, 5, 15, 16)}
    assert tag == {1: "g2", 2: "w4", 4: "w4", 5: "g2", 15: "g2", 16: "f16"}


def test_gemv_compare_write_configs_fills_an_untuned_bucket_between_equal_winners(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """T = 4 and T = 16 won with one config and T = 8 was not run: 2..16 tokens take it (the old 5..8 bucket goes);
    if T = 8 ran and lost, or the two winners differ, 5..8 keep their old config."""
    import json

    from bench.gemv_compare import write_configs
    from kernels.ap_moe import pick_config

    old = [{"min_tokens": 1, "config": {"path": "gemv1", "tag": "t1"}},
           {"min_tokens": 5, "config": {"path": "gemv", "tag": "g5"}},
           {"min_tokens": 16, "config": {"path": "fused", "tag": "f16"}}]
    same = {"path": "gemv1", "tag": "s"}

    def run(rows: list[dict]) -> dict[int, str]:
        path = tmp_path / "ap_moe.json"
        path.write_text(json.dumps({"default": old[:1], "by_shape": {"2048x1408": old}}))
        write_configs(str(path), [{"shape": "qwen1.5-moe", "q": 4, **r} for r in rows])
        table = json.loads(path.read_text())
        return {t: pick_config(t, 2048, 1408, table)["tag"] for t in (1, 2, 4, 5, 8, 9, 16, 17)}

    both = [{"T": 4, "speedup": 1.2, "new_cfg": same}, {"T": 16, "speedup": 3.0, "new_cfg": dict(same)}]
    assert run(both) == {1: "t1", 2: "s", 4: "s", 5: "s", 8: "s", 9: "s", 16: "s", 17: "f16"}
    lost8 = [*both, {"T": 8, "speedup": 0.9, "new_cfg": {"path": "gemv1", "tag": "l8"}}]
    assert run(lost8) == {1: "t1", 2: "s", 4: "s", 5: "g5", 8: "g5", 9: "s", 16: "s", 17: "f16"}
    differ = [both[0], {"T": 16, "speedup": 3.0, "new_cfg": {"path": "gemv1", "tag": "o"}}]
    assert run(differ) == {1: "t1", 2: "s", 4: "s", 5: "g5", 8: "g5", 9: "o", 16: "o", 17: "f16"}


def test_serve_speed_gives_uniform_the_pagedweight_requests(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bench/serve_speed.py on a shrunken Qwen1.5-MoE config on the CPU: by default the uniform rows serve the
    PagedWeight run's request list (b long + b short prompts, equal work on both sides of the ratio); with
    --uniform-workload long only the b long prompts."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    cfg = json.loads(Path("tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B/config.json").read_text())
    cfg.update(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=8,
               num_experts_per_tok=2, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    requests = {}
    for mode in ("same", "long"):
        out = tmp_path / f"{mode}.md"
        subprocess.run([sys.executable, "bench/serve_speed.py", "--device", "cpu", "--config-dir", str(tmp_path),
                        "--skip-hf", "--skip-lean16", "--batches", "2", "--bits", "4", "--prompt-len", "64", "--gen",
                        "4", "--big-budget-gib", "1", "--uniform-workload", mode, "--out-md", str(out)],
                       check=True, capture_output=True, timeout=300)
        rows = json.loads(out.with_suffix(".json").read_text())["rows"]
        requests[mode] = [r.get("requests") for r in rows if r["system"] == "ours uniform 4-bit"]
        # after the PagedWeight run, uniform 4-bit in its budget serves its requests (equal total memory), and the
        # keys the report reads survive serve_speed's key filter (triton_compiles_in_run once did not)
        pw = next(r for r in rows if r["system"] == "PagedWeight under pressure")
        eq = next(r for r in rows if r["system"] == "uniform 4-bit, PagedWeight's budget")
        assert "error" not in eq and eq["requests"] == pw["requests"] == 4
        assert eq["gpu_memory"] == pw["gpu_memory"]
        for r in (pw, eq):
            assert r["triton_compiles_in_run"] >= 0
            # served tokens: each prompt and generated token once (2 x 64 + 2 x 256 prompt tokens + 4 x 4 generated)
            assert abs(r["served_tokens_per_second"] * r["seconds"] - (2 * 64 + 2 * 256 + 4 * 4)) < 1e-6
            assert len(r["slowest_steps"]) == 3 and r["slowest_steps"][0]["seconds"] >= r["slowest_steps"][2]["seconds"]
        assert "the highest uniform that fits PW's budget" in out.read_text() and " at 4 bits (" in out.read_text()
    assert requests == {"same": [4], "long": [2]}
