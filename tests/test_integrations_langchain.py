"""LangChain adapter: the standard cache suites plus semcomm's semantic behaviour."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from langchain_core.load import dumps
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, Generation
from langchain_tests.integration_tests import (
    AsyncCacheTestSuite,
    SyncCacheTestSuite,
)

from semcomm import SemanticCache
from semcomm.integrations.langchain import SemcommCache, parse_prompt
from semcomm.semantic import CallableEmbedder

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
