"""The cost model: bytes of AP blocks, pool pages and KV blocks (SPEC Eq. 3 and 7), without torch.

Every byte count the planner, the engine, the benchmarks and the notebooks use comes from here:
``block_bytes`` is M_i^b of an [N, K] block at b bits (planes with their word padding plus the
b-bit LUT); ``block_pages``/``page_rounded_bytes`` round each plane and each LUT up to whole pool
pages (what the page pool really holds); ``kv_page_bytes`` is one pool page (one layer's K or V of a KV block),
``kv_block_pages``/``kv_block_bytes`` one KV block (B_KV); ``decode_step_bytes`` is what
one decode step reads from memory (the roofline floor of the serving benchmark).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pwformat.layout import LUT_BYTES, PARENT_BITS, WORD_BYTES, words_per_row


def plane_bytes(n: int, k: int) -> int:
    """Bytes of one bit-plane of an [N, K] block: N * ceil(K/32) int32 words."""
    return n * words_per_row(k) * WORD_BYTES


def lut_bytes(n: int, bits: int) -> int:
    """Bytes of the b-bit LUT of an N-row block: N * 2^b 16-bit entries."""
    return n * 2**bits * LUT_BYTES


def block_bytes(n: int, k: int, bits: int, seed: int = 3, lower_luts_resident: bool = False) -> int:
    """M^b of SPEC Eq. 3 for an [N, K] block at ``bits``: plane bytes + LUT bytes (+ lower LUTs).

    Raises ``ValueError`` if ``bits`` is outside [seed, 8].
    """
    if not seed <= bits <= PARENT_BITS:
        raise ValueError(f"bits {bits} outside [{seed}, {PARENT_BITS}]")
    luts = lut_bytes(n, bits)
    if lower_luts_resident:
        luts += sum(lut_bytes(n, b) for b in range(seed, bits))
    return bits * plane_bytes(n, k) + luts


def pages(nbytes: int, page_bytes: int) -> int:
    """Whole pool pages that hold ``nbytes``: ceil(nbytes / page_bytes)."""
    return -(-nbytes // page_bytes)


def block_pages(shapes: Sequence[tuple[int, int]], bits: Sequence[int],
                page_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Pool pages of one plane, int64 [n], and of each b-bit LUT, int64 [n, 9] (column b; 0 for b not in
    ``bits``), of blocks of shapes (N, K). Every plane and every LUT starts on its own page."""
    plane_pages = np.array([pages(plane_bytes(n, k), page_bytes) for n, k in shapes], dtype=np.int64)
    lut_pages = np.zeros((len(shapes), PARENT_BITS + 1), dtype=np.int64)
    for b in bits:
        lut_pages[:, b] = [pages(lut_bytes(n, b), page_bytes) for n, _ in shapes]
    return plane_pages, lut_pages


def page_rounded_bytes(shapes: Sequence[tuple[int, int]], bits: np.ndarray, page_bytes: int) -> np.ndarray:
    """int64 [n, len(bits)]: M_i^b rounded up to whole pool pages (b planes + the b-bit LUT), in bytes."""
    plane_pages, lut_pages = block_pages(shapes, [int(b) for b in bits], page_bytes)
    return (bits[None, :] * plane_pages[:, None] + lut_pages[:, bits]) * page_bytes


def kv_page_bytes(block_size: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of one layer's K (or V) block of ``block_size`` tokens: one pool page of the KV cache."""
    return block_size * num_kv_heads * head_dim * elem_bytes


def kv_block_pages(num_layers: int) -> int:
    """Pool pages of one KV block: each layer's K page and V page."""
    return 2 * num_layers


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """B_KV of SPEC Eq. 7: bytes of one KV block over all layers, K and V."""
    return kv_block_pages(num_layers) * kv_page_bytes(block_size, num_kv_heads, head_dim, elem_bytes)


@dataclass(frozen=True)
class MoELayerShape:
    """One MoE layer's expert shapes: hidden size H, routed expert width I (gate_up [2I, H], down [H, I]),
    experts E, top-k, shared expert width (0: none)."""

    hidden: int
    expert_intermediate: int
    num_experts: int
    top_k: int
    shared_intermediate: int


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct experts ``batch`` tokens route to when routing is uniform at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def expert_bytes_read(layer: MoELayerShape, batch: int, bits: float | None) -> float:
    """Expert bytes one decode step of ``batch`` tokens reads in ``layer``: the distinct routed experts (uniform
    routing) and the shared expert, each at ``bits`` per weight plus its ``bits``-bit LUTs (one per row of
    gate_up and down), or at 16 bits without LUTs for ``bits=None``. Word padding is ignored."""
    per = 3 * layer.hidden * layer.expert_intermediate
    shared = 3 * layer.hidden * layer.shared_intermediate
    distinct = expected_distinct_experts(layer.num_experts, layer.top_k, batch)
    if bits is None:
        return (distinct * per + shared) * 2.0
    rows = 2 * layer.expert_intermediate + layer.hidden
    srows = 2 * layer.shared_intermediate + layer.hidden if layer.shared_intermediate else 0
    return (distinct * (per * bits / 8 + rows * 2**bits * LUT_BYTES)
            + shared * bits / 8 + srows * 2**bits * LUT_BYTES)


def decode_step_bytes(non_expert_bytes: int, layers: Sequence[MoELayerShape], batch: int, context: int,
                      kv_token_bytes: int, bits: float | None) -> float:
    """Bytes one decode step of ``batch`` sequences of ``context`` tokens reads: the non-expert weights, the
    experts it routes to (``expert_bytes_read``) and every sequence's KV (``kv_token_bytes`` per token, all
    layers, K and V). Divided into the memory bandwidth it bounds decode tokens/s from above."""
    experts = sum(expert_bytes_read(m, batch, bits) for m in layers)
    return non_expert_bytes + experts + batch * context * kv_token_bytes


def artifact_bytes(shapes: Sequence[tuple[int, int]], bits: Sequence[int]) -> int:
    """Bytes of an artifact's planes and LUTs for blocks of shapes (N, K): 8 planes and one LUT per bitwidth in
    ``bits`` each (what ``pwcal quantize`` writes and the serving host mirror holds, headers aside)."""
    return sum(PARENT_BITS * plane_bytes(n, k) + sum(lut_bytes(n, b) for b in bits) for n, k in shapes)


@dataclass(frozen=True)
class HostMemory:
    """Peak host RSS of the PagedWeight stages, in bytes above the interpreter's baseline (Python, torch, the CUDA
    context), from the sizes that set it. ``artifact``: ``artifact_bytes``; ``non_expert``: the non-expert weights
    in the compute dtype; ``layer_experts``: the largest MoE layer's dense experts (routed and shared) in the
    compute dtype; ``layer_file``: the same in the checkpoint's dtype (one layer of the file, mapped while read);
    ``experts``: every expert block dense in the compute dtype."""

    artifact: int
    non_expert: int
    layer_experts: int
    layer_file: int
    experts: int = 0

    def serve(self, device_is_host: bool, pool_bytes: int = 0) -> int:
        """``pwrun generate --artifacts``: the host mirror (every plane and LUT, once) and one layer of the files
        mapped while loading; where the device is the host, also the non-expert weights, the page pool and the
        reference path's dense copies of the blocks it ran (dequantized at their committed bits, at most
        ``experts``: a speed choice of the CPU path; CUDA runs the AP kernels on the pool's planes)."""
        return self.artifact + self.layer_file + (self.non_expert + pool_bytes + self.experts if device_is_host
                                                  else 0)

    def calibrate(self, device_is_host: bool) -> int:
        """``pwcal quantize / sensitivity / fit-residual`` (Hessian importance): one layer of the checkpoint
        mapped while it is read; where the device is the host, also the non-expert weights and one MoE layer of
        experts (while it is read, the per-expert tensors and their stack). Activations and quantizer work space
        are not counted (they depend on --samples, --seq-len and the block shapes, not on the number of layers)."""
        return self.layer_file + (self.non_expert + 2 * self.layer_experts if device_is_host else 0)

    def bound(self, slack: float = 0.10) -> int:
        """The target: artifact bytes plus the non-expert weights plus ``slack``."""
        return int((self.artifact + self.non_expert) * (1 + slack))
