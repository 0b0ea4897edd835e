"""bench/profile_decode: the profiled steps start only once every request decodes (the fifteenth session's
batch-16 profile measured prefill chunks), no request finishes before the last profiled step (the sixteenth
session's first fix ran out of tokens at batch 16), and a batch that never decodes together is an error."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from profile_decode import STEP_TOKENS, new_tokens, prefill_steps, to_decode


class ChunkedPrefill:
    """An engine stand-in: ``batch`` prompts of ``prompt`` tokens prefilled in order, ``chunk`` tokens per step
    (a request's last chunk yields its first token), one decode token per decoding request per step (decodes ride
    along with prefill chunks), a request finishes at ``max_new`` tokens; ``cap`` limits how many requests hold
    KV at once (a cache too small for the whole batch)."""

    def __init__(self, batch: int, prompt: int, chunk: int, max_new: int = 10**6, cap: int | None = None,
                 decode_first: bool = False) -> None:
        self.left, self.out = [prompt] * batch, [0] * batch
        self.chunk, self.max_new, self.cap = chunk, max_new, cap or batch
        self.decode_first = decode_first  # decode tokens take the step's budget first (the real scheduler)
        self.totals = SimpleNamespace(prefill_tokens=0, decode_tokens=0)
        self.steps = 0

    def step(self) -> None:
        live = [i for i in range(len(self.left)) if self.out[i] < self.max_new][: self.cap]
        if not live:
            raise RuntimeError("no request fits in the KV cache even with every expert at its floor")
        self.steps += 1
        decoding = [i for i in live if self.left[i] == 0]
        for i in decoding:
            self.out[i] += 1
        self.totals.decode_tokens += len(decoding)
        budget = self.chunk - (len(decoding) if self.decode_first else 0)
        for i in live:
            take = min(self.left[i], budget)
            if take:
                self.left[i] -= take
                budget -= take
                self.totals.prefill_tokens += take
                self.out[i] += self.left[i] == 0


@pytest.mark.parametrize(("batch", "prompt", "chunk"), [(1, 2048, 2048), (16, 2048, 2048), (4, 300, 256),
                                                        (3, 10, 2048)])
def test_stops_after_two_pure_decode_steps(batch: int, prompt: int, chunk: int) -> None:
    e = ChunkedPrefill(batch, prompt, chunk)
    to_decode(e, batch, prompt)
    assert all(n == 0 for n in e.left)
    prefill_steps = -(-batch * prompt // chunk)
    assert e.steps == prefill_steps + 2  # the last chunk's step decodes nothing yet: 2 pure-decode steps after it
    assert e.totals.prefill_tokens == batch * prompt


@pytest.mark.parametrize(("batch", "prompt"), [(1, 2048), (4, 2048), (16, 2048), (16, 3000), (64, 2048), (92, 2048),
                                               (1, 65536), (4, 32768)])
@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("decode_first", [False, True])
def test_new_tokens_last_through_the_profiled_steps(batch: int, prompt: int, steps: int, decode_first: bool) -> None:
    e = ChunkedPrefill(batch, prompt, STEP_TOKENS, max_new=new_tokens(batch, prompt, steps), decode_first=decode_first)
    to_decode(e, batch, prompt)
    assert e.steps <= prefill_steps(batch, prompt) + 2
    for _ in range(2 * steps):  # timed, then profiled: every request decodes in each
        before = e.totals.decode_tokens
        e.step()
        assert e.totals.decode_tokens - before == batch


def test_old_sizing_ran_out_at_batch_16() -> None:
    e = ChunkedPrefill(16, 2048, STEP_TOKENS, max_new=2 * 5 + 4)
    with pytest.raises(RuntimeError, match="no request fits"):
        to_decode(e, 16, 2048)


def test_batch_that_never_decodes_together_is_an_error() -> None:
    e = ChunkedPrefill(4, 64, 64, cap=2)
    with pytest.raises(RuntimeError, match="never decoded together"):
        to_decode(e, 4, 64)
