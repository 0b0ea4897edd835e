"""The engine ``pwrun serve`` builds for requests that arrive later (no HTTP stack here: the server imports it).

What it does: with an artifact, ``build_engine`` under the budget, policy and planner of ``pwrun generate`` (the
budget provisions ``max_batch`` requests of ``max_model_len`` tokens); with ``--policy 16-bit``
``build_dense_engine`` under the same budget; without either, the 16-bit reference model with a KV pool of that size.
"""

from __future__ import annotations

from pathlib import Path

from pwrun.core.request import SamplingParams
from pwrun.engine.build import ServeConfig, build_engine, dense_server_engine
from pwrun.engine.build_dense import build_dense_engine
from pwrun.engine.llm_engine import LLMEngine
from pwrun.model.loader import load_model


def build_serving_engine(model_dir: Path, artifacts: Path | None, cfg: ServeConfig, max_model_len: int,
                         device: str = "auto", dtype: str = "auto") -> LLMEngine:
    """The engine, holding no request yet; raises ``PagedWeightError`` on bad input or a budget too small for one
    request of ``max_model_len`` tokens (with an artifact or the 16-bit policy: ``cfg.gpu_memory``; without
    either: the 16-bit reference model and ``cfg.engine`` only)."""
    if cfg.policy.dense:
        return build_dense_engine(model_dir, cfg, SamplingParams(), [], set(), device, dtype,
                                  max_request_tokens=max_model_len)
    if artifacts is not None:
        return build_engine(model_dir, artifacts, cfg, SamplingParams(), [], set(), device, dtype,
                            max_request_tokens=max_model_len)
    return dense_server_engine(load_model(model_dir, device=device, dtype=dtype), cfg.engine, max_model_len)
