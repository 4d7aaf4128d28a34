"""LlamaIndex adapters: the cache wrapper (cached complete/chat, sync and async, isolation,
streaming passthrough), and retrieved nodes sent to a live semcomm gateway as documents
(DocumentsSynthesizer, SemcommGateway), asserted on what the gateway received and answered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, CompletionResponse
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.llms import LLMMetadata, MockLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import TextNode

from semcomm import SemanticCache
from semcomm.errors import UpstreamError
from semcomm.integrations.llamaindex import (
    PARTS_KEY,
    DocumentsSynthesizer,
    SemcommGateway,
    SemcommLLM,
    takes_documents,
)
from semcomm.semantic import CallableEmbedder

from ._integrations_gateway import PASSAGES, bow, gateway
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
    inner = CountingLLM(max_tokens=None)
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
    inner = CountingLLM(max_tokens=None)
    llm = SemcommLLM(inner, cache)
    r1 = await llm.acomplete("async llama question")
    r2 = await llm.acomplete("async llama question")
    assert inner.calls == 1 and r1.text == r2.text


def test_streaming_passes_through(cache) -> None:
    llm = SemcommLLM(MockLLM(), cache)
    text = "".join(r.delta or "" for r in llm.stream_complete("stream me"))
    assert text == "stream me"



# -- documents: retrieved nodes sent to a semcomm gateway as documents -------------------------
Q1, Q2 = "Where is item-1 traded?", "Which river has place 2?"


class Bow(BaseEmbedding):
    """A bag-of-words embedding, so that retrieval orders the passages by the question."""

    def _get_query_embedding(self, query: str) -> list[float]:
        return bow([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return bow([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return bow([text])[0]


class ChatMockLLM(MockLLM):
    """LlamaIndex's MockLLM as a chat model: another LLM than the gateway."""

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(is_chat_model=True)


def _index() -> VectorStoreIndex:
    return VectorStoreIndex([TextNode(text=p, id_=f"place-{i}") for i, p in enumerate(PASSAGES)],
                            embed_model=Bow())


def test_the_synthesizer_marks_passages_for_the_gateway_only() -> None:
    gw = SemcommGateway(model="tiny")
    # one template for both LLMs (the default selector picks by the LLM's kind)
    tmpl = PromptTemplate("Context:\n{context_str}\nQuery: {query_str}\nAnswer: ")
    msgs = DocumentsSynthesizer(gw, text_qa_template=tmpl).messages("why?", ["alpha", "beta"])
    user = msgs[-1]
    parts = user.additional_kwargs[PARTS_KEY]
    assert [p["text"] for p in parts if p.get("document")] == ["alpha\n\n", "beta\n\n"]
    assert "".join(p["text"] for p in parts) == user.content
    assert parts[0] == {"type": "text", "text": user.content.split("alpha")[0]}  # type: ignore[union-attr]
    assert "why?" in parts[-1]["text"] and not parts[-1].get("document")
    # any other LLM gets the same text, unmarked; the cache wrapper keeps the gateway's marks
    other = DocumentsSynthesizer(ChatMockLLM(max_tokens=None), text_qa_template=tmpl).messages(
        "why?", ["alpha", "beta"])
    assert [m.content for m in other] == [m.content for m in msgs]
    assert all(PARTS_KEY not in m.additional_kwargs for m in other)
    assert takes_documents(SemcommLLM(gw, SemanticCache(embedder=CallableEmbedder(bow_embed))))
    assert not takes_documents(MockLLM())
    assert gw._body(msgs, False, {})["messages"][-1]["content"] == parts


def test_a_query_engine_sends_nodes_that_the_gateway_reuses(tmp_path: Path) -> None:
    index = _index()
    with gateway(tmp_path) as (url, log):
        llm = SemcommGateway(model="tiny", api_base=url, max_tokens=4, temperature=0)
        usual = index.as_query_engine(llm=llm, similarity_top_k=3)
        engine = index.as_query_engine(llm=llm, similarity_top_k=3,
                                       response_synthesizer=DocumentsSynthesizer(llm))
        usual.query(Q1)
        engine.query(Q1)
        answer = engine.query(Q2)
    assert len(answer.source_nodes) == 3 and len(log) == 3
    plain, first, second = log
    # LlamaIndex's own synthesizer: one string, nothing marked, no documents reused
    assert all(isinstance(m["content"], str) for m in plain.body["messages"])
    assert plain.documents() == [] and plain.reused() is None and plain.documents_hit() is None
    # DocumentsSynthesizer: each retrieved node a document part; stored on the first call,
    # all three found stored and reused on the second, retrieved in another order
    passages = sorted(p + "\n\n" for p in PASSAGES)
    assert sorted(first.documents()) == sorted(second.documents()) == passages
    assert first.documents() != second.documents()
    assert first.documents_hit() == 0 and second.documents_hit() == 3, second.answer
    reused = second.reused()
    assert reused is not None and reused > 0, second.hits
    assert str(answer) == second.answer["choices"][0]["message"]["content"]  # type: ignore[index]


async def test_streaming_async_and_the_llm_itself(tmp_path: Path) -> None:
    index = _index()
    with gateway(tmp_path) as (url, log):
        llm = SemcommGateway(model="tiny", api_base=url, max_tokens=4, temperature=0,
                             documents={"selector": "epic", "recompute": 0.3})
        engine = index.as_query_engine(llm=llm, similarity_top_k=3,
                                       response_synthesizer=DocumentsSynthesizer(llm))
        streaming = index.as_query_engine(
            llm=llm, similarity_top_k=3,
            response_synthesizer=DocumentsSynthesizer(llm, streaming=True))
        whole = str(await engine.aquery(Q1))
        streamed = "".join(streaming.query(Q1).response_gen)  # type: ignore[union-attr,arg-type]
        astreamed = await streaming.aquery(Q1)
        apieces = [p async for p in astreamed.async_response_gen()]  # type: ignore[union-attr]
        done = llm.complete("Say hi")
        pieces = [r.delta for r in llm.stream_complete("Say hi")]
        chat = await llm.achat([ChatMessage(role="user", content="Say hi")])
        with pytest.raises(UpstreamError) as bad:
            SemcommGateway(model="no-such-model", api_base=url).complete("hi")
    assert whole == streamed == "".join(apieces)
    assert done.text == "".join(p or "" for p in pieces) == chat.message.content
    assert bad.value.status is not None and bad.value.status >= 400
    asked = [e for e in log if e.documents()]
    assert len(asked) == 3 and all(e.body["semcomm_documents"] == {"selector": "epic",
                                                                    "recompute": 0.3}
                                   for e in asked)
    assert all(e.reused() for e in asked[1:])  # streamed answers report reuse too
    assert "semcomm_documents" not in log[3].body  # a plain prompt does not send the options
