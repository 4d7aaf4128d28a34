"""LlamaIndex adapter: :class:`SemcommLLM`, an ``LLM`` that wraps another and caches answers.

LlamaIndex has no LLM response cache hook, so the cache wraps the model:
``Settings.llm = SemcommLLM(OpenAI(...))`` or pass it to a query engine. ``complete``/``chat``
and their async forms look in the cache first; streaming calls go to the wrapped model
unchanged. The model identity is the wrapped model's class and metadata (name, context
window), so two wrapped models never share entries.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from .._query import split_query
from ..errors import require
from ..semantic import Scope, SemanticCache

require("llama_index.core", "llamaindex")

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms import LLM
from pydantic import PrivateAttr

__all__ = ["SemcommLLM"]


class SemcommLLM(LLM):
    """Semantic cache around a LlamaIndex ``LLM`` (see the module docstring)."""

    _inner: Any = PrivateAttr()
    _cache: Any = PrivateAttr()
    _scope: Any = PrivateAttr()
    _ttl: Any = PrivateAttr()
    _model_id: str = PrivateAttr()

    def __init__(self, llm: LLM, cache: SemanticCache | None = None, *,
                 scope: str = "llamaindex", tenant: str | None = None,
                 ttl: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._inner = llm
        self._cache = cache if cache is not None else SemanticCache()
        self._scope = Scope(scope, tenant)
        self._ttl = ttl
        md = llm.metadata
        ident = {"class": type(llm).__qualname__, "model": md.model_name,
                 "context_window": md.context_window, "num_output": md.num_output}
        self._model_id = "llamaindex:" + hashlib.sha256(
            json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]

    @classmethod
    def class_name(cls) -> str:
        return "SemcommLLM"

    @property
    def cache(self) -> SemanticCache:
        return self._cache  # type: ignore[no-any-return]

    @property
    def inner(self) -> LLM:
        return self._inner  # type: ignore[no-any-return]

    @property
    def metadata(self) -> LLMMetadata:
        return self._inner.metadata  # type: ignore[no-any-return]

    # -- keys ---------------------------------------------------------------------------
    @staticmethod
    def _chat_key(messages: Sequence[ChatMessage]) -> tuple[str | None, list[dict[str, str]]]:
        msgs = [{"role": str(getattr(m.role, "value", m.role)), "content": m.content or ""}
                for m in messages]
        return split_query(msgs)

    def _kw(self, ctx: Any, kind: str) -> dict[str, Any]:
        return {"scope": self._scope, "context": ctx, "model": f"{self._model_id}:{kind}"}

    # -- completion ---------------------------------------------------------------------
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        if not prompt.strip():
            return self._inner.complete(prompt, formatted=formatted, **kwargs)
        hit = self._cache.lookup(prompt, **self._kw(None, "complete"))
        if hit is not None:
            return CompletionResponse(text=hit.answer, additional_kwargs={"semcomm_hit": True})
        resp = self._inner.complete(prompt, formatted=formatted, **kwargs)
        self._cache.store(prompt, resp.text, ttl=self._ttl, **self._kw(None, "complete"))
        return resp  # type: ignore[no-any-return]

    async def acomplete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponse:
        if not prompt.strip():
            return await self._inner.acomplete(prompt, formatted=formatted, **kwargs)
        hit = await self._cache.alookup(prompt, **self._kw(None, "complete"))
        if hit is not None:
            return CompletionResponse(text=hit.answer, additional_kwargs={"semcomm_hit": True})
        resp = await self._inner.acomplete(prompt, formatted=formatted, **kwargs)
        await self._cache.astore(prompt, resp.text, ttl=self._ttl, **self._kw(None, "complete"))
        return resp  # type: ignore[no-any-return]

    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        return self._inner.stream_complete(prompt, formatted=formatted, **kwargs)  # type: ignore[no-any-return]

    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return await self._inner.astream_complete(prompt, formatted=formatted, **kwargs)  # type: ignore[no-any-return]

    # -- chat ---------------------------------------------------------------------------
    @staticmethod
    def _chat_hit(answer: str) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=answer),
                            additional_kwargs={"semcomm_hit": True})

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        query, ctx = self._chat_key(messages)
        if query is None:
            return self._inner.chat(messages, **kwargs)  # type: ignore[no-any-return]
        hit = self._cache.lookup(query, **self._kw(ctx, "chat"))
        if hit is not None:
            return self._chat_hit(hit.answer)
        resp = self._inner.chat(messages, **kwargs)
        self._cache.store(query, resp.message.content or "", ttl=self._ttl,
                          **self._kw(ctx, "chat"))
        return resp  # type: ignore[no-any-return]

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        query, ctx = self._chat_key(messages)
        if query is None:
            return await self._inner.achat(messages, **kwargs)  # type: ignore[no-any-return]
        hit = await self._cache.alookup(query, **self._kw(ctx, "chat"))
        if hit is not None:
            return self._chat_hit(hit.answer)
        resp = await self._inner.achat(messages, **kwargs)
        await self._cache.astore(query, resp.message.content or "", ttl=self._ttl,
                                 **self._kw(ctx, "chat"))
        return resp  # type: ignore[no-any-return]

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._inner.stream_chat(messages, **kwargs)  # type: ignore[no-any-return]

    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        return await self._inner.astream_chat(messages, **kwargs)  # type: ignore[no-any-return]
