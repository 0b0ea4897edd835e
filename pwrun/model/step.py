"""What one forward step computes, as device tensors (the model runner builds them from a decision).

What it does: ``StepTensors.build`` turns the engine core's ``ScheduledChunk``s (which new tokens
of which request run in this step and where they go in the KV cache) into the device tensors the
model reads (flattened tokens [T], positions [T], slots [T],
per-sequence query offsets, context lengths and block tables). A chunk of many tokens is a
prefill, a chunk of one token a decode; one step may mix both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pwrun.core.decision import ScheduledChunk


@dataclass
class StepTensors:
    """Device tensors of one step: tokens/positions/slots [T] int64; ``query_start`` has S+1 offsets."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]
    padded_tables: torch.Tensor | None = None  # [S, max_blocks] int32 (zero-padded) for paged kernels
    context_lens_t: torch.Tensor | None = None  # [S] int32
    last_index: torch.Tensor | None = None  # [S] int64, see ``last_token_index``

    @property
    def decode_only(self) -> bool:
        """Every sequence runs exactly one new token (a pure decode step)."""
        return len(self.tokens) == self.num_seqs

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def last_token_index(self) -> torch.Tensor:
        """[S] index into the T tokens of each sequence's last token (whose logits sample the next)."""
        if self.last_index is not None:
            return self.last_index
        return torch.tensor([e - 1 for e in self.query_start[1:]], device=self.tokens.device)

    @staticmethod
    def build(chunks: list[ScheduledChunk] | tuple[ScheduledChunk, ...], device: torch.device | str) -> StepTensors:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for c in chunks:
            tokens.extend(c.token_ids)
            positions.extend(range(c.start, c.start + len(c.token_ids)))
            slots.extend(c.slots)
            starts.append(len(tokens))

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        width = max((len(c.block_table) for c in chunks), default=1)
        padded = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]
        lens = [c.start + len(c.token_ids) for c in chunks]
        return StepTensors(
            tokens=t(tokens), positions=t(positions), slots=t(slots), query_start=starts,
            context_lens=lens, block_tables=[t(list(c.block_table)) for c in chunks],
            padded_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            context_lens_t=torch.tensor(lens, dtype=torch.int32, device=device),
        )
