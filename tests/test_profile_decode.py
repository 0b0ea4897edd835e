"""bench/profile_decode.to_decode: the profiled steps start only once every request decodes (the fifteenth
session's batch-16 profile measured prefill chunks), and a batch that never decodes together is an error."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from profile_decode import to_decode  # noqa: E402


class ChunkedPrefill:
    """An engine stand-in: ``batch`` prompts of ``prompt`` tokens prefilled ``chunk`` tokens per step (a request's
    last chunk yields its first token), then one decode token per request per step; ``cap`` limits how many
    requests decode at once (a KV cache too small for the whole batch)."""

    def __init__(self, batch: int, prompt: int, chunk: int, cap: int | None = None) -> None:
        self.left = [prompt] * batch
        self.chunk, self.cap = chunk, cap or batch
        self.totals = SimpleNamespace(prefill_tokens=0, decode_tokens=0)
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        budget = self.chunk
        decoding = [i for i, n in enumerate(self.left) if n == 0][: self.cap]
        self.totals.decode_tokens += len(decoding)
        for i, n in enumerate(self.left):
            take = min(n, budget)
            if take and len(decoding) < self.cap:
                self.left[i] -= take
                budget -= take
                self.totals.prefill_tokens += take


@pytest.mark.parametrize(("batch", "prompt", "chunk"), [(1, 2048, 2048), (16, 2048, 2048), (4, 300, 256),
                                                        (3, 10, 2048)])
def test_stops_after_two_pure_decode_steps(batch: int, prompt: int, chunk: int) -> None:
    e = ChunkedPrefill(batch, prompt, chunk)
    to_decode(e, batch)
    assert all(n == 0 for n in e.left)
    prefill_steps = -(-batch * prompt // chunk)
    assert e.steps == prefill_steps + 2  # the last chunk's step decodes nothing yet: 2 pure-decode steps after it
    assert e.totals.prefill_tokens == batch * prompt


def test_batch_that_never_decodes_together_is_an_error() -> None:
    e = ChunkedPrefill(4, 64, 64, cap=2)
    with pytest.raises(RuntimeError, match="never decoded together"):
        to_decode(e, 4)
