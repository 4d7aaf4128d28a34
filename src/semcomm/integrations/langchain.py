"""LangChain adapters: :class:`SemcommCache`, a ``langchain_core.caches.BaseCache``, and
:func:`documents_prompt` / :func:`documents_message`, which send retrieved documents to a
semcomm gateway as documents.

Documents: ``documents_prompt(prompt)`` renders ``prompt`` with each retrieved ``Document`` as
its own content part marked ``"document": true`` where ``{context}`` stands (the text between
them stays ordinary text parts). The gateway's in-process models reuse each passage's KV at
whatever position it lands, in any order (docs/rag.md); any other OpenAI-compatible server
reads the parts as the same text joined. ``ChatOpenAI`` sends such content parts unchanged. In
a retrieval chain the one line that changes::

    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    chain = {"context": retriever, "question": RunnablePassthrough()} | documents_prompt(prompt) | llm

Cache: use it with ``langchain_core.globals.set_llm_cache(SemcommCache())`` or pass ``cache=``
to a model. Nothing is monkey-patched.

- The ``llm_string`` (model + parameters) is part of the key, in the partition, not a
  post-filter: two models or two temperatures never share entries.
- Chat prompts arrive as ``dumps(messages)``; they are parsed (JSON, allow-listed message
  classes only) so that the last human message is the semantic query and the system prompt
  plus the last ``context_turns`` other messages are the exact-match context.
- Generations are stored as LangChain's JSON serialisation and revived with
  ``langchain_core.load.loads`` restricted to generation and message classes (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import uuid
import warnings
from collections.abc import Iterable
from typing import Any

from .._query import split_query
from ..errors import require
from ..semantic import Scope, SemanticCache

require("langchain_core", "langchain")

from langchain_core.caches import RETURN_VAL_TYPE, BaseCache
from langchain_core.documents import Document
from langchain_core.load import dumps, loads
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    Generation,
    GenerationChunk,
)
from langchain_core.prompt_values import ChatPromptValue, PromptValue
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda

__all__ = ["SemcommCache", "document_parts", "documents_message", "documents_prompt",
           "parse_prompt"]

_ALLOWED = [Generation, GenerationChunk, ChatGeneration, ChatGenerationChunk, AIMessage,
            AIMessageChunk, HumanMessage, SystemMessage, ToolMessage, ChatMessage,
            FunctionMessage]

_ROLE = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
         "function": "function", "chat": "user"}


def parse_prompt(prompt: str) -> tuple[str, list[dict[str, str]]]:
    """Split a LangChain cache prompt into (query, context messages).

    A plain-text prompt is the query itself. A ``dumps(messages)`` prompt yields the last human
    message with text as the query and every other message as context (``semcomm._query``).
    """
    s = prompt.lstrip()
    if not s.startswith("[{"):
        return prompt, []
    try:
        data = json.loads(prompt)
    except ValueError:
        return prompt, []
    if not isinstance(data, list) or not all(isinstance(m, dict) and "lc" in m for m in data):
        return prompt, []
    msgs: list[dict[str, str]] = []
    for m in data:
        kw = m.get("kwargs", {})
        cls = (m.get("id") or ["", "Message"])[-1]
        role = _ROLE.get(str(kw.get("type", "")), None) or (
            "user" if cls.startswith("Human") else "assistant" if cls.startswith("AI")
            else "system" if cls.startswith("System") else "user")
        content = kw.get("content", "")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") if isinstance(p, dict) else str(p)
                               for p in content)
        msgs.append({"role": role, "content": str(content)})
    query, context = split_query(msgs)
    return (query, context) if query is not None else (prompt, [])


class SemcommCache(BaseCache):
    """A semantic LangChain cache backed by :class:`semcomm.SemanticCache`.

    ``SemcommCache()`` works in memory with the default embedder and hit policy. Pass
    ``cache=`` to share an existing :class:`SemanticCache`, or the cache's own arguments
    (``path=``, ``store=``, ``threshold=``, ``ttl=`` ...). ``scope``/``tenant`` place the
    entries; ``clear()`` drops only this adapter's scope.
    """

    def __init__(self, cache: SemanticCache | None = None, *, scope: str = "langchain",
                 tenant: str | None = None, ttl: float | None = None,
                 threshold: float | None = None, **cache_kwargs: Any) -> None:
        if cache is not None and cache_kwargs:
            raise TypeError("pass either cache= or SemanticCache arguments, not both")
        self.cache = cache if cache is not None else SemanticCache(**cache_kwargs)
        self.scope = Scope(scope, tenant)
        self.ttl = ttl
        self.threshold = threshold

    @staticmethod
    def _model(llm_string: str) -> str:
        return "langchain:" + hashlib.sha256(llm_string.encode("utf-8")).hexdigest()[:32]

    @staticmethod
    def _decode(answer: str) -> list[Generation]:
        with warnings.catch_warnings():  # `loads` is marked beta; its allow-list is what we need
            warnings.simplefilter("ignore")
            gens = loads(answer, allowed_objects=_ALLOWED)  # type: ignore[arg-type]
        return list(gens)

    def lookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        query, ctx = parse_prompt(prompt)
        if not query.strip():
            return None
        hit = self.cache.lookup(query, scope=self.scope, context=ctx,
                                model=self._model(llm_string), threshold=self.threshold)
        return None if hit is None else self._decode(hit.answer)

    def update(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        query, ctx = parse_prompt(prompt)
        if not query.strip():
            return
        self.cache.store(query, dumps(list(return_val)), scope=self.scope, context=ctx,
                         model=self._model(llm_string), ttl=self.ttl)

    def clear(self, **kwargs: Any) -> None:
        self.cache.invalidate(scope=self.scope)

    async def alookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        query, ctx = parse_prompt(prompt)
        if not query.strip():
            return None
        hit = await self.cache.alookup(query, scope=self.scope, context=ctx,
                                       model=self._model(llm_string), threshold=self.threshold)
        return None if hit is None else self._decode(hit.answer)

    async def aupdate(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        query, ctx = parse_prompt(prompt)
        if not query.strip():
            return
        await self.cache.astore(query, dumps(list(return_val)), scope=self.scope, context=ctx,
                                model=self._model(llm_string), ttl=self.ttl)

    async def aclear(self, **kwargs: Any) -> None:
        await self.cache.ainvalidate(scope=self.scope)




# -- documents --------------------------------------------------------------------------------
def document_parts(docs: Iterable[Document | str], separator: str = "\n\n"
                   ) -> list[dict[str, Any]]:
    """One content part per document, in order: ``{"type": "text", "text": page_content +
    separator, "document": True}``.

    Each part carries its own separator (the gateway joins parts as written), so a passage is
    the same text, and the same stored KV, wherever it lands among the others.
    """
    return [{"type": "text", "text": (d.page_content if isinstance(d, Document) else str(d))
             + separator, "document": True} for d in docs]


def documents_message(docs: Iterable[Document | str], question: str = "", *,
                      separator: str = "\n\n") -> HumanMessage:
    """A ``HumanMessage`` whose content is ``docs`` as document parts, then ``question`` as an
    ordinary text part (left out when empty)."""
    parts = document_parts(docs, separator)
    if question:
        parts.append({"type": "text", "text": question})
    return HumanMessage(content=parts)  # type: ignore[arg-type]


def _expand(content: Any, mark: str, parts: list[dict[str, Any]]) -> Any:
    """``content`` with each ``mark`` in its text replaced by ``parts`` (a copy of each)."""
    if isinstance(content, str):
        if mark not in content:
            return content
        out: list[Any] = []
        for i, piece in enumerate(content.split(mark)):
            if i:
                out.extend(dict(p) for p in parts)
            if piece:
                out.append({"type": "text", "text": piece})
        return out
    if isinstance(content, list):
        expanded: list[Any] = []
        for block in content:
            text = block.get("text") if isinstance(block, dict) and \
                block.get("type") == "text" else block if isinstance(block, str) else None
            if isinstance(text, str) and mark in text:
                expanded.extend(_expand(text, mark, parts))
            else:
                expanded.append(block)
        return expanded
    return content


def documents_prompt(prompt: BasePromptTemplate, variable: str = "context", *,
                     separator: str = "\n\n") -> Runnable[dict[str, Any], PromptValue]:
    """``prompt``, rendered with the documents given for ``variable`` as document parts.

    The runnable takes the prompt's own input. When ``input[variable]`` is a list of
    ``Document`` (a retriever's output) or of strings, each becomes a content part marked
    ``"document": true`` where ``{variable}`` stands in whichever message holds it (the text
    around it becomes ordinary text parts); any other value (a string already formatted)
    renders ``prompt`` unchanged. The result is a ``ChatPromptValue`` for any chat model.
    """
    if variable not in prompt.input_variables:
        raise ValueError(f"{variable!r} is not a variable of the prompt "
                         f"(it has {sorted(prompt.input_variables)})")

    def render(inputs: dict[str, Any]) -> PromptValue:
        docs = inputs.get(variable)
        if not isinstance(docs, list | tuple) or not all(isinstance(d, Document | str)
                                                         for d in docs):
            return prompt.invoke(inputs)
        mark = f"\ue000semcomm-documents-{uuid.uuid4().hex}\ue001"
        value = prompt.invoke({**inputs, variable: mark})
        parts = document_parts(docs, separator)
        messages: list[BaseMessage] = [
            m.model_copy(update={"content": _expand(m.content, mark, parts)})
            for m in value.to_messages()]
        return ChatPromptValue(messages=messages)

    return RunnableLambda(render, name="documents_prompt")
