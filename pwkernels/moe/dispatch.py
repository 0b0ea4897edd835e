"""The AP MoE entry points: pick a path and its launch config by token count and expert shape, then launch.

``ap_moe`` computes ``pwkernels.moe.ref.ap_moe_ref`` (SPEC section 7) on one of three paths, chosen per call from
the tuned buckets of ``pwkernels/configs/ap_moe.json`` (``pwkernels.moe.launch``: by expert shape "HxI", else the
default buckets; the largest ``min_tokens`` <= T wins):
  * ``decode`` (``pwkernels.moe.decode``): word-first GEMV kernels, a few tokens per expert;
  * ``mid`` (``pwkernels.moe.mid``): dequantized tiles into tensor cores, tens of tokens;
  * ``prefill`` (``pwkernels.moe.prefill``): dequantize used experts once, then grouped GEMMs.
Experts are SwiGLU or GeGLU (``activation``, ``pwkernels.moe.activation``). ``ap_moe_block`` adds a layer's
shared expert as an always-selected expert; on the decode path both sets of partial outputs are summed and
rounded once in one launch. Only this module checks inputs.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pwkernels.config_buckets import pick_bucket
from pwkernels.moe.decode import decode_moe, decode_partials
from pwkernels.moe.experts import APExperts
from pwkernels.moe.launch import DecodeConfig, LaunchConfig, MidConfig, PrefillConfig, parse_config
from pwkernels.moe.layout import combine
from pwkernels.moe.mid import mid_moe
from pwkernels.moe.mid_words import words_moe
from pwkernels.moe.prefill import prefill_moe

CONFIGS = json.loads((Path(__file__).parent.parent / "configs" / "ap_moe.json").read_text())  # JSON form


def shape_buckets(hidden: int | None = None, inter: int | None = None,
                  configs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The token buckets (``{"min_tokens": T, "config": ...}``) of experts ``hidden`` x ``inter`` in
    ``configs/ap_moe.json`` (or ``configs``, the same layout): the shape's own if tuned, else the default ones.
    Read-only (shared)."""
    table = CONFIGS if configs is None else configs
    return table["by_shape"].get(f"{hidden}x{inter}", table["default"])


def pick_config(num_tokens: int, hidden: int | None = None, inter: int | None = None,
                configs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON form of the config for ``num_tokens`` tokens among ``shape_buckets(hidden, inter, configs)``: the
    largest ``min_tokens`` <= T wins ({} if there are no buckets). Read-only (shared)."""
    return pick_bucket(shape_buckets(hidden, inter, configs), num_tokens, "min_tokens") or {}


def launch_config(num_tokens: int, hidden: int | None = None, inter: int | None = None,
                  configs: dict[str, Any] | None = None) -> LaunchConfig:
    """The typed config of ``pick_config`` (shipped table: parsed once per (T, H, I) and cached). Raises
    ``ValueError`` if that config does not parse."""
    if configs is None:
        return _shipped_config(num_tokens, hidden, inter)
    return parse_config(pick_config(num_tokens, hidden, inter, configs))


@functools.lru_cache(maxsize=4096)
def _shipped_config(num_tokens: int, hidden: int | None, inter: int | None) -> LaunchConfig:
    return parse_config(pick_config(num_tokens, hidden, inter))


def check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, ex: APExperts, sync: bool) -> None:
    """Shapes, dtypes, strides, devices; with ``sync`` also the value ranges of ids and bits (host syncs).
    Raises ``ValueError`` on the first violation."""
    if x.dim() != 2 or x.shape[1] != ex.hidden:
        raise ValueError(f"x must be [T, {ex.hidden}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along the hidden dim")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.shape != topk_w.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_w must both be [T, k] with T = {x.shape[0]}")
    if ex.lut_pool.dtype != x.dtype:
        raise ValueError(f"LUT dtype {ex.lut_pool.dtype} must equal the activation dtype {x.dtype}")
    if ex.pool.dtype != torch.int32 or ex.plane_offset.shape != (2 * ex.num_experts, 8):
        raise ValueError("pool must be int32 and plane_offset [2E, 8]")
    if ex.bits.dtype != torch.int32:
        raise ValueError("bits must be int32 in 1..8")
    for t in (ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, topk_ids, topk_w):
        if t.device != x.device:
            raise ValueError("all tensors must be on x's device")
    if not sync:
        return
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= ex.num_experts):
        raise ValueError(f"expert ids must be in [0, {ex.num_experts})")
    if int(ex.bits.min()) < 1 or int(ex.bits.max()) > 8:
        raise ValueError("bits must be int32 in 1..8")


def ap_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
           config: LaunchConfig | Mapping[str, Any] | None = None, check: bool = True,
           activation: str = "silu") -> torch.Tensor:
    """MoE output y [T, H] in x's dtype. x [T, H] bf16/fp16; topk_ids [T, k] integer; topk_w [T, k] float.

    ``config``: a launch config or its JSON form (default: ``launch_config`` by T and shape). ``check=False``
    skips the value checks that sync with the host (ids in range, bits in 1..8): the decode path then never syncs.
    ``activation``: of the experts' gate half, ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU, Gemma-4).
    Raises ``ValueError`` on bad input or a bad config.
    """
    check_inputs(x, topk_ids, topk_w, experts, sync=check)
    if isinstance(config, Mapping):
        config = parse_config(config)
    cfg = config if config is not None else launch_config(topk_ids.shape[0], experts.hidden, experts.inter)
    if topk_ids.numel() == 0:
        return torch.zeros_like(x)
    if isinstance(cfg, DecodeConfig):
        return decode_moe(x, topk_ids, topk_w, experts, cfg, activation)
    if isinstance(cfg, MidConfig) and cfg.WORDS:
        return words_moe(x, topk_ids, topk_w, experts, cfg, activation)
    if isinstance(cfg, MidConfig):
        return mid_moe(x, topk_ids, topk_w, experts, cfg, activation)
    if isinstance(cfg, PrefillConfig):
        return prefill_moe(x, topk_ids, topk_w, experts, cfg, activation)
    raise ValueError(f"config must be a DecodeConfig, MidConfig or PrefillConfig, got {cfg!r}")


def ap_moe_shared(x: torch.Tensor, shared: APExperts, gate: torch.Tensor | None = None,
                  check: bool = True) -> torch.Tensor:
    """The shared expert through the same kernels: every token selects expert 0 with weight
    ``sigmoid(gate)`` [T, 1] (or 1). ``shared`` holds one expert (blocks 0 and 1); ``check`` as in ``ap_moe``."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
    w = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device) if gate is None else torch.sigmoid(
        gate.float())
    return ap_moe(x, ids, w, shared, check=check)


def ap_moe_block(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
                 shared: APExperts | None = None, shared_w: torch.Tensor | None = None,
                 shared_ids: torch.Tensor | None = None, check: bool = True, activation: str = "silu"
                 ) -> torch.Tensor:
    """A layer's MoE output y [T, H] (x's dtype): the routed experts (as ``ap_moe``) plus, if ``shared`` is given,
    the shared expert times ``shared_w`` [T, 1] fp32 (its gate already applied), as an always-selected expert
    (SPEC section 7: one fused path for routed and shared experts).

    ``shared_ids``: optional [T, 1] int64 zeros to reuse (saves a fill per call). When both configs take the
    decode path, the two sets of fp32 partials are summed and rounded once, in one launch; elsewhere the two
    outputs are added in x's dtype. Raises ``ValueError`` as ``ap_moe`` does, and if ``shared_w`` is not [T, 1] or
    the shared expert's hidden size or LUT dtype differs from the routed experts'.
    """
    if shared is None:
        return ap_moe(x, topk_ids, topk_w, experts, check=check, activation=activation)
    t = x.shape[0]
    if shared_w is None or shared_w.shape != (t, 1):
        raise ValueError(f"shared_w must be [T, 1] = [{t}, 1]")
    if shared.hidden != experts.hidden or shared.lut_pool.dtype != experts.lut_pool.dtype:
        raise ValueError(f"the shared expert (hidden {shared.hidden}, LUT {shared.lut_pool.dtype}) must match the "
                         f"routed experts (hidden {experts.hidden}, LUT {experts.lut_pool.dtype})")
    sid = shared_ids if shared_ids is not None else torch.zeros(t, 1, dtype=torch.int64, device=x.device)
    cr, cs = launch_config(t, experts.hidden, experts.inter), launch_config(t, shared.hidden, shared.inter)
    if isinstance(cr, DecodeConfig) and isinstance(cs, DecodeConfig) and topk_ids.numel() > 0:
        check_inputs(x, topk_ids, topk_w, experts, sync=check)
        check_inputs(x, sid, shared_w, shared, sync=check)
        a, xw = decode_partials(x, topk_ids, topk_w, experts, cr, activation=activation)
        b, _ = decode_partials(x, sid, shared_w, shared, cs, xw, activation)
        return combine(a, b, x.dtype)
    return ap_moe(x, topk_ids, topk_w, experts, check=check, activation=activation) + \
        ap_moe(x, sid, shared_w, shared, check=check, activation=activation)
