"""One evaluation run -> one results row: a suite (workload + engine settings) under a policy and budget.

What it does: ``TextSpec``/``LongSpec`` describe the two suites (``text``: WikiText-2 and C4 windows;
``long``: passage retrieval and QMSum windows, the long-context requests that create KV pressure);
``Evaluator`` holds the model and artifact paths, builds suites, computes static footprints and the
runtime's minimum budget, and turns a run into a row of ``results.SCHEMA``: ``run`` serves the suite
through the runtime (``scoring.serve_workload``), ``reference`` scores it with the 16-bit model (or a
dense b-bit one) and charges it its static footprint. Quality per task: perplexity = exp(mean NLL)
over every continuation token of the task; retrieval = top-1 accuracy. It does not choose budgets.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import pyarrow as pa

from pweval.meetings import qmsum_workload
from pweval.memory import Footprint, non_expert_bytes, static_footprint
from pweval.results import QUALITY, request_scores
from pweval.retrieval import RetrievalItem, RetrievalSpec, build_items, retrieval_workload
from pweval.retrieval import accuracy as retrieval_accuracy
from pweval.scoring import Scored, nll, reference_logprobs, serve_workload
from pweval.workload import Workload, interleave, text_workload
from pwformat.errors import BudgetTooSmall, PagedWeightError
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_model
from pwrun.core.config import EngineConfig
from pwrun.core.policy import Policy
from pwrun.core.request import SamplingParams
from pwrun.engine.budget import format_size
from pwrun.engine.build import ServeConfig, build_engine
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer


@dataclass(frozen=True)
class TextSpec:
    """``per_dataset`` windows of ``prompt_tokens + continuation_tokens`` from each dataset, served ``max_batch``
    at a time."""

    datasets: tuple[str, ...] = ("wikitext2", "c4")
    per_dataset: int = 48
    prompt_tokens: int = 192
    continuation_tokens: int = 64
    seed: int = 0
    max_batch: int = 16
    max_step_tokens: int = 256


@dataclass(frozen=True)
class LongSpec:
    """Retrieval questions plus ``meetings`` x ``per_meeting`` QMSum windows, served ``max_batch`` at a time."""

    retrieval: RetrievalSpec = field(default_factory=RetrievalSpec)
    meetings: int = 16
    per_meeting: int = 2
    prompt_tokens: int = 1984
    continuation_tokens: int = 64
    seed: int = 0
    max_batch: int = 32
    max_step_tokens: int = 512


@dataclass(frozen=True)
class Suite:
    """A workload with the engine settings it is served with; ``items``: its retrieval questions (may be empty)."""

    name: str
    workload: Workload
    items: tuple[RetrievalItem, ...]
    engine: EngineConfig
    prompt_tokens: int
    continuation_tokens: int
    seed: int


class Evaluator:
    """Runs suites of the model in ``model_dir`` with the AP artifact in ``artifact_dir`` on ``device``."""

    def __init__(self, model_dir: Path, artifact_dir: Path, device: str = "cpu", dtype: str = "auto") -> None:
        self.model_dir, self.artifact_dir, self.device, self.dtype = Path(model_dir), Path(artifact_dir), device, dtype
        self.artifact = APArtifact(self.artifact_dir)
        self.artifact.check_model(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.peak_kv: dict[Suite, int] = {}
        self.last = Scored([], None, None, 0.0)  # the latest run's scores, summary and trace
        self.last_suite: Suite | None = None

    @cached_property
    def model(self) -> LeanMoEModel:
        """The 16-bit model on the device (the reference; its non-expert bytes are the runtime's fixed part)."""
        return load_model(self.model_dir, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ suites
    def text_suite(self, spec: TextSpec) -> Suite:
        wl = text_workload(self.tokenizer, spec.datasets, spec.per_dataset, spec.prompt_tokens,
                           spec.continuation_tokens, spec.seed, self.model.spec.max_position_embeddings)
        return Suite("text", wl, (), EngineConfig(max_batch=spec.max_batch, max_step_tokens=spec.max_step_tokens),
                     spec.prompt_tokens, spec.continuation_tokens, spec.seed)

    def long_suite(self, spec: LongSpec) -> Suite:
        items = build_items(self.tokenizer, spec.retrieval)
        meetings = qmsum_workload(self.tokenizer, spec.meetings, spec.per_meeting, spec.prompt_tokens,
                                  spec.continuation_tokens, spec.seed)
        wl = Workload("long", tuple(interleave([list(retrieval_workload(items).requests), list(meetings.requests)])))
        if wl.longest > self.model.spec.max_position_embeddings:
            raise PagedWeightError(f"long requests of {wl.longest} tokens exceed the model's context")
        return Suite("long", wl, tuple(items), EngineConfig(max_batch=spec.max_batch,
                                                            max_step_tokens=spec.max_step_tokens),
                     spec.prompt_tokens, spec.continuation_tokens, spec.seed)

    # ------------------------------------------------------------------ memory
    def footprint(self, suite: Suite, bits: int) -> Footprint:
        """Static footprint of ``suite`` with every expert at ``bits`` (16: the 16-bit model); its KV part is the
        measured peak (``measure_peak_kv``) once known, else the full-concurrency bound."""
        fp = static_footprint(self.model.spec, non_expert_bytes(self.model), suite.workload, suite.engine, bits,
                              self.model.dtype, cuda=self.model.device.type == "cuda")
        kv = self.peak_kv.get(suite)
        return fp if kv is None else replace(fp, kv=kv)

    def measure_peak_kv(self, suite: Suite) -> int:
        """KV bytes ``suite`` really holds at its peak when nothing queues: served once with every expert at the
        lowest bitwidth under its full-concurrency footprint, peak pool pages minus the experts' pages. Later
        footprints of ``suite`` use it (a static deployment needs this much to serve it without queueing)."""
        self.peak_kv.pop(suite, None)
        low = min(self.artifact.bits)
        fp = self.footprint(suite, low)
        cfg = ServeConfig(fp.total, Policy.named("uniform", low), suite.engine)
        scored = serve_workload(self.model_dir, self.artifact_dir, cfg, suite.workload, self.device, self.dtype)
        s = scored.summary
        assert s is not None and s["preemptions"] == 0
        self.peak_kv[suite] = int(s["pool_peak_pages"] * s["page_bytes"] - fp.experts)
        return self.peak_kv[suite]

    def minimum(self, suite: Suite, policy: str = "pagedweight") -> int:
        """The smallest budget (bytes) the runtime accepts for ``suite`` under ``policy``."""
        try:  # the budget check comes before any allocation
            build_engine(self.model_dir, self.artifact_dir, ServeConfig(1, Policy.named(policy), suite.engine),
                         SamplingParams(max_new_tokens=1), suite.workload.prompts, set(), self.device, self.dtype,
                         forced=suite.workload.forced)
        except BudgetTooSmall as exc:
            return exc.minimum
        raise AssertionError("a 1-byte budget was accepted")

    # ------------------------------------------------------------------ runs
    def run(self, suite: Suite, policy: str, budget: int, label: str = "custom", bits: int | None = None,
            infeasible_ok: bool = False, damage: Path | None = None, name: str | None = None) -> dict[str, Any]:
        """Serve ``suite`` under ``budget`` bytes with ``policy``; the results row. A budget below the policy's
        minimum raises ``BudgetTooSmall``, or with ``infeasible_ok`` gives a row without quality and a note.
        ``damage``: a measured damage table in place of the sensitivities (``ServeConfig.damage``); ``name``: the
        row's policy name (default ``policy``)."""
        cfg = ServeConfig(budget, Policy.named(policy, bits), suite.engine, damage=damage)
        policy = name or policy
        try:
            scored = serve_workload(self.model_dir, self.artifact_dir, cfg, suite.workload, self.device, self.dtype)
        except BudgetTooSmall as exc:
            if not infeasible_ok:
                raise
            self.last = Scored([], None, None, 0.0)
            return {**self._row(suite, Scored([], None, None, 0.0), policy, bits, label), "gpu_memory": budget,
                    "note": f"infeasible: {policy} needs at least {format_size(exc.minimum)}"}
        s = scored.summary
        assert s is not None
        row = self._row(suite, scored, policy, bits, label)
        row.update({
            "gpu_memory": budget, "fixed_bytes": s["fixed_bytes"], "workspace_bytes": s["workspace_bytes"],
            "pool_bytes": s["pool_bytes"], "expert_bytes_mean": s["weight_bytes_mean"],
            "expert_bytes_scored": s["weight_bytes_decode_mean"],
            "expert_bytes_16bit": s["expert_bytes_16bit"], "kv_bytes_max": s["kv_bytes_max"],
            "kv_bytes_mean": s["kv_bytes_mean"], "mean_bits": s["mean_bits"],
            "preemptions": s["preemptions"], "demoted_blocks": s["demoted_blocks"],
            "promoted_blocks": s["promoted_blocks"], "tokens_per_second": s["tokens_per_second"],
            "device": s["device"], "dtype": s["dtype"],
        })
        self.last = scored
        return row

    def reference(self, suite: Suite, bits: int = 16) -> dict[str, Any]:
        """Score ``suite`` with the 16-bit model (or every expert dense at ``bits``), charged its static footprint."""
        model = self.model if bits == 16 else dense_model(self.artifact, self.model, bits)
        scored = reference_logprobs(model, suite.workload, block_size=suite.engine.block_size)
        fp = self.footprint(suite, bits)
        row = self._row(suite, scored, "16-bit" if bits == 16 else "dense", bits, "FP16" if bits == 16 else f"U{bits}")
        row.update({
            "gpu_memory": fp.total, "fixed_bytes": fp.fixed, "workspace_bytes": fp.workspace, "pool_bytes": 0,
            "expert_bytes_mean": float(fp.experts), "expert_bytes_scored": float(fp.experts),
            "expert_bytes_16bit": self.footprint(suite, 16).experts,
            "kv_bytes_max": fp.kv, "kv_bytes_mean": math.nan, "mean_bits": float(bits), "preemptions": 0,
            "demoted_blocks": 0, "promoted_blocks": 0, "tokens_per_second": math.nan,
            "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
        })
        self.last = scored
        return row

    def scores(self, row: dict[str, Any]) -> pa.Table:
        """The per-request scores (``results.SCORES``) of the latest run, whose row is ``row``."""
        if self.last_suite is None or not self.last.logprobs:
            return request_scores(row["run_id"], [], [])
        return request_scores(row["run_id"], [r.task for r in self.last_suite.workload.requests], self.last.logprobs)

    def _row(self, suite: Suite, scored: Scored, policy: str, bits: int | None, label: str) -> dict[str, Any]:
        self.last_suite = suite
        wl = suite.workload
        row: dict[str, Any] = {
            "run_id": uuid.uuid4().hex[:12], "suite": suite.name, "policy": policy, "bits": bits, "budget": label,
            "seconds": scored.seconds,
            "requests": len(wl.requests), "max_batch": suite.engine.max_batch,
            "max_step_tokens": suite.engine.max_step_tokens, "prompt_tokens": suite.prompt_tokens,
            "continuation_tokens": suite.continuation_tokens, "seed": suite.seed, "artifact": str(self.artifact_dir),
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        if not scored.logprobs:
            return row
        for task in QUALITY:
            if task in wl.tasks:
                loss, n = nll(wl, scored.logprobs, task)
                row[f"{task}_ppl"], row[f"{task}_tokens"] = math.exp(loss), n
        if suite.items:
            row["retrieval_acc"] = retrieval_accuracy(list(suite.items), wl.requests, scored.logprobs)
            row["retrieval_questions"] = len(suite.items)
            row["retrieval_candidates"] = len(suite.items[0].candidates)
        return row

