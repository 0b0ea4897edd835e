"""The model runner: the one owner of device memory, executing the engine core's decisions.

What it does: allocates the page pool's bytes (one uint8 tensor: KV pages and, with AP experts, their
bit-planes and LUTs), views them as the paged KV store, and holds the model (non-expert weights, or the
whole 16-bit model when the experts are not paged), the expert store (``experts/``) and the decode CUDA
graphs. ``execute`` maps the decision's new KV blocks, mirrors its weight moves, builds the step's
tensors and runs the forward (replaying a CUDA graph for pure decode steps); ``sample`` turns the logits
into tokens (or the log-probability of forced ones) with one seeded generator per request. Whether the
Triton kernels run is ``EngineConfig.use_kernels`` (default: on CUDA), not the device type, so the
kernel wiring also runs on the CPU in Triton's interpreter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pwformat.cost import kv_block_pages, kv_page_bytes
from pwrun.core.config import EngineConfig
from pwrun.core.decision import StepDecision, WeightMoves
from pwrun.core.planner.tables import BlockTable
from pwrun.core.pool import PagePool
from pwrun.core.request import Request, SamplingParams
from pwrun.core.weight_table import WeightPageTable
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import MoEObserver
from pwrun.model.step import StepTensors
from pwrun.runner.experts.store import ExpertStore
from pwrun.runner.graphs import DecodeGraphs
from pwrun.runner.kv_store import PooledKVCache
from pwrun.runner.sampling import sample, token_logprob


class ModelRunner:
    """Runs ``model`` over a page pool of ``num_pages`` pages of ``page_bytes`` (KV pages of ``cfg.block_size``
    tokens). Raises ``RuntimeError`` (from torch) if the device cannot hold the pool."""

    def __init__(self, model: LeanMoEModel, cfg: EngineConfig, num_pages: int, page_bytes: int) -> None:
        self.model, self.cfg = model, cfg
        self.device = model.device
        self.use_kernels = cfg.use_kernels if cfg.use_kernels is not None else self.device.type == "cuda"
        model.fused = cfg.fused_kernels and self.use_kernels
        spec = model.spec
        a = spec.layers[0].attention
        if page_bytes != kv_page_bytes(cfg.block_size, a.num_kv_heads, a.head_dim, model.dtype.itemsize):
            raise ValueError("a pool page must hold exactly one layer's K (or V) of one KV block")
        self.memory = torch.empty(num_pages * page_bytes, dtype=torch.uint8, device=self.device)
        self.kv = PooledKVCache(self.memory, spec.num_layers, num_pages // kv_block_pages(spec.num_layers),
                                cfg.block_size, a.num_kv_heads, a.head_dim, model.dtype, self.use_kernels)
        self.experts: ExpertStore | None = None
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
                with_grad: bool = False) -> torch.Tensor:
        """Apply ``decision``'s KV mapping and weight moves, then launch its forward; fp32 logits [S, V] (last
        token of each chunk) or [T, V] (``logits_for="all"``). On CUDA the logits may still be computing.
        ``observer`` sees the 16-bit experts' inputs (calibration); ``with_grad``: through
        ``LeanMoEModel.forward_with_grad`` (16-bit experts, no observer)."""
        self.kv.map_blocks(decision.new_kv_blocks)
        self.apply(decision.moves)
        step = StepTensors.build(decision.chunks, self.device)
        if with_grad:
            return self.model.forward_with_grad(step, self.kv, logits_for=logits_for)
        moe = None if self.experts is None else self.experts.moe
        self.captured = False
        if (logits_for == "last" and self.cfg.cuda_graphs and self.device.type == "cuda" and step.decode_only
                and moe is not None):  # the 16-bit reference experts sync with the host: not capturable
            if self.graphs is None:
                keep = [] if self.experts is None else [self.experts.moe.mass_acc, self.experts.moe.norm_acc]
                self.graphs = DecodeGraphs(self.model, self.kv, moe, decision.max_table_blocks, keep)
            if self.graphs.fits(step):
                before = len(self.graphs.sizes)
                out = self.graphs.run(step)
                self.captured = len(self.graphs.sizes) > before
                return out
        return self.model.forward(step, self.kv, logits_for=logits_for, observer=observer, moe=moe)

    def sync(self) -> None:
        """Wait for the compute stream only: reload copies on the side stream go on across step boundaries."""
        self._sync()

    def sample(self, decision: StepDecision, logits: torch.Tensor) -> tuple[list[int | None], list[float | None]]:
        """Per chunk: the sampled token (None where the chunk does not end its request's known tokens; the forced
        token where one is given) and the log-probability of a forced token (nats; None otherwise)."""
        tokens: list[int | None] = []
        logprobs: list[float | None] = []
        for c, row in zip(decision.chunks, logits, strict=True):
            if not c.last:
                tokens.append(None)
                logprobs.append(None)
            elif c.forced is not None:
                tokens.append(c.forced)
                logprobs.append(token_logprob(row, c.forced))
            else:
                tokens.append(int(sample(row[None], self._params[c.rid], self._gens[c.rid])[0]))
                logprobs.append(None)
        return tokens, logprobs

    def peak_bytes(self) -> int:
        """Peak device memory allocated so far (CUDA; 0 elsewhere)."""
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else 0
