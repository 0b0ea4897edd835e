"""The host mirror of every expert block and the copies into the page pool (SPEC sections 3 and 6).

What it does: keeps every block's 8 bit-planes and every LUT in host memory (pinned on CUDA: weights
never change, so a demotion copies nothing back) and executes ``CopyOrder``s into the pool's bytes.
Reloads copy on a side CUDA stream behind the running step and record one event per reload batch;
``finished`` lists the batches whose copies completed (on the CPU every copy is done at once).
"""

from __future__ import annotations

from typing import Any

import torch

from pwrun.ap.artifact import APArtifact
from pwrun.core.decision import Reload
from pwrun.core.weight_table import CopyOrder
from pwrun.model.inventory import LinearBlock


class HostMirror:
    """Planes [8, N, K/32] int32 and b-bit LUTs [N, 2^b] (``lut_dtype``) of blocks ``keys`` (layer, expert, unit)
    with ``shapes`` (N, K), read from ``artifact`` layer by layer; copies into ``memory`` (uint8 [bytes])."""

    def __init__(self, artifact: Any, keys: list[tuple[int, int, str]], shapes: list[tuple[int, int]],
                 bits: list[int], lut_dtype: torch.dtype, memory: torch.Tensor, page_bytes: int) -> None:
        self.memory, self.page_bytes = memory, page_bytes
        self.device = memory.device
        pin = self.device.type == "cuda"
        planes_of: list[torch.Tensor | None] = [None] * len(keys)
        luts_of: list[dict[int, torch.Tensor] | None] = [None] * len(keys)
        for layer in sorted({k[0] for k in keys}):
            t = artifact.layer_tensors(layer)
            for i in (i for i, k in enumerate(keys) if k[0] == layer):
                name = APArtifact.key(LinearBlock(*keys[i], *shapes[i]))
                planes = t[f"{name}.planes"].contiguous()
                luts = {b: t[f"{name}.lut{b}"].to(lut_dtype).contiguous() for b in bits}
                planes_of[i] = planes.pin_memory() if pin else planes
                luts_of[i] = {b: x.pin_memory() for b, x in luts.items()} if pin else luts
        self.planes: list[torch.Tensor] = [p for p in planes_of if p is not None]
        self.luts: list[dict[int, torch.Tensor]] = [x for x in luts_of if x is not None]
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: list[tuple[Any, int]] = []  # (event or None, reload batch id)
        self.bytes_h2d = 0

    def copy(self, orders: list[CopyOrder] | tuple[CopyOrder, ...]) -> None:
        """Execute copy orders on the current stream (host mirror -> pool pages)."""
        for o in orders:
            src = self.planes[o.block][o.index] if o.what == "plane" else self.luts[o.block][o.index]
            raw = src.reshape(-1).view(torch.uint8)
            start = o.page * self.page_bytes
            self.memory[start:start + raw.numel()].copy_(raw, non_blocking=True)
            self.bytes_h2d += raw.numel()

    def start(self, reloads: list[Reload]) -> None:
        """Start the copies of ``reloads`` (side stream on CUDA, after the work queued so far)."""
        for r in reloads:
            if self.side is not None:
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    self.copy(r.orders)
                    event = torch.cuda.Event()
                    event.record(self.side)
                self._pending.append((event, r.batch))
            else:
                self.copy(r.orders)
                self._pending.append((None, r.batch))

    def finished(self) -> list[int]:
        """Reload batches whose copies completed since the last call (in the order they started)."""
        done, keep = [], []
        for event, batch in self._pending:
            if event is None or event.query():
                done.append(batch)
            else:
                keep.append((event, batch))
        self._pending = keep
        return done
