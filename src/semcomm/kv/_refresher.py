"""The refresher: one daemon thread per process re-listing every open DiskStore's directory.

Other processes write and delete chunk files in a shared directory; a store learns of them when
it re-lists the directory (``DiskStore._refresh``). Instead of a thread per store, one thread
re-lists every store of the process in turn, each ``refresh_s`` after its last re-listing, and
waits while the process is busy with chunks (:data:`ACTIVITY`, set by every put and read).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Protocol


class Refreshed(Protocol):
    """A store the refresher re-lists (``DiskStore``)."""

    refresh_s: float | None
    path: Path
    _lock_fd: int

    def _refresh_and_evict(self) -> None: ...

__all__ = ["ACTIVITY", "QUIET_S", "REFRESHER", "REFRESH_S", "Refresher"]

logger = logging.getLogger("semcomm.kv")

REFRESH_S = 1.0  # how often a store's refresher re-lists the directory (other processes' files)
# the refresher waits while a store of the process was used this recently (a put or read), so
# its listing does not land inside a burst of puts or a request's loads; at most one period more
QUIET_S = 0.02


class Activity:
    """When any DiskStore of this process last put or read a chunk (the refresher waits)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = 0.0  # monotonic seconds; written without a lock (one float store)

    def busy(self, now: float) -> bool:
        return now - self.at < QUIET_S


ACTIVITY = Activity()


class Refresher:
    """One daemon thread per process re-listing every open DiskStore's directory in turn.

    A store is due ``refresh_s`` after its last re-listing; while any store of the process is
    in use (a put or read within ``QUIET_S``) a due store waits, at most one period more, so
    a re-listing does not land inside a burst of puts or a request's loads (three stores of
    one process each re-listing on a thread of their own slowed a pass of puts on another
    store by 2x on this 2-core box). The registry holds stores weakly; the thread ends when
    it is empty and starts again with the next store (and anew in a forked child).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # id(store) -> (store, when it is due, the latest it may wait to); guarded by _lock
        self._due: dict[int, tuple[weakref.ref[Refreshed], float, float]] = {}
        self._thread: threading.Thread | None = None

    def add(self, store: Refreshed) -> None:
        assert store.refresh_s is not None
        due = time.monotonic() + store.refresh_s
        with self._lock:
            self._due[id(store)] = (weakref.ref(store), due, due + store.refresh_s)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="semcomm-kv-refresh",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def remove(self, store: Refreshed) -> None:
        with self._lock:
            item = self._due.get(id(store))
            if item is not None and item[0]() in (store, None):
                del self._due[id(store)]

    def after_fork(self) -> None:
        """In a forked child: fresh locks, and a thread again if stores are registered."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread = None
        stores = [ref() for ref, _, _ in self._due.values()]
        self._due.clear()
        for store in stores:
            if store is not None and store.refresh_s is not None:
                self.add(store)

    def _next(self) -> Refreshed | None:
        """The next store to re-list, once it is due and the process is quiet; None: stop."""
        with self._lock:
            while True:
                for k in [k for k, (ref, _, _) in self._due.items() if ref() is None]:
                    del self._due[k]  # collected without close()
                if not self._due:
                    self._thread = None
                    return None
                now = time.monotonic()
                k, (ref, due, latest) = min(self._due.items(), key=lambda kv: kv[1][1])
                if due > now:
                    self._wake.wait(due - now)
                    continue
                if ACTIVITY.busy(now) and now < latest:
                    self._wake.wait(QUIET_S)
                    continue
                store = ref()
                if store is None:
                    continue
                every = store.refresh_s or REFRESH_S
                # due again a period after this re-listing ends (set before it, in case it fails)
                self._due[k] = (ref, now + every, now + 2 * every)
                return store

    def _run(self) -> None:
        while True:
            store = self._next()
            if store is None:
                return
            try:
                store._refresh_and_evict()
            except Exception:  # never let one bad round end the thread
                if store._lock_fd >= 0:
                    logger.exception("DiskStore %s: re-listing the directory failed",
                                     store.path)
            finally:
                del store


REFRESHER = Refresher()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=REFRESHER.after_fork)
