"""Model runner: the one place that owns the KV cache tensors and calls the model for a step.

What it does: holds a ``LeanMoEModel``, its ``PagedKVCache`` and the control-plane
``BlockTables``; ``run`` takes each sequence's new tokens, reserves their KV blocks, builds the
step tensors and returns the logits. ``release`` frees a finished sequence's blocks. It does not
decide which sequences run (the caller schedules) and does not sample.
"""

from __future__ import annotations

import torch

from pwrun.kv.blocks import BlockAllocator, BlockTables
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import MoEObserver
from pwrun.model.step import SeqChunk, StepTensors


class ModelRunner:
    """Runs steps of ``model`` over a KV cache of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, model: LeanMoEModel, num_blocks: int, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        self.tables = BlockTables(BlockAllocator(num_blocks), block_size)
        self.cache = model.new_kv_cache(num_blocks, block_size)
        self.lengths: dict[int, int] = {}

    def run(self, new_tokens: dict[int, list[int]], logits_for: str = "last",
            observer: MoEObserver | None = None, with_grad: bool = False) -> torch.Tensor:
        """Append ``new_tokens[seq_id]`` to each sequence and run them in one step.

        Returns fp32 logits [S, V] (last token of each sequence, in ``new_tokens`` order) or
        [T, V] (``logits_for="all"``). ``with_grad``: through ``LeanMoEModel.forward_with_grad`` (no observer).
        Raises ``OutOfBlocks`` (allocating nothing) if the cache is full.
        """
        needs = sum(self.tables.extra_blocks(s, self.lengths.get(s, 0) + len(t)) for s, t in new_tokens.items())
        if needs > self.tables.allocator.num_free:
            from pwrun.kv.blocks import OutOfBlocks

            raise OutOfBlocks(f"step needs {needs} KV blocks, {self.tables.allocator.num_free} free")
        chunks = []
        for seq_id, toks in new_tokens.items():
            start = self.lengths.get(seq_id, 0)
            end = start + len(toks)
            self.tables.reserve(seq_id, end)
            chunks.append(SeqChunk(seq_id, tuple(toks), start, tuple(self.tables.slots(seq_id, start, end)),
                                   tuple(self.tables.table(seq_id))))
            self.lengths[seq_id] = end
        step = StepTensors.build(chunks, self.model.device)
        if with_grad:
            return self.model.forward_with_grad(step, self.cache, logits_for=logits_for)
        return self.model.forward(step, self.cache, logits_for=logits_for, observer=observer)

    def release(self, seq_id: int) -> None:
        """Free the KV blocks of a finished sequence."""
        self.tables.free(seq_id)
        self.lengths.pop(seq_id, None)
