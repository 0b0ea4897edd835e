"""Next-token sampling: greedy, temperature and nucleus (top-p); log-probabilities of forced tokens.

What it does: turns fp32 logits [S, V] into token ids [S] with a seeded ``torch.Generator`` so
sampled runs are reproducible (``SamplingParams`` lives in ``pwrun.core.request``). It does not run
the model.
"""

from __future__ import annotations

import torch

from pwrun.core.request import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Token ids [S] int64 from logits [S, V] float."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        keep[..., 0] = True  # the top token always (a top_p that underflows float32, e.g. 1e-300, keeps only it)
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def sample_rows(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """Token ids of ``logits[rows[j]]`` ([S, V] float) under ``params[j]``: the greedy rows (temperature 0) by one
    argmax and one copy to the host, the others one by one with their own ``generators[j]`` (``sample``); equal to
    ``sample`` row by row."""
    out = [0] * len(rows)
    greedy = [j for j, p in enumerate(params) if p.temperature == 0]
    if greedy:
        picked = logits if len(greedy) == logits.shape[0] and rows == list(range(len(rows))) else \
            logits[torch.tensor([rows[j] for j in greedy], device=logits.device)]
        for j, t in zip(greedy, picked.argmax(dim=-1).tolist(), strict=True):
            out[j] = t
    for j, p in enumerate(params):
        if p.temperature != 0:
            out[j] = int(sample(logits[rows[j]][None], p, generators[j])[0])
    return out


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> list[float]:
    """log p(``tokens[j]``) in nats under ``logits[rows[j]]`` ([S, V] float; teacher-forced scoring), with one copy
    to the host. Raises ``IndexError``/``RuntimeError`` (torch's) for a token outside [0, V)."""
    idx = torch.tensor(rows, device=logits.device)
    tok = torch.tensor(tokens, device=logits.device)
    return torch.log_softmax(logits[idx].float(), dim=-1).gather(1, tok[:, None]).squeeze(1).tolist()
