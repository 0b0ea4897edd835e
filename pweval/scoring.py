"""Score a workload: log p of every continuation token, through the runtime or a reference model.

What it does: ``serve_workload`` builds the PagedWeight engine for a budget and policy
(``pwrun.engine.build.build_engine``) with every request teacher-forced, serves the whole workload
concurrently (continuous batching, planner, preemption) and returns each request's per-token
log-probabilities, computed with the expert precision in force at the step that scored them, plus
the run summary and trace. ``reference_logprobs`` scores the same requests with a plain model (the
16-bit one, or a dense b-bit one from ``APArtifact.dense_model``) in one forward per request, batched.
``nll`` reduces log-probabilities per task. It does not pick budgets or write results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from pweval.workload import Request, Workload
from pwrun.core.request import SamplingParams
from pwrun.engine.build import ServeConfig, build_engine
from pwrun.engine.report import summarize, trace_frame
from pwrun.model.lean import LeanMoEModel
from pwrun.runner.prefill import prefill_logits


@dataclass
class Scored:
    """``logprobs[k]``: [len(continuation_k)] float64 log p (nats) of request k's continuation tokens.

    ``summary``: ``pwrun.engine.report.summarize`` of the run (None for a reference model);
    ``trace``: one row per engine step; ``seconds``: wall time of the scoring.
    """

    logprobs: list[np.ndarray]
    summary: dict[str, Any] | None
    trace: pd.DataFrame | None
    seconds: float


def serve_workload(model_dir: Path, artifact_dir: Path, cfg: ServeConfig, workload: Workload,
                   device: str = "cpu", dtype: str = "auto") -> Scored:
    """Serve ``workload`` teacher-forced under ``cfg``; raises ``PagedWeightError`` for a budget below the minimum."""
    engine = build_engine(model_dir, artifact_dir, cfg, SamplingParams(max_new_tokens=1), workload.prompts, set(),
                          device=device, dtype=dtype, forced=workload.forced)
    t0 = time.perf_counter()
    outs = engine.run_until_done()
    seconds = time.perf_counter() - t0
    lps = [np.asarray(outs[k].logprobs, dtype=np.float64) for k in range(len(workload.requests))]
    for k, (lp, r) in enumerate(zip(lps, workload.requests, strict=True)):
        if lp.size != len(r.continuation):
            raise RuntimeError(f"request {k} scored {lp.size} of {len(r.continuation)} tokens")
    return Scored(lps, summarize(engine).to_dict(), trace_frame(engine), seconds)


@torch.inference_mode()
def reference_logprobs(model: LeanMoEModel, workload: Workload, step_tokens: int = 4096,
                       block_size: int = 16) -> Scored:
    """Teacher-forced log p of every continuation under ``model`` (no budget, no paging).

    Requests run ``step_tokens`` tokens at a time (whole requests, at least one per step).
    """
    t0 = time.perf_counter()
    out: list[np.ndarray] = [np.empty(0)] * len(workload.requests)
    reqs = list(enumerate(workload.requests))
    i = 0
    while i < len(reqs):
        batch: list[tuple[int, Request]] = [reqs[i]]
        i += 1
        while i < len(reqs) and sum(r.tokens for _, r in batch) + reqs[i][1].tokens <= step_tokens:
            batch.append(reqs[i])
            i += 1
        logits = prefill_logits(model, [[*r.prompt, *r.continuation[:-1]] for _, r in batch], block_size)
        at = 0
        for k, r in batch:
            n = len(r.prompt) + len(r.continuation) - 1
            rows = logits[at + len(r.prompt) - 1: at + n].float()
            lp = torch.log_softmax(rows, dim=-1)[torch.arange(len(r.continuation)), torch.tensor(r.continuation)]
            out[k] = lp.double().cpu().numpy()
            at += n
    return Scored(out, None, None, time.perf_counter() - t0)


def nll(workload: Workload, logprobs: list[np.ndarray], task: str) -> tuple[float, int]:
    """Mean negative log-likelihood (nats/token) and token count over the continuations of ``task``."""
    parts = [lp for r, lp in zip(workload.requests, logprobs, strict=True) if r.task == task]
    if not parts:
        raise ValueError(f"the workload has no {task} requests")
    tokens = np.concatenate(parts)
    return float(-tokens.mean()), int(tokens.size)
