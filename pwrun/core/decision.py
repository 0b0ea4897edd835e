"""What the engine core decides each step, for the model runner to execute (control plane, no torch).

What it does: ``StepDecision`` is the one object ``EngineCore.step()`` returns: the chunks to run (in
order), the requests preempted and admitted, the KV blocks allocated since the last step (with their
pool pages, for the runner's KV page table) and the ``WeightMoves`` to apply before the forward.
``WeightMoves`` is also what the core returns after sampling and while the device computes (CUDA):
the reloads whose copies completed and were committed, the blocks lowered (with their LUT copies),
and the reloads to start (copies on a side stream). The runner syncs its kernel tables for every
block listed, from the shared ``WeightPageTable``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pwrun.core.weight_table import CopyOrder


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens ``token_ids`` of request ``rid`` at positions ``start .. start+len-1``.

    ``slots``: their physical KV slots; ``block_table``: the request's whole block table; ``last``: the chunk
    ends the request's known tokens (its logits sample the next one); ``forced``: the token fed instead of a
    sampled one at that position (teacher forcing), whose log-probability the runner returns.
    """

    rid: int
    token_ids: tuple[int, ...]
    start: int
    slots: tuple[int, ...]
    block_table: tuple[int, ...]
    last: bool = True
    forced: int | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a chunk needs at least one token")
        if len(self.slots) != len(self.token_ids):
            raise ValueError("one slot per token")

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class Reload:
    """One batch of reloads started together (one copy event): ``blocks`` raised by ``orders`` host -> device."""

    batch: int
    blocks: tuple[int, ...]
    orders: tuple[CopyOrder, ...]


@dataclass
class WeightMoves:
    """Weight page table changes to mirror on the device, in order: ``committed`` blocks (reloads whose copies
    completed; their tables change), ``lowered`` blocks with their ``lut_copies`` (on the compute stream,
    ordered after every kernel that read the old LUT), ``reloads`` to start (side stream)."""

    committed: list[int] = field(default_factory=list)
    lowered: list[int] = field(default_factory=list)
    lut_copies: list[CopyOrder] = field(default_factory=list)
    reloads: list[Reload] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.committed or self.lowered or self.reloads)


@dataclass(frozen=True)
class StepDecision:
    """One step: ``chunks`` to run (in order), ``preempted``/``admitted`` request ids, ``new_kv_blocks`` (block id,
    its 2L pool pages: layer l's K page at 2l, V page at 2l+1), ``moves`` to apply before the forward, and
    ``max_table_blocks``: the longest block table any request so far may reach (the width CUDA graphs pad to)."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[int, ...]
    admitted: tuple[int, ...]
    new_kv_blocks: tuple[tuple[int, tuple[int, ...]], ...]
    moves: WeightMoves
    max_table_blocks: int

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
