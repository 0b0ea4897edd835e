"""The model runner: the one owner of device memory, executing the engine core's decisions.

What it does: allocates the page pool's bytes (one uint8 tensor: KV pages and, with paged experts, their
AP bit-planes and LUTs or their 16-bit weights), views them as the paged KV store, and holds the model
(non-expert weights, or the whole 16-bit model when the experts are not paged), the expert store (``experts/``)
and the decode CUDA graphs. ``execute`` maps the decision's new KV blocks, mirrors its weight moves, builds the step's
tensors and runs the forward (replaying a CUDA graph for pure decode steps); ``sample`` turns the logits
into tokens (or the log-probability of forced ones) with one seeded generator per request. Whether the
Triton kernels run is ``EngineConfig.use_kernels`` (default: on CUDA), not the device type, so the
kernel wiring also runs on the CPU in Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pwrun.core.config import EngineConfig
from pwrun.core.decision import ScheduledChunk, StepDecision, WeightMoves
from pwrun.core.planner.tables import BlockTable
from pwrun.core.pool import PagePool
from pwrun.core.request import Request, SamplingParams
from pwrun.core.weight_table import WeightPageTable
from pwrun.model.inventory import kv_layout
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import MoEObserver
from pwrun.model.step import StepTensors
from pwrun.runner.experts.dense import DenseExpertStore, ExpertSource
from pwrun.runner.experts.store import ExpertStore
from pwrun.runner.graphs import DecodeGraphs
from pwrun.runner.kv_store import PooledKVCache
from pwrun.runner.sampling import sample_rows, token_logprobs


class ModelRunner:
    """Runs ``model`` over a page pool of ``num_pages`` pages of ``page_bytes`` (KV pages of ``cfg.block_size``
    tokens). Raises ``RuntimeError`` (from torch) if the device cannot hold the pool."""

    def __init__(self, model: LeanMoEModel, cfg: EngineConfig, num_pages: int, page_bytes: int) -> None:
        self.model, self.cfg = model, cfg
        self.device = model.device
        self.use_kernels = cfg.use_kernels if cfg.use_kernels is not None else self.device.type == "cuda"
        model.fused = cfg.fused_kernels and self.use_kernels
        if page_bytes != kv_layout(model.spec).page_bytes(cfg.block_size, model.dtype.itemsize):
            raise ValueError("a pool page must hold exactly the widest layer's K (or V) of one KV block")
        self.memory = torch.empty(num_pages * page_bytes, dtype=torch.uint8, device=self.device)
        spec = model.spec
        a = spec.layers[0].attention
        layers = [(ls.attention.num_kv_heads, ls.attention.head_dim, ls.attention.window) for ls in spec.layers]
        self.kv = PooledKVCache(self.memory, spec.num_layers, kv_layout(spec).max_blocks(num_pages), cfg.block_size,
                                a.num_kv_heads, a.head_dim, model.dtype, self.use_kernels, layers)
        self.experts: ExpertStore | DenseExpertStore | None = None
        self.graphs: DecodeGraphs | None = None
        self.captured = False  # the last step captured a CUDA graph (one-off cost: warm-up + capture)
        self._params: dict[int, SamplingParams] = {}
        self._gens: dict[int, torch.Generator] = {}
        self._sync = torch.cuda.current_stream(self.device).synchronize if self.device.type == "cuda" \
            else (lambda: None)

    # ------------------------------------------------------------------ experts
    def load_experts(self, source: Any, table: BlockTable, wpt: WeightPageTable, pool: PagePool,
                     q_bits: np.ndarray, observe: bool) -> ExpertStore:
        """Place the AP experts of ``source`` (an ``APArtifact`` or any object with ``layer_tensors(layer)``) at
        ``q_bits`` [n] in the pool; ``observe``: accumulate the live routing statistics (a planner reads them)."""
        self.experts = ExpertStore(source, self.model, table, wpt, pool, self.memory, self.use_kernels)
        self.experts.moe.observe = observe
        self.experts.place(q_bits)
        return self.experts

    def load_dense_experts(self, source: ExpertSource, pool: PagePool) -> DenseExpertStore:
        """Place the 16-bit experts of ``source`` (one MoE layer at a time) in WEIGHT runs of the pool, for good."""
        self.experts = DenseExpertStore(source, self.model, pool, self.memory, self.use_kernels)
        return self.experts

    def apply(self, moves: WeightMoves) -> None:
        """Mirror weight page table changes on the device (see ``ExpertStore.apply``)."""
        if self.experts is not None and not moves.empty:
            self.experts.apply(moves)

    def finished_reloads(self) -> list[int]:
        return [] if self.experts is None else self.experts.finished_reloads()

    def take_stats(self) -> tuple[np.ndarray, np.ndarray]:
        assert self.experts is not None
        return self.experts.take_stats()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Request ``rid`` samples with its parameters from a generator seeded ``request.seed`` (default
        ``params.seed + rid``)."""
        self._params[request.rid] = request.params
        seed = request.params.seed + request.rid if request.seed is None else request.seed
        self._gens[request.rid] = torch.Generator().manual_seed(seed)

    def release(self, rid: int) -> None:
        self._params.pop(rid, None)
        self._gens.pop(rid, None)

    # ------------------------------------------------------------------ steps
    def execute(self, decision: StepDecision, logits_for: str = "last", observer: MoEObserver | None = None,
                with_grad: bool = False, moe: Callable[[torch.Tensor, int], torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Apply ``decision``'s KV mapping and weight moves, then launch its forward; fp32 logits [S, V] (last
        token of each chunk) or [T, V] (``logits_for="all"``). On CUDA the logits may still be computing.
        ``observer`` sees the 16-bit experts' inputs (calibration); ``with_grad``: through
        ``LeanMoEModel.forward_with_grad`` (16-bit experts, no observer). ``moe``: runs the MoE blocks instead of
        the runner's experts (``LeanMoEModel.forward``'s argument; offline scoring of many expert allocations)."""
        self.kv.map_blocks(decision.new_kv_blocks)
        self.apply(decision.moves)
        if moe is None and self.experts is not None and not with_grad:
            moe = self.experts.moe
        self.captured = False
        if (logits_for == "last" and not with_grad and self.cfg.cuda_graphs and self.device.type == "cuda"
                and moe is not None):  # the 16-bit reference experts sync with the host: not capturable
            if self.graphs is None:
                keep = [] if self.experts is None else [self.experts.moe.mass_acc, self.experts.moe.norm_acc]
                self.graphs = DecodeGraphs(self.model, self.kv, moe, decision.max_table_blocks, keep)
            if self.graphs.fits(decision.chunks):
                before = len(self.graphs.sizes)
                out = self.graphs.run(decision.chunks)
                self.captured = len(self.graphs.sizes) > before
                return out
        step = StepTensors.build(decision.chunks, self.device)
        if with_grad:
            return self.model.forward_with_grad(step, self.kv, logits_for=logits_for)
        return self.model.forward(step, self.kv, logits_for=logits_for, observer=observer, moe=moe)

    @property
    def wants_warm_up(self) -> bool:
        """CUDA with the kernels: steps compile kernels and capture graphs on first use unless warmed up."""
        return self.device.type == "cuda" and self.use_kernels

    def warm_up(self, block: int, pages: tuple[int, ...], max_batch: int, max_step_tokens: int,
                table_blocks: int) -> int:
        """Before the first request: run a prefill step of ``max_step_tokens`` tokens and a mixed one of odd
        length (compiling the kernels of prefill and mixed steps at both of Triton's integer specializations),
        and capture the decode graph of every batch size 1..``max_batch`` with block tables of
        ``table_blocks`` columns, so that no step of a run compiles or captures. Every write goes to KV block
        ``block`` (pool pages ``pages``: a scratch block the caller frees afterwards); the routing statistics
        are left as they were. Returns the graphs captured."""
        self.kv.map_blocks(((block, pages),))
        bs = self.cfg.block_size

        def chunk(n: int, start: int = 0) -> ScheduledChunk:
            return ScheduledChunk(rid=-1, token_ids=(0,) * n, start=start,
                                  slots=tuple(block * bs + (start + i) % bs for i in range(n)),
                                  block_table=(block,) * -(-(start + n) // bs))

        keep = [] if self.experts is None else [self.experts.moe.mass_acc, self.experts.moe.norm_acc]
        saved = [t.clone() for t in keep]
        moe = None if self.experts is None else self.experts.moe
        for chunks in ([chunk(max_step_tokens)], [chunk(max(1, min(17, max_step_tokens - 1)), 3), chunk(1, 5)]):
            self.model.forward(StepTensors.build(chunks, self.device), self.kv, logits_for="last", moe=moe)
        captured = 0
        if self.cfg.cuda_graphs and self.device.type == "cuda" and moe is not None:
            width = max(table_blocks, 1)
            if self.graphs is None:
                self.graphs = DecodeGraphs(self.model, self.kv, moe, width, keep)
            for s in range(1, max_batch + 1):
                chunks = [chunk(1, 1)] * s
                if self.graphs.fits(chunks):
                    self.graphs.capture(chunks)
                    captured += 1
        for t, v in zip(keep, saved, strict=True):
            t.copy_(v)
        self._sync()
        return captured

    def sync(self) -> None:
        """Wait for the compute stream only: reload copies on the side stream go on across step boundaries."""
        self._sync()

    def sample(self, decision: StepDecision, logits: torch.Tensor) -> tuple[list[int | None], list[float | None]]:
        """Per chunk: the sampled token (None where the chunk does not end its request's known tokens; the forced
        token where one is given) and the log-probability of a forced token (nats; None otherwise). Greedy rows
        are decided by one argmax and forced rows scored by one log-softmax, each with one copy to the host (a
        row at a time would wait for the device once per request)."""
        n = len(decision.chunks)
        if logits.shape[0] != n:
            raise ValueError(f"{logits.shape[0]} rows of logits for {n} chunks")
        tokens: list[int | None] = [None] * n
        logprobs: list[float | None] = [None] * n
        forced = [(i, c.forced) for i, c in enumerate(decision.chunks) if c.last and c.forced is not None]
        free = [i for i, c in enumerate(decision.chunks) if c.last and c.forced is None]
        if forced:
            rows, want = [i for i, _ in forced], [t for _, t in forced]
            for i, t, lp in zip(rows, want, token_logprobs(logits, rows, want), strict=True):
                tokens[i], logprobs[i] = t, lp
        if free:
            rids = [decision.chunks[i].rid for i in free]
            picked = sample_rows(logits, free, [self._params[r] for r in rids], [self._gens[r] for r in rids])
            for i, t in zip(free, picked, strict=True):
                tokens[i] = t
        return tokens, logprobs

    def peak_bytes(self) -> int:
        """Peak device memory allocated so far (CUDA; 0 elsewhere)."""
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else 0
