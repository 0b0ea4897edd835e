"""Logits of whole token lists in one step of the engine (perplexity, teacher-forced scoring, calibration).

What it does: ``prefill_logits`` runs given token lists (e.g. perplexity windows) through the engine core and
the model runner as one prefill step over a pool of exactly their KV blocks, and returns the logits of every
position, optionally with gradients (``LeanMoEModel.forward_with_grad``: the Fisher of ``pwcal``) or an
``observer`` (calibration statistics). The reference path runs (no Triton kernels), as calibration expects.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pwrun.core.config import EngineConfig
from pwrun.core.engine_core import EngineCore
from pwrun.core.kv_blocks import blocks_needed
from pwrun.core.pool import PagePool, PoolConfig
from pwrun.core.request import Request, SamplingParams
from pwrun.model.inventory import kv_layout
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import MoEObserver
from pwrun.runner.model_runner import ModelRunner


def prefill_logits(model: LeanMoEModel, tokens: list[list[int]], block_size: int = 16,
                   observer: MoEObserver | None = None, with_grad: bool = False,
                   moe: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 logits [sum of lengths, V] of every position of every list in ``tokens`` (concatenated in order).
    ``moe``: replaces the model's MoE blocks (``LeanMoEModel.forward``; x [T, H] and the layer -> [T, H])."""
    if not tokens or any(not t for t in tokens):
        raise ValueError("prefill_logits needs at least one non-empty token list")
    spec = model.spec
    cfg = EngineConfig(block_size=block_size, max_batch=len(tokens), max_step_tokens=sum(len(t) for t in tokens),
                       cuda_graphs=False, use_kernels=False)
    layout = kv_layout(spec)
    num_pages = sum(blocks_needed(len(t), block_size) for t in tokens) * layout.pages_per_block
    page_bytes = layout.page_bytes(block_size, model.dtype.itemsize)
    core = EngineCore(cfg, PagePool(PoolConfig(num_pages, page_bytes)), layout)
    runner = ModelRunner(model, cfg, num_pages, page_bytes)
    for rid, t in enumerate(tokens):
        core.add_request(Request(rid, tuple(t), SamplingParams(max_new_tokens=1)))
    decision = core.step()
    assert len(decision.chunks) == len(tokens), "every list runs whole in one step"
    return runner.execute(decision, logits_for="all", observer=observer, with_grad=with_grad, moe=moe)
