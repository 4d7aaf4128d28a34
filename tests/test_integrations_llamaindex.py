"""LlamaIndex LLM wrapper: cached complete/chat (sync and async), isolation, streaming passthrough."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.base.llms.types import ChatMessage, CompletionResponse
from llama_index.core.llms import MockLLM

from semcomm import SemanticCache
from semcomm.integrations.llamaindex import SemcommLLM
from semcomm.semantic import CallableEmbedder

from ._semantic_helpers import bow_embed


class CountingLLM(MockLLM):
    """LlamaIndex's own MockLLM, counting calls to the model."""

    calls: int = 0

    def complete(self, prompt: str, formatted: bool = False, **kw: Any) -> CompletionResponse:
        self.calls += 1
        return CompletionResponse(text=f"answer #{self.calls} to {prompt}")


@pytest.fixture
def cache() -> SemanticCache:
    return SemanticCache(embedder=CallableEmbedder(bow_embed))


def test_complete_and_chat_are_cached(cache) -> None:
    inner = CountingLLM()
    llm = SemcommLLM(inner, cache)
    a = llm.complete("what is a semantic cache")
    b = llm.complete("what is a semantic cache")
    assert inner.calls == 1 and a.text == b.text and b.additional_kwargs["semcomm_hit"]
    msgs = [ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content="what is a kv cache")]
    c1 = llm.chat(msgs)
    c2 = llm.chat(msgs)
    assert inner.calls == 2 and c1.message.content == c2.message.content
    other = [ChatMessage(role="system", content="be verbose"), msgs[1]]
    llm.chat(other)
    assert inner.calls == 3  # another system prompt is another context


def test_two_wrapped_models_do_not_share(cache) -> None:
    a = SemcommLLM(CountingLLM(max_tokens=10), cache)
    b_inner = CountingLLM(max_tokens=20)
    b = SemcommLLM(b_inner, cache)
    a.complete("shared question text")
    b.complete("shared question text")
    assert b_inner.calls == 1


async def test_async_complete(cache) -> None:
    inner = CountingLLM()
    llm = SemcommLLM(inner, cache)
    r1 = await llm.acomplete("async llama question")
    r2 = await llm.acomplete("async llama question")
    assert inner.calls == 1 and r1.text == r2.text


def test_streaming_passes_through(cache) -> None:
    llm = SemcommLLM(MockLLM(), cache)
    text = "".join(r.delta or "" for r in llm.stream_complete("stream me"))
    assert text == "stream me"
