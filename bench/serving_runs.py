"""The serving suite's timed runs (``bench.serving``), one function per system: our engine under an AP policy and
budget (``engine_run``), the 16-bit engine (``dense_run``), our 16-bit lean reference (``lean16_run``) and
transformers' eager ``generate`` (``hf_run``). Each returns the figures of one row (tokens/s, step-time medians
and breakdowns, planner time, peak device memory)."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.common import BENCH_PLANNER, BENCH_POLICY, HostExperts, SyntheticAP, sync, triton_cache_entries
from pwrun.core.config import EngineConfig
from pwrun.core.policy import Policy
from pwrun.core.request import SamplingParams
from pwrun.engine.build import ServeConfig, assemble_engine, dense_engine
from pwrun.engine.build_dense import assemble_dense_engine
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.report import summarize
from pwrun.model.lean import LeanMoEModel


def reset_peak(device: str) -> None:
    """Free what earlier engines held (reference cycles included) and restart the peak-memory count."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak(device: str) -> int:
    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else 0


def non_expert_bytes(model: LeanMoEModel) -> int:
    """Non-expert weight bytes one decode step reads: attention, a dense MLP beside or instead of the experts
    (Gemma-4's, 16-bit), and LM head (not the embedding table, unlike the bytes held,
    ``pweval.memory.non_expert_bytes``; routers are counted by ``common.decode_step_bytes``)."""
    w = model.weights
    mlps = [t for lw in w.layers if lw.mlp is not None for t in (lw.mlp.gate_up, lw.mlp.down)]
    return sum(t.numel() * t.element_size() for lw in w.layers for t in lw.attn.tensors()) \
        + sum(t.numel() * t.element_size() for t in mlps) + w.lm_head.numel() * w.lm_head.element_size()


def bits_read_per_token(spec: Any, steps: list[dict[str, Any]]) -> float:
    """Committed bits per expert weight one decode token reads (median over ``steps``): every shared expert at its
    blocks' bits plus top-k routed experts at the routed blocks' mean bits (the random router picks each expert
    equally often)."""
    if not steps:
        return math.nan
    moe = [ls.moe for ls in spec.layers if ls.moe is not None]
    shared = sum(3 * spec.hidden_size * m.shared_intermediate for m in moe)
    routed = sum(3 * spec.hidden_size * m.expert_intermediate * m.top_k for m in moe)
    per = [(shared * r["shared_bits"] if shared else 0.0) + routed * r["routed_bits"] for r in steps]
    return float(np.median(per)) / (shared + routed)


def _median_ms(rows: list[dict[str, Any]], key: str) -> float:
    return 1e3 * float(np.median([r[key] for r in rows])) if rows else math.nan


def engine_run(model: LeanMoEModel, src: SyntheticAP, table: Any, policy: str, bits: int | None, budget: int,
               reqs: list[list[int]], gen: int, max_batch: int, device: str) -> dict[str, Any]:
    """One timed serving run of an AP policy (``timed_run``)."""
    cfg = ServeConfig(budget, Policy.named(policy, bits), EngineConfig(max_batch=max_batch, max_step_tokens=2048),
                      BENCH_PLANNER)

    def build(n: int) -> Any:
        return assemble_engine(model, src, table, BENCH_POLICY, None, None, cfg, SamplingParams(max_new_tokens=n),
                               reqs, set())

    return timed_run(build, gen, device)


def dense_run(model: LeanMoEModel, experts: HostExperts, budget: int, reqs: list[list[int]], gen: int,
              max_batch: int, device: str) -> dict[str, Any]:
    """``engine_run`` for the 16-bit engine (``--policy 16-bit``): ``model`` without its experts (``strip_experts``),
    its experts in the page pool from ``experts``, the 16-bit MoE kernels and CUDA graphs."""
    cfg = ServeConfig(budget, engine=EngineConfig(max_batch=max_batch, max_step_tokens=2048))

    def build(n: int) -> Any:
        return assemble_dense_engine(model, experts, cfg, SamplingParams(max_new_tokens=n), reqs, set())

    return timed_run(build, gen, device)


def timed_run(build: Callable[[int], LLMEngine], gen: int, device: str) -> dict[str, Any]:
    """Serve ``build(3)`` (an engine generating 3 tokens per request) untimed, then time ``build(gen)``'s run: the
    JIT is not timed; the steps that capture a CUDA graph are left out of the decode figures
    (``decode_tps_incl_capture`` keeps them)."""
    build(3).run_until_done()
    reset_peak(device)
    e = build(gen)
    cached = triton_cache_entries()
    outs = e.run_until_done()
    s = summarize(e).to_dict()
    keep = {k: s[k] for k in SUMMARY_KEYS if k in s}
    keep["triton_compiles_in_run"] = triton_cache_entries() - cached  # > 0: JIT time inside the timed run
    # tokens served per second of the whole run: each prompt and generated token once
    keep["served_tokens_per_second"] = sum(o.prompt_tokens + len(o.token_ids) for o in outs.values()) / max(
        e.seconds, 1e-9)
    tr = [asdict(r) for r in e.trace]
    dec_all = [r for r in tr if r["step_tokens"] == r["running"] and r["running"] > 0 and r["preempted"] == 0]
    dec = [r for r in dec_all if not r.get("graph_captured")]
    pre = [r for r in tr if r not in dec_all]
    moving = [r for r in dec if r["bytes_in_flight"] > 0]
    still = [r for r in dec if r["bytes_in_flight"] == 0]
    keep |= {
        "graph_capture_steps": len(dec_all) - len(dec),
        "decode_tps_incl_capture": sum(r["step_tokens"] for r in dec_all) / max(sum(r["seconds"] for r in dec_all),
                                                                                1e-9),
        "decode_tps_measured": sum(r["step_tokens"] for r in dec) / max(sum(r["seconds"] for r in dec), 1e-9),
        "prefill_tps_measured": sum(r["step_tokens"] for r in pre) / max(sum(r["seconds"] for r in pre), 1e-9),
        "decode_step_ms_median": _median_ms(dec, "seconds"), "decode_model_ms_median": _median_ms(dec, "model_seconds"),
        "decode_step_ms_moving": _median_ms(moving, "seconds"), "decode_step_ms_still": _median_ms(still, "seconds"),
        "steps_moving": len(moving), "bits_read_per_token": bits_read_per_token(e.runner.model.spec, dec),
        "device_peak_bytes": peak(device)}
    for name, rs in (("moving", moving), ("still", still)):
        if rs:  # where a decode step's host time goes (medians, ms)
            keep[f"breakdown_{name}_ms"] = {k: round(_median_ms(rs, k), 3) for k in (
                "seconds", "model_seconds", "reload_seconds", "after_seconds", "sync_seconds",
                *(f"{p}_seconds" for p in ("poll", "refresh", "raise_plan", "raise_start", "prepare")))}
    if dec:  # planner time of the decode steps alone
        keep["planner_ms_per_decode_step"] = 1e3 * float(np.mean([r["planner_seconds"] for r in dec]))
        keep["planner_share_of_decode_step"] = sum(r["planner_seconds"] for r in dec) / max(
            sum(r["seconds"] for r in dec), 1e-9)
    del e
    reset_peak(device)
    return keep


SUMMARY_KEYS = ("planner_ms_per_step", "planner_overlapped_ms_per_step", "demoted_blocks", "promoted_blocks",
                "bytes_host_to_device", "preemptions", "mean_bits", "weight_bytes_max", "kv_bytes_max",
                "gpu_memory", "seconds")


def lean16_run(model: LeanMoEModel, reqs: list[list[int]], gen: int, device: str) -> dict[str, Any]:
    """Our 16-bit lean model over a paged KV cache (reference expert loop): prefill, then greedy decode."""
    bs = 16
    reset_peak(device)
    e = dense_engine(model, SamplingParams(max_new_tokens=gen), reqs, set(), bs)
    sync(device)
    t0 = time.perf_counter()
    e.step()  # every prompt in one prefill step
    sync(device)
    t1 = time.perf_counter()
    e.run_until_done()
    sync(device)
    t2 = time.perf_counter()
    return {"prefill_tps_measured": sum(map(len, reqs)) / (t1 - t0),
            "decode_tps_measured": len(reqs) * (gen - 1) / (t2 - t1), "device_peak_bytes": peak(device)}


def hf_random_model(config_dir: Path, device: str) -> Any:
    """transformers' own model of the config in ``config_dir`` (a multimodal config: its text model), random bf16
    weights built on ``device``, in eval mode."""
    cfg = AutoConfig.from_pretrained(str(config_dir)).get_text_config()
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def hf_run(config_dir: Path, batch: int, plen: int, gen: int) -> dict[str, Any]:
    """transformers' eager bf16 ``generate`` with random weights (CUDA): prefill from a 1-token run, decode from
    the difference to a ``gen``-token run."""
    m = hf_random_model(config_dir, "cuda")
    cfg = m.config
    ids = torch.randint(100, cfg.vocab_size - 100, (batch, plen), device="cuda")
    times = {}
    with torch.inference_mode():
        m.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
        for n in (1, gen):
            torch.cuda.synchronize()
            t = time.perf_counter()
            m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t
    out = {"prefill_tps_measured": batch * plen / times[1],
           "decode_tps_measured": batch * (gen - 1) / (times[gen] - times[1]),
           "device_peak_bytes": int(torch.cuda.max_memory_allocated())}
    del m
    torch.cuda.empty_cache()
    return out
