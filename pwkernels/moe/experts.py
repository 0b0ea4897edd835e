"""The table-addressed weights of E AP experts that every MoE kernel reads (SPEC section 7).

Layout (never assumed contiguous, so a runtime can place and move every plane independently):
  * ``pool`` int32 [P]: all bit-planes. Plane p of block i is an [N_i, ceil(K_i / 32)] int32 array
    (the layout of ``pwformat.ap``) starting at word ``plane_offset[i, p]``.
  * ``lut_pool`` fp16/bf16 [L]: the LUT of block i at its committed bitwidth, an [N_i, 2^q_i] array
    starting at element ``lut_offset[i]``.
  * ``bits`` int32 [2E]: committed q_i in 1..8. Block ids: gate_up [2I, H] of expert e = 2e, down [H, I] = 2e + 1.
    Planes q_i..7 of block i are never read.

``DenseExperts`` is the 16-bit counterpart (``pwkernels.moe.dense``): ``pool`` bf16/fp16 [P] holds each block's
row-major weight starting at element ``offset[i]`` (same block ids), again never assumed contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pwformat.ap import pack_planes
from pwkernels.moe.dense_grouped import grouped_mm_fits


@dataclass(frozen=True)
class APExperts:
    """Table-addressed AP weights of E experts; ``inter`` is I, ``hidden`` is H."""

    pool: torch.Tensor  # int32 [P]
    plane_offset: torch.Tensor  # int64 [2E, 8] word offsets
    lut_pool: torch.Tensor  # fp16/bf16 [L]
    lut_offset: torch.Tensor  # int64 [2E]
    bits: torch.Tensor  # int32 [2E]
    hidden: int
    inter: int

    @property
    def num_experts(self) -> int:
        return self.bits.numel() // 2

    def block(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(planes [q, N, Kw], lut [N, 2^q], N, K) of block i, gathered through the tables (host syncs)."""
        n, k = (2 * self.inter, self.hidden) if i % 2 == 0 else (self.hidden, self.inter)
        kw = -(-k // 32)
        q = int(self.bits[i])
        offs = self.plane_offset[i, :q].tolist()
        planes = torch.stack([self.pool[o:o + n * kw].view(n, kw) for o in offs])
        lo = int(self.lut_offset[i])
        return planes, self.lut_pool[lo:lo + n * 2**q].view(n, 2**q), n, k


def build_experts(codes: list[torch.Tensor], luts: list[dict[int, torch.Tensor]], bits: list[int], hidden: int,
                  inter: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                  shuffle_seed: int | None = None) -> APExperts:
    """Lay out blocks (2 per expert: gate_up [2I, H], down [H, I]) into one plane pool + LUT pool.

    ``codes[i]``: 8-bit parent codes [N, K] uint8, or already packed planes [8, N, Kw] int32;
    ``luts[i][b]``: [N, 2^b]; ``bits[i]``: committed q. Only planes 0..q-1 and the q-bit LUT are placed.
    With ``shuffle_seed`` the planes land in a random order with gaps, to exercise table addressing.
    """
    pieces: list[tuple[int, int, torch.Tensor]] = []
    for i, (c, q) in enumerate(zip(codes, bits, strict=True)):
        planes = c if c.dtype == torch.int32 else pack_planes(c.to(device))
        pieces += [(i, p, planes[p].flatten().to(device)) for p in range(q)]
    if shuffle_seed is not None:
        g = torch.Generator().manual_seed(shuffle_seed)
        pieces = [pieces[j] for j in torch.randperm(len(pieces), generator=g).tolist()]
    offset = torch.full((len(codes), 8), -1, dtype=torch.int64)
    chunks, pos = [], 0
    gap = 7 if shuffle_seed is not None else 0
    for i, p, words in pieces:
        chunks.append(torch.full((gap,), -1, dtype=torch.int32, device=device))
        pos += gap
        offset[i, p] = pos
        chunks.append(words)
        pos += words.numel()
    lut_chunks, lut_offset, lpos = [], [], 0
    for i, q in enumerate(bits):
        lut_offset.append(lpos)
        lut_chunks.append(luts[i][q].flatten().to(device=device, dtype=dtype))
        lpos += lut_chunks[-1].numel()
    return APExperts(pool=torch.cat(chunks), plane_offset=offset.to(device),
                     lut_pool=torch.cat(lut_chunks), lut_offset=torch.tensor(lut_offset).to(device),
                     bits=torch.tensor(bits, dtype=torch.int32, device=device), hidden=hidden, inter=inter)


def random_experts(hidden: int, inter: int, n: int, q: int = 4, dtype: torch.dtype = torch.bfloat16,
                   device: str = "cuda") -> APExperts:
    """n experts of shape H = ``hidden``, I = ``inter``, every block at q bits: random int32 planes and LUTs
    [N, 2^q] (x 0.01). For compiling and timing kernels only (q is a run-time value: one compile serves every q)."""
    codes, luts = [], []
    for i in range(2 * n):
        rows, k = (2 * inter, hidden) if i % 2 == 0 else (hidden, inter)
        codes.append(torch.randint(-2**31, 2**31 - 1, (8, rows, -(-k // 32)), dtype=torch.int32, device=device))
        luts.append({q: torch.randn(rows, 2**q, device=device) * 0.01})
    return build_experts(codes, luts, [q] * (2 * n), hidden, inter, dtype, device)


@dataclass(frozen=True)
class DenseExperts:
    """Table-addressed 16-bit weights of E experts: block i ([2I, H] gate_up for i = 2e, [H, I] down for i = 2e + 1),
    row-major, starts at element ``offset[i]`` of ``pool``; ``inter`` is I, ``hidden`` is H."""

    pool: torch.Tensor  # bf16/fp16 [P] (any float dtype for the reference)
    offset: torch.Tensor  # int64 [2E] element offsets
    hidden: int
    inter: int
    # gate_up [E, 2I, H] and down [E, H, I] as strided views of the pool, where the blocks of expert e sit at
    # base + e * stride (``stacked_views``): the grouped-GEMM path of ``pwkernels.moe.dense_grouped`` reads them
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_experts(self) -> int:
        return self.offset.numel() // 2

    def block(self, i: int) -> torch.Tensor:
        """The weight [N, K] of block i, a view of the pool (host sync: reads its offset)."""
        n, k = (2 * self.inter, self.hidden) if i % 2 == 0 else (self.hidden, self.inter)
        o = int(self.offset[i])
        return self.pool[o:o + n * k].view(n, k)


def build_dense_experts(weights: list[torch.Tensor], hidden: int, inter: int, dtype: torch.dtype,
                        device: torch.device | str = "cpu", shuffle_seed: int | None = None) -> DenseExperts:
    """Lay out blocks ``weights`` (2 per expert: gate_up [2I, H], down [H, I]) in one pool of ``dtype``.

    With ``shuffle_seed`` the blocks land in a random order with gaps (filled with NaN: a kernel that reads outside
    its block fails the comparison), to exercise table addressing."""
    order = list(range(len(weights)))
    if shuffle_seed is not None:
        g = torch.Generator().manual_seed(shuffle_seed)
        order = torch.randperm(len(weights), generator=g).tolist()
    gap = 5 if shuffle_seed is not None else 0
    offset = [0] * len(weights)
    chunks, pos = [], 0
    for i in order:
        chunks.append(torch.full((gap,), float("nan"), dtype=dtype, device=device))
        pos += gap
        offset[i] = pos
        chunks.append(weights[i].to(device=device, dtype=dtype).flatten())
        pos += weights[i].numel()
    pool = torch.cat(chunks)
    return DenseExperts(pool=pool, offset=torch.tensor(offset, dtype=torch.int64, device=device), hidden=hidden,
                        inter=inter, stacked=stacked_views(pool, offset, hidden, inter))


def stacked_views(pool: torch.Tensor, offsets: list[int], hidden: int, inter: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """gate_up [E, 2I, H] and down [E, H, I] as views of ``pool`` when block 2e starts at g + e * S and block
    2e + 1 at d + e * S for one stride S (every expert's pair laid out alike, as placement in expert order gives)
    and every start is 16-byte aligned (cuBLAS' grouped GEMM); None otherwise, and None where torch's grouped GEMM
    would not run in one launch for the pool's dtype and device (``grouped_mm_runs_without_sync``)."""
    if not grouped_mm_fits(pool):
        return None
    g, d = offsets[0::2], offsets[1::2]
    n = len(g)
    stride = g[1] - g[0] if n > 1 else 2 * inter * hidden + hidden * inter
    if any(g[e] != g[0] + e * stride or d[e] != d[0] + e * stride for e in range(n)):
        return None
    elt = pool.element_size()
    if any((v * elt) % 16 for v in (g[0], d[0], stride)):
        return None
    gate_up = pool.as_strided((n, 2 * inter, hidden), (stride, hidden, 1), g[0])
    down = pool.as_strided((n, hidden, inter), (stride, inter, 1), d[0])
    return gate_up, down
