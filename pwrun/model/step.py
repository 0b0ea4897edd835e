"""What one forward step computes, as device tensors (the model runner builds them from a decision).

What it does: ``StepTensors.build`` turns the engine core's ``ScheduledChunk``s (which new tokens
of which request run in this step and where they go in the KV cache) into the device tensors the
model reads (flattened tokens [T], positions [T], slots [T],
per-sequence query offsets, context lengths and block tables). A chunk of many tokens is a
prefill, a chunk of one token a decode; one step may mix both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    query_start_t: torch.Tensor | None = None  # [S + 1] int32 ``query_start`` on the device (varlen kernels)

    @property
    def max_query_len(self) -> int:
        """The most new tokens of one sequence in this step (sizes a varlen kernel's grid)."""
        return max((b - a for a, b in zip(self.query_start, self.query_start[1:], strict=False)), default=0)

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
        """The step's tensors from one host buffer and one host-to-device copy (each separate small copy costs
        the step ~10 us of host time, which a batch-1 decode step of ~2.5 ms notices). Every section starts on a
        16-byte boundary: Triton specializes a kernel on its pointers' alignment, so a section whose alignment
        followed the step's token count would compile a second variant in the middle of a run."""
        n_tok = sum(len(c.token_ids) for c in chunks)
        s = len(chunks)
        width = max((len(c.block_table) for c in chunks), default=1)
        starts = [0]
        lens: list[int] = []
        # int64 sections, each padded to an even length: tokens [T] | positions [T] | slots [T] | context lens [S]
        # | tables [S, width] | query offsets [S + 1]
        sizes = (n_tok, n_tok, n_tok, s, s * width, s + 1)
        at = np.concatenate([[0], np.cumsum([n + n % 2 for n in sizes])])
        tok, posn, slot, ctx, tab, qs = (int(a) for a in at[:-1])
        host = np.zeros(int(at[-1]), dtype=np.int64)
        pos = 0
        for i, c in enumerate(chunks):
            k = len(c.token_ids)
            host[tok + pos: tok + pos + k] = c.token_ids
            host[posn + pos: posn + pos + k] = np.arange(c.start, c.start + k)
            host[slot + pos: slot + pos + k] = c.slots
            pos += k
            starts.append(pos)
            lens.append(c.start + k)
            host[tab + i * width: tab + i * width + len(c.block_table)] = c.block_table
        host[ctx: ctx + s] = lens
        host[qs: qs + s + 1] = starts
        dev = torch.from_numpy(host).to(device)
        tables = dev[tab: tab + s * width].view(s, width)
        return StepTensors(
            tokens=dev[tok: tok + n_tok], positions=dev[posn: posn + n_tok], slots=dev[slot: slot + n_tok],
            query_start=starts, context_lens=lens,
            block_tables=[tables[i, : len(c.block_table)] for i, c in enumerate(chunks)],
            padded_tables=tables.to(torch.int32), context_lens_t=dev[ctx: ctx + s].to(torch.int32),
            query_start_t=dev[qs: qs + s + 1].to(torch.int32),
        )
