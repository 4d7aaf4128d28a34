"""WriteQueue: chunks a store has accepted but not yet written, and the threads that write them.

``DiskStore(durability="write-behind")`` hands each validated chunk to a ``WriteQueue`` and
returns (the store itself keeps the chunk readable until it is written). The queue is bounded
in bytes: a producer that runs ahead of the disk waits in ``submit`` (backpressure) instead of
growing the queue.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["WriteQueue"]

logger = logging.getLogger("semcomm.kv")

_IDLE_S = 2.0  # a writer thread with nothing to write for this long exits


class _Job(Protocol):
    """What the queue needs of a job: the chunk key and the bytes to write."""

    @property
    def key(self) -> bytes: ...

    @property
    def value(self) -> bytes: ...


J = TypeVar("J", bound=_Job)


class WriteQueue(Generic[J]):
    """Jobs written by ``threads`` writer threads, at most ``max_bytes`` queued.

    Invariants:

    * **Bounded.** The bytes of queued and in-flight jobs never exceed ``max_bytes``, except
      one job larger than that, which is admitted alone (when nothing else is queued).
    * **Per-key order.** Every job of one key goes to the same thread (chosen by the key's
      first byte), so jobs of a key are written in the order they were submitted: the last
      ``put`` of a key is the one left on disk.
    * ``flush`` returns once nothing is queued or in flight; ``close`` flushes, then stops the
      threads (later ``submit`` calls raise ``RuntimeError``). Queues still open when the
      interpreter exits are flushed by an ``atexit`` hook.

    The queue never calls ``write`` (or anything of its owner) while it holds its own lock,
    so the owner may call its methods under the owner's lock. ``write`` runs in the writer
    threads and must not raise (an exception is logged and the
    job is dropped: the chunk is then simply absent, a miss).
    """

    def __init__(self, write: Callable[[J], None], *, max_bytes: int, threads: int,
                 name: str = "semcomm-kv-writer") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"writer threads must be an int >= 1, got {threads!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_pending_bytes must be an int >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._write = write
        self._name = name
        self._cond = threading.Condition()
        self._queues: list[deque[J]] = [deque() for _ in range(threads)]
        self._bytes = 0  # queued and in-flight bytes; guarded by _cond
        self._jobs = 0  # queued and in-flight jobs; guarded by _cond
        self._threads: list[threading.Thread | None] = [None] * threads  # started on demand
        self._writers: set[int] = set()  # idents of running writer threads
        self._closed = False
        _OPEN.add(self)

    # ---- producer side -----------------------------------------------------------------
    def submit(self, job: J) -> None:
        """Queue ``job``; blocks while the queue is full. ``RuntimeError`` once closed."""
        size = len(job.value)
        with self._cond:
            while (not self._closed and self._jobs
                   and self._bytes + size > self.max_bytes):
                self._cond.wait()
            if self._closed:
                raise RuntimeError("the store's write queue is closed")
            self._bytes += size
            self._jobs += 1
            i = job.key[0] % len(self._queues)
            self._queues[i].append(job)
            if self._threads[i] is None:
                t = threading.Thread(target=self._run, args=(i,), name=f"{self._name}-{i}",
                                     daemon=True)
                self._threads[i] = t
                t.start()
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until every submitted job has been written.

        From a writer thread itself (a store event subscriber) it returns at once: waiting
        there would wait for itself."""
        if threading.get_ident() in self._writers:
            return
        with self._cond:
            while self._jobs:
                self._cond.wait()

    def close(self) -> None:
        """Flush, then stop the writer threads (idempotent)."""
        with self._cond:
            if self._closed:
                return
            while self._jobs:
                self._cond.wait()
            self._closed = True
            self._cond.notify_all()
            threads = [t for t in self._threads if t is not None]
        for t in threads:
            t.join()
        _OPEN.discard(self)

    @property
    def queued(self) -> tuple[int, int]:
        """(jobs, bytes) queued or being written now."""
        with self._cond:
            return self._jobs, self._bytes

    # ---- writer side -------------------------------------------------------------------
    def _run(self, i: int) -> None:
        """Writer thread ``i``: its queue's jobs in order; exits after ``_IDLE_S`` idle.

        An idle exit drops the thread's reference to the store, so a store nobody closes is
        still garbage collected once its writes are done; ``submit`` starts a new thread."""
        q = self._queues[i]
        with self._cond:
            self._writers.add(threading.get_ident())
        try:
            while True:
                with self._cond:
                    if not q and not self._closed:
                        self._cond.wait_for(lambda: q or self._closed, timeout=_IDLE_S)
                    if not q:  # closed and drained, or idle: the next submit restarts it
                        self._threads[i] = None
                        return
                    job = q.popleft()
                try:
                    self._write(job)
                except Exception:  # the callback is meant not to raise: keep the thread
                    logger.exception("semcomm KV write-behind: writing chunk %s failed",
                                     bytes(job.key).hex()[:16])
                with self._cond:
                    self._bytes -= len(job.value)
                    self._jobs -= 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._writers.discard(threading.get_ident())


_OPEN: weakref.WeakSet[WriteQueue[Any]] = weakref.WeakSet()


@atexit.register
def _flush_open_queues() -> None:
    """Write what is still queued before the interpreter exits (daemon threads stop then)."""
    for q in list(_OPEN):
        try:
            q.close()
        except Exception:  # pragma: no cover - best effort at exit
            logger.exception("semcomm KV write-behind: flushing at exit failed")
