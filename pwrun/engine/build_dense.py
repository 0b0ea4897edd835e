"""Build the 16-bit serving engine (``--policy 16-bit``): the checkpoint's own experts in the page pool, under a budget.

What it does: loads the non-expert weights onto the device, splits ``--gpu-memory`` as for AP experts
(``split_budget``: non-expert weights, step workspace, page pool), refuses a budget below what the 16-bit experts
(whole pages per block) and the longest request's KV need, stating the minimum (``BudgetTooSmall``), places every
expert block in one run of WEIGHT pages, read from the checkpoint one MoE layer at a time, and returns an
``LLMEngine`` over the rest of the pool as KV, warmed up (kernels compiled, decode CUDA graphs captured) as the AP
engine is. No artifact, no planner: the experts never move. It is the FP16 system of SPEC section 8's comparison,
served by the same engine under the same budget as the AP policies.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import torch

from pwformat.errors import PagedWeightError
from pwkernels.warmup import precompile_gemv
from pwrun.core.arrivals import ArrivalSchedule
from pwrun.core.engine_core import EngineCore
from pwrun.core.kv_blocks import blocks_needed
from pwrun.core.pool import WEIGHT
from pwrun.core.request import SamplingParams
from pwrun.engine.budget import format_size
from pwrun.engine.build import (
    ServeConfig,
    add_requests,
    check_device_budget,
    linear_shapes,
    request_sizes,
    split_budget,
    strip_experts,
)
from pwrun.engine.llm_engine import LLMEngine
from pwrun.model.inventory import SHARED_EXPERT, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_spec, resolve_device, resolve_dtype
from pwrun.model.streamed import StreamedExperts
from pwrun.model.weights import MLPWeights
from pwrun.runner.experts.dense import ExpertSource, dense_block_pages


class LoadedExperts:
    """The experts of a model loaded whole (Gemma-4, whose expert layout only its own loader reads), by MoE layer;
    taken before ``strip_experts`` drops them from the model."""

    def __init__(self, model: LeanMoEModel) -> None:
        self._layers = {i: (m.gate_up, m.down, m.shared) for i, lw in enumerate(model.weights.layers)
                        if (m := lw.moe) is not None}

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, MLPWeights | None]:
        return self._layers[index]


def build_dense_engine(model_dir: Path, cfg: ServeConfig, params: SamplingParams, requests: list[list[int]],
                       eos: set[int], device: str = "auto", dtype: str = "auto",
                       forced: list[list[int]] | None = None, max_request_tokens: int = 0,
                       arrivals: ArrivalSchedule | None = None) -> LLMEngine:
    """``build_engine`` for the 16-bit experts of ``model_dir`` (same arguments, no artifact): an ``LLMEngine``
    holding ``requests`` as requests 0..n-1. Raises ``PagedWeightError`` on bad input (``BudgetTooSmall`` with the
    minimum for a budget below it).

    The experts are read from the checkpoint's files one MoE layer at a time, on the host in the model's dtype,
    then copied into the pool; a Gemma-4 checkpoint is loaded whole on the host first (its loader reads every
    weight)."""
    dev = resolve_device(device)
    check_device_budget(cfg.gpu_memory, dev)
    dt = resolve_dtype(dtype, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    spec, names = load_spec(Path(model_dir))
    name = str(dt).removeprefix("torch.")
    source: ExpertSource
    if names.gemma4:
        whole = load_model(model_dir, device="cpu", dtype=name, experts="load")
        source = LoadedExperts(whole)
        model = strip_experts(whole, dev)
    else:
        model = strip_experts(load_model(model_dir, device=str(dev), dtype=name, experts="skip"), dev)
        source = StreamedExperts(Path(model_dir), spec, names, dt, torch.device("cpu"))
    return assemble_dense_engine(model, source, cfg, params, requests, eos, forced, max_request_tokens, arrivals)


def dense_expert_bytes(model: LeanMoEModel, page_bytes: int) -> int:
    """Pool bytes of every expert block at 16 bits (the model's dtype), in whole pages of ``page_bytes`` per block."""
    elt = model.dtype.itemsize
    return sum(dense_block_pages(b.n, b.k, elt, page_bytes) for b in expert_blocks(model.spec)) * page_bytes


def fitted_budget(model: LeanMoEModel, cfg: ServeConfig, sizes: list[int], max_request_tokens: int) -> int:
    """The budget (bytes) a run needs when none is given: the non-expert weights, the step workspace, the 16-bit
    experts and every request's KV at its peak at once (whole blocks), so no request waits for pages. Raises
    ``PagedWeightError`` if the device does not have that much memory."""
    probe = split_budget(model, replace(cfg, gpu_memory=0), sizes, max_request_tokens, ap_experts=False)
    layout, bs, chunk = probe.layout, cfg.engine.block_size, cfg.engine.max_step_tokens
    kv_pages = sum(layout.peak_blocks(n, bs, chunk) for n in probe.sizes if n > 0) * layout.pages_per_block
    experts, kv = dense_expert_bytes(model, probe.page_bytes), kv_pages * probe.page_bytes
    need = probe.fixed + probe.work + experts + kv
    try:
        check_device_budget(need, model.device)
    except PagedWeightError as exc:
        raise PagedWeightError(
            f"the 16-bit model and every request's KV need {format_size(need)}, more than {model.device} has: "
            f"{format_size(probe.fixed + experts)} of weights, {format_size(kv)} of KV (fewer or shorter prompts "
            f"shrink it) and {format_size(probe.work)} of step workspace (a lower --max-batch or --max-step-tokens "
            "shrinks it); or serve an artifact (--artifacts) under --gpu-memory") from exc
    return need


def assemble_dense_engine(model: LeanMoEModel, source: ExpertSource, cfg: ServeConfig, params: SamplingParams,
                          requests: list[list[int]], eos: set[int], forced: list[list[int]] | None = None,
                          max_request_tokens: int = 0, arrivals: ArrivalSchedule | None = None) -> LLMEngine:
    """The 16-bit engine from in-memory parts: ``model`` (non-expert weights on the device, ``strip_experts``) and
    its experts from ``source`` (``forced``, ``max_request_tokens``, ``arrivals``: see
    ``pwrun.engine.build.build_engine``).
    Raises ``PagedWeightError`` (``BudgetTooSmall`` with the minimum) if the budget is too small."""
    spec, dev, ecfg = model.spec, model.device, cfg.engine
    kernels = ecfg.use_kernels if ecfg.use_kernels is not None else dev.type == "cuda"
    if kernels and model.dtype not in (torch.bfloat16, torch.float16):
        raise PagedWeightError(f"the 16-bit MoE kernels take bfloat16 or float16 weights, not {model.dtype}: give "
                               "--dtype bfloat16 (or float16)")
    sizes = request_sizes(params, requests, forced)
    fitted = cfg.gpu_memory <= 0
    if fitted:
        cfg = replace(cfg, gpu_memory=fitted_budget(model, cfg, sizes, max_request_tokens))
    split = split_budget(model, cfg, sizes, max_request_tokens, ap_experts=False)
    expert_bytes = dense_expert_bytes(model, split.page_bytes)
    split.check(expert_bytes, "the 16-bit experts need")
    if dev.type == "cuda" and ecfg.precompile_workers != 0:  # the MoE kernels compile in the warm-up
        workers = None if ecfg.precompile_workers < 0 else ecfg.precompile_workers
        for msg in precompile_gemv(linear_shapes(model), ecfg.max_batch, workers, ecfg.max_step_tokens):
            warnings.warn(f"decode kernels compile on first use instead: {msg}", stacklevel=2)
    pool, runner = split.pool_and_runner(model)
    store = runner.load_dense_experts(source, pool)
    placed = store.bytes_h2d
    store.bytes_h2d = 0
    blocks = expert_blocks(spec)
    info = {"device": str(dev), "dtype": str(model.dtype).removeprefix("torch."), "policy": "16-bit", "bits": None,
            "gpu_memory": cfg.gpu_memory, "fixed_bytes": split.fixed, "workspace_bytes": split.work,
            "pool_bytes": split.num_pages * split.page_bytes, "page_bytes": split.page_bytes,
            "kv_block_bytes": split.kv_block_bytes, "expert_bytes_16bit": sum(b.n * b.k * 2 for b in blocks),
            "initial_expert_bytes": placed, "initial_weight_pages": pool.count(WEIGHT), "initial_mean_bits": 16.0,
            "floor_expert_bytes": expert_bytes, "shared_expert": any(b.expert == SHARED_EXPERT for b in blocks),
            "host_mirror_bytes": 0, "budget_fitted": fitted}
    engine = LLMEngine(EngineCore(ecfg, pool, split.layout), runner, info)
    engine.warm_up(blocks_needed(split.longest + 1, ecfg.block_size))
    add_requests(engine, params, requests, eos, forced, arrivals)
    return engine
