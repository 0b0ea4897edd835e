"""The host mirror of every expert block and the copies into the page pool (SPEC sections 3 and 6).

What it does: keeps every block's 8 bit-planes and every LUT in one host buffer of exactly their bytes (pinned
on CUDA: weights never change, so a demotion copies nothing back) and executes ``CopyOrder``s into the pool's bytes.
Reloads copy on a side CUDA stream behind the running step and record one event per reload batch;
``finished`` lists the batches whose copies completed (on the CPU every copy is done at once).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from pwformat.layout import WORD_BYTES, words_per_row
from pwrun.ap.artifact import APArtifact
from pwrun.core.decision import Reload
from pwrun.core.weight_table import CopyOrder
from pwrun.model.inventory import LinearBlock


class HostMirror:
    """Planes [8, N, K/32] int32 and b-bit LUTs [N, 2^b] (``lut_dtype``) of blocks ``keys`` (layer, expert, unit)
    with ``shapes`` (N, K), read from ``artifact`` layer by layer; copies into ``memory`` (uint8 [bytes]).

    All planes and LUTs are views of one host buffer of exactly their bytes (``host_bytes``), filled straight
    from the artifact's mapped files (one copy, no intermediate one), and on CUDA page-locked in place
    (``cudaHostRegister``: torch's pinned allocator would round every tensor up to a power of two)."""

    def __init__(self, artifact: Any, keys: list[tuple[int, int, str]], shapes: list[tuple[int, int]],
                 bits: list[int], lut_dtype: torch.dtype, memory: torch.Tensor, page_bytes: int) -> None:
        self.memory, self.page_bytes = memory, page_bytes
        self.device = memory.device
        elt = torch.empty(0, dtype=lut_dtype).element_size()
        sizes = [(8 * n * words_per_row(k) * WORD_BYTES, [n * 2**b * elt for b in bits]) for n, k in shapes]
        self.host_bytes = sum(p + sum(luts) for p, luts in sizes)
        self.buffer = torch.empty(self.host_bytes, dtype=torch.uint8)
        self._registered = False
        if self.device.type == "cuda" and self.host_bytes:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.host_bytes, 0)
            self._registered = int(err) == 0
            if not self._registered:
                warnings.warn(f"cannot page-lock the {self.host_bytes}-byte host mirror (cudaHostRegister: {err}): "
                              "reloads copy synchronously", stacklevel=2)
        self.planes: list[torch.Tensor] = []
        self.luts: list[dict[int, torch.Tensor]] = []
        # byte spans in the buffer, so that a copy order costs two slices (a reload step issues hundreds):
        # (first plane's offset, bytes per plane) per block and (offset, bytes) per block and LUT bitwidth
        self._plane_at: list[tuple[int, int]] = []
        self._lut_at: list[dict[int, tuple[int, int]]] = []
        at = 0

        def take(nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            nonlocal at
            view = self.buffer[at:at + nbytes].view(dtype).view(shape)
            at += nbytes
            return view

        for (n, k), (pb, lbs) in zip(shapes, sizes, strict=True):
            self._plane_at.append((at, pb // 8))
            self.planes.append(take(pb, torch.int32, (8, n, words_per_row(k))))
            spans = {}
            for b, lb in zip(bits, lbs, strict=True):
                spans[b] = (at, lb)
                at += lb
            self._lut_at.append(spans)
            self.luts.append({b: self.buffer[o:o + lb].view(lut_dtype).view(n, 2**b) for b, (o, lb) in spans.items()})
        for layer in sorted({k[0] for k in keys}):
            t = artifact.layer_tensors(layer)  # views of the mapped file: unmapped once dropped
            for i in (i for i, k in enumerate(keys) if k[0] == layer):
                name = APArtifact.key(LinearBlock(*keys[i], *shapes[i]))
                self.planes[i].copy_(t[f"{name}.planes"])
                for b in bits:
                    self.luts[i][b].copy_(t[f"{name}.lut{b}"])
            del t
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: list[tuple[Any, int]] = []  # (event or None, reload batch id)
        self.bytes_h2d = 0
        self.copies = 0  # copy_ calls issued (merged orders count once)

    def __del__(self) -> None:
        if getattr(self, "_registered", False):
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False

    def copy(self, orders: list[CopyOrder] | tuple[CopyOrder, ...]) -> None:
        """Execute copy orders on the current stream (host mirror -> pool pages). Orders whose bytes follow each
        other both in the mirror and in the pool (a block's planes placed in consecutive page runs) go as one
        copy: each ``copy_`` costs the host ~10 us, and a reload step issues hundreds."""
        run_src = run_dst = run_n = 0
        for o in orders:
            if o.what == "plane":
                at, n = self._plane_at[o.block]
                at += o.index * n
            else:
                at, n = self._lut_at[o.block][o.index]
            start = o.page * self.page_bytes
            if run_n and at == run_src + run_n and start == run_dst + run_n:
                run_n += n
                continue
            self._copy_span(run_src, run_dst, run_n)
            run_src, run_dst, run_n = at, start, n
        self._copy_span(run_src, run_dst, run_n)

    def _copy_span(self, src: int, dst: int, n: int) -> None:
        if n:
            self.memory[dst:dst + n].copy_(self.buffer[src:src + n], non_blocking=True)
            self.bytes_h2d += n
            self.copies += 1

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
