"""One HTTP request's choices in the engine: tokenized prompts in, text deltas and finish reasons out.

What it does: ``encode`` tokenizes prompts and checks them against the server's context (400 with the limit);
``Generation`` turns them into engine requests (one per choice, sampled from a generator seeded ``seed + index``
as ``pwrun generate --seed`` seeds prompt ``index``), submits them to the engine thread (503 past the bounded
queue) and yields ``(index, delta, finish_reason)`` as outputs arrive through an ``asyncio.Queue`` (the engine
thread posts a step's outputs with one ``call_soon_threadsafe``: ``Mailbox``). A stop string ends its choice
("stop") and aborts its request; a client that went away, a cancelled stream or a shutdown aborts every unfinished
request (``close``).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pwrun.core.request import Request, RequestOutput, SamplingParams
from pwrun.model.loader import token_chars
from pwrun.serve.engine_loop import EngineStopped, QueueFull
from pwrun.serve.engine_process import AnyLoop
from pwrun.serve.protocol import ApiError
from pwrun.serve.text import ChoiceText

_FINISH = {"eos": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True)
class ServeLimits:
    """``max_model_len``: prompt + generated tokens of one request at most; ``vocab_size``: valid token ids."""

    max_model_len: int
    vocab_size: int


def body_limit(limits: ServeLimits, max_pending: int, tokenizer: Any) -> int:
    """Bytes a request body may have: every request the server holds with a prompt as long as the context, at
    the longest token's characters (JSON-escaped: up to 6 bytes each, at least 12 per token id), plus 1 MiB."""
    return 2**20 + max_pending * limits.max_model_len * 6 * max(token_chars(tokenizer), 2)


def encode(tokenizer: Any, prompts: list[str] | list[list[int]], limits: ServeLimits, max_tokens: int | None,
           default_max_tokens: int | None, special_tokens: bool = True) -> tuple[list[list[int]], int]:
    """Token ids of each prompt (texts, or lists of ids checked against the vocabulary) and the tokens to
    generate: ``max_tokens``, else ``default_max_tokens`` capped by the context, else what the context leaves.
    Raises ``ApiError`` 400 for an empty prompt or one that does not fit the context with its generation."""
    out = []
    most = limits.max_model_len * token_chars(tokenizer)
    for p in prompts:
        if isinstance(p, str) and len(p) > most:  # refused before the tokenizer spends seconds on it
            raise ApiError(400, f"this model's maximum context length is {limits.max_model_len} tokens, and the "
                           f"prompt has {len(p)} characters (more than any {limits.max_model_len} tokens make): "
                           "shorten it", param="prompt", code="context_length_exceeded")
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:  # JSON's \uXXXX escapes can encode a lone surrogate, which no tokenizer takes
                raise ApiError(400, "the prompt is not valid Unicode: it has a lone surrogate escape (e.g. \\ud800) "
                               "that no character pairs; fix the text", param="prompt") from None
        try:
            ids = list(p) if isinstance(p, list) else tokenizer(p, add_special_tokens=special_tokens, verbose=False)\
                .input_ids
        except (TypeError, ValueError) as exc:
            raise ApiError(400, f"the prompt cannot be tokenized: {str(exc)[:200]}", param="prompt") from None
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is not in the vocabulary (0..{limits.vocab_size - 1})",
                           param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization: give some text", param="prompt")
        out.append(ids)
    n, longest = limits.max_model_len, max(len(ids) for ids in out)
    if longest >= n:
        raise ApiError(400, f"this model's maximum context length is {n} tokens, but the prompt has {longest} "
                       "tokens: shorten it", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = n - longest if default_max_tokens is None else min(default_max_tokens, n - longest)
    elif longest + max_tokens > n:
        raise ApiError(400, f"this model's maximum context length is {n} tokens, but {longest + max_tokens} were "
                       f"requested ({longest} in the prompt, {max_tokens} in max_tokens): shorten the prompt or "
                       "lower max_tokens", param="max_tokens", code="context_length_exceeded")
    return out, max_tokens


class Mailbox:
    """Outputs from the engine thread to the event loop ``aio``: one wake-up of the loop per batch (a step's outputs),
    not one per output."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self.aio = aio
        self._items: collections.deque[tuple[asyncio.Queue[Any], Any]] = collections.deque()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[Any], item: Any) -> None:
        """Put ``item`` in ``queue`` soon (from any thread)."""
        self._items.append((queue, item))
        if not self._scheduled:
            self._scheduled = True
            try:
                self.aio.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the event loop is closed: the server stopped and nobody reads the output
                pass

    def _deliver(self) -> None:
        self._scheduled = False  # before draining: an item posted meanwhile is drained now or schedules anew
        while self._items:
            queue, item = self._items.popleft()
            queue.put_nowait(item)


_GONE = object()  # queued by the disconnect watcher: stop waiting


class Generation:
    """The choices of one HTTP request (``prompts``: token ids, one choice each), run by ``loop``; ``incremental``:
    decode the text as it comes (a stream) rather than once at the end."""

    def __init__(self, loop: AnyLoop, tokenizer: Any, prompts: list[list[int]], params: SamplingParams,
                 eos: frozenset[int], stop: list[str], seed: int | None, incremental: bool = True) -> None:
        self.loop = loop
        base = secrets.randbelow(2**62) if seed is None else seed
        self.requests = [Request(loop.next_rid(), tuple(ids), params, eos=eos, seed=base + i)
                         for i, ids in enumerate(prompts)]
        self.index = {r.rid: i for i, r in enumerate(self.requests)}
        self.texts = [ChoiceText(tokenizer, stop) for _ in prompts]
        self.finish: list[str | None] = [None] * len(prompts)
        self.tokens = [0] * len(prompts)
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.incremental = incremental or bool(stop)  # text as it comes (streams, stop strings), or once at the end
        self.gone = False
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def start(self, mailbox: Mailbox) -> None:
        """Submit the requests, their outputs to come through ``mailbox``; ``ApiError`` 503 if the queue is full or
        the engine has stopped."""

        def sink(item: RequestOutput | BaseException) -> None:  # on the engine thread
            mailbox.post(self._queue, item)

        try:
            self.loop.submit(self.requests, sink)
        except QueueFull as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry later", kind="server_busy") from None
        except EngineStopped as exc:
            raise ApiError(503, f"the server cannot take requests: {exc}", kind="server_unavailable") from None

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    async def events(self, disconnected: Callable[[], Awaitable[bool]] | None = None,
                     poll_seconds: float = 0.5) -> AsyncIterator[tuple[int, str, str | None]]:
        """``(choice index, new text, finish reason or None)`` until every choice has finished. ``disconnected``:
        polled every ``poll_seconds`` beside; once it says so, the requests are aborted and ``ConnectionError`` is
        raised."""
        watcher = None if disconnected is None else asyncio.create_task(self._watch(disconnected, poll_seconds))
        try:
            while not self.done:
                item = await self._queue.get()
                if item is _GONE:
                    break
                if isinstance(item, BaseException):
                    self.close()
                    raise ApiError(503, str(item), kind="server_unavailable", refused=False)  # counted as failed
                i = self.index[item.rid]
                if self.finish[i] is not None:
                    continue  # ended by a stop string: the abort's output is not news
                self.tokens[i] = len(item.token_ids)
                if not self.incremental:  # the whole text once, at the end
                    if item.finish is not None:
                        self.finish[i] = _FINISH[item.finish]
                        yield i, self.texts[i].feed(item.token_ids, final=True), self.finish[i]
                    continue
                text = self.texts[i]
                delta = text.feed(item.token_ids, final=item.finished)
                if text.stopped:
                    self.finish[i] = "stop"
                    if not item.finished:
                        self.loop.abort(item.rid, "stop")
                elif item.finish is not None:
                    self.finish[i] = _FINISH[item.finish]
                if delta or self.finish[i] is not None:
                    yield i, delta, self.finish[i]
        finally:
            if watcher is not None:
                watcher.cancel()
        if self.gone:
            raise ConnectionError("the client went away")

    async def _watch(self, disconnected: Callable[[], Awaitable[bool]], poll_seconds: float) -> None:
        while not self.done:
            await asyncio.sleep(poll_seconds)
            if await disconnected():
                self.gone = True
                self.close()
                self._queue.put_nowait(_GONE)
                return

    def close(self) -> None:
        """Abort every request that has not finished (its pages return to the pool at the next step boundary)."""
        for r in self.requests:
            if self.finish[self.index[r.rid]] is None:
                self.loop.abort(r.rid)
                self.finish[self.index[r.rid]] = "abort"

    def usage(self) -> dict[str, int]:
        completion = sum(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}
