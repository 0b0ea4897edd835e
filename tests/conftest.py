import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# a pytest-xdist worker runs with COLUMNS=80 in its environment: the CLIs would wrap their piped output there
# and not in a plain run (tests that want a width pass COLUMNS themselves)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)

# Triton kernels run in the interpreter on machines without a GPU (CI); natively on the GPU machine.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # every test starts at the session's thread count (``_torch_threads``): a command run in-process, also inside a
    # module-scoped fixture, may change it, and sums compared at 1e-9 (the Fisher test) change with it
    SESSION_THREADS = torch.get_num_threads()
    torch.set_num_threads(SESSION_THREADS)
except ImportError:  # pragma: no cover
    pass


def _calibrate(out):  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from pwcal.cli import app
    from pwrun.data import default_model_dir

    model, small, runner = str(default_model_dir()), ["--device", "cpu"], CliRunner()
    steps = [
        ["quantize", model, "--out", str(out), "--samples", "8", "--seq-len", "256", *small],
        ["sensitivity", model, "--artifacts", str(out), "--samples", "16", "--seq-len", "256", *small],
        ["fit-residual", model, "--artifacts", str(out), "--prompts", "16", *small],
        ["search-buckets", model, "--artifacts", str(out), "--candidates", "2", "--heldout-windows", "4",
         "--confirm-windows", "2", *small],
    ]
    for args in steps:
        r = runner.invoke(app, args)
        assert r.exit_code == 0, (args[0], r.stderr)
    return out


try:
    import pytest

    @pytest.fixture(scope="session")
    def calibrated_artifacts(tmp_path_factory):  # type: ignore[no-untyped-def]
        """The whole pwcal pipeline on the bundled tiny MoE with small settings (once per test session)."""
        return _calibrate(tmp_path_factory.mktemp("cal") / "ap")

    @pytest.fixture(autouse=True)
    def _torch_threads():  # type: ignore[no-untyped-def]
        """A command run in-process sets torch's thread count (``--threads``, or the idle cores by default): each
        test starts and ends at the session's, so that floating-point sums keep one order across tests."""
        torch.set_num_threads(SESSION_THREADS)
        yield
        torch.set_num_threads(SESSION_THREADS)
except ImportError:  # pragma: no cover
    pass


# Test files with a CUDA path (native kernels, CUDA graphs, side-stream copies): `make gpu-test` runs them on a GPU.
GPU_MODULES = {
    "test_cuda", "test_kernel_wiring", "test_moe_decode", "test_moe_mid", "test_moe_prefill", "test_moe_dispatch",
    "test_paged_attention", "test_pooled_attention", "test_warmup", "test_warmup_gemv", "test_dense_gemv",
    "test_fused_ops", "test_pair_sort", "test_varlen_attention", "test_gemma4", "test_moe_gelu", "test_moe_dense",
    "test_dense_serving", "test_moe_align", "test_act_mul",
}


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    import pytest

    for item in items:
        if item.path.stem in GPU_MODULES:
            item.add_marker(pytest.mark.gpu)
