"""What every benchmark suite shares: the run's environment, the JSONL results, GPU timing, byte counts and the
synthetic workloads at a seed model's real shape.

What it does:
- ``environment`` / ``write_records``: each suite appends one JSON line per measurement to
  ``bench/results/<suite>.jsonl`` carrying commit, GPU, torch/triton versions, UTC date, command and label;
  ``bench.render`` turns the latest records into ``docs/performance.md``.
- timing: ``event_ms`` (CUDA events, median), ``graph_ms`` (CUDA-graph replay, median), ``copy_bandwidth``.
- byte counts, adapters from a model spec to ``pwformat.cost``: ``kv_bytes`` (bf16 K + V of a context),
  ``decode_step_bytes`` (the bandwidth floor's numerator), ``table_at`` / ``page_rounded_table`` (page-rounded M_i^b).
- synthetic workloads: ``random_model`` (the lean model of a config with random weights), ``SyntheticAP``
  (random planes and LUTs for every expert block), ``synthetic_table`` (a calibration table), ``prompts``, and
  ``write_random_checkpoint`` (a Hugging Face checkpoint with random weights at the config's real shape).
Values of random weights mean nothing for quality: these are for timing only.

Every call into pwrun/pwcal/kernels that more than one suite makes lives here, so an interface change is fixed
in one place. Run suites from the repository root: ``python -m bench.<suite>``.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
import triton
from transformers import AutoConfig, AutoModelForCausalLM

from pwformat import cost
from pwformat.layout import words_per_row
from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.runtime import PlannerConfig
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.data import default_model_dir
from pwrun.model.checkpoint import LayerWeights, ModelWeights, _attention, _moe
from pwrun.model.checkpoint_gemma4 import load_gemma4
from pwrun.model.families import spec_from_config
from pwrun.model.inventory import expert_blocks, kv_layout, moe_layer_shapes
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import read_config
from pwrun.model.weights import MLPWeights

RESULTS = Path("bench/results")
QWEN = Path("tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B")
MIXTRAL = Path("tests/fixtures/configs/mistralai__Mixtral-8x7B-v0.1")
GEMMA4 = Path("tests/fixtures/configs/google__gemma-4-26B-A4B")
BITS = [3, 4, 5, 6, 7, 8]  # bitwidths of the synthetic artifacts and tables
# the routing buckets and planner thresholds the serving and planner suites run with (no bucket search on random
# weights): two mass buckets, floors 4/5/6 then 3/4/5 bits
BENCH_POLICY = BucketPolicy((0.5, 0.85), (1.0, 1.0, 1.0), ((4, 5, 6), (3, 4, 5)), (2, 2, 2))
BENCH_PLANNER = PlannerConfig(free_threshold=4, reload_threshold=16)
# bench-only policy names: a policy with engine settings of its own. pagedweight-peak: reloads leave room for every
# running request up to its last token (the rule before the 32-token reload reserve): less movement, lower bits
POLICY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "pagedweight-peak": ("pagedweight", {"reload_reserve_tokens": None}),
    "pagedweight-cap4.25": ("pagedweight", {"max_mean_bits": 4.25})}


def policy_variant(name: str) -> tuple[str, dict[str, Any]]:
    """(the engine's policy name, EngineConfig settings) of a bench policy name."""
    return POLICY_VARIANTS.get(name, (name, {}))


# ---------------------------------------------------------------- environment and results


def _commit() -> str:
    """$COMMIT if set (a copied tree's git metadata can lag its files), else ``git rev-parse --short HEAD``."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(label: str | None = None) -> dict[str, Any]:
    """Commit, GPU name (or ``cpu``), torch / triton / transformers versions, UTC date and time, the command line,
    and ``label`` (which build a comparison row belongs to; default: the commit). A run that ``bench.compare`` starts
    as the baseline of another build ($BENCH_BASELINE=1) is marked ``baseline``: the rendered tables leave it out."""
    commit = _commit()
    baseline = {"baseline": True} if os.environ.get("BENCH_BASELINE") else {}
    return {"commit": commit, "label": label or commit, **baseline,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": " ".join(["python", "-m", _module(), *sys.argv[1:]])}


def _module() -> str:
    """``bench.<suite>`` of the running ``__main__`` (its file name when run otherwise)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem


def write_records(suite: str, records: Iterable[dict[str, Any]], env: dict[str, Any],
                  out: Path | None = None) -> Path:
    """Append one JSON line per record (``env`` + ``suite`` + the record) to ``out`` (default
    ``bench/results/<suite>.jsonl``); returns the path. Non-JSON values (paths, numpy numbers) become strings."""
    path = out or RESULTS / f"{suite}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps({"suite": suite, **env, **r}, default=_jsonable) + "\n")
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every JSON line of ``path`` (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- timing


def sync(device: str | torch.device = "cuda") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def event_ms(fn: Callable[[], object], reps: int = 20, flush: torch.Tensor | None = None) -> float:
    """Median ms of ``reps`` calls of ``fn`` (CUDA events around each; 3 untimed calls first). ``flush``: a buffer
    written before every call, outside the events (evicts L2 as a layer deep in a decode step finds it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if flush is not None:
            flush.fill_(1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def graph_ms(fn: Callable[[int], object], calls: int = 10, reps: int = 20, flush: torch.Tensor | None = None) -> float:
    """Median GPU ms per call of ``fn(i)``, i = 0..calls-1, captured once in a CUDA graph and replayed ``reps``
    times (no Python launch overhead; ``flush`` as in ``event_ms``); inf if it cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(min(3, calls)):
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i)
    except RuntimeError:
        return float("inf")
    return event_ms(g.replay, reps, flush) / calls


def copy_bandwidth(device: str = "cuda") -> float:
    """Bytes/s of a device-to-device copy, read + write counted (the floors' convention)."""
    x = torch.empty(2**30 if torch.device(device).type == "cuda" else 2**26, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * 10 * x.numel() / (time.perf_counter() - t)


def _triton_cache() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton"
                / "cache")


def triton_cache_entries() -> int:
    """Kernel directories in Triton's on-disk cache ($TRITON_CACHE_DIR, else ~/.triton/cache): a count that grows
    during a timed run means a kernel was compiled inside it (JIT time in the timing)."""
    d = _triton_cache()
    return sum(1 for e in d.iterdir() if e.is_dir()) if d.is_dir() else 0


def triton_cache_dirs() -> set[str]:
    """The kernel directories of Triton's on-disk cache now (see ``triton_cache_entries``)."""
    d = _triton_cache()
    return {e.name for e in d.iterdir() if e.is_dir()} if d.is_dir() else set()


def compiled_kernels(dirs: set[str]) -> list[str]:
    """The kernel name and its integer specialization of each cache directory in ``dirs`` (from the metadata JSON
    Triton writes beside the binary), to name what a run compiled."""
    out = []
    for name in sorted(dirs):
        for f in (_triton_cache() / name).glob("*.json"):
            try:
                meta = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and "name" in meta:
                out.append(f"{meta['name']} {json.dumps(meta.get('constants', ''))[:120]}")
    return out


# ---------------------------------------------------------------- byte counts


def kv_bytes(spec: Any, tokens: int) -> int:
    """bf16 K + V bytes of ``tokens`` positions over every layer of ``spec`` (as the pool lays them out)."""
    return kv_layout(spec).block_bytes(tokens, 2)


def decode_step_bytes(spec: Any, non_expert: int, bits: float | None, batch: int, ctx: int) -> float:
    """Bytes one decode step of ``batch`` sequences at ``ctx`` positions must read (``pwformat.cost``): the
    ``non_expert`` weight bytes (attention and LM head, no embedding table), every router (bf16), the experts the
    batch routes to and the shared experts at ``bits`` (None: bf16), and the KV cache of every sequence (a
    sliding-window layer's at most its window, ``KVLayout.read_bytes``)."""
    layers = moe_layer_shapes(spec)
    routers = sum(m.num_experts * m.hidden * 2 for m in layers)
    kv = batch * kv_layout(spec).read_bytes(ctx, 2)
    return cost.decode_step_bytes(non_expert + routers, layers, batch, ctx, 0, bits) + kv


def table_at(table: BlockTable, spec: Any, bits: int) -> np.ndarray:
    """[n] page-rounded bytes M_i^b of every block of ``table`` at ``bits`` (16-token bf16 KV pages of ``spec``)."""
    return page_rounded_table(table, spec).bytes[:, table.columns(bits)]


def page_rounded_table(table: BlockTable, spec: Any) -> BlockTable:
    """``table`` with its bytes filled in as the engine rounds them (16-token bf16 KV pages)."""
    page = kv_layout(spec).page_bytes(16, 2)
    return replace(table, bytes=cost.page_rounded_bytes(table.shapes(spec), table.bits, page))


# ---------------------------------------------------------------- synthetic models and workloads


def seed_spec(config_dir: Path) -> tuple[Any, Any]:
    """(spec, tensor names) of the Hugging Face ``config.json`` in ``config_dir``."""
    return spec_from_config(read_config(config_dir))


class _RandomReader:
    """Stands in for the checkpoint reader: random tensors of the asked shapes (norms, scales and layer scalars 1;
    a Gemma-4 text model at the ``model.`` prefix)."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        self.dtype, self.device = dtype, device
        self.g = torch.Generator(device=device).manual_seed(0)

    def has(self, name: str) -> bool:
        return name.endswith("experts.gate_up_proj") or name == "model.embed_tokens.weight"

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        assert shape is not None
        if "norm" in name or "scale" in name:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        return (torch.randn(shape, device=self.device, generator=self.g) * 0.02).to(self.dtype)

    def maybe(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return None


def random_model(config_dir: Path, dtype: torch.dtype, device: str) -> LeanMoEModel:
    """The lean model of the config in ``config_dir`` with random weights of ``dtype`` on ``device``. Every layer
    must be MoE (AssertionError otherwise)."""
    spec, names = seed_spec(config_dir)
    r = _RandomReader(dtype, device)
    if names.gemma4:
        return LeanMoEModel(spec, load_gemma4(r, spec))  # type: ignore[arg-type]
    h, v = spec.hidden_size, spec.vocab_size
    embed = r.get("embed", (v, h))
    lm_head = embed if spec.tie_word_embeddings else r.get("lm_head", (v, h))
    layers = []
    for layer in spec.layers:
        p = f"model.layers.{layer.index}."
        lw = LayerWeights(attn_norm=r.get(p + "norm", (h,)), ffn_norm=r.get(p + "norm2", (h,)),
                          attn=_attention(r, p + "self_attn.", spec, layer))  # type: ignore[arg-type]
        assert layer.moe is not None
        lw.moe = _moe(r, p, spec, layer, names, "load")  # type: ignore[arg-type]
        layers.append(lw)
    return LeanMoEModel(spec, ModelWeights(embed=embed, lm_head=lm_head, final_norm=r.get("norm", (h,)),
                                           layers=layers))


class SyntheticAP:
    """Random AP planes [8, N, ceil(K / 32)] int32 and sorted LUTs [N, 2^q] (``dtype``, q in BITS) for every expert
    block of ``spec``, in one host buffer (pinned when ``device`` is CUDA, where the values are drawn): the
    artifact reader's stand-in for the engine (``layer_tensors``)."""

    def __init__(self, spec: Any, dtype: torch.dtype, device: str = "cuda") -> None:
        self.bits, self.seed_bits = BITS, 3
        self.blocks = expert_blocks(spec)
        sizes = [8 * cost.plane_bytes(b.n, b.k) + sum(cost.lut_bytes(b.n, q) for q in BITS) for b in self.blocks]
        self.buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device == "cuda")
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        pos = 0
        g = torch.Generator(device=device).manual_seed(0)
        for b, size in zip(self.blocks, sizes, strict=True):
            kw = words_per_row(b.k)
            name = f"{'shared' if b.expert < 0 else b.expert}.{b.unit}"
            d = self.tensors.setdefault(b.layer, {})
            n_pl = 8 * cost.plane_bytes(b.n, b.k)
            planes = self.buf[pos:pos + n_pl].view(torch.int32).view(8, b.n, kw)
            planes.copy_(torch.randint(-2**31, 2**31 - 1, (8, b.n, kw), dtype=torch.int32, device=device,
                                       generator=g))
            d[f"{name}.planes"] = planes
            off = pos + n_pl
            for q in BITS:
                nb = cost.lut_bytes(b.n, q)
                lut = self.buf[off:off + nb].view(dtype).view(b.n, 2**q)
                lut.copy_(torch.sort(torch.randn(b.n, 2**q, device=device, generator=g) * 0.02, dim=1)[0].to(dtype))
                d[f"{name}.lut{q}"] = lut
                off += nb
            pos += size
        sync(device)

    def layer_tensors(self, layer: int, device: str = "cpu") -> dict[str, torch.Tensor]:
        return self.tensors[layer]


def synthetic_table(spec: Any, seed: int = 0) -> BlockTable:
    """A calibration table of every expert block of ``spec`` at BITS: routing mass Dirichlet per layer (shared
    experts 1), sensitivity s_i^b (SPEC Eq. 2) lognormal x mass, each bit ~4x smaller; bytes left 0 (the engine
    fills them page-rounded)."""
    rng = np.random.default_rng(seed)
    blocks = sorted(expert_blocks(spec), key=lambda b: (b.layer, b.expert, b.unit))
    n = len(blocks)
    e = max(ls.moe.num_experts for ls in spec.layers if ls.moe is not None)
    mass_le = rng.dirichlet(np.ones(e) * 2, size=spec.num_layers)
    mass = np.array([1.0 if b.expert < 0 else mass_le[b.layer, b.expert] for b in blocks])
    base = rng.lognormal(0, 1, n) * mass * 1e3
    sens = base[:, None] * 4.0 ** -(np.arange(len(BITS))[None, :])
    return BlockTable(bits=np.array(BITS), layer=np.array([b.layer for b in blocks]),
                      expert=np.array([b.expert for b in blocks]),
                      unit=np.array([UNITS.index(b.unit) for b in blocks]), sens=sens,
                      bytes=np.zeros((n, len(BITS)), np.int64), tokens=np.full(n, 1000), mass=mass)


def prompts(batch: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` random prompts of ``n`` token ids in [100, vocab - 100)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for _ in range(batch)]


def write_random_checkpoint(config_dir: Path, out: Path, device: str, layers: int | None = None) -> None:
    """A Hugging Face checkpoint (safetensors, bf16) of the config in ``config_dir`` with transformers' random
    initialisation, built on ``device``, and the bundled tiny model's tokenizer (its ids are below any seed
    model's vocabulary size): what a user hands ``pwcal``, at the real shape (``layers``: only the first that many
    decoder layers, where the whole model does not fit the GPU or the disk)."""
    if layers is None:
        cfg = AutoConfig.from_pretrained(str(config_dir))
    else:  # cut the raw config.json (a multimodal one, Gemma-4, keeps its decoder's layers in text_config)
        raw = json.loads((config_dir / "config.json").read_text())
        text = raw.get("text_config", raw)
        if not 1 <= layers <= text["num_hidden_layers"]:
            raise ValueError(f"{config_dir.name} has {text['num_hidden_layers']} layers, cannot keep {layers}")
        text["num_hidden_layers"] = layers
        if text.get("layer_types"):
            text["layer_types"] = text["layer_types"][:layers]
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(raw))
            cfg = AutoConfig.from_pretrained(d)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="4GB")
    del model
    tok = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, out / name)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class HostExperts:
    """The random model's experts, moved to the host by MoE layer before ``strip_experts`` drops them from the
    device: the FP16 engine's source (``pwrun.runner.experts.dense.ExpertSource``)."""

    def __init__(self, model: LeanMoEModel) -> None:
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, MLPWeights | None]] = {}
        for i, lw in enumerate(model.weights.layers):
            if (m := lw.moe) is not None:
                sh = None if m.shared is None else MLPWeights(m.shared.gate_up.cpu(), m.shared.down.cpu())
                self._layers[i] = (m.gate_up.cpu(), m.down.cpu(), sh)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, MLPWeights | None]:
        return self._layers[index]
