"""Engine jobs and the batching worker that serves them.

One :class:`BatchingWorker` owns one engine runner and one thread. Requests queue in FIFO order
(bounded: a full queue raises :class:`OverloadedError`, which the app turns into 429 with
Retry-After); the thread takes the oldest request plus every request queued behind it, up to
``max_batch``, and hands the batch to the runner. FIFO batches mean no request is starved: a
request waits at most for the batches ahead of it.

Events flow back from the engine thread to the asyncio side through ``emit`` callbacks that the
backend makes thread-safe with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import OverloadedError
from ..kv import ChunkKey
from ..security import TenantContext
from ._events import Event, Failed, Started
from ._prefill import PrefillScheduler

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import HFEngine

__all__ = ["BatchingWorker", "Job", "Runner"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    """One generation request as the engine thread sees it."""

    prompt_ids: list[int]  # full prompt, rendered and tokenized
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    tenant: str | None  # configured tenant id (never client-chosen); selects the KV namespace
    emit: Callable[[Event], None]  # thread-safe; called from the engine thread
    cancelled: threading.Event = field(default_factory=threading.Event)  # set when the client left
    enqueued_at: float = field(default_factory=time.perf_counter)
    snapshot: Any = None  # optional KV snapshot to continue from (pipelines, same model)
    digest: str | None = None  # the admitted tenant's salt digest (None: derive from tenant)
    isolate: bool = False  # no KV reuse: nothing read from or written to the shared store
    keys: list[ChunkKey] | None = None  # the prompt's chunk keys in the engine's namespace
    # a prompt with documents (a semcomm.engine.SegmentedPrompt whose ids are prompt_ids): its
    # documents' KV is reused at their positions; selector and recompute as the engine takes
    segments: Any = None
    selector: str | None = None
    recompute: float | None = None
    margin: float | None = None  # documents: the confidence test (engine/_documents.py)
    watch: float | None = None  # documents: rebuild the KV when a later decode step is unsure


class Runner(Protocol):
    """Runs a batch of jobs to completion on the calling thread, emitting events per job."""

    model_id: str
    model: Any
    tokenizer: Any
    max_positions: int
    scheduler: PrefillScheduler | None  # the process's long-prefill scheduler, if any

    def keys(self, ids: Sequence[int], ctx: TenantContext) -> list[ChunkKey] | None:
        """The prompt's chunk keys in the namespace the job's engine stores under (None: this
        runner reuses no KV for ``ctx``)."""
        ...

    def namespaces(self) -> set[bytes]:
        """KV namespace digests this runner has stored under."""
        ...

    def engine(self, tenant: str | None, digest: str | None = None, *,
               isolate: bool = False) -> HFEngine | None:
        """The engine serving ``tenant`` (None: this runner reuses no KV)."""
        ...

    def run(self, jobs: list[Job]) -> None: ...


class BatchingWorker:
    """A bounded FIFO queue in front of one runner, drained in batches by one thread.

    Invariants: at most ``max_queue`` jobs wait; jobs start in arrival order; a batch holds at
    most ``max_batch`` jobs; every submitted job gets exactly one Completion or Failed event.
    """

    def __init__(self, runner: Runner, *, max_batch: int = 8, max_queue: int = 64,
                 name: str = "engine", batch_wait_s: float = 0.02) -> None:
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.runner = runner
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.name = name
        self.batch_wait_s = batch_wait_s  # how long a short batch waits for company
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = 0  # jobs in the batch now running
        self._arriving = 0  # requests being prepared for submit()
        self._batches = 0
        self._batched_jobs = 0
        self._service_s = 0.0  # EWMA of one batch's wall time, for Retry-After
        self._thread = threading.Thread(target=self._loop, name=f"semcomm-{name}", daemon=True)
        self._thread.start()

    # --- asyncio side -------------------------------------------------------------------------
    def arriving(self, delta: int) -> None:
        """Count requests on their way to :meth:`submit` (the batcher waits for them)."""
        with self._cond:
            self._arriving += delta
            if delta < 0:
                self._cond.notify()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (:class:`OverloadedError` when the queue is full).

        A short job is in flight for the prefill scheduler from here to its first token (long
        prefills on other workers step aside meanwhile, docs/server.md)."""
        sched = self.runner.scheduler
        if (sched is None or self._thread.ident is None
                or len(job.prompt_ids) > sched.long_tokens):
            self._enqueue(job)
            return
        ticket = sched.short_request(self._thread.ident)
        emit = job.emit

        def emit_then_close(event: Event) -> None:
            if not isinstance(event, Started):
                ticket.close()  # engine thread: the first token (or the end) is out
            emit(event)

        job.emit = emit_then_close
        try:
            self._enqueue(job)
        except BaseException:
            ticket.close()
            raise

    def _enqueue(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise OverloadedError(f"model {self.name!r} is shutting down", retry_after_s=5)
            if len(self._queue) >= self.max_queue:
                raise OverloadedError(
                    f"model {self.name!r} has {len(self._queue)} queued requests (limit "
                    f"{self.max_queue}); retry later",
                    retry_after_s=self.retry_after_s(),
                )
            self._queue.append(job)
            self._cond.notify()

    def retry_after_s(self) -> float:
        batches_ahead = len(self._queue) / self.max_batch + 1
        return max(1.0, round(batches_ahead * max(self._service_s, 0.05), 1))

    @property
    def thread_ident(self) -> int | None:
        """``threading.get_ident()`` of the engine thread running this worker's batches."""
        return self._thread.ident

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._busy + len(self._queue)

    def stats(self) -> dict[str, float]:
        return {
            "queued": len(self._queue),
            "running": self._busy,
            "batches": self._batches,
            "mean_batch": self._batched_jobs / self._batches if self._batches else 0.0,
        }

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # --- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                # a short batch waits briefly for requests arriving together: always up to
                # batch_wait_s, and up to 5x that while requests are being prepared (rendered,
                # tokenized) on their way to this queue; the oldest request waits no longer
                if self.max_batch > 1 and self.batch_wait_s > 0 and not self._closed:
                    t0 = time.perf_counter()
                    while len(self._queue) < self.max_batch and not self._closed:
                        cap = self.batch_wait_s * (5 if self._arriving else 1)
                        left = t0 + cap - time.perf_counter()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                batch: list[Job] = []
                while self._queue and len(batch) < self.max_batch:
                    job = self._queue.popleft()
                    if job.cancelled.is_set():
                        job.emit(Failed(ConnectionAbortedError("client went away")))
                        continue
                    batch.append(job)
                self._busy = len(batch)
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                self.runner.run(batch)
            except BaseException as exc:  # every job must hear back, whatever went wrong
                log.exception("engine %s failed on a batch of %d", self.name, len(batch))
                for job in batch:
                    job.emit(Failed(exc))
            finally:
                dt = time.perf_counter() - t0
                self._service_s = dt if self._service_s == 0 else 0.8 * self._service_s + 0.2 * dt
                self._batches += 1
                self._batched_jobs += len(batch)
                with self._cond:
                    self._busy = 0
