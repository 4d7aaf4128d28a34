"""The threads that write a DiskStore's chunks besides the caller.

* :class:`WriteQueue`: chunks a store has accepted but not yet written, and the threads that
  write them. ``DiskStore(durability="write-behind")`` hands each validated chunk to a
  ``WriteQueue`` and returns (the store itself keeps the chunk readable until it is written).
  The queue is bounded in bytes: a producer that runs ahead of the disk waits in ``submit``
  (backpressure) instead of growing the queue.
* :class:`WriteBatch` and :data:`HELPERS`: one ``put_many``'s writes, shared out between the
  caller and the process's helper threads (which also run ``DiskStore.prefetch``'s reads).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["HELPERS", "Helpers", "WriteBatch", "WriteQueue"]

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
    * **Per-key order.** Every job of one key goes to the same lane (chosen by the key's
      first byte), and a lane's jobs are written one at a time, in the order they were
      submitted: the last ``put`` of a key is the one left on disk.
    * **Waiting callers write.** A caller that would only wait (``flush``, ``close``, a
      ``submit`` held back by the bound) takes the next job of a lane nobody is writing and
      writes it itself, instead of sleeping until a writer thread gets the CPU (each lane is
      still written by one thread at a time: ``_busy``).
    * ``flush`` returns once nothing is queued or in flight; ``close`` flushes, then stops the
      threads (later ``submit`` calls raise ``RuntimeError``). Queues still open when the
      interpreter exits are flushed by an ``atexit`` hook.

    The queue never calls ``write`` while it holds its own lock. ``write`` runs in the writer
    threads, and in a caller of ``flush``, ``close`` or a held-back ``submit`` (so the owner
    must not call those holding a lock that ``write`` takes); it must not raise (an exception
    is logged and the job is dropped: the chunk is then simply absent, a miss).
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
        self._queues: list[deque[J]] = [deque() for _ in range(threads)]  # one per lane
        self._busy = [False] * threads  # lane i has a job being written (by any thread)
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
                self._help_or_wait()
            if self._closed:
                raise RuntimeError("the store's write queue is closed")
            self._bytes += size
            self._jobs += 1
            i = job.key[0] % len(self._queues)
            self._queues[i].append(job)
            if self._threads[i] is None:
                self._start(i)
            self._cond.notify_all()

    def start(self) -> None:
        """Start every writer thread now (they also start on demand, and exit when idle).

        A thread start waits for the new thread to run, which takes milliseconds on a loaded
        machine: a store starts them when it is created, not in its first ``put``."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the store's write queue is closed")
            for i, t in enumerate(self._threads):
                if t is None:
                    self._start(i)

    def _start(self, i: int) -> None:
        """Start lane ``i``'s writer thread (holds _cond)."""
        t = threading.Thread(target=self._run, args=(i,), name=f"{self._name}-{i}",
                             daemon=True)
        self._threads[i] = t
        t.start()

    def flush(self) -> None:
        """Wait until every submitted job has been written.

        From a writer thread itself (a store event subscriber) it returns at once: waiting
        there would wait for itself."""
        if threading.get_ident() in self._writers:
            return
        with self._cond:
            while self._jobs:
                self._help_or_wait()

    def close(self) -> None:
        """Flush, then stop the writer threads (idempotent)."""
        if threading.get_ident() in self._writers:
            raise RuntimeError("a store's write queue cannot be closed from its own writer")
        with self._cond:
            if self._closed:
                return
            while self._jobs:
                self._help_or_wait()
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
    def _help_or_wait(self) -> None:
        """Write one job of a lane nobody is writing, else wait for a change (holds _cond)."""
        for i, q in enumerate(self._queues):
            if q and not self._busy[i]:
                self._write_one(i, q.popleft())
                return
        self._cond.wait()

    def _write_one(self, i: int, job: J) -> None:
        """Write ``job`` of lane ``i`` in this thread (called holding _cond; released meanwhile)."""
        self._busy[i] = True
        me = threading.get_ident()
        helper = me not in self._writers  # a waiting caller: a writer while it writes
        if helper:
            self._writers.add(me)  # a flush() from a store event it triggers returns at once
        self._cond.release()
        try:
            self._write(job)
        except Exception:  # the callback is meant not to raise: keep the thread
            logger.exception("semcomm KV write-behind: writing chunk %s failed",
                             bytes(job.key).hex()[:16])
        finally:
            self._cond.acquire()
            if helper:
                self._writers.discard(me)
            self._busy[i] = False
            self._bytes -= len(job.value)
            self._jobs -= 1
            self._cond.notify_all()

    def _run(self, i: int) -> None:
        """Writer thread ``i``: its lane's jobs in order; exits after ``_IDLE_S`` idle.

        An idle exit drops the thread's reference to the store, so a store nobody closes is
        still garbage collected once its writes are done; ``submit`` starts a new thread."""
        q = self._queues[i]
        me = threading.get_ident()

        def work() -> bool:  # a job to write, or closed and drained (holds _cond)
            return bool(q) and not self._busy[i] or self._closed and not q

        with self._cond:
            self._writers.add(me)
            try:
                while True:
                    if q and not self._busy[i]:
                        self._write_one(i, q.popleft())
                        continue
                    if self._closed and not q:
                        break
                    if not self._cond.wait_for(work, timeout=_IDLE_S) and not q:
                        break  # idle: the next submit starts a new thread
                self._threads[i] = None
            finally:
                self._writers.discard(me)


_OPEN: weakref.WeakSet[WriteQueue[Any]] = weakref.WeakSet()


@atexit.register
def _flush_open_queues() -> None:
    """Write what is still queued before the interpreter exits (daemon threads stop then)."""
    for q in list(_OPEN):
        try:
            q.close()
        except Exception:  # pragma: no cover - best effort at exit
            logger.exception("semcomm KV write-behind: flushing at exit failed")


class WriteBatch(Generic[J]):
    """One ``put_many``'s writes, taken one job at a time by its caller and by helper threads.

    The caller writes too and waits only for jobs a helper has already taken, never for a
    helper to be scheduled (a woken thread can get a CPU milliseconds later on a loaded
    machine): a helper that starts after the caller took the last job finds nothing to do.
    """

    __slots__ = ("_done", "_fn", "_jobs", "_left", "_lock", "_next", "results")

    def __init__(self, fn: Callable[[J], str | None], jobs: Sequence[J]) -> None:
        self._fn = fn  # writes one job: its temporary (or final) path, None on failure
        self._jobs = jobs
        self.results: list[str | None] = [None] * len(jobs)  # one writer per index
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._next = 0  # the next job to take; guarded by _lock
        self._left = len(jobs)  # jobs not yet written (taken or not); guarded by _lock

    def drain(self) -> None:
        """Write jobs until none is left to take (the caller's and each helper's loop)."""
        while True:
            with self._lock:
                i = self._next
                if i >= len(self._jobs):
                    return
                self._next = i + 1
            try:
                self.results[i] = self._fn(self._jobs[i])
            except Exception:  # _stage reports OSErrors itself; anything else: a failed write
                logger.exception("DiskStore: writing chunk %s failed",
                                 self._jobs[i].key.hex()[:16])
            finally:
                with self._lock:
                    self._left -= 1
                    if not self._left:
                        self._done.notify_all()

    def wait(self) -> None:
        """Return once every job has been written (by whichever thread took it)."""
        with self._lock:
            while self._left:
                self._done.wait()


class Helpers:
    """The process's helper threads of batched writes (``DiskStore.put_many``), started once.

    Shared by every store of the process; a helper runs ``WriteBatch.drain`` of whatever batch it
    is handed. ``warm`` starts them ahead of the first batch (a thread start waits for the new
    thread to run); a forked child starts its own again (``after_fork``).
    """

    MAX = 8  # helper threads at most, whatever the stores ask for

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._started = 0  # threads asked for so far (the pool starts one per idle-less submit)

    def _get(self, n: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.MAX,
                                                thread_name_prefix="semcomm-kv-put")
            pool = self._pool
            start = max(0, min(n, self.MAX) - self._started)
            self._started += start
        for _ in range(start):  # each submit with no idle thread starts one
            pool.submit(time.sleep, 0.005)
        return pool

    def warm(self, n: int) -> None:
        if n > 0:
            self._get(n)

    def run(self, batch: WriteBatch[Any], helpers: int) -> None:
        """Write ``batch`` with the caller and up to ``helpers`` helper threads; wait for all."""
        if helpers > 0:
            pool = self._get(helpers)
            for _ in range(helpers):
                try:
                    pool.submit(batch.drain)
                except RuntimeError:  # interpreter shutting down: the caller writes it all
                    break
        batch.drain()
        batch.wait()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on a helper thread; nothing waits for it."""
        self._get(1).submit(fn, *args)

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._pool = None  # the parent's threads do not exist here
        self._started = 0


HELPERS = Helpers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=HELPERS.after_fork)
