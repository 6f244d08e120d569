"""The server's request bodies: size limit, JSON, validated models with bounds.

``inferscale.serve`` reads every body through :func:`read_body` (``413`` beyond
``max_body_bytes``, counted while reading, so an oversized body is never held whole;
``400`` for bytes that are not one JSON object) and validates it with the models of
:func:`chat_model` / :class:`HydrateRequest` / :class:`EvictRequest` through
:func:`validate` (``400`` naming each bad field). Numbers are strict (``"5"`` is not a
``top_k``), bounds come from :class:`RequestLimits`; fields of the OpenAI API this
server does not use are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from inferscale.serve.backend import AnswerRequest
from inferscale.types import VERSION_RE, user_id_problem


class RequestError(ValueError):
    """A request the server answers with ``status`` and ``message`` (4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on a request (``INFERSCALE_MAX_REQUEST_BYTES``, ``_MAX_QUESTION_CHARS``,
    ``_MAX_OUTPUT_TOKENS``, ``_MAX_TOP_K``)."""

    max_body_bytes: int = 1 << 20
    max_question_chars: int = 8192
    max_output_tokens: int = 4096
    max_top_k: int = 100
    max_messages: int = 256

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_question_chars, self.max_output_tokens,
               self.max_top_k, self.max_messages) < 1:
            raise ValueError("request limits must be >= 1")

    @classmethod
    def from_settings(cls, settings: Any) -> "RequestLimits":
        return cls(settings.max_request_bytes, settings.max_question_chars,
                   settings.max_output_tokens, settings.max_top_k)


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None,
                    limit: int) -> dict:
    """The JSON object of a body streamed as ``chunks``; RequestError 413 / 400."""
    if content_length and content_length.isascii() and content_length.isdigit() \
            and int(content_length) > limit:  # (str.isdigit holds for "²" too)
        raise RequestError(413, f"the body is {content_length} bytes; at most {limit}")
    parts, size = [], 0
    async for part in chunks:
        size += len(part)
        if size > limit:
            raise RequestError(413, f"the body exceeds {limit} bytes")
        parts.append(part)
    try:
        body = json.loads(b"".join(parts))
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, huge ints, deep nesting
        raise RequestError(400, f"the body is not valid JSON: {str(exc)[:200]}") from exc
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, not {type(body).__name__}")
    return body


def validate(model: type[BaseModel], body: dict) -> Any:
    """``model`` from ``body``, or RequestError 400 naming every bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
                             for e in exc.errors()[:10])
        raise RequestError(400, problems) from exc


def _user_id(value: str) -> str:
    problem = user_id_problem(value)
    if problem:
        raise ValueError(f"user id {problem}")
    return value


def _version(value: str) -> str:
    if value != "latest" and not VERSION_RE.fullmatch(value):
        raise ValueError("version must be 'latest' or 32 lowercase hex digits")
    return value


UserId = Annotated[str, Field(strict=True), AfterValidator(_user_id)]
Text = Annotated[str, Field(strict=True, max_length=256)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def chat_model(limits: RequestLimits) -> type[BaseModel]:
    """The chat-completions request model with ``limits``' bounds."""
    TopK = Annotated[int, Field(strict=True, ge=1, le=limits.max_top_k)]
    Tokens = Annotated[int, Field(strict=True, ge=1, le=limits.max_output_tokens)]

    class Message(_Model):
        role: Text
        content: str | list[Any] | None = None

    class Options(_Model):
        model_config = ConfigDict(extra="forbid", frozen=True)
        top_k: TopK | None = None
        mode: Literal["kv", "prompt"] | None = None

    class StreamOptions(_Model):
        include_usage: Annotated[bool, Field(strict=True)] | None = None

    class ChatRequest(_Model):
        model: Text | None = None
        messages: Annotated[list[Message], Field(min_length=1,
                                                 max_length=limits.max_messages)]
        max_tokens: Tokens | None = None
        max_completion_tokens: Tokens | None = None
        temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0,
                                            allow_inf_nan=False)] | None = None
        top_k: TopK | None = None
        user: UserId | None = None
        stream: Annotated[bool, Field(strict=True)] | None = None
        stream_options: StreamOptions | None = None
        ignore_eos: Annotated[bool, Field(strict=True)] | None = None  # vLLM's extension
        inferscale: Options | None = None

        def question(self) -> str:
            """The last user message's text, a string or OpenAI content parts (text
            parts joined by newlines); RequestError 400 when there is none, it is
            empty, longer than the limit, not valid Unicode text (a lone surrogate) or
            holds a part that is not text."""
            last = next((i for i in range(len(self.messages) - 1, -1, -1)
                         if self.messages[i].role == "user"), None)
            if last is None:
                raise RequestError(400, "messages need a user message")
            text = _message_text(self.messages[last].content, f"messages.{last}.content")
            if not text.strip():
                raise RequestError(400, f"messages.{last}: the last user message is empty")
            if len(text) > limits.max_question_chars:
                raise RequestError(400, f"the user message is {len(text)} characters; at "
                                        f"most {limits.max_question_chars}")
            return text

        def answer_request(self, user: str | None, shed: bool) -> AnswerRequest:
            """What the backend answers: the question (:meth:`question`), for ``user``
            (whose memory the caller may use), the options with their fallbacks applied
            (``inferscale.top_k``, else ``top_k``; ``max_tokens``, else
            ``max_completion_tokens``); ``shed``: the user's first memory lookup may be
            shed under load."""
            opts = self.inferscale
            k = (opts.top_k if opts and opts.top_k else None) or self.top_k
            return AnswerRequest(user, self.question(), k, opts.mode if opts else None,
                                 self.max_tokens or self.max_completion_tokens,
                                 self.temperature or 0.0, bool(self.ignore_eos), shed)

    return ChatRequest


def _message_text(content: Any, where: str) -> str:
    """The text of a message's ``content``: a string, or a list of ``{"type": "text",
    "text": str}`` parts joined by newlines. RequestError 400 naming ``where`` for any
    other part, and for text that is not valid Unicode (it could not be tokenized)."""
    if content is None:
        return ""
    if isinstance(content, str):
        parts = [content]
    else:
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"{where}.{j}: only text parts "
                                        '({"type": "text", "text": "..."}) are supported')
            parts.append(part["text"])
    text = "\n".join(parts)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(400, f"{where}: not valid Unicode text (a lone surrogate at "
                                f"character {exc.start})") from None
    return text


class HydrateRequest(_Model):
    user: UserId
    tier: Literal["gpu", "host", "facts"] = "gpu"  # HydrateTarget
    version: Annotated[str, Field(strict=True), AfterValidator(_version)] = "latest"


class EvictRequest(_Model):
    user: UserId
