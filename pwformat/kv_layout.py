"""How one KV block's pool pages split over the layers (SPEC section 5; no torch, no numpy).

What it does: a KV block holds ``block_size`` tokens of every layer's K and V. A pool page holds one
token-row of the widest layer's K (``page_token_elems`` = max over layers of Hkv * D elements) for
``block_size`` tokens. A layer whose K is that wide takes two pages (K, V); a layer at most half as wide
keeps its K and V in the two halves of one page (Gemma-4's global layers: 2 x 512 beside 8 x 256), so a
layer's K and V are sub-pages ``page * sub + {0, 1}`` of a view of the pool with ``sub`` sub-pages per page.
Layers with a sliding window (``windows``) are the ones whose pages a block can give back once it has
fallen out of every window of its sequence (``sliding_pages``). Every layer's width must divide the widest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from pwformat.cost import kv_page_bytes


@dataclass(frozen=True)
class KVLayout:
    """``token_elems[l]``: elements of one token's K (= V) in layer l (Hkv * D); ``windows[l]``: its sliding
    window in tokens (None: global attention)."""

    token_elems: tuple[int, ...]
    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if not self.token_elems or len(self.token_elems) != len(self.windows):
            raise ValueError("a KV layout needs one width and one window per layer, at least one layer")
        widest = max(self.token_elems)
        bad = [e for e in self.token_elems if e <= 0 or widest % e]
        if bad:
            raise ValueError(f"KV widths {sorted(set(self.token_elems))} (Hkv * head_dim per layer) must each divide "
                             f"the widest ({widest}) to share one page size")

    @classmethod
    def uniform(cls, num_layers: int) -> KVLayout:
        """``num_layers`` equal global layers: two pages (K, V) per layer."""
        if num_layers <= 0:
            raise ValueError("num_layers must be positive")
        return cls((1,) * num_layers, (None,) * num_layers)

    @classmethod
    def of(cls, layers: Sequence[tuple[int, int, int | None]]) -> KVLayout:
        """From (num_kv_heads, head_dim, window) per layer."""
        return cls(tuple(h * d for h, d, _ in layers), tuple(w for _, _, w in layers))

    @property
    def num_layers(self) -> int:
        return len(self.token_elems)

    @property
    def page_token_elems(self) -> int:
        """Elements per token of one page: the widest layer's K."""
        return max(self.token_elems)

    def sub(self, layer: int) -> int:
        """Sub-pages of layer ``layer``'s K (or V) shape per page."""
        return self.page_token_elems // self.token_elems[layer]

    def layer_pages(self, layer: int) -> int:
        """Pages layer ``layer`` takes per block: 1 when K and V fit one page, else 2."""
        return 1 if self.sub(layer) >= 2 else 2

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Index of layer l's first page in a block's page list (L + 1 entries)."""
        out = [0]
        for layer in range(self.num_layers):
            out.append(out[-1] + self.layer_pages(layer))
        return tuple(out)

    @property
    def pages_per_block(self) -> int:
        return self.offsets[-1]

    @cached_property
    def sliding_pages(self) -> tuple[int, ...]:
        """Indices into a block's page list of the sliding-window layers' pages."""
        return tuple(i for layer, w in enumerate(self.windows) if w is not None
                     for i in range(self.offsets[layer], self.offsets[layer + 1]))

    @property
    def window(self) -> int | None:
        """The widest sliding window (a block may give back its sliding pages once outside it), None if none."""
        ws = [w for w in self.windows if w is not None]
        return max(ws) if ws else None

    def max_blocks(self, num_pages: int) -> int:
        """Block ids a pool of ``num_pages`` pages needs: whole blocks, or trimmed ones (global pages only) where
        the layout has sliding layers."""
        kept = self.pages_per_block - len(self.sliding_pages)
        return num_pages // (max(kept, 1) if self.sliding_pages else self.pages_per_block)

    def peak_pages(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """Pages a sequence of ``num_tokens`` tokens holds at most while it is computed ``chunk_tokens`` (>= 1) at a
        time: every block whole, or with sliding-window layers whole blocks only for the window and the next chunk
        (a block behind the window keeps its global layers' pages)."""
        total = -(-num_tokens // block_size)
        window = self.window
        if window is None:
            return total * self.pages_per_block
        whole = min(total, -(-(window + chunk_tokens) // block_size) + 1)
        kept = self.pages_per_block - len(self.sliding_pages)
        return whole * self.pages_per_block + (total - whole) * kept

    def peak_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """``peak_pages`` in whole blocks (rounded up): what admission reserves and a budget holds per sequence."""
        return -(-self.peak_pages(num_tokens, block_size, chunk_tokens) // self.pages_per_block)

    def units(self, layer: int, pages: Sequence[int]) -> tuple[int, int]:
        """Layer ``layer``'s K and V sub-page ids (in its view of ``sub`` sub-pages per page) within a block whose
        page list is ``pages``."""
        first, sub = self.offsets[layer], self.sub(layer)
        if self.layer_pages(layer) == 1:
            return pages[first] * sub, pages[first] * sub + 1
        return pages[first] * sub, pages[first + 1] * sub

    def page_bytes(self, block_size: int, elem_bytes: int) -> int:
        """Bytes of one pool page (``pwformat.cost.kv_page_bytes`` of the widest layer)."""
        return kv_page_bytes(block_size, 1, self.page_token_elems, elem_bytes)

    def read_bytes(self, context: int, elem_bytes: int) -> int:
        """K and V bytes one decode query of a ``context``-token sequence reads over every layer: a sliding-window
        layer reads at most its window."""
        return sum(2 * e * elem_bytes * (context if w is None else min(context, w))
                   for e, w in zip(self.token_elems, self.windows, strict=True))

    def block_bytes(self, block_size: int, elem_bytes: int) -> int:
        """B_KV of SPEC Eq. 7: bytes of one whole KV block (every layer, K and V)."""
        return self.pages_per_block * self.page_bytes(block_size, elem_bytes)
