"""Model backends: the narrow protocol the gateway serves every model through.

A :class:`ModelBackend` turns a :class:`GenRequest` into a stream of ``Started``, ``Delta``
pieces and one final ``Completion`` (``semcomm.runtime``'s one result type; :func:`collect`
drains a stream). Three kinds:

* :class:`LocalBackend`: an in-process HF model behind a ``semcomm.runtime.BatchingWorker``
  (KV prefix reuse when the runner is an engine runner, plain batched decoding otherwise);
* ``UpstreamBackend`` (in ``_upstream``): any OpenAI-compatible server (vLLM, Ollama, a cloud
  API, another semcomm), over httpx with timeouts and retries only where a retry cannot
  duplicate output;
* ``PipelineBackend`` (in ``_pipeline``): a chain of stages served as one virtual model.

A request is prepared once (``ModelBackend.prepare``: rendered, tokenized and its chunk keys
hashed, off the event loop) and carries the result in ``GenRequest.prepared``; nothing
downstream renders, tokenizes or hashes it again. Failure injection for tests
(``fail_mode``) is ``_faults.FaultyBackend``.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import InvalidInputError, OverloadedError, UpstreamError
from ..kv import ChunkKey
from ..runtime import (
    BatchingWorker,
    Completion,
    Event,
    Failed,
    Job,
    KVAccountant,
    Runner,
    StreamItem,
)
from ..security import TenantContext

__all__ = [
    "BackendStatus",
    "Completion",
    "GenRequest",
    "LocalBackend",
    "ModelBackend",
    "ModelState",
    "PreparedPrompt",
    "Residency",
    "StreamItem",
    "collect",
    "messages_text",
    "render_prompt",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PreparedPrompt:
    """A request's prompt on one in-process model: rendered and tokenized once."""

    ids: list[int]  # the prompt's tokens (chat template applied)
    keys: list[ChunkKey] | None = None  # chunk keys in the tenant's KV namespace (None: the
    # model reuses no KV for this request, or its weights are unloaded: the engine hashes)
    kv_tokens: int = 0  # tokens of KV the request reserves: prompt + max_tokens (capped)
    segments: Any = None  # with documents: the engine's SegmentedPrompt (its ids are ``ids``)


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a chat with documents: a message's content part, in order."""

    role: str  # "system" | "user" | "assistant"
    text: str
    document: bool = False  # a passage whose KV is reused at any position (docs/rag.md)


@dataclass(slots=True)
class GenRequest:
    """One normalized generation request (chat or plain completion).

    After admission it carries the tenant context (``ctx``) and, once prepared, the prompt's
    tokens and chunk keys per in-process model (``prepared``, by model name), which the
    replica router and the engine use as they are."""

    model: str  # the name the client asked for
    messages: list[dict[str, str]] | None  # chat: [{"role", "content"}], content flattened to text
    prompt: str | None  # completion: the raw prompt
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    tenant: str | None = None  # configured tenant id from the API key; never from the body
    request_id: str = ""
    snapshot: Any = None  # KV snapshot to continue from (pipeline handoff on one model)
    stream: bool = True  # the client reads a stream (upstreams then stream too)
    ctx: TenantContext | None = None  # set by admission; None only outside the gateway
    prepared: dict[str, PreparedPrompt] = field(default_factory=dict)
    # a chat whose content parts mark documents (None: none marked): an in-process model with
    # KV reuse reuses their KV at any position; everything else reads ``messages``
    documents: list[Piece] | None = None
    selector: str | None = None  # with documents: which tokens are recomputed (engine default)
    recompute: float | None = None  # with documents: the share recomputed (engine default)
    margin: float | None = None  # with documents: below it, full prefill (None: no test)
    watch: float | None = None  # with documents: below it at a later step, KV rebuilt in full

    @property
    def tenant_ctx(self) -> TenantContext:
        """The admitted tenant context (a public one for requests built outside the gateway)."""
        if self.ctx is not None:
            return self.ctx
        return TenantContext.public() if self.tenant is None else TenantContext(
            self.tenant, "", False)

    @property
    def text(self) -> str:
        """The request's text: the prompt, or the messages as :func:`messages_text`."""
        return self.prompt or "" if self.messages is None else messages_text(self.messages)


@dataclass(slots=True)
class BackendStatus:
    up: bool
    detail: str = ""
    queue_depth: int = 0
    in_flight: int = 0


@runtime_checkable
class ModelBackend(Protocol):
    """What the gateway needs from a model: preparation, a stream of results, a status, a
    close."""

    name: str
    kind: str  # "hf" | "upstream" | "pipeline"

    @property
    def kv_reuse(self) -> bool:
        """Requests restore and store KV prefixes (a same-model handoff can too)."""
        ...

    @property
    def max_positions(self) -> int | None:
        """The context in tokens, where semcomm knows it."""
        ...

    def prepare(self, req: GenRequest) -> PreparedPrompt | None:
        """Render and tokenize ``req`` for this model once (blocking: callers on the event loop
        run it in a thread) and keep it in ``req.prepared``; 400 for a prompt that cannot fit.
        None for a model whose tokenizer semcomm does not hold (upstreams, pipelines)."""
        ...

    def stream(self, req: GenRequest) -> AsyncIterator[StreamItem]: ...

    def status(self) -> BackendStatus: ...

    async def aclose(self) -> None: ...


async def collect(items: AsyncIterator[StreamItem]) -> Completion:
    """Drain a backend stream and return its final ``Completion``: the one way to drain."""
    final: Completion | None = None
    async for item in items:
        if isinstance(item, Completion):
            final = item
    if final is None:
        raise UpstreamError("the backend ended without a result", status=502)
    return final


def messages_text(messages: Sequence[dict[str, str]]) -> str:
    """Chat messages as plain text (``role: content`` lines), for a model without a chat
    template and for the replica router's keys on upstreams: the one way to flatten them."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def prompt_chars(req: GenRequest) -> int:
    """Characters of the request's text (every message's content, or the prompt)."""
    if req.messages is not None:
        return sum(len(m["content"]) for m in req.messages)
    return len(req.prompt or "")


def longest_token_chars(tokenizer: Any) -> int | None:
    """Characters of the tokenizer's longest vocabulary entry (None: unknown). A text of more
    than ``positions x`` this many characters cannot fit ``positions`` tokens, so it can be
    refused before it is tokenized (a byte-level entry spells each byte as one character, so
    this never undercounts)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return None
    return max((len(t) for t in vocab), default=0) or None


def render_prompt(tokenizer: Any, req: GenRequest) -> list[int]:
    """Token ids of the request's prompt: the chat template for messages, plain text otherwise."""
    if req.messages is not None:
        if getattr(tokenizer, "chat_template", None):
            out = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                tokenize=True)
            ids = out["input_ids"] if hasattr(out, "keys") else out
            return [int(i) for i in ids]
        text = messages_text(req.messages) + "assistant:"
    else:
        text = req.prompt or ""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


class ModelState(enum.Enum):
    """Where an in-process model's weights are: LOADED -> UNLOADED (idle past keep-alive) ->
    LOADING (a request arrived) -> LOADED. Only :class:`LocalBackend` changes it."""

    LOADED = "loaded"
    UNLOADED = "unloaded"
    LOADING = "loading"


@dataclass(slots=True)
class Residency:
    """Keep-alive bookkeeping of one :class:`LocalBackend` (changed under its state lock)."""

    state: ModelState = ModelState.LOADED
    unloads: int = 0  # times the idle weights were dropped
    reloads: int = 0  # times a request brought them back
    reload_s_total: float = 0.0  # wall seconds spent reloading, all reloads together
    last_reload_s: float = 0.0  # the latest reload's wall seconds
    idle_since: float | None = None  # monotonic time the last request ended (None: busy)

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "loaded": self.state is ModelState.LOADED,
                "unloads": self.unloads, "reloads": self.reloads,
                "reload_s_total": round(self.reload_s_total, 4),
                "last_reload_s": round(self.last_reload_s, 4)}


class LocalBackend:
    """An in-process model: requests become :class:`Job` s on a :class:`BatchingWorker`.

    Keep-alive (``keep_alive_s`` with a ``reload`` factory): once no request has run for
    ``keep_alive_s`` seconds the worker is closed and the model object dropped (its weights
    freed; the KV chunks it stored stay in the shared store), and the next request waits while
    ``reload()`` builds a fresh worker over a freshly loaded model. The tokenizer is kept (a
    request can be rendered and admitted without the weights). Reload time is counted in
    :attr:`residency`. Without ``reload`` the model stays loaded.
    """

    kind = "hf"

    def __init__(self, name: str, worker: BatchingWorker, *, kv_reuse: bool = False,
                 reload: Callable[[], BatchingWorker] | None = None,
                 keep_alive_s: float | None = None, memory: KVAccountant | None = None,
                 worker_name: str | None = None) -> None:
        self.name = name
        self._worker: BatchingWorker | None = worker
        self.worker_name = worker_name or worker.name  # "<model>/worker-<i>" of several
        self.tokenizer = worker.runner.tokenizer
        self.model_id = worker.runner.model_id
        self.max_positions = int(worker.runner.max_positions)
        # the longest text that could fit the context: longer ones are refused untokenized
        longest = longest_token_chars(self.tokenizer)
        self.max_prompt_chars = self.max_positions * longest if longest else None
        self.kv_reuse = kv_reuse  # the runner restores cached KV prefixes
        self.memory = memory  # the process's KV admission; None admits every request
        self._reload = reload
        self.keep_alive_s = keep_alive_s if reload is not None else None
        self.residency = Residency()
        self._state_lock = threading.Lock()  # guards _worker, _active, _timer, residency
        self._load_lock = threading.Lock()  # one reload at a time
        self._active = 0  # requests between acquire and release
        self._timer: threading.Timer | None = None
        self._past_namespaces: set[bytes] = set()  # KV namespaces of unloaded runners
        self._closed = False
        self._arm_timer()

    # --- residency ------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self._worker is not None

    @property
    def worker(self) -> BatchingWorker:
        """The batching worker, reloading the model first if keep-alive dropped it."""
        w = self._worker
        return w if w is not None else self._load()

    @property
    def runner(self) -> Runner:
        """The runner (it holds the model), reloading the model first if it was dropped."""
        return self.worker.runner

    @property
    def loaded_runner(self) -> Runner | None:
        """The runner when the model is loaded, None when keep-alive dropped it (no reload)."""
        w = self._worker
        return None if w is None else w.runner

    def namespaces(self) -> set[bytes]:
        """KV namespace digests this model has stored under, loaded or not."""
        out = set(self._past_namespaces)
        runner = self.loaded_runner
        if runner is not None:
            out.update(runner.namespaces())
        return out

    def _load(self) -> BatchingWorker:
        with self._load_lock:
            w = self._worker
            if w is not None:
                return w
            if self._reload is None or self._closed:
                raise OverloadedError(f"model {self.name!r} is shutting down", retry_after_s=5)
            with self._state_lock:
                self.residency.state = ModelState.LOADING
            t0 = time.perf_counter()
            try:
                w = self._reload()
            except BaseException:
                with self._state_lock:
                    self.residency.state = ModelState.UNLOADED
                raise
            dt = time.perf_counter() - t0
            with self._state_lock:
                self._worker = w
                r = self.residency
                r.state, r.reloads, r.last_reload_s = ModelState.LOADED, r.reloads + 1, dt
                r.reload_s_total += dt
            log.info("model %s reloaded in %.2f s", self.name, dt)
            return w

    def _acquire(self) -> BatchingWorker | None:
        with self._state_lock:
            self._active += 1
            self.residency.idle_since = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return self._worker

    async def _acquire_loaded(self) -> BatchingWorker:
        w = self._acquire()
        if w is None:
            try:
                w = await asyncio.to_thread(self._load)
            except BaseException:
                self._release()
                raise
        return w

    def _release(self) -> None:
        with self._state_lock:
            self._active -= 1
            assert self._active >= 0, "release without acquire"
            if self._active == 0:
                self.residency.idle_since = time.monotonic()
                self._arm_timer_locked()

    def _arm_timer(self) -> None:
        with self._state_lock:
            self._arm_timer_locked()

    def _arm_timer_locked(self) -> None:
        if self.keep_alive_s is None or self._closed or self._worker is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(self.keep_alive_s, self.unload_if_idle)
        self._timer.daemon = True
        self._timer.start()

    def unload_if_idle(self) -> bool:
        """Drop the model now if no request is running (what the keep-alive timer calls).

        Returns True when the weights were dropped. Nothing happens without a ``reload``
        factory (the model could not come back)."""
        if self._reload is None:
            return False
        with self._load_lock, self._state_lock:
            if self._active or self._worker is None:
                return False
            worker, self._worker = self._worker, None
            self._timer = None
            self._past_namespaces.update(worker.runner.namespaces())
            self.residency.state = ModelState.UNLOADED
            self.residency.unloads += 1
        worker.close()  # its thread is idle: no job is queued or running
        del worker
        gc.collect()  # the model, its engines and their caches hold each other
        log.info("model %s unloaded after %.0f s idle", self.name, self.keep_alive_s or 0)
        return True

    def status(self) -> BackendStatus:
        w = self._worker
        if w is None:
            return BackendStatus(up=True, detail=f"in-process {self.model_id} (unloaded: idle "
                                 "past keep_alive_s, reloads on the next request)")
        return BackendStatus(up=True, detail=f"in-process {self.model_id}",
                             queue_depth=w.queue_depth, in_flight=w.in_flight)

    def prompt_ids(self, req: GenRequest) -> list[int]:
        """The request's prompt tokens, or a 400 when it cannot fit the model's context: by its
        length in characters first (nothing tokenized), then by its tokens. Tokenizing a long
        prompt takes a while: callers on the event loop run this in a thread."""
        self.check_prompt_chars(req)
        return self._check_length(req, render_prompt(self.tokenizer, req))

    def _check_length(self, req: GenRequest, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidInputError("the prompt is empty after rendering")
        limit = self.max_positions
        if len(ids) + 1 > limit:
            e = InvalidInputError(
                f"the prompt has {len(ids)} tokens; model {self.name!r} accepts at most "
                f"{limit - 1} prompt tokens"
            )
            e.param = "prompt" if req.messages is None else "messages"  # type: ignore[attr-defined]
            raise e
        return ids

    def check_prompt_chars(self, req: GenRequest) -> None:
        """400 when the request's text is longer than any prompt the context holds could be
        (no tokenizer runs: the gateway calls this before the semantic lookup)."""
        chars = prompt_chars(req)
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            e = InvalidInputError(
                f"the prompt has {chars:,} characters; model {self.name!r} accepts at most "
                f"{self.max_positions - 1:,} prompt tokens, which no text over "
                f"{self.max_prompt_chars:,} characters fits")
            e.param = "prompt" if req.messages is None else "messages"  # type: ignore[attr-defined]
            raise e

    def kv_headroom(self) -> int | None:
        """KV bytes this worker may still reserve (None: no memory plan)."""
        if self.memory is None:
            return None
        return int(self.memory.worker_headroom(self.name, self.worker_name))

    def prepare(self, req: GenRequest) -> PreparedPrompt:
        """The request's prompt on this model (kept in ``req.prepared``): tokens, and chunk keys
        when the loaded runner reuses KV (an unloaded model is not brought back for them)."""
        prep = req.prepared.get(self.name)
        if prep is None:
            segments = None
            if (req.documents is not None and self.kv_reuse and not req.tenant_ctx.isolate
                    and self._moves_documents()):
                segments = self._segments(req)
                ids = self._check_length(req, list(segments.ids))
                keys = None  # documents are keyed by their own tokens, in the engine
            else:
                ids = self.prompt_ids(req)
                runner = self.loaded_runner if self.kv_reuse else None
                keys = runner.keys(ids, req.tenant_ctx) if runner is not None else None
            n = len(ids)
            prep = req.prepared[self.name] = PreparedPrompt(
                ids, keys, kv_tokens=n + min(req.max_tokens, self.max_positions - n),
                segments=segments)
        return prep

    def _moves_documents(self) -> bool:
        """Whether this model's documents can be reused at another position (not for ALiBi,
        learned absolute positions, ...: then a chat with documents is served as plain text,
        every token computed, never a wrong position)."""
        from ..errors import UnsupportedModelError

        runner = self.loaded_runner
        engine = runner.engine(None) if runner is not None else None
        if engine is None:
            return False
        try:
            engine.documents()
        except UnsupportedModelError as exc:
            log.info("model %s serves documents as plain text: %s", self.name, exc)
            return False
        return True

    def _segments(self, req: GenRequest) -> Any:
        """The engine's prompt with documents: system, user and assistant pieces in order,
        each marked passage a ``Document`` (tokenized alone, its KV reused where it lands)."""
        from ..engine import Assistant, Document, System, User, build_prompt

        self.check_prompt_chars(req)
        kinds = {"system": System, "assistant": Assistant}
        segs = [Document(p.text) if p.document else kinds.get(p.role, User)(p.text)
                for p in req.documents or () if p.text]
        return build_prompt(self.tokenizer, segs)

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        worker = await self._acquire_loaded()
        try:
            async for item in self._stream(worker, req):
                yield item
        finally:
            self._release()

    async def _stream(self, worker: BatchingWorker, req: GenRequest) -> AsyncIterator[StreamItem]:
        worker.arriving(1)
        try:
            prep = req.prepared.get(self.name)
            if prep is None:  # a request built without the gateway (a pipeline stage)
                prep = await asyncio.to_thread(self.prepare, req)  # tokenizing: off the loop
        except BaseException:
            worker.arriving(-1)
            raise
        ids = prep.ids
        max_new = prep.kv_tokens - len(ids)
        reservation = None
        memory = self.memory
        if memory is not None:  # KV headroom for prompt + max_tokens, or wait, or 429
            try:
                reservation = await asyncio.to_thread(memory.reserve, self.name,
                                                      prep.kv_tokens, worker=self.worker_name)
            except BaseException:
                worker.arriving(-1)
                raise
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        def emit(event: Event) -> None:  # the engine thread hands each event to the loop
            loop.call_soon_threadsafe(queue.put_nowait, event)

        ctx = req.tenant_ctx
        job = Job(prompt_ids=ids, max_new_tokens=max_new, temperature=req.temperature,
                  top_p=req.top_p, seed=req.seed, stop=list(req.stop), tenant=ctx.tenant,
                  emit=emit,
                  snapshot=req.snapshot, digest=ctx.digest or None, isolate=ctx.isolate,
                  keys=prep.keys, segments=prep.segments, selector=req.selector,
                  recompute=req.recompute, margin=req.margin, watch=req.watch)
        try:
            worker.submit(job)  # OverloadedError when the queue is full
        except BaseException:
            if memory is not None and reservation is not None:
                memory.release(reservation)
            raise
        finally:
            worker.arriving(-1)
        done = False
        try:
            while True:
                event = await queue.get()
                if isinstance(event, Failed):
                    done = True
                    raise event.error
                if isinstance(event, Completion):
                    done = True
                    event.meta = {"model": self.name, "engine": self.model_id, **event.meta}
                    yield event
                    return
                yield event
        finally:
            if not done:
                job.cancelled.set()
            if memory is not None and reservation is not None:
                memory.release(reservation)

    async def aclose(self) -> None:
        with self._state_lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            w = self._worker
        if w is not None:
            await asyncio.to_thread(w.close)
