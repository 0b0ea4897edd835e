"""Constants of the Any-Precision bit-plane format (SPEC section 2), without torch.

Codes are nested 8-bit parent codes; a plane holds one bit of every code of a block, 32 columns per int32
word; a b-bit LUT holds 2^b 16-bit floats per row. ``pwformat.ap`` packs and unpacks; ``pwformat.cost``
counts the bytes.
"""

from __future__ import annotations

FORMAT = "pagedweight-ap"  # manifest "format" and the safetensors metadata of every layer file
PARENT_BITS = 8
FORMAT_VERSION = 1
SUPPORTED_SEEDS = (2, 3)
WORD_BYTES = 4  # one int32 plane word = 32 columns
LUT_BYTES = 2  # one LUT entry: fp16 (or bf16 for a bf16 model)


def words_per_row(k: int) -> int:
    """int32 words per row of one bit-plane: ceil(K / 32)."""
    return -(-k // 32)
