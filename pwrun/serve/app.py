"""The HTTP application (FastAPI): OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``,
plus ``/health`` and ``/metrics``.

What it does: validates a body (``protocol.parse``: 400 naming a bad or unsupported field, 404 for another model
name), tokenizes it (the chat template for chat; a 400 when the tokenizer has none), runs its choices through the
engine thread (``generation.Generation``) and answers with one JSON body or, with ``stream``, server-sent events
in OpenAI's chunk format ending in ``data: [DONE]``. A client that disconnects has its requests aborted.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pwrun.core.request import SamplingParams
from pwrun.serve.engine_process import AnyLoop
from pwrun.serve.generation import Generation, Mailbox, ServeLimits, body_limit, encode
from pwrun.serve.metrics import ServerMetrics
from pwrun.serve.protocol import ApiError, ChatBody, CompletionBody, parse

# a body declared past this many times the limit is refused before it is read (below it, read and dropped: a client
# still sending when the answer comes may not see it)
EARLY_413_FACTOR = 4


@dataclass
class ServerState:
    """What the routes share: the engine thread, the tokenizer, the served name and limits, EOS ids, metrics;
    ``shutting_down``: True once the server stops taking requests (503)."""

    loop: AnyLoop
    tokenizer: Any
    model_name: str
    limits: ServeLimits
    eos: frozenset[int]
    metrics: ServerMetrics
    shutting_down: Callable[[], bool] = lambda: False
    mailbox: Mailbox | None = None  # made on the first request, in the event loop


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving ``state``."""
    app = FastAPI(title="pwrun serve", docs_url=None, redoc_url=None)
    app.state.serve = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.refused:
            state.metrics.refused.labels(str(exc.status)).inc()
        retry = {"Retry-After": "1"} if exc.status == 503 else None  # busy or stopping: worth another try
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths (404) and methods (405) in OpenAI's error shape, as every other refusal."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": f"{exc.detail}: {request.method} {request.url.path}", "type": kind,
                          "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health() -> Response:
        ok = state.loop.alive and not state.shutting_down()
        return JSONResponse({"status": "ok" if ok else (state.loop.error or "shutting down")},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "pagedweight", "max_model_len": state.limits.max_model_len}]}

    async def _json(request: Request) -> Any:
        """The body as JSON: 413 past ``body_limit`` (the rest of the body is read and dropped, not kept, so that
        the client gets the answer; at once, unread, where its Content-Length is past ``EARLY_413_FACTOR`` times
        the limit), 400 if it is not JSON or the client left before its end."""
        limit = body_limit(state.limits, state.loop.max_pending, state.tokenizer)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > EARLY_413_FACTOR * limit:
            raise ApiError(413, f"the request body declares {declared} bytes, more than this server takes ({limit}: "
                           f"{state.loop.max_pending} prompts of {state.limits.max_model_len} tokens at most)")
        raw, size = bytearray(), 0
        try:
            async for part in request.stream():
                size += len(part)
                if size <= limit:
                    raw += part
        except ClientDisconnect:  # nobody to answer: the error keeps it out of the server log's tracebacks
            raise ApiError(400, "the client closed the connection before the request body ended") from None
        if size > limit:
            raise ApiError(413, f"the request body has {size} bytes, more than this server takes ({limit}: "
                           f"{state.loop.max_pending} prompts of {state.limits.max_model_len} tokens at most)")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "the request body is not valid JSON") from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionBody = parse(CompletionBody, await _json(request))
        prompts = _prompts(body.prompt)
        if len(prompts) > state.loop.max_pending:
            raise ApiError(400, f"{len(prompts)} prompts in one request: this server holds at most "
                           f"{state.loop.max_pending} requests at once (--max-batch + --max-queue)", param="prompt")
        # tokenized on a worker thread: a long text does not hold up the other requests' streams
        ids, max_tokens = await asyncio.to_thread(encode, state.tokenizer, prompts, state.limits, body.max_tokens, 16)
        return await _run(request, body, ids, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body: ChatBody = parse(ChatBody, await _json(request))
        tok = state.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, f"the tokenizer of {state.model_name} has no chat template: use /v1/completions, or "
                           "start the server with --chat-template FILE (a Jinja template)", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own checks (e.g. roles in a given order) raise
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids, max_tokens = await asyncio.to_thread(encode, tok, [str(text)], state.limits, limit, None, False)
        return await _run(request, body, ids, max_tokens, chat=True)

    async def _run(request: Request, body: Any, ids: list[list[int]], max_tokens: int, chat: bool) -> Response:
        if state.shutting_down():
            raise ApiError(503, "the server is shutting down", kind="server_unavailable")
        if body.model != state.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist: this server serves {state.model_name!r}",
                           param="model", kind="not_found_error", code="model_not_found")
        try:
            params = SamplingParams(max_tokens, 1.0 if body.temperature is None else body.temperature,
                                    1.0 if body.top_p is None else body.top_p)
        except ValueError as exc:  # a temperature the sampler cannot use (e.g. 1e-300)
            raise ApiError(400, str(exc), param="temperature" if "temperature" in str(exc) else None) from None
        stop = [] if body.stop is None else [body.stop] if isinstance(body.stop, str) else list(body.stop)
        gen = Generation(state.loop, state.tokenizer, ids, params, state.eos, stop, body.seed, body.stream)
        aio = asyncio.get_running_loop()
        if state.mailbox is None or state.mailbox.aio is not aio:
            state.mailbox = Mailbox(aio)
        gen.start(state.mailbox)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": state.model_name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(gen, head, chat, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        texts = [""] * len(ids)
        finish: list[str | None] = [None] * len(ids)
        try:
            async for i, delta, reason in gen.events(request.is_disconnected):
                texts[i] += delta
                finish[i] = reason
        except ConnectionError:
            return Response(status_code=499)
        finally:
            gen.close()
        if "abort" in finish:  # the server stopped first: a partial text is no answer (a stream ends "abort")
            raise ApiError(503, "the server stopped before this request finished: send it again (to a running "
                           "server)", kind="server_unavailable", refused=False)
        if chat:
            choices = [{"index": 0, "message": {"role": "assistant", "content": texts[0]}, "logprobs": None,
                        "finish_reason": finish[0]}]
        else:
            choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                       for i, (t, f) in enumerate(zip(texts, finish, strict=True))]
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": choices, "usage": gen.usage()})

    return app


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """A completion's ``prompt`` as a list of prompts: texts or token id lists (one choice each)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt: give a text, a list of texts, token ids or lists of token ids", param="prompt")
    if isinstance(prompt[0], int):
        return [[int(t) for t in prompt]]
    return prompt


async def _stream(gen: Generation, head: dict[str, Any], chat: bool, usage: bool) -> AsyncIterator[str]:
    """OpenAI's chunks: chat opens with the assistant role; each delta; each choice's finish reason; the usage
    (``stream_options.include_usage``); ``[DONE]``. Cancelled (the client went away): the requests are aborted."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(i: int, text: str | None, reason: str | None) -> dict[str, Any]:
        if chat:
            delta = {} if text is None else {"content": text}
            c: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            c = {"index": i, "text": text or "", "logprobs": None, "finish_reason": reason}
        return {**head, "object": obj, "choices": [c]}

    try:
        if chat:
            yield _sse({**head, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                             "logprobs": None, "finish_reason": None}]})
        async for i, delta, reason in gen.events():
            if delta:
                yield _sse(chunk(i, delta, None))
            if reason is not None:
                yield _sse(chunk(i, None if chat else "", reason))
        if usage:
            yield _sse({**head, "object": obj, "choices": [], "usage": gen.usage()})
    except ApiError as exc:
        yield _sse(exc.body())
    finally:
        gen.close()
    yield "data: [DONE]\n\n"
