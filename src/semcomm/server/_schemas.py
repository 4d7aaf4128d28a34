"""OpenAI-compatible request bodies (validated) and response builders.

Requests accept the fields OpenAI clients send; fields semcomm does not implement are accepted
when they would not change the result (``user``, ``logit_bias`` of None or ``{}``,
``logprobs: false``, ``response_format: {"type": "text"}``, a zero penalty, ...) and refused
with a 400 naming the field when they would (``n > 1``, ``tools``, ``logprobs: true``,
``top_logprobs``, a non-empty ``logit_bias``, a JSON ``response_format``, a non-zero penalty,
``best_of > 1``, ...). Booleans are strict: ``"stream": "yes"`` is refused, not read as true.
``user`` is never used for tenancy: the tenant comes from the API key alone.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
)

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
    """A text content part. ``"document": true`` marks a retrieved passage (or any text several
    prompts share): an in-process model reuses its KV at whatever position it appears
    (docs/rag.md); every other server reads it as plain text."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str
    document: StrictBool = False


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

    def has_documents(self) -> bool:
        return isinstance(self.content, list) and any(p.document for p in self.content)

    def pieces(self) -> list[tuple[str, bool]]:
        """``(text, is_document)`` of each content part, in order."""
        if isinstance(self.content, list):
            return [(p.text, p.document) for p in self.content]
        return [(self.text(), False)]


class DocumentOptions(_Lenient):
    """``semcomm_documents`` in a chat request with documents: how much of them is
    recomputed in context (defaults: the engine's, docs/rag.md)."""

    selector: Literal["cacheblend", "epic", "prophet", "concat", "full"] | None = None
    recompute: float | None = Field(None, ge=0, le=1)
    # below this top-1 minus top-2 probability of the first token, full prefill instead
    margin: float | None = Field(None, ge=0, le=1)
    # below this top-1 minus top-2 probability at a later decode step, the KV is rebuilt in full
    watch: float | None = Field(None, ge=0, le=1)


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


def _refuse(field: str, why: str) -> ValueError:
    return ValueError(f"{field} {why} is not supported by semcomm (it would change the answer); "
                      "leave it out")


_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1  # what the engine's torch generator accepts


class _GenFields(_Lenient):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=1, description="only n = 1 is supported")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    user: str | None = Field(None, description="recorded nowhere; tenancy comes from the API key")
    presence_penalty: float | None = Field(None, ge=-2, le=2,
                                           description="only 0 (no penalty) is supported")
    frequency_penalty: float | None = Field(None, ge=-2, le=2,
                                            description="only 0 (no penalty) is supported")
    logprobs: Any = Field(None, description="not supported: only false or null")
    top_logprobs: Any = Field(None, description="not supported: only 0 or null")
    logit_bias: Any = Field(None, description="not supported: only {} or null")
    best_of: Any = Field(None, description="only 1 or null")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v:
            raise _refuse(str(info.field_name), f"= {v:g}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        # chat: a boolean; legacy completions: a count of alternatives (0 means none)
        if not (v is None or v is False or (type(v) is int and v == 0)):
            raise _refuse("logprobs", f"= {v!r}")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: Any) -> Any:
        if not (v is None or (type(v) is int and v == 0)):
            raise _refuse("top_logprobs", f"= {v!r}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: Any) -> Any:
        if v is not None and v != {}:
            raise _refuse("logit_bias", "(a non-empty map)")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, v: Any) -> Any:
        if not (v is None or (type(v) is int and v == 1)):
            raise _refuse("best_of", f"= {v!r}")
        return v

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
    response_format: Any = Field(None, description='only {"type": "text"} or null')
    functions: Any = Field(None, description="not supported (tool calling)")
    function_call: Any = Field(None, description="not supported (tool calling)")
    modalities: Any = Field(None, description='only ["text"] or null')
    audio: Any = Field(None, description="not supported")
    prediction: Any = Field(None, description="not supported")
    semcomm_documents: DocumentOptions | None = Field(
        None, description="for content parts marked as documents: selector and recompute share")

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise ValueError("tool calling is not supported by semcomm models")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and v not in ("none", "auto"):
            raise _refuse(str(info.field_name), f"= {v!r}")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, v: Any) -> Any:
        if v is not None and v != {"type": "text"}:
            raise _refuse("response_format", f"= {v!r}")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v is not None and v != ["text"]:
            raise _refuse("modalities", f"= {v!r}")
        return v

    @field_validator("audio", "prediction")
    @classmethod
    def _absent(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise _refuse(str(info.field_name), "(any value)")
        return v


class CompletionRequest(_GenFields):
    prompt: str | list[str] = Field(description="one prompt (a list must hold exactly one)")
    echo: StrictBool | None = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return v

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               documents: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAI's usage block; ``cached_tokens`` counts every prompt token not recomputed. A
    request with documents adds what they reused and recomputed (``document_anchors``: the
    documents placed from an anchor, engine/_anchors.py)."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if documents is not None:
        details.update(
            document_tokens=documents.get("document_tokens", 0),
            document_tokens_reused=documents.get("reused_tokens", 0),
            document_tokens_recomputed=documents.get("recomputed_document_tokens", 0),
            recomputed_tokens=documents.get("recomputed_tokens", 0),
            selector=documents.get("selector", ""),
            recompute=documents.get("recompute", 0.0),
            document_anchors=documents.get("documents_anchored", 0))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
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
