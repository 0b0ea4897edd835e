"""CUDA graphs of the decode step: one graph per batch size, replayed every decode step.

What it does: a decode step runs ~60 kernels per layer; launched from Python that costs tens of
milliseconds per step, far above the bytes the step must read. The whole model forward of a pure
decode step (S sequences, one token each) has static shapes once the block tables are padded to a
fixed width, and no host synchronisation (the fused MoE kernel runs with ``check=False``, the
paged-decode kernel clamps by context length), so it is captured once per S and replayed with new
inputs copied into static buffers (``DecodeInputs``: one host-to-device copy per step). Everything
the planner and the mover change between steps (the kernels' plane/LUT offset tables and committed
bits, the KV page table) lives in device tensors updated in place, so a replay always reads the
current page table. Prefill and mixed steps run eagerly. CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pwrun.core.decision import ScheduledChunk
from pwrun.model.lean import LeanMoEModel
from pwrun.runner.decode_inputs import DecodeInputs


class DecodeGraphs:
    """Captured decode forwards keyed by batch size; block tables padded to ``max_blocks`` columns."""

    def __init__(self, model: LeanMoEModel, cache: Any, moe: Callable[[torch.Tensor, int], torch.Tensor] | None,
                 max_blocks: int, keep_state: list[torch.Tensor]) -> None:
        """``moe``: the MoE forward of the AP experts (None: the model's own 16-bit experts); ``keep_state``: device
        tensors the warm-up runs must not change (e.g. routing statistics)."""
        self.model, self.cache, self.moe, self.max_blocks = model, cache, moe, max_blocks
        self.keep_state = keep_state
        self._graphs: dict[int, tuple[DecodeInputs, torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        # one side stream for every warm-up and capture: each new stream would get its own cuBLAS workspace
        self._side = torch.cuda.Stream(model.device)

    @property
    def sizes(self) -> list[int]:
        """Batch sizes captured so far."""
        return list(self._graphs)

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """``chunks`` are a pure decode step whose block tables fit the graphs' width."""
        return DecodeInputs.fits(chunks, self.max_blocks)

    def _capture(self, chunks: Sequence[ScheduledChunk]) -> tuple[DecodeInputs, torch.cuda.CUDAGraph, torch.Tensor]:
        s = len(chunks)
        inputs = DecodeInputs(s, self.max_blocks, self.model.device)
        st = inputs.load(chunks)
        dev = self.model.device
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
        entry = (inputs, graph, out)
        self._graphs[s] = entry
        return entry

    def capture(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Capture the graph of ``len(chunks)`` sequences now (warm-up before the first request), if not yet
        captured; ``chunks`` (``fits``) give the inputs of the capture's warm-up runs."""
        if len(chunks) not in self._graphs:
            self._capture(chunks)

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """fp32 logits [S, V] of the pure decode step of ``chunks`` (``fits``; captures this S on first use)."""
        entry = self._graphs.get(len(chunks))
        if entry is None:
            entry = self._capture(chunks)
        inputs, graph, out = entry
        inputs.load(chunks)
        graph.replay()
        return out
