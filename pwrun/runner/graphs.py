"""CUDA graphs of the decode step: one graph per batch size, replayed every decode step.

What it does: a decode step runs ~60 kernels per layer; launched from Python that costs tens of
milliseconds per step, far above the bytes the step must read. The whole model forward of a pure
decode step (S sequences, one token each) has static shapes once the block tables are padded to a
fixed width, and no host synchronisation (the fused MoE kernel runs with ``check=False``, the
paged-decode kernel clamps by context length), so it is captured once per S and replayed with new
inputs copied into static buffers. Everything the planner and the mover change between steps (the
kernels' plane/LUT offset tables and committed bits, the KV page table) lives in device tensors
updated in place, so a replay always reads the current page table. Prefill and mixed steps run
eagerly. CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pwrun.model.lean import LeanMoEModel
from pwrun.model.step import StepTensors


class DecodeGraphs:
    """Captured decode forwards keyed by batch size; block tables padded to ``max_blocks`` columns."""

    def __init__(self, model: LeanMoEModel, cache: Any, moe: Callable[[torch.Tensor, int], torch.Tensor] | None,
                 max_blocks: int, keep_state: list[torch.Tensor]) -> None:
        """``moe``: the MoE forward of the AP experts (None: the model's own 16-bit experts); ``keep_state``: device
        tensors the warm-up runs must not change (e.g. routing statistics)."""
        self.model, self.cache, self.moe, self.max_blocks = model, cache, moe, max_blocks
        self.keep_state = keep_state
        self._graphs: dict[int, tuple[StepTensors, torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        # one side stream for every warm-up and capture: each new stream would get its own cuBLAS workspace
        self._side = torch.cuda.Stream(model.device)

    @property
    def sizes(self) -> list[int]:
        """Batch sizes captured so far."""
        return list(self._graphs)

    def fits(self, step: StepTensors) -> bool:
        return step.decode_only and step.padded_tables is not None and step.padded_tables.shape[1] <= self.max_blocks

    def _load(self, st: StepTensors, step: StepTensors) -> None:
        assert st.padded_tables is not None and st.context_lens_t is not None
        assert step.padded_tables is not None and step.context_lens_t is not None
        st.tokens.copy_(step.tokens)
        st.positions.copy_(step.positions)
        st.slots.copy_(step.slots)
        st.padded_tables.zero_()
        st.padded_tables[:, : step.padded_tables.shape[1]].copy_(step.padded_tables)
        st.context_lens_t.copy_(step.context_lens_t)

    def _capture(self, step: StepTensors) -> tuple[StepTensors, torch.cuda.CUDAGraph, torch.Tensor]:
        s, dev = step.num_seqs, step.tokens.device
        def zeros() -> torch.Tensor:
            return torch.zeros(s, dtype=torch.int64, device=dev)

        st = StepTensors(
            tokens=zeros(), positions=zeros(), slots=zeros(), query_start=list(range(s + 1)), context_lens=[1] * s,
            block_tables=[], padded_tables=torch.zeros(s, self.max_blocks, dtype=torch.int32, device=dev),
            context_lens_t=torch.ones(s, dtype=torch.int32, device=dev),
            last_index=torch.arange(s, device=dev))
        self._load(st, step)
        saved = [t.clone() for t in self.keep_state]
        side = self._side
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile/autotune every kernel outside the capture
                self.model.forward(st, self.cache, logits_for="last", moe=self.moe)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            out = self.model.forward(st, self.cache, logits_for="last", moe=self.moe)
        self._pool = graph.pool()
        for t, v in zip(self.keep_state, saved, strict=True):
            t.copy_(v)
        entry = (st, graph, out)
        self._graphs[s] = entry
        return entry

    def capture(self, step: StepTensors) -> None:
        """Capture the graph of ``step``'s batch size now (warm-up before the first request), if not yet captured."""
        if step.num_seqs not in self._graphs:
            self._capture(step)

    def run(self, step: StepTensors) -> torch.Tensor:
        """fp32 logits [S, V] of a pure decode step (captures the graph of this S on first use)."""
        entry = self._graphs.get(step.num_seqs)
        if entry is None:
            entry = self._capture(step)
        st, graph, out = entry
        self._load(st, step)
        graph.replay()
        return out
