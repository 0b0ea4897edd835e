"""Typed launch configs of the MoE paths, and their JSON form in ``pwkernels/configs/ap_moe.json``.

The JSON holds, per expert shape "HxI" (``by_shape``, tuned on a GPU) or ``default``, buckets by token count
``{"min_tokens": T, "config": {...}}``; the largest ``min_tokens`` <= T wins. A config names its ``path``
(decode | mid | prefill) and that path's tiles; ``parse_config`` turns it into the dataclass below and refuses
unknown paths, unknown keys and bad values, so a typo in a tuned file fails at import, not on the GPU.
``DenseMoEConfig`` is the 16-bit experts' config (``pwkernels.moe.dense``): a GEMV tile, two grouped-GEMM tiles and
the token counts where one gives way to the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

SLOTS_ALLOWED = (0, 1, 2, 4, 8)


def _positive(owner: object, *names: str) -> None:
    for name in names:
        v = getattr(owner, name)
        if type(v) is not int or v < 1:
            raise ValueError(f"{type(owner).__name__}.{name} must be an integer >= 1, got {v!r}")


def _block_k(owner: object) -> None:
    if owner.BLOCK_K % 32:  # type: ignore[attr-defined]
        raise ValueError(f"{type(owner).__name__}.BLOCK_K must be a multiple of 32 (one plane word), got "
                         f"{owner.BLOCK_K}")  # type: ignore[attr-defined]


@dataclass(frozen=True)
class DecodeTile:
    """One decode kernel's tile: BLOCK_N rows (gate_up: gate/up row pairs), BLOCK_K columns per K step (a multiple
    of 32), SPLIT_K programs over K (down), RAW_SHFL: LUT shuffles by inline ``shfl.sync`` (NVIDIA only)."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    SPLIT_K: int = 1
    RAW_SHFL: bool = False

    def __post_init__(self) -> None:
        _positive(self, "BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K")
        _block_k(self)
        object.__setattr__(self, "RAW_SHFL", bool(self.RAW_SHFL))


@dataclass(frozen=True)
class DecodeConfig:
    """Decode path: tiles of its gate_up and down kernels; SLOTS 0 (token slots, chunks of 8 tokens) or S in
    1, 2, 4, 8 (pairs sorted by expert, S per program)."""

    gate_up: DecodeTile
    down: DecodeTile
    SLOTS: int = 0
    path: ClassVar[str] = "decode"

    def __post_init__(self) -> None:
        if type(self.SLOTS) is not int or self.SLOTS not in SLOTS_ALLOWED:
            raise ValueError(f"SLOTS must be 0 (token slots), 1, 2, 4 or 8 (pairs per program), got {self.SLOTS!r}")


@dataclass(frozen=True)
class MidConfig:
    """Mid-size path: BLOCK_M (token, slot) pairs x BLOCK_N rows per tile, K steps of BLOCK_K (a multiple of 32).

    WORDS: word-first dequantization (``pwkernels.moe.mid_words``): K steps of BLOCK_K = 512 or 1024 columns (16 or
    32 plane words), BLOCK_N intermediate columns per gate_up program and BLOCK_N_DOWN (0: BLOCK_N) output rows per
    down program, RAW_SHFL as in ``DecodeTile``, SPLIT_Q: one launch per class of bitwidths (q <= 4, 5, >= 6), each
    compiled for its class only; BLOCK_M 16 or 32 (64 gave wrong sums natively on an H100 while Triton's
    interpreter agreed with the reference) and 2 * BLOCK_N at least 16 (``tl.dot``)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    WORDS: bool = False
    BLOCK_N_DOWN: int = 0
    RAW_SHFL: bool = False
    SPLIT_Q: bool = False
    path: ClassVar[str] = "mid"

    def __post_init__(self) -> None:
        _positive(self, "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")
        _block_k(self)
        object.__setattr__(self, "WORDS", bool(self.WORDS))
        object.__setattr__(self, "RAW_SHFL", bool(self.RAW_SHFL))
        object.__setattr__(self, "SPLIT_Q", bool(self.SPLIT_Q))
        if type(self.BLOCK_N_DOWN) is not int or self.BLOCK_N_DOWN < 0:
            raise ValueError(f"MidConfig.BLOCK_N_DOWN must be an integer >= 0, got {self.BLOCK_N_DOWN!r}")
        if self.WORDS:
            _powers_of_two(self, "BLOCK_M", "BLOCK_N", "BLOCK_N_DOWN")
            if self.BLOCK_K not in (512, 1024) or self.BLOCK_M not in (16, 32) or self.BLOCK_N < 8 \
                    or 0 < self.BLOCK_N_DOWN < 16:
                raise ValueError(f"a word-first MidConfig needs BLOCK_K 512 or 1024, BLOCK_M 16 or 32, BLOCK_N >= 8 "
                                 f"and BLOCK_N_DOWN 0 or >= 16 (tl.dot), got {self}")


@dataclass(frozen=True)
class PrefillConfig:
    """Prefill path: the dequantize kernel's tile, BLOCK_N rows x BLOCK_K columns (a multiple of 32)."""

    BLOCK_N: int = 32
    BLOCK_K: int = 128
    num_warps: int = 4
    path: ClassVar[str] = "prefill"

    def __post_init__(self) -> None:
        _positive(self, "BLOCK_N", "BLOCK_K", "num_warps")
        _block_k(self)


def _powers_of_two(owner: object, *names: str) -> None:
    for name in names:
        v = getattr(owner, name)
        if v & (v - 1):
            raise ValueError(f"{type(owner).__name__}.{name} must be a power of 2, got {v}")


@dataclass(frozen=True)
class DenseGemvTile:
    """16-bit experts, few tokens: one program per (pair, BLOCK_N rows), K steps of BLOCK_K columns (powers of 2).

    ``DOWN_SPLIT``: 0, one down program per (token, BLOCK_N rows) sums the token's k pairs itself (one launch; at
    one token that is H / BLOCK_N programs, each reading k experts in turn); s >= 1, one per (pair, s-th of the K
    columns, BLOCK_N rows), their fp32 partials summed in a fixed order by a second launch (k * s times the
    programs, for the GPU's parallelism at one or two tokens)."""

    BLOCK_N: int = 32
    BLOCK_K: int = 256
    num_warps: int = 4
    DOWN_SPLIT: int = 0

    def __post_init__(self) -> None:
        _positive(self, "BLOCK_N", "BLOCK_K", "num_warps")
        _powers_of_two(self, "BLOCK_N", "BLOCK_K")
        if type(self.DOWN_SPLIT) is not int or self.DOWN_SPLIT < 0:
            raise ValueError(f"DenseGemvTile.DOWN_SPLIT must be an integer >= 0, got {self.DOWN_SPLIT!r}")


@dataclass(frozen=True)
class DenseGemmTile:
    """16-bit experts, many tokens: BLOCK_M pairs of one expert x BLOCK_N rows per tile on tensor cores, K steps of
    BLOCK_K (powers of 2, each >= 16 for ``tl.dot``)."""

    BLOCK_M: int = 16
    BLOCK_N: int = 64
    BLOCK_K: int = 64
    num_warps: int = 4

    def __post_init__(self) -> None:
        _positive(self, "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")
        _powers_of_two(self, "BLOCK_M", "BLOCK_N", "BLOCK_K")
        if min(self.BLOCK_M, self.BLOCK_N, self.BLOCK_K) < 16:
            raise ValueError(f"DenseGemmTile sides must be >= 16 (tl.dot), got {self}")


@dataclass(frozen=True)
class DenseMoEConfig:
    """The 16-bit MoE paths: ``gemv`` up to ``max_gemv_tokens`` tokens, ``gemm`` above, ``gemm_large`` from
    ``min_large_tokens``.

    Defaults from ``python -m bench.dense_moe`` (Qwen1.5-MoE, Mixtral-8x7B and Gemma-4 expert shapes, CUDA-graph
    replay): the GEMV with 16-row programs, 1024-column K steps and the down projection split 4 ways along K is
    fastest up to 4 tokens (H100, Qwen1.5-MoE routed experts: 0.045 / 0.078 / 0.136 ms at 1 / 2 / 4 tokens
    against 0.087 / 0.118 / 0.200 unsplit with 512-column steps and 0.095 / 0.127 / 0.171 for cuBLAS' grouped
    GEMM; its shared expert 0.048 / 0.055 / 0.083; Gemma-4 0.067 / 0.121 / 0.218; it re-reads an
    expert per pair, so it loses from 8), 16-pair tiles up to 64 tokens and 64-pair tiles from 128. Where the
    pool's layout allows it (``DenseExperts.stacked``) cuBLAS' grouped GEMM (``pwkernels.moe.dense_grouped``)
    takes over from 5 tokens, and from 1 token on experts as wide as Mixtral's (14336: 0.36 vs 0.39 ms at 1
    token, 0.76 vs 1.27 at 4 on an H200).
    """

    gemv: DenseGemvTile = DenseGemvTile(BLOCK_N=16, BLOCK_K=1024, DOWN_SPLIT=4)
    gemm: DenseGemmTile = DenseGemmTile()
    gemm_large: DenseGemmTile = DenseGemmTile(BLOCK_M=64)
    max_gemv_tokens: int = 4
    min_large_tokens: int = 128
    min_grouped_mm_tokens: int = 5  # cuBLAS' grouped GEMM from here where the experts lie at one stride ...
    wide_inter: int = 8192  # ... and from 1 token for experts at least this wide (I), where the GEMV loses

    def __post_init__(self) -> None:
        for name in ("max_gemv_tokens", "min_large_tokens", "min_grouped_mm_tokens", "wide_inter"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")

    def grouped_mm_from(self, inter: int) -> int:
        """Tokens from which experts of width ``inter`` at one stride take cuBLAS' grouped GEMM."""
        return 1 if inter >= self.wide_inter else self.min_grouped_mm_tokens

    def pick(self, num_tokens: int) -> DenseGemvTile | DenseGemmTile:
        """The tile of the path that runs ``num_tokens`` tokens."""
        if num_tokens <= self.max_gemv_tokens:
            return self.gemv
        return self.gemm_large if num_tokens >= self.min_large_tokens else self.gemm


LaunchConfig = DecodeConfig | MidConfig | PrefillConfig
_BY_PATH: dict[str, type[DecodeConfig] | type[MidConfig] | type[PrefillConfig]] = {
    c.path: c for c in (DecodeConfig, MidConfig, PrefillConfig)}


def _fields(cls: type, raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} in {where} (allowed: {sorted(names)})")
    return dict(raw)


def parse_config(raw: Mapping[str, Any]) -> LaunchConfig:
    """The typed config of one bucket's JSON form ``{"path": ..., ...}``. Raises ``ValueError`` for an unknown
    path or key, a missing tile, or a bad value."""
    body = dict(raw)
    path = body.pop("path", None)
    cls = _BY_PATH.get(path) if isinstance(path, str) else None
    if cls is None:
        raise ValueError(f"config path must be one of {sorted(_BY_PATH)}, got {path!r}")
    fields = _fields(cls, body, f"a {path} config")
    try:
        if cls is DecodeConfig:
            for unit in ("gate_up", "down"):
                fields[unit] = DecodeTile(**_fields(DecodeTile, fields[unit], f"the decode {unit} tile"))
        return cls(**fields)
    except (KeyError, TypeError) as err:
        raise ValueError(f"incomplete {path} config {dict(raw)}: {err}") from err


def to_json(cfg: LaunchConfig) -> dict[str, Any]:
    """The JSON form of a typed config (inverse of ``parse_config``)."""
    return {"path": cfg.path, **dataclasses.asdict(cfg)}
