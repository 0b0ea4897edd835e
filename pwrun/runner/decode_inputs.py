"""The static inputs of a captured decode graph, loaded from a step's chunks with one host-to-device copy.

What it does: a decode graph reads its inputs from fixed device addresses. Building the step's tensors and then
copying each into those addresses costs ~10 small launches per step, which a batch-1 decode step of ~2.5 ms
notices. ``DecodeInputs`` keeps, per batch size S, one device byte buffer laid out as tokens / positions /
slots [S] int64, block tables [S, max_blocks] int32 and context lengths [S] int32 (each section 16-byte
aligned), and a host twin of it (pinned on CUDA). ``load`` fills the host twin with numpy and copies it in one
transfer, ordered on the current stream before the replay that reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pwrun.core.decision import ScheduledChunk
from pwrun.model.step import StepTensors


def _sections(s: int, max_blocks: int) -> tuple[list[int], int]:
    """Byte offsets of tokens, positions, slots, tables, context lengths; total bytes (16-byte aligned)."""
    sizes = [8 * s, 8 * s, 8 * s, 4 * s * max_blocks, 4 * s]
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += -(-n // 16) * 16
    return starts, at


class DecodeInputs:
    """Inputs of a pure decode step of ``s`` sequences whose block tables have at most ``max_blocks`` columns."""

    def __init__(self, s: int, max_blocks: int, device: torch.device) -> None:
        self.s, self.max_blocks = s, max_blocks
        starts, total = _sections(s, max_blocks)
        pin = device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self.dev = torch.zeros(total, dtype=torch.uint8, device=device)
        ends = [a + n for a, n in zip(starts, [8 * s, 8 * s, 8 * s, 4 * s * max_blocks, 4 * s], strict=True)]

        def views(buf: torch.Tensor) -> list[torch.Tensor]:
            out = [buf[a:b].view(torch.int64) for a, b in zip(starts[:3], ends[:3], strict=True)]
            out.append(buf[starts[3]:ends[3]].view(torch.int32).view(s, max_blocks))
            out.append(buf[starts[4]:ends[4]].view(torch.int32))
            return out

        h = [v.numpy() for v in views(self.host)]
        self._tok, self._pos, self._slot, self._tab, self._ctx = h
        tok, pos, slot, tab, ctx = views(self.dev)
        self.step = StepTensors(tokens=tok, positions=pos, slots=slot, query_start=list(range(s + 1)),
                                context_lens=[1] * s, block_tables=[], padded_tables=tab, context_lens_t=ctx,
                                last_index=torch.arange(s, device=device))
        # recorded after each copy out of ``host`` (CUDA): the next load refills it only once that copy is done
        self._copied = torch.cuda.Event() if pin else None

    @staticmethod
    def fits(chunks: Sequence[ScheduledChunk], max_blocks: int) -> bool:
        """A pure decode step (one new token per sequence) whose tables fit ``max_blocks`` columns."""
        return all(len(c.token_ids) == 1 and len(c.block_table) <= max_blocks for c in chunks)

    def load(self, chunks: Sequence[ScheduledChunk]) -> StepTensors:
        """Write the step of ``chunks`` (``fits``, ``s`` of them) into the device buffer; returns its tensors."""
        if self._copied is not None:
            self._copied.synchronize()  # returns at once when never recorded
        tab = self._tab
        tab.fill(0)
        for i, c in enumerate(chunks):
            self._tok[i] = c.token_ids[0]
            self._pos[i] = c.start
            self._slot[i] = c.slots[0]
            self._ctx[i] = c.start + 1
            tab[i, : len(c.block_table)] = c.block_table
        self.dev.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.step
