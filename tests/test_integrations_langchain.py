"""LangChain adapters: the standard cache suites plus semcomm's semantic behaviour, and a
retrieval chain whose Documents reach a live semcomm gateway as documents (documents_prompt),
asserted on what the gateway received and answered."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.load import dumps
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, Generation
from langchain_core.prompt_values import PromptValue
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import (
    AsyncCacheTestSuite,
    SyncCacheTestSuite,
)

from semcomm import SemanticCache
from semcomm.integrations.langchain import (
    SemcommCache,
    documents_message,
    documents_prompt,
    parse_prompt,
)
from semcomm.semantic import CallableEmbedder

from ._integrations_gateway import PASSAGES, Exchange, bow, gateway
from ._semantic_helpers import Clock, bow_embed, minilm  # noqa: F401


class TestSemcommCacheSync(SyncCacheTestSuite):
    @pytest.fixture
    def cache(self, minilm) -> SemcommCache:  # noqa: F811
        return SemcommCache()


class TestSemcommCacheAsync(AsyncCacheTestSuite):
    @pytest.fixture
    async def cache(self, minilm) -> SemcommCache:  # noqa: F811
        return SemcommCache()


LLM_A = "model=gpt-x temperature=0"
LLM_B = "model=gpt-y temperature=0"


def test_constructible_with_no_args_and_semantic_hit(minilm) -> None:  # noqa: F811
    c = SemcommCache()
    c.update("How do I reset my password?", LLM_A, [Generation(text="Settings > Reset")])
    got = c.lookup("How can I reset my password?", LLM_A)
    assert got == [Generation(text="Settings > Reset")]
    assert c.lookup("How do I reset my password?", LLM_B) is None  # isolation by llm_string
    assert c.lookup("How do I not reset my password?", LLM_A) is None  # negation near-miss


def test_threshold_is_respected() -> None:
    c = SemcommCache(embedder=CallableEmbedder(bow_embed), threshold=0.99, guard=False)
    c.update("red green blue yellow", LLM_A, [Generation(text="colors")])
    assert c.lookup("red green blue purple", LLM_A) is None
    loose = SemcommCache(c.cache, threshold=0.5)
    assert loose.lookup("red green blue purple", LLM_A) == [Generation(text="colors")]


def test_ttl_expires() -> None:
    clock = Clock()
    c = SemcommCache(embedder=CallableEmbedder(bow_embed), ttl=5, clock=clock)
    c.update("what is the weather", LLM_A, [Generation(text="sunny")])
    assert c.lookup("what is the weather", LLM_A) is not None
    clock.advance(6)
    assert c.lookup("what is the weather", LLM_A) is None


def test_chat_generations_round_trip_and_context() -> None:
    c = SemcommCache(embedder=CallableEmbedder(bow_embed))
    sys_a = SystemMessage(content="You answer in French.")
    sys_b = SystemMessage(content="You answer in German.")
    prompt = dumps([sys_a, HumanMessage(content="what is the capital city")])
    gen = ChatGeneration(message=AIMessage(content="Paris", id="x1"),
                         generation_info={"finish_reason": "stop", "n": 1})
    c.update(prompt, LLM_A, [gen])
    got = c.lookup(prompt, LLM_A)
    assert got is not None and len(got) == 1
    assert isinstance(got[0], ChatGeneration)
    assert got[0].message.content == "Paris" and got[0].generation_info == gen.generation_info
    other_ctx = dumps([sys_b, HumanMessage(content="what is the capital city")])
    assert c.lookup(other_ctx, LLM_A) is None
    query, ctx = parse_prompt(prompt)
    assert query == "what is the capital city" and ctx == [
        {"role": "system", "content": "You answer in French."}]


def test_clear_only_drops_its_scope() -> None:
    shared = SemanticCache(embedder=CallableEmbedder(bow_embed))
    shared.store("unrelated entry here", "keep", scope="app")
    c = SemcommCache(shared)
    c.update("hello there", LLM_A, [Generation(text="hi")])
    c.clear()
    assert c.lookup("hello there", LLM_A) is None
    assert shared.lookup("unrelated entry here", scope="app") is not None


def test_tenants_do_not_share() -> None:
    shared = SemanticCache(embedder=CallableEmbedder(bow_embed))
    a = SemcommCache(shared, tenant="a")
    b = SemcommCache(shared, tenant="b")
    a.update("tell me a secret", LLM_A, [Generation(text="a's secret")])
    assert b.lookup("tell me a secret", LLM_A) is None
    assert a.lookup("tell me a secret", LLM_A) == [Generation(text="a's secret")]



# -- documents: retrieved Documents sent to a semcomm gateway as documents --------------------
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer from the context."),
    ("human", "Context:\n{context}Question: {question}")])
Q1, Q2 = "Where is item-1 traded?", "Which river has place 2?"


class Bow(Embeddings):
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return bow(texts)

    def embed_query(self, text: str) -> list[float]:
        return bow([text])[0]


def format_docs(docs: list[Document]) -> str:
    """The usual RAG chain's formatter (each passage followed by a blank line)."""
    return "".join(d.page_content + "\n\n" for d in docs)


def _openai_sender(base_url: str, **extra: Any) -> Callable[[PromptValue], str]:
    """A chat model step for langchain_core alone: the official openai client sends the
    prompt's messages as ``ChatOpenAI`` converts them (content, parts included, unchanged)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    roles = {"human": "user", "system": "system", "ai": "assistant"}

    def send(value: PromptValue) -> str:
        msgs = [{"role": roles[m.type], "content": m.content} for m in value.to_messages()]
        out = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                             messages=msgs, **extra)  # type: ignore[arg-type]
        return out.choices[0].message.content or ""

    return send


def test_documents_prompt_renders_each_document_as_a_part() -> None:
    docs = [Document(page_content="alpha text"), Document(page_content="beta text")]
    value = documents_prompt(PROMPT).invoke({"context": docs, "question": "why?"})
    system, human = value.to_messages()
    assert system.content == "Answer from the context."
    assert human.content == [
        {"type": "text", "text": "Context:\n"},
        {"type": "text", "text": "alpha text\n\n", "document": True},
        {"type": "text", "text": "beta text\n\n", "document": True},
        {"type": "text", "text": "Question: why?"}]
    # the parts joined are the prompt the usual chain renders with format_docs
    plain = PROMPT.invoke({"context": format_docs(docs), "question": "why?"}).to_messages()
    assert "".join(p["text"] for p in human.content) == plain[1].content  # type: ignore[index]
    # an already formatted context renders the prompt unchanged; a missing variable is refused
    assert documents_prompt(PROMPT).invoke({"context": "as text", "question": "q"}) == \
        PROMPT.invoke({"context": "as text", "question": "q"})
    with pytest.raises(ValueError, match="passages"):
        documents_prompt(PROMPT, "passages")
    msg = documents_message(docs, "why?", separator="\n")
    assert [p.get("document", False) for p in msg.content] == [True, True, False]  # type: ignore[union-attr]
    assert msg.text == "alpha text\nbeta text\nwhy?"


def _check_reuse(plain: Exchange, first: Exchange, second: Exchange) -> None:
    # without documents_prompt: one string, nothing marked, no documents reused
    assert isinstance(plain.body["messages"][1]["content"], str)
    assert plain.documents() == [] and plain.reused() is None, plain.hits
    assert plain.documents_hit() is None
    # with it: the retrieved passages, each a document part, the same text joined
    passages = sorted(p + "\n\n" for p in PASSAGES)
    assert sorted(first.documents()) == sorted(second.documents()) == passages
    assert first.documents() != second.documents()  # retrieved in another order
    assert "".join(p["text"] for p in first.parts()) == plain.body["messages"][1]["content"]
    # the gateway took them as documents: stored on the first call, all three found stored
    # and reused on the second, in another order
    assert first.reused() is not None and first.documents_hit() == 0, first.hits
    reused = second.reused()
    assert reused is not None and reused > 0 and second.documents_hit() == 3, second.answer


def test_a_retrieval_chain_sends_documents_that_the_gateway_reuses(tmp_path: Path) -> None:
    retriever = InMemoryVectorStore.from_texts(PASSAGES, Bow()).as_retriever(
        search_kwargs={"k": 3})
    with gateway(tmp_path) as (url, log):
        llm = RunnableLambda(_openai_sender(url))
        usual = ({"context": retriever | format_docs, "question": RunnablePassthrough()}
                 | PROMPT | llm)
        chain = ({"context": retriever, "question": RunnablePassthrough()}
                 | documents_prompt(PROMPT) | llm)
        usual.invoke(Q1)
        chain.invoke(Q1)
        answer = chain.invoke(Q2)
    assert isinstance(answer, str) and len(log) == 3
    _check_reuse(*log)


def test_chat_openai_sends_the_parts_unchanged(tmp_path: Path) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    retriever = InMemoryVectorStore.from_texts(PASSAGES, Bow()).as_retriever(
        search_kwargs={"k": 3})
    with gateway(tmp_path) as (url, log):
        llm = langchain_openai.ChatOpenAI(
            model="tiny", base_url=url, api_key="unused", max_tokens=4, temperature=0,
            max_retries=0, extra_body={"semcomm_documents": {"selector": "epic"}})
        usual = ({"context": retriever | format_docs, "question": RunnablePassthrough()}
                 | PROMPT | llm)
        chain = ({"context": retriever, "question": RunnablePassthrough()}
                 | documents_prompt(PROMPT) | llm)
        usual.invoke(Q1)
        chain.invoke(Q1)
        chain.invoke(Q2)
    assert len(log) == 3 and log[2].body["semcomm_documents"] == {"selector": "epic"}
    _check_reuse(*log)
