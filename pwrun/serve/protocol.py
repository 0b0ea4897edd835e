"""The OpenAI request bodies the server accepts, and the error body it answers with.

What it does: ``CompletionBody`` and ``ChatBody`` are the fields of ``/v1/completions`` and
``/v1/chat/completions`` that are served (pydantic, validated); any other field, or a served field at a value
that asks for something not built (``n`` > 1, ``logprobs``, penalties, ``echo``, tools), is refused by
``unsupported`` with a 400 that names it. ``ApiError`` carries an HTTP status and the OpenAI error JSON.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``; ``refused``: the
    request was turned away (counted in ``pwrun_requests_refused``), not failed after the engine took it (counted in
    ``pwrun_requests_finished{finish="failed"}``)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, refused: bool = True) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.refused = refused

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints serve; unknown fields are kept (``extra``) so that ``unsupported`` can name them."""

    model_config = ConfigDict(extra="allow", strict=True)  # "8" is not a number, "yes" not a boolean (as OpenAI)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    # accepted only at their neutral values (``unsupported``)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Common):
    """``/v1/completions``: ``prompt`` is a text, a list of texts (one choice each), token ids or lists of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Common):
    """``/v1/chat/completions``: ``messages`` through the tokenizer's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


# field -> its values that ask for nothing more than plain sampling
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "echo": (False,), "logprobs": (None, False), "best_of": (None, 1), "suffix": (None,), "top_logprobs": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
}


def unsupported(body: _Common) -> list[str]:
    """The fields of ``body`` this server does not serve: unknown ones and known ones at non-neutral values."""
    names = sorted((body.model_extra or {}).keys())
    for name, neutral in _NEUTRAL.items():
        if name in body.model_fields_set and getattr(body, name) not in neutral:
            names.append(name)
    for m in getattr(body, "messages", []):
        names += [f"messages[].{k}" for k in sorted((m.model_extra or {}).keys())]
    return names


def parse(kind: type[_Common], data: Any) -> Any:
    """``data`` (decoded JSON) as ``kind``; ``ApiError`` 400 naming the first bad field, or every unsupported one."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        body = kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{where}: {err['msg']}" if where else err["msg"], param=where) from None
    names = unsupported(body)
    if names:
        raise ApiError(400, f"unsupported parameter(s): {', '.join(names)} (this server serves model, prompt or "
                       "messages, max_tokens, temperature, top_p, seed, stop, stream, stream_options and user)",
                       param=names[0], code="unsupported_parameter")
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: give at most 4 non-empty strings", param="stop")
    return body
