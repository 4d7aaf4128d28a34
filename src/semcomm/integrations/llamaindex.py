"""LlamaIndex adapters: :class:`SemcommGateway` (an ``LLM`` for a semcomm gateway),
:class:`DocumentsSynthesizer` (retrieved nodes sent as documents) and :class:`SemcommLLM` (an
``LLM`` that wraps another and caches answers).

Documents: ``DocumentsSynthesizer(llm)`` answers a query from the retrieved nodes in one call,
each node's text its own passage (LlamaIndex's default synthesizer repacks the nodes into
chunks, which loses where each begins). With a :class:`SemcommGateway` (also inside a
:class:`SemcommLLM`) the passages go out as content parts marked ``"document": true``, whose
KV the gateway's in-process models reuse at whatever position each lands, in any order
(docs/rag.md); with any other LLM they are sent as the same text. In a query engine the one
line that changes::

    query_engine = index.as_query_engine(llm=llm)
    query_engine = index.as_query_engine(llm=llm, response_synthesizer=DocumentsSynthesizer(llm))

Cache: LlamaIndex has no LLM response cache hook, so the cache wraps the model:
``Settings.llm = SemcommLLM(OpenAI(...))`` or pass it to a query engine. ``complete``/``chat``
and their async forms look in the cache first; streaming calls go to the wrapped model
unchanged. The model identity is the wrapped model's class and metadata (name, context
window), so two wrapped models never share entries.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Sequence
from typing import Any

from .._query import split_query
from ..errors import UpstreamError, require
from ..semantic import Scope, SemanticCache

require("llama_index.core", "llamaindex")

from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
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
from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms import LLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.types import RESPONSE_TEXT_TYPE
from pydantic import Field, PrivateAttr

__all__ = ["PARTS_KEY", "DocumentsSynthesizer", "SemcommGateway", "SemcommLLM",
           "takes_documents"]

#: A ``ChatMessage.additional_kwargs`` key: the message's content as OpenAI content parts, sent
#: as they are by :class:`SemcommGateway` (``content`` holds the same text joined).
PARTS_KEY = "semcomm_parts"
_HITS_HEADER = "x-semcomm-hits"
_ROLES = {"chatbot": "assistant", "model": "assistant", "function": "tool"}


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


# -- the gateway --------------------------------------------------------------------------------
class SemcommGateway(LLM):
    """A LlamaIndex chat ``LLM`` for a semcomm gateway (``semcomm serve``) or any other
    OpenAI-compatible chat-completions endpoint.

    A message whose ``additional_kwargs[PARTS_KEY]`` holds content parts is sent with them as
    its content (how :class:`DocumentsSynthesizer` marks passages); ``documents`` is the
    request's ``semcomm_documents`` (``{"selector": ..., "recompute": ...}``) when any message
    has parts. A response's ``additional_kwargs`` carry ``semcomm_hits`` (the
    ``x-semcomm-hits`` header: ``docs:<tokens>`` when documents were reused) and ``usage``.
    """

    model: str = Field(description="the model name the gateway serves")
    api_base: str = Field(default="http://127.0.0.1:8000/v1",
                          description="the gateway's OpenAI base URL, ending in /v1")
    api_key: str | None = Field(default=None, exclude=True,
                                description="a tenant's API key (none: an open gateway)")
    max_tokens: int | None = Field(default=None, description="max_tokens of each request")
    temperature: float | None = Field(default=None, description="sampling temperature")
    context_window: int = Field(default=4096, description="the model's context, in tokens")
    timeout: float = Field(default=120.0, description="seconds for one request")
    documents: dict[str, Any] | None = Field(
        default=None, description="semcomm_documents of a request with document parts")
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="more request body fields")

    _http: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "SemcommGateway"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window,
                           num_output=self.max_tokens or 256, is_chat_model=True,
                           model_name=self.model)

    # -- requests -----------------------------------------------------------------------
    @property
    def _url(self) -> str:
        return self.api_base.rstrip("/") + "/chat/completions"

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @staticmethod
    def _message(m: ChatMessage) -> dict[str, Any]:
        role = str(getattr(m.role, "value", m.role))
        parts = m.additional_kwargs.get(PARTS_KEY)
        return {"role": _ROLES.get(role, role),
                "content": list(parts) if parts is not None else m.content or ""}

    def _body(self, messages: Sequence[ChatMessage], stream: bool,
              kwargs: dict[str, Any]) -> dict[str, Any]:
        msgs = [self._message(m) for m in messages]
        body: dict[str, Any] = {"model": self.model, "messages": msgs}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.documents and any(isinstance(m["content"], list) for m in msgs):
            body["semcomm_documents"] = dict(self.documents)
        body.update(self.additional_kwargs)
        body.update(kwargs)
        if stream:
            body["stream"] = True
        return body

    def _client(self) -> Any:
        import httpx

        if self._http is None:
            self._http = httpx.Client(timeout=self.timeout)
        return self._http

    def _fail(self, status: int, text: str) -> UpstreamError:
        return UpstreamError(f"{self._url} answered HTTP {status}: {text[:500]}",
                             status=status, retryable=status in (429, 502, 503, 504))

    @staticmethod
    def _response(data: dict[str, Any], hits: str | None) -> ChatResponse:
        msg = (data.get("choices") or [{}])[0].get("message") or {}
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=msg.get("content") or ""),
            raw=data, additional_kwargs={"semcomm_hits": hits, "usage": data.get("usage")})

    def _event(self, line: str) -> dict[str, Any] | None:
        """The JSON of a server-sent ``data:`` line; None for any other line, ``{}`` at the
        end of the stream."""
        if not line.startswith("data:"):
            return None
        payload = line[5:].strip()
        if payload == "[DONE]":
            return {}
        chunk: dict[str, Any] = json.loads(payload)
        if "error" in chunk:
            raise UpstreamError(f"{self._url}: {chunk['error']}")
        return chunk

    @staticmethod
    def _chunk(chunk: dict[str, Any], text: str, hits: str | None) -> ChatResponse:
        """The ``ChatResponse`` of one streamed chunk after ``text``: ``delta`` is its piece."""
        choices = chunk.get("choices") or []
        piece = ((choices[0].get("delta") or {}).get("content") or "") if choices else ""
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text + piece),
                            delta=piece, raw=chunk,
                            additional_kwargs={"semcomm_hits": hits, "usage": chunk.get("usage")})

    # -- chat ---------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        r = self._client().post(self._url, json=self._body(messages, False, kwargs),
                                headers=self._headers)
        if r.status_code >= 400:
            raise self._fail(r.status_code, r.text)
        return self._response(r.json(), r.headers.get(_HITS_HEADER))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        body = self._body(messages, True, kwargs)

        def gen() -> Generator[ChatResponse, None, None]:
            with self._client().stream("POST", self._url, json=body,
                                       headers=self._headers) as r:
                if r.status_code >= 400:
                    raise self._fail(r.status_code, r.read().decode("utf-8", "replace"))
                hits, text = r.headers.get(_HITS_HEADER), ""
                for line in r.iter_lines():
                    chunk = self._event(line)
                    if chunk == {}:
                        return
                    if chunk is not None:
                        out = self._chunk(chunk, text, hits)
                        text = out.message.content or ""
                        yield out

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout) as c:
            r = await c.post(self._url, json=self._body(messages, False, kwargs),
                             headers=self._headers)
        if r.status_code >= 400:
            raise self._fail(r.status_code, r.text)
        return self._response(r.json(), r.headers.get(_HITS_HEADER))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        import httpx

        body = self._body(messages, True, kwargs)

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            async with httpx.AsyncClient(timeout=self.timeout) as c, \
                    c.stream("POST", self._url, json=body, headers=self._headers) as r:
                if r.status_code >= 400:
                    raise self._fail(r.status_code,
                                     (await r.aread()).decode("utf-8", "replace"))
                hits, text = r.headers.get(_HITS_HEADER), ""
                async for line in r.aiter_lines():
                    chunk = self._event(line)
                    if chunk == {}:
                        return
                    if chunk is not None:
                        out = self._chunk(chunk, text, hits)
                        text = out.message.content or ""
                        yield out

        return gen()

    # -- completion: one user message ---------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_to_completion_decorator(self.chat)(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponse:
        return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)


def takes_documents(llm: Any) -> bool:
    """Whether ``llm`` sends ``additional_kwargs[PARTS_KEY]`` as content parts: a
    :class:`SemcommGateway`, also inside a :class:`SemcommLLM`."""
    while isinstance(llm, SemcommLLM):
        llm = llm.inner
    return isinstance(llm, SemcommGateway)


# -- the synthesizer ----------------------------------------------------------------------------
class DocumentsSynthesizer(BaseSynthesizer):
    """Answer from the retrieved nodes in one LLM call, each node's text a passage.

    The prompt is ``text_qa_template`` (LlamaIndex's default question-answering prompt unless
    given), with the passages in order where ``{context_str}`` stands, each followed by
    ``separator``. The nodes are neither repacked nor truncated: they must fit the model's
    context together. Where the LLM takes documents (:func:`takes_documents`), each passage is
    a content part marked ``"document": true``; otherwise the message is the same text.
    """

    def __init__(self, llm: LLM | None = None, *,
                 text_qa_template: BasePromptTemplate | None = None,
                 separator: str = "\n\n", streaming: bool = False,
                 callback_manager: CallbackManager | None = None) -> None:
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._text_qa_template = text_qa_template or DEFAULT_TEXT_QA_PROMPT_SEL
        self._separator = separator

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = prompts["text_qa_template"]

    def messages(self, query_str: str, text_chunks: Sequence[str]) -> list[ChatMessage]:
        """The chat this synthesizer sends for ``query_str`` over ``text_chunks``."""
        mark = f"\ue000semcomm-documents-{uuid.uuid4().hex}\ue001"
        llm = self._llm
        msgs = list(self._text_qa_template.format_messages(llm=llm, context_str=mark,
                                                           query_str=query_str))
        if llm.system_prompt:
            msgs.insert(0, ChatMessage(role=MessageRole.SYSTEM, content=llm.system_prompt))
        docs = [{"type": "text", "text": c + self._separator, "document": True}
                for c in text_chunks]
        marked = takes_documents(llm)
        out = []
        for m in msgs:
            text = m.content or ""
            if mark not in text:
                out.append(m)
                continue
            parts: list[dict[str, Any]] = []
            for i, piece in enumerate(text.split(mark)):
                if i:
                    parts.extend(dict(d) for d in docs)
                if piece:
                    parts.append({"type": "text", "text": piece})
            kw = dict(m.additional_kwargs)
            if marked:
                kw[PARTS_KEY] = parts
            out.append(ChatMessage(role=m.role, content="".join(p["text"] for p in parts),
                                   additional_kwargs=kw))
        return out

    def get_response(self, query_str: str, text_chunks: Sequence[str],
                     **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        messages = self.messages(query_str, text_chunks)
        if not self._streaming:
            return self._llm.chat(messages).message.content or ""
        stream = self._llm.stream_chat(messages)
        return (r.delta or "" for r in stream)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str],
                            **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        messages = self.messages(query_str, text_chunks)
        if not self._streaming:
            return (await self._llm.achat(messages)).message.content or ""
        stream = await self._llm.astream_chat(messages)

        async def deltas() -> AsyncIterator[str]:
            async for r in stream:
                yield r.delta or ""

        return deltas()  # type: ignore[return-value]
