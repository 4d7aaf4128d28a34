"""The server's runners: each turns a batch of queued jobs into one ``semcomm.engine`` call.

* :class:`EngineRunner` serves a model through per-tenant ``semcomm.engine.HFEngine`` s (each
  has its own salted KV namespace), all sharing one model and one store: KV prefix reuse.
* :class:`DirectRunner` serves a model the engine does not support, without KV reuse.
* :class:`PrefillScheduler` (one per process and setting, :func:`prefill_scheduler`) runs every
  engine prefill's forward: a long one (more uncached tokens than ``long_tokens``) is cut into
  pieces ending at KV chunk boundaries and each piece needs one of ``slots`` shared by every
  model in the process, so long prefills never take every core from the short requests; short
  prefills and decode steps never wait for it.

Both hand the batch to one ``semcomm.engine.BatchDecoder`` (the one decode loop: sampling,
detokenizing, stop strings, batching; a batch of one with an engine is exactly
``HFEngine.generate``, docs/architecture.md, invariant 2) and turn its callbacks and results
into the worker's events. Neither touches KV tensors nor the transformers cache API.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..engine import BatchDecoder, BatchRequest, BatchResult, GenerationStats, SamplingParams
from ._batching import Delta, Event, Finished, GenOutput, Job, Started

__all__ = ["DirectRunner", "EngineRunner", "PrefillScheduler", "engine_runner",
           "prefill_scheduler"]

log = logging.getLogger(__name__)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class PrefillScheduler:
    """Bounds how many long prefills run at once across every model of the process.

    A prefill whose uncached part (the tokens its forward computes) is longer than
    ``long_tokens`` is long: it runs as pieces of about ``piece_tokens`` (cut at multiples of
    the engine's KV chunk size, so the cache holds the same positions at each cut as after a
    prefix hit; logits bit-identical to one forward, tests/test_server_prefill_sched.py; an
    engine with sliding-window layers passes ``align=0``: one piece, whose float results
    would change if cut), and each piece holds one of ``slots``. Pieces wait in arrival order; a
    waiting long prefill resumes between another's pieces, so two long prompts take turns.
    While short prefills are running and every core is taken (``cores``), the next piece
    waits for them, at most ``yield_s``. With ``nice > 0`` the pieces compute on ``slots``
    threads of this scheduler running at that niceness (Linux: per thread), so the OS gives a
    core to a runnable short request or decode step first and to the long prefill when one is
    idle. Short prefills never wait; decode steps do not pass through here. Thread-safe;
    ``stats()`` is what ``/health`` and ``/metrics`` show.
    """

    def __init__(self, *, slots: int, long_tokens: int, piece_tokens: int,
                 cores: int | None = None, yield_s: float = 0.5, nice: int = 0) -> None:
        if slots < 1 or long_tokens < 1 or piece_tokens < 1:
            raise ValueError("slots, long_tokens and piece_tokens must be >= 1")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in [0, 19], got {nice}")
        self.nice = nice
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.nice_applied = False
        self.slots = slots
        self.long_tokens = long_tokens
        self.piece_tokens = piece_tokens
        self.cores = cores if cores is not None else _cores()
        self.yield_s = yield_s
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()
        self._running = 0  # long pieces running now
        self._shorts = 0  # short prefills running now
        self.peak_running = 0
        self.long_prefills = 0
        self.short_prefills = 0
        self.pieces = 0
        self.waits = 0  # pieces that could not start at once
        self.wait_s = 0.0

    def cuts(self, start: int, n: int, align: int) -> list[tuple[int, int]]:
        """The pieces ``[a, b)`` (offsets into the ``n`` new tokens) of a long prefill whose
        cache holds ``start`` positions: every cut at an absolute position that is a multiple
        of ``align`` rounded up from ``piece_tokens``."""
        step = max(1, align) * max(1, -(-self.piece_tokens // max(1, align)))
        out, a = [], 0
        while a < n:
            b = min(n, ((start + a) // step + 1) * step - start)
            out.append((a, b))
            a = b
        return out

    @contextmanager
    def _short(self) -> Iterator[None]:
        with self._cond:
            self._shorts += 1
            self.short_prefills += 1
        try:
            yield
        finally:
            with self._cond:
                self._shorts -= 1
                self._cond.notify_all()

    @contextmanager
    def _slot(self) -> Iterator[None]:
        me = object()
        t0 = time.perf_counter()
        yield_until = t0 + self.yield_s
        with self._cond:
            self._queue.append(me)
            waited = False
            while True:
                now = time.perf_counter()
                busy = (self._shorts > 0 and self._shorts + self._running >= self.cores
                        and now < yield_until)
                if self._queue[0] is me and self._running < self.slots and not busy:
                    break
                waited = True
                self._cond.wait(max(0.001, yield_until - now) if busy else None)
            self._queue.popleft()
            self._running += 1
            self.peak_running = max(self.peak_running, self._running)
            self.pieces += 1
            if waited:
                self.waits += 1
                self.wait_s += time.perf_counter() - t0
            self._cond.notify_all()  # the next in line may take another free slot
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def run(self, runner: Any, ids: Any, cache: Any, *, align: int) -> Any:
        """``runner.forward(ids, cache)`` (``ids`` ``[1, n]``), long ones piece by piece."""
        n = int(ids.shape[1])
        if n <= self.long_tokens:
            with self._short():
                return runner.forward(ids, cache)
        with self._cond:
            self.long_prefills += 1
        logits = None
        pieces = self.cuts(int(cache.get_seq_length()), n, align) if align > 0 else [(0, n)]
        pool = self._executor()
        for a, b in pieces:
            with self._slot():
                if pool is None:
                    logits = runner.forward(ids[:, a:b], cache)
                else:  # the caller waits; the piece computes on a lower-priority thread
                    logits = pool.submit(_forward_no_grad, runner, ids[:, a:b], cache).result()
        return logits

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor | None:
        if self.nice == 0:
            return None
        with self._cond:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.slots, thread_name_prefix="semcomm-long-prefill",
                    initializer=self._lower_priority)
            return self._pool

    def _lower_priority(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            self.nice_applied = True
        except (AttributeError, OSError) as exc:  # not Linux: the pieces run at normal priority
            log.warning("long prefills run at normal priority (%s)", exc)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"slots": self.slots, "long_tokens": self.long_tokens,
                    "piece_tokens": self.piece_tokens, "cores": self.cores,
                    "nice": self.nice, "nice_applied": self.nice_applied,
                    "running": self._running, "waiting": len(self._queue),
                    "peak_running": self.peak_running, "long_prefills": self.long_prefills,
                    "short_prefills": self.short_prefills, "pieces": self.pieces,
                    "waits": self.waits, "wait_s": round(self.wait_s, 6)}


def _forward_no_grad(runner: Any, ids: Any, cache: Any) -> Any:
    import torch

    with torch.no_grad():  # grad mode is per thread: the engine's caller set it on its own
        return runner.forward(ids, cache)


_SCHEDULERS: dict[tuple[int, int, int, int], PrefillScheduler] = {}
_SCHEDULERS_LOCK = threading.Lock()


def prefill_scheduler(slots: int | None, long_tokens: int, piece_tokens: int,
                      nice: int = 0) -> PrefillScheduler | None:
    """The process's scheduler for these settings (None when ``slots == 0``: off).

    ``slots=None`` means ``max(1, cores - 1)``. Every gateway in a process with the same
    settings shares one scheduler: the cores are the process's, whatever serves the model.
    """
    if slots == 0:
        return None
    n = slots if slots is not None else max(1, _cores() - 1)
    key = (n, long_tokens, piece_tokens, nice)
    with _SCHEDULERS_LOCK:
        sched = _SCHEDULERS.get(key)
        if sched is None:
            sched = _SCHEDULERS[key] = PrefillScheduler(slots=n, long_tokens=long_tokens,
                                                        piece_tokens=piece_tokens, nice=nice)
        return sched


def engine_runner(model: Any, tokenizer: Any, *, model_id: str, store: Any, salter: Any,
                  chunk_size: int | None, codec: str | None,
                  scheduler: PrefillScheduler | None = None) -> tuple[Any, str]:
    """Return ``(runner, note)``; ``runner`` is None when the engine cannot serve this model."""
    try:
        from ..engine import DEFAULT_CHUNK_SIZE, HFEngine
    except ImportError as exc:
        return None, f"semcomm.engine.HFEngine unavailable ({exc}); plain batched decoding"
    try:
        runner = EngineRunner(HFEngine, model, tokenizer, model_id=model_id, store=store,
                              salter=salter, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                              codec=codec or "lossless", scheduler=scheduler)
    except Exception as exc:  # unsupported model family etc.: serve it plainly, say why
        log.warning("model %s served without KV reuse: %s", model_id, exc)
        return None, f"HFEngine refused the model ({exc}); plain batched decoding"
    return runner, (f"HFEngine: KV prefix reuse, chunk {runner.chunk_size}, codec "
                    f"{runner.codec}, store {getattr(store, 'name', type(store).__name__)}")


def _kv_extra(st: GenerationStats) -> dict[str, Any]:
    """The engine's per-request KV statistics, as reported in ``GenOutput.extra["kv"]``."""
    return {"hit_tokens": st.hit_tokens, "tier": st.tier,
            "bytes_loaded": st.bytes_loaded, "bytes_stored": st.bytes_stored,
            "load_ms": round(st.load_ms, 3), "prefill_ms": round(st.prefill_ms, 3)}


def _request(job: Job, engine: Any = None) -> BatchRequest:
    """The engine's request for ``job``: its events go to ``job.emit``."""
    def started(st: GenerationStats) -> None:
        # at least one token is always recomputed (docs/architecture.md, invariant 3)
        hit = min(st.hit_tokens, len(job.prompt_ids) - 1)
        job.emit(Started(prompt_tokens=st.prompt_tokens, hit_tokens=hit, hit_tiers=st.hit_tiers))

    def text(piece: str) -> None:
        job.emit(Delta(piece))

    return BatchRequest(
        prompt_ids=list(job.prompt_ids), max_new_tokens=job.max_new_tokens,
        params=SamplingParams(temperature=job.temperature, top_p=job.top_p, seed=job.seed),
        stop=tuple(job.stop), engine=engine, snapshot=job.snapshot, on_start=started,
        on_text=text, cancelled=job.cancelled.is_set)


def _finished(res: BatchResult, *, kv: bool) -> Event | None:
    """The ``Finished`` event of a result (None for a cancelled job: nobody listens)."""
    if res.finish_reason == "cancelled":
        return None
    st = res.stats
    extra: dict[str, Any] = {"kv": _kv_extra(st)} if kv else {}
    if res.batch > 1 and kv:
        extra["batch"] = res.batch
    return Finished(GenOutput(
        token_ids=res.token_ids, text=res.text,
        finish_reason="length" if res.finish_reason == "length" else "stop",
        prompt_tokens=st.prompt_tokens, hit_tokens=st.hit_tokens, hit_tiers=st.hit_tiers,
        ttft_s=st.ttft_s, extra=extra))


def _emit_all(jobs: list[Job], results: list[BatchResult], *, kv: bool) -> None:
    for job, res in zip(jobs, results):
        ev = _finished(res, kv=kv)
        if ev is not None:
            job.emit(ev)


class EngineRunner:
    """Runs batches of jobs on per-tenant ``HFEngine`` s over one shared model (see module doc)."""

    def __init__(self, engine_cls: Any, model: Any, tokenizer: Any, *, model_id: str, store: Any,
                 salter: Any, chunk_size: int, codec: str,
                 scheduler: PrefillScheduler | None = None) -> None:
        self.engine_cls = engine_cls
        self.scheduler = scheduler
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.store = store
        self.salter = salter
        self.chunk_size = chunk_size
        self.codec = codec
        self._engines: dict[tuple[str | None, bool], Any] = {}
        self._lock = threading.Lock()
        first = self.engine(None)  # validates the model family once, up front
        self.decoder = BatchDecoder.for_engine(first)
        self.max_positions = self.decoder.max_positions

    def engine(self, tenant: str | None, digest: str | None = None, *,
               isolate: bool = False) -> Any:
        """The engine serving ``tenant``: its KV namespace carries the tenant's salt digest.

        ``digest`` is the digest admission decided (``TenantContext.digest``); the engine's
        namespace must carry exactly it (a mismatch is a wiring bug, refused). ``isolate``
        gives an engine without a store: nothing is restored from or written to shared KV.
        """
        with self._lock:
            eng = self._engines.get((tenant, isolate))
            if eng is None:
                eng = self.engine_cls(self.model, self.tokenizer,
                                      store=None if isolate else self.store,
                                      chunk_size=self.chunk_size, codec=self.codec,
                                      tenant=tenant, salter=self.salter)
                eng.prefill_scheduler = self.scheduler
                self._engines[(tenant, isolate)] = eng
        if digest is not None and eng.namespace.tenant != digest:
            raise RuntimeError(f"KV namespace digest {eng.namespace.tenant!r} differs from the "
                               f"admitted tenant digest {digest!r}")
        return eng

    def namespaces(self) -> set[bytes]:
        """The KV namespace digests of this runner's engines (one per tenant served so far)."""
        with self._lock:
            return {bytes(e.namespace_digest) for e in self._engines.values()}

    def run(self, jobs: list[Job]) -> None:
        reqs = [_request(job, self.engine(job.tenant, job.digest, isolate=job.isolate))
                for job in jobs]
        _emit_all(jobs, self.decoder.generate(reqs), kv=True)


class DirectRunner:
    """Serves batches of jobs on a plain transformers causal LM (no KV prefix cache)."""

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.decoder = BatchDecoder(model, tokenizer)
        self.max_positions = self.decoder.max_positions

    def run(self, jobs: list[Job]) -> None:
        _emit_all(jobs, self.decoder.generate([_request(job) for job in jobs]), kv=False)
