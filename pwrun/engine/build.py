"""Build a serving engine from a model directory, an artifact directory and a memory budget.

What it does: checks the artifact against the model and the policy against the artifact's
stages; loads the non-expert weights onto the device (in the model's dtype; the dense experts are never read);
splits ``--gpu-memory`` into fixed parts and the page pool (``split_budget``, shared with ``build_dense.py``, which
holds the 16-bit experts in the pool for ``--policy 16-bit``); places every expert block at its
initial bitwidth (the planner's fit of the pool, a uniform or a static allocation); refuses a
budget below what the floors and the longest request need, stating the minimum; and returns an
``LLMEngine`` (engine core + model runner) holding the requests. ``dense_engine`` is the same engine
with the model's own 16-bit experts outside the pool (no budget, no artifact, no planner; the pool holds only KV).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pwformat.cost import block_pages, page_rounded_bytes
from pwformat.errors import BudgetTooSmall, PagedWeightError
from pwformat.kv_layout import KVLayout
from pwkernels.warmup import LinearShape, MoEShape, precompile_decode, precompile_gemv
from pwrun.ap.artifact import APArtifact
from pwrun.core.arrivals import ArrivalSchedule
from pwrun.core.config import EngineConfig
from pwrun.core.engine_core import EngineCore
from pwrun.core.kv_blocks import blocks_needed
from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.greedy import fit_budget, floor_bits
from pwrun.core.planner.online import OnlineStats, ResidualHeads
from pwrun.core.planner.runtime import Planner, PlannerConfig
from pwrun.core.planner.tables import BlockTable
from pwrun.core.policy import Policy
from pwrun.core.pool import WEIGHT, PagePool, PoolConfig
from pwrun.core.request import Request, SamplingParams
from pwrun.core.weight_table import WeightPageTable
from pwrun.engine.budget import dtype_label, format_size, workspace_bytes
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.report import process_age_seconds
from pwrun.engine.tables import (
    block_table,
    bucket_policy,
    calib_features,
    missing_tables,
    read_table,
    with_damage,
)
from pwrun.model.inventory import SHARED_EXPERT, expert_blocks, host_memory, kv_layout
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, resolve_device, resolve_dtype
from pwrun.model.weights import fuse_qkv
from pwrun.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class ServeConfig:
    """``gpu_memory``: the whole budget in bytes; ``policy``: see ``pwrun.core.policy``; ``damage``: a measured
    per-block damage table that replaces the artifact's sensitivities (``pwrun.engine.tables.with_damage``: the
    oracle baseline of the evaluation, ``docs/eval/oracle/``)."""

    gpu_memory: int
    policy: Policy = field(default_factory=Policy)
    engine: EngineConfig = field(default_factory=EngineConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    damage: Path | None = None


def strip_experts(model: LeanMoEModel, device: torch.device) -> LeanMoEModel:
    """Move the non-expert weights to ``device`` and drop the 16-bit expert tensors (the pool holds AP ones);
    q, k and v become views of one tensor (``fuse_qkv``: one projection GEMM per step)."""
    w = model.weights
    model.experts = None
    empty = torch.empty(0, dtype=model.dtype, device=device)
    tied = w.lm_head is w.embed
    w.embed = w.embed.to(device)
    w.lm_head = w.embed if tied else w.lm_head.to(device)
    w.final_norm = w.final_norm.to(device)
    for lw in w.layers:
        lw.attn_norm, lw.ffn_norm = lw.attn_norm.to(device), lw.ffn_norm.to(device)
        for k, v in vars(lw.attn).items():
            if v is not None:
                setattr(lw.attn, k, v.to(device))
        fuse_qkv(lw.attn)
        if lw.mlp is not None:
            lw.mlp.gate_up, lw.mlp.down = lw.mlp.gate_up.to(device), lw.mlp.down.to(device)
        if lw.sandwich is not None:
            for k, v in vars(lw.sandwich).items():
                setattr(lw.sandwich, k, v.to(device))
        if lw.moe is not None:
            lw.moe.router = lw.moe.router.to(device)
            for k in ("router_scale", "expert_scale"):
                if getattr(lw.moe, k) is not None:
                    setattr(lw.moe, k, getattr(lw.moe, k).to(device))
            lw.moe.gate_up = lw.moe.down = empty
            if lw.moe.shared is not None:
                lw.moe.shared.gate_up = lw.moe.shared.down = empty
            if lw.moe.shared_gate is not None:
                lw.moe.shared_gate = lw.moe.shared_gate.to(device)
    return model


def check_device_budget(budget: int, dev: torch.device) -> None:
    """Raise ``PagedWeightError`` if ``budget`` bytes exceed the device's whole memory (the GPU's, or the host's
    RAM for the CPU): checked before anything is allocated for it."""
    if dev.type == "cuda":
        have = torch.cuda.get_device_properties(dev).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if budget > have:
        raise PagedWeightError(f"--gpu-memory {format_size(budget)} is more than {dev} has ({format_size(have)} in "
                               f"all): give at most --gpu-memory {have // 2**20}MiB")


def build_engine(model_dir: Path, artifact_dir: Path, cfg: ServeConfig, params: SamplingParams,
                 requests: list[list[int]], eos: set[int], device: str = "auto", dtype: str = "auto",
                 forced: list[list[int]] | None = None, max_request_tokens: int = 0,
                 arrivals: ArrivalSchedule | None = None) -> LLMEngine:
    """An ``LLMEngine`` holding ``requests`` (token ids; request ids 0..n-1), each queued at its time of
    ``arrivals`` once the run starts (None: all at t=0); raises ``PagedWeightError`` on bad input or budget.
    ``forced``: per request, continuation tokens to feed and score (teacher forcing:
    ``RequestOutput.logprobs``) instead of sampling; each request then runs for exactly that many tokens.
    ``max_request_tokens``: prompt + new tokens of the longest request that may be added later (a server: the
    budget, the workspace and a static placement provision ``max_batch`` requests of that length).
    The 16-bit policy reads no artifact: ``pwrun.engine.build_dense.build_dense_engine`` builds its engine.
    """
    if cfg.policy.dense:
        raise PagedWeightError("--policy 16-bit serves the checkpoint's own experts: build it without an artifact "
                               "(build_dense_engine)")
    t0, before = time.perf_counter(), process_age_seconds()
    art = APArtifact(artifact_dir)
    art.check_model(model_dir)
    cfg.policy.check_bits(art.bits)
    missing_tables(art, cfg.policy, model_dir)  # the caller shows the warnings (e.g. once per CLI run)
    dev = resolve_device(device)
    check_device_budget(cfg.gpu_memory, dev)
    dt = resolve_dtype(dtype, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t1 = time.perf_counter()
    # the dense experts are never read: the non-expert weights go straight to the device, one layer at a time
    model = strip_experts(load_model(model_dir, device=str(dev), dtype=str(dt).removeprefix("torch."),
                                     experts="skip"), dev)
    t2 = time.perf_counter()
    want = art.manifest.model.weights_served
    if want is not None and model.weights.source_digest != want:  # the sampled fingerprint can miss an edit
        raise PagedWeightError(f"the weights in {model_dir} differ from those artifact {art.path} was made from "
                               "(the digest of every non-expert tensor, model.weights_served in its manifest): pass "
                               "the checkpoint it was made from with --model, or re-run pwcal quantize for this one")
    table = block_table(art, model, need_calibration=cfg.policy.calibrated)
    if cfg.damage is not None:
        table = with_damage(table, cfg.damage)
    heads_df = read_table(art, "residual_heads")
    heads, features = ResidualHeads(heads_df) if heads_df is not None else None, calib_features(art, table)
    phases = {"artifact_checks": t1 - t0, "non_expert_weights": t2 - t1, "tables": time.perf_counter() - t2}
    if before is not None:  # the process's start, imports, tokenizer, prompts, the artifact's re-hash
        phases = {"before_build": before} | phases
    return assemble_engine(model, art, table, bucket_policy(art), heads, features, cfg, params, requests, eos,
                           forced, max_request_tokens, arrivals, startup=phases)


def moe_shapes(model: LeanMoEModel) -> list[MoEShape]:
    """The distinct expert shapes of ``model``'s MoE layers (SPEC section 3's units, by shape), for
    ``pwkernels.warmup.precompile_decode``; [] for a model without MoE layers."""
    spec = model.spec
    return list(dict.fromkeys(
        MoEShape(spec.hidden_size, ls.moe.expert_intermediate, ls.moe.top_k, ls.moe.shared_intermediate,
                 str(model.dtype).removeprefix("torch."), ls.moe.activation, ls.moe.num_experts)
        for ls in spec.layers if ls.moe is not None))


def linear_shapes(model: LeanMoEModel) -> list[LinearShape]:
    """The distinct 16-bit linears a CUDA decode step runs through ``pwkernels.dense_gemv.linear`` (fused q/k/v, which
    serving always builds (unfused projections take ``F.linear``); o_proj; the router, with the shared-expert gate
    as one more row where the layer has one, as ``ExpertStore`` fuses them; a sandwich layer's dense MLP; the LM
    head), for ``pwkernels.warmup.precompile_gemv``."""
    dt = str(model.dtype).removeprefix("torch.")
    h = model.spec.hidden_size
    out = []
    for lw in model.weights.layers:
        a = lw.attn
        if a.qkv is not None:
            out.append(LinearShape(a.qkv.shape[0], a.qkv.shape[1], a.qkv_bias is not None, dt))
        out.append(LinearShape(a.o.shape[0], a.o.shape[1], False, dt))
        if lw.moe is not None:
            out.append(LinearShape(lw.moe.router.shape[0] + (lw.moe.shared_gate is not None), h, False, dt))
        if lw.sandwich is not None and lw.mlp is not None:  # the dense MLP beside the MoE block (Gemma-4)
            out += [LinearShape(int(t.shape[0]), int(t.shape[1]), False, dt) for t in (lw.mlp.gate_up, lw.mlp.down)]
    out.append(LinearShape(model.weights.lm_head.shape[0], model.weights.lm_head.shape[1], False, dt))
    return list(dict.fromkeys(out))


def request_sizes(params: SamplingParams, requests: list[list[int]], forced: list[list[int]] | None) -> list[int]:
    """Tokens of each request at its end: its prompt plus ``params.max_new_tokens``, or plus its forced
    continuation. Raises ``PagedWeightError`` unless ``forced`` is one non-empty list per request."""
    if forced is not None and (len(forced) != len(requests) or any(not f for f in forced)):
        raise PagedWeightError("forced continuations must be one non-empty token list per request")
    new = [len(f) for f in forced] if forced is not None else [params.max_new_tokens] * len(requests)
    return [len(r) + n for r, n in zip(requests, new, strict=True)]


@dataclass(frozen=True)
class BudgetSplit:
    """``--gpu-memory`` split for one engine (bytes): the non-expert weights (``fixed``), the step workspace
    (``work``) and ``num_pages`` pool pages of ``page_bytes``; ``sizes``: prompt + new tokens of every request the
    budget provisions (the longest: ``longest``), whose peak KV is ``min_kv_pages`` pages (SPEC section 5)."""

    model: LeanMoEModel
    cfg: ServeConfig
    layout: KVLayout
    sizes: list[int]
    fixed: int
    work: int
    page_bytes: int
    num_pages: int
    min_kv_pages: int

    @property
    def longest(self) -> int:
        return max(self.sizes)

    @property
    def kv_block_bytes(self) -> int:
        """B_KV of Eq. 7."""
        return self.layout.pages_per_block * self.page_bytes

    def check(self, expert_bytes: int, what: str) -> None:
        """Raise ``BudgetTooSmall`` (with the minimum budget) unless ``expert_bytes`` of experts (whole pages) and
        the longest request's KV fit the pool; ``what`` names the expert bytes ("the 16-bit experts need")."""
        kv = self.min_kv_pages * self.page_bytes
        if expert_bytes + kv <= self.num_pages * self.page_bytes:
            return
        minimum = self.fixed + self.work + expert_bytes + kv
        raise BudgetTooSmall(
            f"--gpu-memory {format_size(self.cfg.gpu_memory)} is too small: {what} {format_size(expert_bytes)} and "
            f"the longest request ({self.longest} tokens) {format_size(kv)} of KV, besides {format_size(self.fixed)} "
            f"of non-expert weights ({dtype_label(self.model.dtype)}) and {format_size(self.work)} of step workspace "
            f"(a lower --max-step-tokens or --max-batch shrinks it): give at least --gpu-memory "
            f"{math.ceil(minimum / 2**20)}MiB", minimum)

    def pool_and_runner(self, model: LeanMoEModel) -> tuple[PagePool, ModelRunner]:
        """The page pool and the model runner owning its bytes; ``PagedWeightError`` if the device cannot hold it."""
        pool = PagePool(PoolConfig(self.num_pages, self.page_bytes))
        try:
            return pool, ModelRunner(model, self.cfg.engine, self.num_pages, self.page_bytes)
        except RuntimeError as exc:  # includes torch.OutOfMemoryError
            raise PagedWeightError(f"cannot allocate a {format_size(self.num_pages * self.page_bytes)} page pool on "
                                   f"{model.device} for --gpu-memory {format_size(self.cfg.gpu_memory)}: give a "
                                   "budget the device has") from exc


def split_budget(model: LeanMoEModel, cfg: ServeConfig, sizes: list[int], max_request_tokens: int,
                 ap_experts: bool = True) -> BudgetSplit:
    """The ``BudgetSplit`` of ``cfg.gpu_memory`` for ``model`` (non-expert weights on the device) serving requests
    of ``sizes`` tokens (prompt + new, ``request_sizes``) and up to ``max_batch`` later ones of
    ``max_request_tokens`` tokens; ``ap_experts``: the workspace holds the AP prefill path's dequantized experts.
    Raises ``PagedWeightError`` if no request is provisioned or the budget exceeds the device."""
    dev, spec, ecfg = model.device, model.spec, cfg.engine
    check_device_budget(cfg.gpu_memory, dev)
    elt = model.dtype.itemsize
    layout = kv_layout(spec)
    page_bytes = layout.page_bytes(ecfg.block_size, elt)
    sizes = list(sizes) + [max_request_tokens] * ecfg.max_batch
    longest = max(sizes)
    if longest < 1:
        raise PagedWeightError("an engine needs requests or max_request_tokens >= 1")
    fixed = model.weights.num_bytes()
    work = workspace_bytes(spec, ecfg.max_step_tokens, ecfg.max_batch, min(longest, spec.max_position_embeddings), elt,
                           cuda=dev.type == "cuda", ap_experts=ap_experts)
    # the longest request's pages at their peak (admission's rule), in whole blocks
    min_kv_pages = layout.peak_blocks(longest, ecfg.block_size, ecfg.max_step_tokens) * layout.pages_per_block
    num_pages = max((cfg.gpu_memory - fixed - work) // page_bytes, 0)
    return BudgetSplit(model, cfg, layout, sizes, fixed, work, page_bytes, int(num_pages), min_kv_pages)


def assemble_engine(model: LeanMoEModel, source: Any, table: BlockTable, policy: BucketPolicy,
                    heads: ResidualHeads | None, calib_features: np.ndarray | None, cfg: ServeConfig,
                    params: SamplingParams, requests: list[list[int]], eos: set[int],
                    forced: list[list[int]] | None = None, max_request_tokens: int = 0,
                    arrivals: ArrivalSchedule | None = None, startup: dict[str, float] | None = None) -> LLMEngine:
    """The engine from in-memory parts: ``model`` (non-expert weights on the device, see ``strip_experts``),
    ``source`` (an ``APArtifact`` or any object with ``bits`` and ``layer_tensors(layer)``), the calibration
    ``table`` (M_i^b is re-derived in whole pages), bucket ``policy``, residual ``heads`` and calibration
    features (``forced``, ``max_request_tokens``, ``arrivals``: see ``build_engine``). Benchmarks use it with
    synthetic parts. The seconds of each start-up phase (``startup``: the caller's, then kernel precompilation,
    the page pool and runner, the experts' placement with the host mirror, the warm-up) go to the engine's info
    as ``startup_seconds``.
    Raises ``PagedWeightError`` if the budget is too small.
    """
    dev, dt = model.device, model.dtype
    spec = model.spec
    ecfg = cfg.engine
    elt = dt.itemsize
    split = split_budget(model, cfg, request_sizes(params, requests, forced), max_request_tokens)
    layout, page_bytes, num_pages, sizes = split.layout, split.page_bytes, split.num_pages, split.sizes
    fixed, work, longest = split.fixed, split.work, split.longest
    min_kv_pages, kv_block_bytes = split.min_kv_pages, split.kv_block_bytes
    table = replace(table, bytes=page_rounded_bytes(table.shapes(spec), table.bits, page_bytes))
    pcfg = cfg.policy.planner_config(cfg.planner)
    if pcfg is not None and pcfg.overlapped is None:
        pcfg = replace(pcfg, overlapped=dev.type == "cuda")
    bits = table.bits
    # the floor (bits) every block can reach (last floor stage), or the uniform bits
    if cfg.policy.bits is not None:
        floor = np.full(table.n, cfg.policy.bits, dtype=np.int64)
    elif pcfg is not None and not pcfg.use_routing:
        floor = np.full(table.n, bits[0], dtype=np.int64)
    else:
        floor = floor_bits(table, policy.assign(table), policy, len(policy.floors) - 1)
    floor_bytes = table.total_bytes(floor)
    split.check(floor_bytes, "the experts at their floors need")
    phases = dict(startup or {})
    t = time.perf_counter()
    if dev.type == "cuda" and ecfg.precompile_workers != 0:  # before the pool takes the device's memory
        workers = None if ecfg.precompile_workers < 0 else ecfg.precompile_workers
        for msg in precompile_decode(moe_shapes(model), ecfg.max_batch, workers, ecfg.max_step_tokens) + \
                precompile_gemv(linear_shapes(model), ecfg.max_batch, workers, ecfg.max_step_tokens):
            warnings.warn(f"decode kernels compile on first use instead: {msg}", stacklevel=2)
    phases["kernel_precompile"], t = time.perf_counter() - t, time.perf_counter()
    pool, runner = split.pool_and_runner(model)
    phases["pool"], t = time.perf_counter() - t, time.perf_counter()
    bit_list = [int(b) for b in table.bits]
    wpt = WeightPageTable(bit_list, *block_pages(table.shapes(spec), bit_list, page_bytes))
    assert np.array_equal(np.stack([wpt.pages_at(b) for b in bit_list], axis=1) * page_bytes, table.bytes)
    reserve = (cfg.planner.free_threshold + 1) * kv_block_bytes + min_kv_pages * page_bytes
    if cfg.policy.placement == "uniform":
        q0 = floor
    elif cfg.policy.placement == "static":
        peak = sorted((blocks_needed(n, ecfg.block_size) for n in sizes), reverse=True)[: ecfg.max_batch]
        budget = num_pages * page_bytes - max(sum(peak) * kv_block_bytes, min_kv_pages * page_bytes)
        # global sensitivity only (mu = 1), within the same floors: raising a neutral fit to the floors
        # afterwards could overflow the pool and leave no room for even one request
        fit = fit_budget(table, BucketPolicy(policy.quantiles, (1.0,) * policy.num_buckets, (policy.floors[-1],),
                                             policy.depth_cap), budget)
        q0 = floor if fit is None else fit
    else:
        room = num_pages * page_bytes - reserve
        if ecfg.max_mean_bits is not None:
            cap = int(wpt.pages_at_mean_bits(ecfg.max_mean_bits)) * page_bytes
            # the least cap (to 0.01 bit) whose pages hold the floors: any cap from it on holds them too
            need = max(min(bit_list), math.ceil(wpt.mean_bits_for_pages(floor_bytes / page_bytes) * 100) / 100)
            if ecfg.max_mean_bits < need:
                raise PagedWeightError(f"--max-mean-bits {ecfg.max_mean_bits:g} holds less than the experts at their "
                                       f"floors ({format_size(floor_bytes)}, every block at the least bits its "
                                       f"bucket allows): give at least {need:g}")
            room = min(room, cap)
        fit = fit_budget(table, policy if (pcfg and pcfg.use_routing) else BucketPolicy.neutral(int(bits[0])), room)
        q0 = floor if fit is None else fit
    planner = None
    if pcfg is not None:
        stats = OnlineStats(table.layer, table.expert, spec.num_layers,
                            max(ls.moe.num_experts for ls in spec.layers if ls.moe is not None), pcfg.decay,
                            calib_features)
        planner = Planner(table, policy, pcfg, heads, stats)
    store = runner.load_experts(source, table, wpt, pool, q0,
                                observe=planner is not None and planner.stats is not None)
    phases["experts"] = time.perf_counter() - t
    initial_weight_pages = pool.count(WEIGHT)
    placed_bytes = int(store.bytes_h2d)
    store.mirror.bytes_h2d = 0
    core = EngineCore(ecfg, pool, layout, wpt, planner)
    info = {"device": str(dev), "dtype": str(dt).removeprefix("torch."), "policy": cfg.policy.name,
            "bits": cfg.policy.bits,
            "gpu_memory": cfg.gpu_memory, "fixed_bytes": fixed, "workspace_bytes": work,
            "pool_bytes": num_pages * page_bytes, "page_bytes": page_bytes, "kv_block_bytes": kv_block_bytes,
            "expert_bytes_16bit": sum(b.n * b.k * 2 for b in expert_blocks(spec)),
            "initial_expert_bytes": placed_bytes,
            "initial_weight_pages": initial_weight_pages, "initial_mean_bits": float(q0.mean()),
            "floor_expert_bytes": floor_bytes, "shared_expert": bool((table.expert == SHARED_EXPERT).any()),
            "host_mirror_bytes": store.mirror.host_bytes,
            "host_model_bytes": host_memory(spec, bit_list, elt).serve(dev.type != "cuda", num_pages * page_bytes)}
    size = np.array([n * k for n, k in table.shapes(spec)], dtype=np.float64)
    shared = table.expert == SHARED_EXPERT
    engine = LLMEngine(core, runner, info, (size * shared, size * ~shared))
    engine.warm_up(blocks_needed(longest + 1, ecfg.block_size))
    engine.info["startup_seconds"] = phases | {"warm_up": engine.info.get("warm_up_seconds", 0.0)}
    add_requests(engine, params, requests, eos, forced, arrivals)
    return engine


def add_requests(engine: LLMEngine, params: SamplingParams, requests: list[list[int]], eos: set[int],
                 forced: list[list[int]] | None = None, arrivals: ArrivalSchedule | None = None) -> None:
    """Add ``requests`` (token ids) as requests 0..n-1 with ``params``, request i arriving at ``arrivals.times[i]``
    seconds from the start of the run (None: all at t=0; ``forced``: see ``build_engine``)."""
    if arrivals is not None and len(arrivals.times) != len(requests):
        raise PagedWeightError(f"{len(arrivals.times)} arrival times for {len(requests)} requests")
    engine.request_rate = math.inf if arrivals is None else arrivals.rate
    stop = frozenset(eos)
    for rid, ids in enumerate(requests):
        engine.add_request(Request(rid, tuple(ids), params, eos=stop,
                                   forced=None if forced is None else tuple(forced[rid])),
                           0.0 if arrivals is None else arrivals.times[rid])


def dense_server_engine(model: LeanMoEModel, cfg: EngineConfig, max_request_tokens: int) -> LLMEngine:
    """The 16-bit engine for requests that arrive later (a server): a pool of the KV blocks of ``cfg.max_batch``
    requests of ``max_request_tokens`` tokens each; no CUDA graphs (see ``dense_engine``)."""
    spec = model.spec
    cfg = replace(cfg, cuda_graphs=False)
    layout = kv_layout(spec)
    page_bytes = layout.page_bytes(cfg.block_size, model.dtype.itemsize)
    num_pages = cfg.max_batch * blocks_needed(max_request_tokens, cfg.block_size) * layout.pages_per_block
    return LLMEngine(EngineCore(cfg, PagePool(PoolConfig(num_pages, page_bytes)), layout),
                     ModelRunner(model, cfg, num_pages, page_bytes),
                     {"device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
                      "policy": "16-bit", "bits": None, "pool_bytes": num_pages * page_bytes, "page_bytes": page_bytes})


def dense_engine(model: LeanMoEModel, params: SamplingParams, requests: list[list[int]], eos: set[int],
                 block_size: int = 16, arrivals: ArrivalSchedule | None = None) -> LLMEngine:
    """The engine with ``model``'s own 16-bit experts: a pool of exactly the KV blocks every request needs at
    once, all requests in one batch and their prompts in one prefill step (no budget, no planner); ``arrivals``:
    see ``build_engine``."""
    spec = model.spec
    # no CUDA graphs: the reference expert loop sizes its groups on the host, which a capture cannot hold
    cfg = EngineConfig(block_size=block_size, max_batch=max(len(requests), 1),
                       max_step_tokens=max(sum(len(r) for r in requests), 1), cuda_graphs=False)
    blocks = sum(blocks_needed(len(r) + params.max_new_tokens, block_size) for r in requests)
    layout = kv_layout(spec)
    page_bytes = layout.page_bytes(block_size, model.dtype.itemsize)
    num_pages = max(blocks, 1) * layout.pages_per_block
    pool = PagePool(PoolConfig(num_pages, page_bytes))
    engine = LLMEngine(EngineCore(cfg, pool, layout), ModelRunner(model, cfg, num_pages, page_bytes),
                       {"device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
                        "policy": "16-bit", "bits": None})
    add_requests(engine, params, requests, eos, arrivals=arrivals)
    return engine
