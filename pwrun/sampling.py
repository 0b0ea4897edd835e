"""Next-token sampling: greedy, temperature and nucleus (top-p).

What it does: turns fp32 logits [S, V] into token ids [S] with a seeded ``torch.Generator`` so
sampled runs are reproducible. It does not run the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 = greedy; ``top_p`` in (0, 1] keeps the smallest set of tokens of that mass."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also refuses nan
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Token ids [S] int64 from logits [S, V] float."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
