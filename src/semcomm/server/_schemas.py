"""OpenAI-compatible request bodies (validated) and response builders.

Requests accept the fields OpenAI clients send; fields semcomm does not implement are accepted
when they would not change the result (``user``, ``logit_bias`` of None, ...) and refused with
a 400 naming the field when they would (``n > 1``, ``tools``). ``user`` is never used for
tenancy: the tenant comes from the API key alone.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "error_body",
    "usage_dict",
]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Lenient):
    include_usage: bool = False


class _GenFields(_Lenient):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=1, description="only n = 1 is supported")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(None, description="recorded nowhere; tenancy comes from the API key")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_GenFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tool calling is not supported by semcomm models")
        return v


class CompletionRequest(_GenFields):
    prompt: str | list[str] = Field(description="one prompt (a list must hold exactly one)")
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return v

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_response(rid: str, model: str, text: str, finish: str, usage: dict[str, Any],
                  meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }],
        "usage": usage,
        "semcomm": meta,
    }


def _chunk(rid: str, object_: str, model: str, created: int, body: dict[str, Any], *,
           finish: str | None, usage: dict[str, Any] | None, meta: dict[str, Any] | None,
           empty: bool) -> dict[str, Any]:
    """One streamed chunk: a single choice holding ``body`` (none when ``empty``)."""
    out: dict[str, Any] = {
        "id": rid, "object": object_, "created": created, "model": model,
        "choices": [] if empty else [{"index": 0, **body, "finish_reason": finish,
                                      "logprobs": None}],
    }
    if usage is not None:
        out["usage"] = usage
    if meta is not None:
        out["semcomm"] = meta
    return out


def chat_chunk(rid: str, model: str, created: int, *, content: str | None = None,
               role: bool = False, finish: str | None = None,
               usage: dict[str, Any] | None = None, meta: dict[str, Any] | None = None,
               empty: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return _chunk(rid, "chat.completion.chunk", model, created, {"delta": delta}, finish=finish,
                  usage=usage, meta=meta, empty=empty)


def completion_response(rid: str, model: str, text: str, finish: str, usage: dict[str, Any],
                        meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
        "semcomm": meta,
    }


def completion_chunk(rid: str, model: str, created: int, *, text: str = "",
                     finish: str | None = None, usage: dict[str, Any] | None = None,
                     meta: dict[str, Any] | None = None, empty: bool = False) -> dict[str, Any]:
    return _chunk(rid, "text_completion", model, created, {"text": text}, finish=finish,
                  usage=usage, meta=meta, empty=empty)


def error_body(message: str, type_: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
