"""Text generation with the lean model: batched prefill, then batched decode over the paged KV cache.

What it does: tokenizes prompts, checks they fit the model's context, sizes a KV cache for all
of them, prefills them in one step and decodes them together until each reaches EOS or
``max_new_tokens``; ``on_text`` receives each sequence's new text as it is produced (streaming).
It does not yet trade weight precision for KV blocks (the planner of a later stage does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pwrun.errors import PagedWeightError
from pwrun.kv.blocks import blocks_needed
from pwrun.model.lean import LeanMoEModel
from pwrun.runner import ModelRunner
from pwrun.sampling import SamplingParams, sample


@dataclass
class Generation:
    """One request's result: ``text`` is the continuation only; timings in seconds."""

    prompt: str
    text: str
    prompt_tokens: int
    new_tokens: int
    finish_reason: str  # "eos" or "length"


@dataclass
class GenerationStats:
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def encode_prompts(tokenizer: Any, prompts: list[str], max_context: int, max_new_tokens: int) -> list[list[int]]:
    """Token ids of each prompt; raises ``PagedWeightError`` if a prompt (plus generation) exceeds the context."""
    out = []
    for i, p in enumerate(prompts):
        which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)} (its first words: " \
            f"{' '.join(p.split()[:6])!r})"
        ids = tokenizer(p, add_special_tokens=True, verbose=False).input_ids
        if not ids:
            raise PagedWeightError(f"{which} is empty after tokenization: give some text")
        if len(ids) + max_new_tokens > max_context:
            raise PagedWeightError(
                f"{which} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} > the model's context of {max_context} tokens: shorten the prompt "
                "or lower --max-new-tokens")
        out.append(ids)
    return out


def generate(model: LeanMoEModel, tokenizer: Any, prompts: list[str], params: SamplingParams,
             block_size: int = 16, on_text: Callable[[int, str], None] | None = None,
             on_progress: Callable[[int, int], None] | None = None) -> tuple[list[Generation], GenerationStats]:
    """Generate a continuation for every prompt; returns the generations and timing stats.

    ``on_progress(finished requests, generated tokens)`` is called after every step.
    """
    ids = encode_prompts(tokenizer, prompts, model.spec.max_position_embeddings, params.max_new_tokens)
    num_blocks = sum(blocks_needed(len(x) + params.max_new_tokens, block_size) for x in ids)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size)
    gen = torch.Generator().manual_seed(params.seed)
    eos = set(model.spec.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    out_ids: list[list[int]] = [[] for _ in prompts]
    printed = [""] * len(prompts)
    finish = ["length"] * len(prompts)

    def emit(i: int) -> None:
        text = tokenizer.decode(out_ids[i], skip_special_tokens=True)
        if on_text is not None and len(text) > len(printed[i]) and not text.endswith("\ufffd"):
            on_text(i, text[len(printed[i]):])
            printed[i] = text

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    logits = runner.run(dict(enumerate(ids)))
    active = list(range(len(prompts)))
    decode_tokens, t_decode = 0, 0.0
    while active:
        nxt = sample(logits, params, gen).tolist()
        if t_decode == 0.0:
            sync()
            t_decode = time.perf_counter()
        still = []
        for i, tok in zip(active, nxt, strict=True):
            if tok in eos:
                finish[i] = "eos"
                runner.release(i)
                continue
            out_ids[i].append(tok)
            emit(i)
            if len(out_ids[i]) >= params.max_new_tokens:
                runner.release(i)
            else:
                still.append(i)
        active = still
        if on_progress is not None:
            on_progress(len(prompts) - len(active), sum(len(o) for o in out_ids))
        if active:
            logits = runner.run({i: [out_ids[i][-1]] for i in active})
            decode_tokens += len(active)
    sync()
    t_end = time.perf_counter()
    results = [Generation(p, tokenizer.decode(o, skip_special_tokens=True), len(x), len(o), f)
               for p, o, x, f in zip(prompts, out_ids, ids, finish, strict=True)]
    return results, GenerationStats(t_decode - t0, t_end - t_decode, decode_tokens)
