"""The request path through the gateway: stream contract, semantic key, isolation, admission.

Each test drives :class:`semcomm.server.Gateway` in process on the config-built tiny model and
would fail if the property it names were broken (each was checked by breaking it once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from semcomm.errors import ConfigError, InvalidInputError, OverloadedError, TenantError
from semcomm.runtime import Completion, Delta, Started
from semcomm.security import TenantContext
from semcomm.server import load_config
from semcomm.server._backends import GenRequest
from semcomm.server._gateway import Gateway
from semcomm.server._wiring import build_gateway

from .test_server_support import LiveServer, live_server, server_config

LONG = "Order log: " + " ".join(f"item-{i} shipped;" for i in range(40))


def _config(tmp: Path, *, semantic: bool = False, extra_models: dict[str, Any] | None = None,
            only_greedy: bool = True, **sections: Any) -> Any:
    over: dict[str, Any] = {
        "server": {"state_dir": str(tmp), "max_tokens_limit": 64},
        "models": {"tiny": {"path": "tiny", "max_batch": 1},
                   "tiny-batch": {"path": "tiny", "max_batch": 4},
                   "plain": {"path": "tiny", "kv_cache": False, "max_batch": 4},
                   **(extra_models or {})},
        "pipelines": {"chain": {"stages": [
            {"model": "tiny", "system": "Route it.", "max_tokens": 3},
            {"model": "tiny", "system": "Answer it."}]}},
        "kv": {"tiers": ["memory"], "chunk_size": 32},
        "semantic": {"enabled": semantic, "backend": "memory", "only_greedy": only_greedy},
        "tenants": {"acme": {"api_key": "k-acme"}, "beta": {"api_key": "k-beta"}},
    }
    over.update(sections)
    return load_config(None, overrides=over, defaults=False, environ={})


class Run:
    """One request's stream, as a client sees it."""

    def __init__(self, served: Any, items: list[Any]) -> None:
        self.hits = served.hits_header
        self.items = items
        self.final: Completion = items[-1]
        self.deltas = "".join(i.text for i in items if isinstance(i, Delta))

    @property
    def started(self) -> Started:
        assert isinstance(self.items[0], Started)
        return self.items[0]


async def _run(gw: Gateway, content: str, *, model: str = "tiny", tenant: str | None = "acme",
               max_tokens: int = 12, stop: list[str] | None = None, stream: bool = True,
               **kw: Any) -> Run:
    sampling = {k: kw.pop(k) for k in ("temperature", "seed") if k in kw}
    req = GenRequest(model=model, messages=[{"role": "user", "content": content}], prompt=None,
                     max_tokens=max_tokens, stop=list(stop or []), tenant=tenant, stream=stream,
                     **sampling)
    served = await gw.serve(req, endpoint="chat", **kw)
    return Run(served, [item async for item in served.items])


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Another semcomm server with the tiny model: the upstream of model "up"."""
    cfg = server_config(tmp_path_factory.mktemp("up"), tenants=False, semantic=False,
                        pipelines={}, models={"tiny": {"path": "tiny", "max_batch": 4}})
    with live_server(cfg) as srv:
        yield srv


@pytest.fixture
def gateway(tmp_path: Path, upstream: LiveServer) -> Iterator[Gateway]:
    url = f"{upstream.url}/v1"
    gw = build_gateway(_config(tmp_path, extra_models={
        "up": {"kind": "upstream", "base_url": url, "upstream_model": "tiny"},
        "ups": {"kind": "upstream", "upstream_model": "tiny",
                "base_urls": [url, url.replace("127.0.0.1", "localhost")]},
        "multi": {"path": "tiny", "workers": 2, "max_batch": 2}}))
    asyncio.run(gw.startup())
    yield gw
    asyncio.run(gw.shutdown())


@pytest.fixture(scope="module")
def sem_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = build_gateway(_config(tmp_path_factory.mktemp("sem"), semantic=True, only_greedy=False))
    asyncio.run(gw.startup())
    yield gw
    asyncio.run(gw.shutdown())


# --- one stream contract ----------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny", "tiny-batch", "plain", "chain", "up", "ups", "multi"])
def test_deltas_join_to_the_final_text_with_stop_strings(gateway: Gateway, model: str) -> None:
    """Started -> Delta* -> Completion; deltas joined == final text == the non-streamed text."""
    prompt = "List the items: item-1 item-2 item-3"

    async def main() -> None:
        free = await _run(gateway, prompt, model=model, max_tokens=24, stream=False)
        text = free.final.text
        assert len(text) >= 8, text
        # a stop string that ends the answer mid-way, one the model never writes, and "\n\n\n"
        stops = [[text[4:7]], ["\u2603never\u2603"], ["\n\n\n"]]
        for stop in stops:
            cut = min((i for i in (text.find(s) for s in stop) if i != -1), default=len(text))
            plain = await _run(gateway, prompt, model=model, max_tokens=24, stop=stop,
                               stream=False)
            assert plain.final.text == text[:cut]
            # three at once: the batching models decode them in one batch
            runs = await asyncio.gather(*[_run(gateway, prompt, model=model, max_tokens=24,
                                               stop=stop) for _ in range(3)])
            for r in runs:
                assert isinstance(r.items[0], Started) and isinstance(r.final, Completion)
                assert all(isinstance(i, Delta) for i in r.items[1:-1])
                assert r.deltas == r.final.text == plain.final.text, (stop, r.deltas)

    asyncio.run(main())


def test_a_semantic_hit_streams_as_every_backend(sem_gateway: Gateway) -> None:
    async def main() -> None:
        first = await _run(sem_gateway, "Where is parcel 5120 now?", max_tokens=6)
        hit = await _run(sem_gateway, "Where is parcel 5120 now?", max_tokens=6)
        assert hit.hits == "semantic" and first.hits != "semantic"
        assert isinstance(hit.items[0], Started)
        assert hit.deltas == hit.final.text == first.final.text != ""

    asyncio.run(main())


# --- the semantic key -------------------------------------------------------------------------

@pytest.mark.parametrize(("query", "change", "hit"), [
    # the control: the same request hits
    ("How do I reset my account password?", {}, True),
    # another model never gets this model's answer
    ("Which plan includes priority phone support?", {"model": "tiny-batch"}, False),
    # a shorter answer is never served for another length
    ("Can I pay my invoice by bank transfer?", {"max_tokens": 5}, False),
    # nor an answer made without the stop string
    ("Why was my card charged twice this month?", {"stop": ["."]}, False),
    # nor another tenant's
    ("What is the warranty on the X200 router?", {"tenant": "beta"}, False),
    # nor a greedy answer for a sampled request
    ("How long does a refund to my card take?", {"temperature": 0.8, "seed": 1}, False),
])
def test_semantic_entries_are_served_only_where_they_were_made(
        sem_gateway: Gateway, query: str, change: dict[str, Any], hit: bool) -> None:

    async def main() -> None:
        stored = await _run(sem_gateway, query, max_tokens=6)
        assert stored.hits != "semantic"
        again = await _run(sem_gateway, query, **{"max_tokens": 6, **change})
        assert (again.hits == "semantic") is hit, (change, again.hits)

    asyncio.run(main())


# --- tenant context and isolation ------------------------------------------------------------

@pytest.mark.parametrize("detect", [False, True])
def test_an_isolated_request_reuses_no_kv(tmp_path: Path, detect: bool) -> None:
    """A request admission isolates (a flagged prober) neither reads nor writes shared KV."""
    probe = {"probe_detection": detect,
             "probe": {"near_dup_threshold": 2.0, "action": "isolate", "min_shared_tokens": 8,
                       "short_output_tokens": 0}}
    gw = build_gateway(_config(tmp_path, semantic=True, security=probe))

    async def main() -> None:
        await gw.startup()
        try:
            first = await _run(gw, LONG + " Summarise it.", max_tokens=4)
            assert first.started.hit_tokens == 0
            store = gw.kv_store
            assert store is not None
            entries = store.stats().entries
            # the same long prefix, the semantic cache bypassed: a KV prefix hit if not isolated
            second = await _run(gw, LONG + " Summarise all.", max_tokens=4, no_cache=True)
            third = await _run(gw, LONG + " Summarise it.", max_tokens=4)  # same as the first
            if detect:  # the second and third requests are isolated: no reuse of any kind
                assert second.started.hit_tokens == 0 and second.hits == "none"
                assert third.hits == "none" and third.started.hit_tokens == 0
                assert store.stats().entries == entries  # nothing written either
            else:
                assert second.started.hit_tokens >= 256
                assert third.hits == "semantic"
        finally:
            await gw.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("keep", [True, False], ids=["logits", "recompute"])
def test_a_whole_prompt_hit_restores_its_logits_unless_turned_off(tmp_path: Path,
                                                                  keep: bool) -> None:
    """``[kv] keep_logits``: a repeated prompt restores every token (no forward) by default,
    all but its last chunk with it off; the answer is the same either way."""
    gw = build_gateway(_config(tmp_path, kv={"tiers": ["memory"], "chunk_size": 32,
                                             "keep_logits": keep}))

    async def main() -> None:
        await gw.startup()
        try:
            cold = await _run(gw, LONG + " Summarise it.", max_tokens=4, no_cache=True)
            warm = await _run(gw, LONG + " Summarise it.", max_tokens=4, no_cache=True)
            n = warm.started.prompt_tokens
            assert cold.started.hit_tokens == 0
            assert warm.started.hit_tokens == (n if keep else (n - 1) // 32 * 32)
            assert warm.deltas == cold.deltas
        finally:
            await gw.shutdown()

    asyncio.run(main())
    with pytest.raises(ConfigError, match="keep_logits"):
        _config(tmp_path, kv={"tiers": ["memory"], "keep_logits": "sometimes"})


def test_in_process_workers_share_one_store_so_load_decides(gateway: Gateway) -> None:
    """Workers of one model restore prefixes from the same store: a request goes to the idle
    worker even though the busy one served its prefix; upstream replicas keep prefix affinity."""
    multi, ups = gateway.backends["multi"], gateway.backends["ups"]
    assert multi.router.policy.name == "least-loaded"  # type: ignore[attr-defined]
    assert ups.router.policy.name == "default"  # type: ignore[attr-defined]
    req = GenRequest(model="multi", messages=[{"role": "user", "content": LONG}], prompt=None,
                     max_tokens=4, stop=[], stream=False)
    keys, n = multi.keys(req)  # type: ignore[attr-defined]
    first = multi.router.route(keys=keys, num_tokens=n)  # type: ignore[attr-defined]
    second = multi.router.route(keys=keys, num_tokens=n)  # type: ignore[attr-defined]
    assert first.replica != second.replica  # the first is still in flight
    for d in (first, second):
        multi.router.complete(d)  # type: ignore[attr-defined]


def test_the_admitted_digest_reaches_the_kv_namespace(gateway: Gateway) -> None:
    async def main() -> None:
        await _run(gateway, "hello from acme", max_tokens=2)

    asyncio.run(main())
    runner: Any = gateway.backends["tiny"].runner  # type: ignore[attr-defined]
    digest = gateway.tenant_digest("acme")
    assert runner.engine("acme", digest).namespace.tenant == digest
    with pytest.raises(RuntimeError, match="differs from the admitted tenant digest"):
        runner.engine("acme", gateway.tenant_digest("beta"))
    assert gateway.admit(GenRequest(model="tiny", messages=None, prompt="x", max_tokens=1,
                                    tenant="acme")) == TenantContext("acme", digest, False)


def test_the_semantic_layer_refuses_a_context_it_would_scope_elsewhere(
        sem_gateway: Gateway) -> None:
    req = GenRequest(model="tiny", messages=[{"role": "user", "content": "hello?"}], prompt=None,
                     max_tokens=2, tenant="acme")
    wrong = TenantContext("acme", sem_gateway.tenant_digest("beta"), False)
    assert sem_gateway.semantic is not None
    with pytest.raises(TenantError):
        asyncio.run(sem_gateway.semantic.lookup(req, wrong))


# --- admission first --------------------------------------------------------------------------

class _CountingEmbedder:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name, self.dim = inner.name, inner.dim
        self.calls = 0

    def embed(self, texts: Any) -> np.ndarray:
        self.calls += 1
        return np.asarray(self.inner.embed(texts))


def test_a_rate_limited_request_costs_no_embedding(tmp_path: Path) -> None:
    from semcomm.routing import ModelRouter, ModelSpec

    router = ModelRouter([ModelSpec("tiny", 1.0), ModelSpec("plain", 1.0)])
    texts = ["my invoice is wrong", "refund my payment", "the server does not boot",
             "ssh connection refused"]
    router.fit(texts, np.array([[1, 0], [1, 0], [0, 1], [0, 1]]), budget=None)
    path = router.save(tmp_path / "router.json")
    gw = build_gateway(_config(tmp_path, security={"rate_limit_rps": 0.001, "rate_limit_burst": 1},
                         routing={"model_router": str(path), "default_model": "tiny"}))

    async def main() -> None:
        await gw.startup()
        try:
            auto: Any = gw.model_router
            counting = _CountingEmbedder(auto.router.embedder)
            auto.router._embedder = counting
            await _run(gw, "my invoice is wrong again", model="auto", max_tokens=2)
            spent = counting.calls
            assert spent > 0
            with pytest.raises(OverloadedError):
                await _run(gw, "the server does not boot", model="auto", max_tokens=2)
            assert counting.calls == spent
        finally:
            await gw.shutdown()

    asyncio.run(main())


# --- [security] is a strict section -----------------------------------------------------------

@pytest.mark.parametrize(("section", "key"), [
    ({"seal_at_rst": False}, "security.seal_at_rst"),
    ({"probe_detection": True, "probe": {"windw_s": 3}}, "security.probe.windw_s"),
    ({"rate_limit_rps": -1}, "security.rate_limit_rps"),
])
def test_security_typos_are_refused(tmp_path: Path, section: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _config(tmp_path, security=section)


def test_every_security_key_still_works(tmp_path: Path) -> None:
    cfg = _config(tmp_path, security={
        "seal_at_rest": False, "seal_secrets": "s" * 32, "probe_detection": True,
        "probe": {"near_dup_threshold": 3.0, "window_s": 10, "block_s": 5, "action": "isolate",
                  "exempt_tenants": ["beta"]},
        "rate_limit_rps": 5, "rate_limit_burst": 2})
    sec = cfg.security
    assert (sec.seal_at_rest, sec.seal_secrets, sec.rate_limit_burst) == (False, ["s" * 32], 2)
    gw = build_gateway(cfg)
    asyncio.run(gw.startup())
    try:
        guard: Any = gw.guard
        assert guard.detector.config.exempt_tenants == ("beta",)
        assert guard.detector.config.near_dup_threshold == 3.0
        assert guard.limiter is not None
    finally:
        asyncio.run(gw.shutdown())


# --- errors across process boundaries ---------------------------------------------------------

@pytest.mark.parametrize("exc", [
    InvalidInputError("the prompt has 5000 tokens; model 'tiny' accepts at most 4095"),
    OverloadedError("model 'tiny' has 64 queued requests", retry_after_s=3.0),
    TenantError("incorrect API key provided"),
])
def test_replica_errors_cross_as_the_same_typed_error(exc: Exception) -> None:
    from semcomm.server._ray import error_from_wire, error_to_wire

    back = error_from_wire(error_to_wire(exc, "tiny"))
    assert type(back) is type(exc) and str(back) == str(exc)
    if isinstance(exc, OverloadedError):
        assert back.retry_after_s == 3.0  # type: ignore[attr-defined]


def test_an_internal_replica_error_is_one_clean_line() -> None:
    from semcomm.server._ray import error_from_wire, error_to_wire

    try:
        raise KeyError("/secret/path/inside/the/replica.py")
    except KeyError as exc:
        back = error_from_wire(error_to_wire(exc, "tiny"))
    assert "secret" not in str(back) and "Traceback" not in str(back)
    assert "model 'tiny' failed inside its replica (KeyError)" in str(back)


def test_a_file_with_its_own_models_drops_the_embedded_default_model(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[models.target]\npath = "tiny"\n')
    cfg = load_config(p, environ={})
    assert list(cfg.models) == ["target"] and cfg.routing.default_model is None
    p.write_text('[models.target]\npath = "tiny"\n[routing]\ndefault_model = "target"\n')
    assert load_config(p, environ={}).routing.default_model == "target"


# --- one split of a chat into query and context -----------------------------------------------

SYS = {"role": "system", "content": "You are the support desk."}
Q1 = {"role": "user", "content": "Where is parcel 7?"}
A1 = {"role": "assistant", "content": "In Lyon."}
Q2 = {"role": "user", "content": "And parcel 9?"}
EMPTY = {"role": "user", "content": "  "}


@pytest.mark.parametrize(("messages", "query", "context"), [
    ([SYS, Q1], "Where is parcel 7?", [SYS]),
    ([SYS, Q1, A1, Q2], "And parcel 9?", [SYS, Q1, A1]),
    ([SYS, Q1, EMPTY], "Where is parcel 7?", [SYS, EMPTY]),  # an empty turn is no query
    ([SYS, Q2, A1], "And parcel 9?", [SYS, A1]),  # an assistant prefill changes the answer
    ([SYS, A1], None, [SYS, A1]),  # nothing to key on: not cached
])
def test_the_gateway_and_every_integration_split_a_chat_alike(
        messages: list[dict[str, str]], query: str | None, context: list[dict[str, str]]
        ) -> None:
    from semcomm.integrations.openai import request_key
    from semcomm.server._semantic_layer import _split

    req = GenRequest(model="tiny", messages=messages, prompt=None, max_tokens=4)
    assert _split(req) == (query or "", context)
    q, ctx, _ = request_key({"model": "gpt", "messages": messages})
    assert (q, ctx) == (query, context)
    lc = pytest.importorskip("semcomm.integrations.langchain")
    from langchain_core.load import dumps
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    prompt = dumps([kinds[m["role"]](content=m["content"]) for m in messages])
    if query is not None:
        assert lc.parse_prompt(prompt) == (query, context)
    li = pytest.importorskip("semcomm.integrations.llamaindex")
    from llama_index.core.llms import ChatMessage

    chat = [ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    assert li.SemcommLLM._chat_key(chat) == (query, context)


# --- prepared once, one contract, one deadline ----------------------------------------------

class _Counting:
    """Counts the tokenizer's renderings and the chunk-key hashes of what runs inside it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> None:
        import semcomm.kv._keys as keys_mod

        self.renders = self.hashes = 0
        real_hash = keys_mod.chunk_key
        real_render = type(tokenizer).apply_chat_template

        def chunk_key(parent: bytes, tokens: Any) -> Any:
            self.hashes += 1
            return real_hash(parent, tokens)

        def render(tok: Any, *a: Any, **kw: Any) -> Any:
            self.renders += 1
            return real_render(tok, *a, **kw)

        monkeypatch.setattr(keys_mod, "chunk_key", chunk_key)
        monkeypatch.setattr(type(tokenizer), "apply_chat_template", render)


@pytest.mark.parametrize("model", ["tiny", "multi"])
def test_a_request_is_rendered_and_hashed_once(gateway: Gateway, model: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway prepares a request once (tokens and chunk keys); the replica router and the
    engine use them as they are: one rendering and one hash per chunk, streamed or not."""
    backend: Any = gateway.backends[model]
    worker = backend.workers[0] if model == "multi" else backend
    count = _Counting(monkeypatch, worker.tokenizer)
    chunks = 0
    for stream in (False, True):
        count.renders = count.hashes = 0
        run = asyncio.run(_run(gateway, LONG + f" stream={stream}", model=model, max_tokens=2,
                               stream=stream))
        chunks = -(-run.final.prompt_tokens // 32)
        assert (count.renders, count.hashes) == (1, chunks), (stream, count.__dict__)
    assert chunks > 4


class _Scripted:
    """A backend that plays a fixed script of events (failures no real model produces)."""

    kind = "upstream"
    kv_reuse = False
    max_positions = None

    def __init__(self, name: str, script: list[Any], pause_s: float = 0.0) -> None:
        self.name, self.script, self.pause_s = name, script, pause_s

    def prepare(self, req: GenRequest) -> None:
        return None

    def status(self) -> Any:
        from semcomm.server import BackendStatus

        return BackendStatus(up=True)

    async def stream(self, req: GenRequest) -> Any:
        for item in self.script:
            yield item
            if isinstance(item, Started):
                await asyncio.sleep(self.pause_s)

    async def aclose(self) -> None:
        return None


def _scripted_gateway(tmp: Path, backend: _Scripted, **server: Any) -> Gateway:
    cfg = _config(tmp, server={"state_dir": str(tmp), "max_tokens_limit": 64, **server})
    return Gateway(cfg, backends={backend.name: backend})


def test_a_backend_that_drops_its_last_piece_fails_the_stream(tmp_path: Path) -> None:
    """The gateway never patches a stream: pieces that do not join to the answer are a 502,
    streamed (an error event) or not."""
    from semcomm.errors import UpstreamError

    lossy = _Scripted("lossy", [Started(prompt_tokens=3, hit_tokens=0), Delta("Hello, "),
                                Completion(text="Hello, world", finish_reason="stop",
                                           prompt_tokens=3, completion_tokens=2)])
    gw = _scripted_gateway(tmp_path, lossy)
    with pytest.raises(UpstreamError, match="stream contract") as err:
        asyncio.run(_run(gw, "hi", model="lossy", tenant=None))
    assert err.value.status == 502
    whole = _Scripted("whole", [Started(prompt_tokens=3, hit_tokens=0), *lossy.script[1:2],
                                Delta("world"), lossy.script[2]])
    gw = _scripted_gateway(tmp_path, whole)
    assert asyncio.run(_run(gw, "hi", model="whole", tenant=None)).deltas == "Hello, world"


def test_the_request_timeout_covers_the_whole_request(tmp_path: Path) -> None:
    """``server.request_timeout_s`` bounds the whole request: a backend that starts at once and
    then stalls is a 504, streamed or not (it used to cover only the first event)."""
    import httpx

    from semcomm.server import create_app

    stall = _Scripted("stall", [Started(prompt_tokens=3, hit_tokens=0), Delta("late"),
                                Completion(text="late", finish_reason="stop", prompt_tokens=3,
                                           completion_tokens=1)], pause_s=30)
    app = create_app(gateway=_scripted_gateway(tmp_path, stall, request_timeout_s=0.5))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=20,
                                     headers={"Authorization": "Bearer k-acme"}) as c:
            body = {"model": "stall", "messages": [{"role": "user", "content": "hi"}]}
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
            r = await c.post("/v1/chat/completions", json={**body, "stream": True})
            assert r.status_code == 200 and '"code":"timeout"' in r.text, r.text
            assert "[DONE]" not in r.text
            assert loop.time() - t0 < 5  # two half-second deadlines, not the 30 s stall

    asyncio.run(main())
