"""The process-wide prefill scheduler: long prefills in pieces, bounded, yielding to short requests.

:class:`PrefillScheduler` (one per process and setting, :func:`prefill_scheduler`) runs every
engine prefill's forward (``HFEngine(prefill_scheduler=...)``, a ``semcomm.engine.PrefillRunner``). A long one (more uncached tokens
than ``long_tokens``) is cut into pieces ending at KV chunk boundaries and each piece needs one
of ``slots`` shared by every model in the process, so long prefills never take every core from
the short requests. With ``yield_to_short`` (the default) a long prefill also steps aside
while a short request is in flight on another worker (from its submit to its first token,
:meth:`PrefillScheduler.short_request`): its next piece does not start, and a running piece
pauses between two decoder layers, until no short request is left or the pause has lasted
``yield_max_s`` (the starvation bound: then it computes at least ``yield_run_s`` before it
pauses again). Pausing between layers changes nothing that is computed. Short prefills and
decode steps never wait for it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["PrefillScheduler", "ShortTicket", "prefill_scheduler"]

log = logging.getLogger(__name__)

ThreadId = int
"""``threading.get_ident()`` of a worker's engine thread: whose prefill or request it is."""


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass(slots=True)
class _Long:
    """One long prefill in :meth:`PrefillScheduler.run`, across its pieces.

    Only the scheduler changes it, under its lock."""

    owner: ThreadId  # the worker thread whose prefill this is (its own short requests queue
    # behind it, so it never waits for them)
    run_until: float = 0.0  # perf_counter() before which it does not yield (set when a pause
    # ran out of yield_max_s: it then computes yield_run_s at least)


class ShortTicket:
    """A short request in flight on a worker (:meth:`PrefillScheduler.short_request`).

    ``close()`` once its first token is out (or it failed); closing twice is a no-op."""

    __slots__ = ("_lock", "_open", "_sched", "owner")

    def __init__(self, sched: PrefillScheduler, owner: ThreadId) -> None:
        self._sched = sched
        self.owner = owner
        self._open = True
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
        self._sched._end_short(self.owner)


_TLS = threading.local()  # .gate: (scheduler, _Long) of the long piece this thread computes now


class PrefillScheduler:
    """Bounds and schedules the long prefills of every model of the process (module doc).

    A prefill whose uncached part (the tokens its forward computes) is longer than
    ``long_tokens`` is long: it runs as pieces of about ``piece_tokens`` (cut at multiples of
    the engine's KV chunk size; the engine computes each chunk in a forward of its own
    anyway, so the scheduler changes when a chunk is computed, never what: the same logits
    with and without it, tests/test_server_prefill_sched.py), and each piece holds one of
    ``slots``. Pieces wait in arrival order;
    a waiting long prefill resumes between another's pieces, so two long prompts take turns.

    Short work in flight, by worker thread: short prefills (counted while their forward runs)
    and short requests (a :class:`ShortTicket`, from submit to first token). With
    ``yield_to_short`` a long prefill pauses, before a piece starts and between its decoder
    layers (a forward pre-hook on each layer, installed once per model), while any is in
    flight on a thread other than its own worker's and other than a worker inside a long
    prefill (a request queued behind a long prefill cannot start before it anyway). A pause
    lasts at most ``yield_max_s``; one that runs out (``forced``) lets the prefill compute
    ``yield_run_s`` before it may pause again, so under endless short traffic a long prefill
    still computes at least ``yield_run_s / (yield_max_s + yield_run_s)`` of the time.
    Without it, the next piece waits while short prefills run and every core (``cores``) is
    taken, at most ``yield_max_s``. With ``nice > 0`` the pieces compute on ``slots`` threads of this
    scheduler at that niceness (Linux: per thread), so the OS gives a core to a runnable short
    request or decode step first. Thread-safe; ``stats()`` is what ``/health`` and
    ``/metrics`` show.
    """

    def __init__(self, *, slots: int, long_tokens: int, piece_tokens: int,
                 cores: int | None = None, nice: int = 0, yield_to_short: bool = True,
                 yield_max_s: float = 0.5, yield_run_s: float = 0.1) -> None:
        if slots < 1 or long_tokens < 1 or piece_tokens < 1:
            raise ValueError("slots, long_tokens and piece_tokens must be >= 1")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in [0, 19], got {nice}")
        if not (math.isfinite(yield_max_s) and yield_max_s >= 0):
            raise ValueError(f"yield_max_s must be a finite number >= 0, got {yield_max_s}")
        if not (math.isfinite(yield_run_s) and yield_run_s > 0):
            raise ValueError(f"yield_run_s must be a finite number > 0, got {yield_run_s}")
        self.nice = nice
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.nice_applied = False
        self.slots = slots
        self.long_tokens = long_tokens
        self.piece_tokens = piece_tokens
        self.cores = cores if cores is not None else _cores()
        self.yield_to_short = yield_to_short
        self.yield_max_s = yield_max_s
        self.yield_run_s = yield_run_s
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()
        self._running = 0  # long pieces running now
        self._shorts = 0  # short prefills running now
        self._in_flight: collections.Counter[ThreadId] = collections.Counter()  # short work
        self._n_in_flight = 0  # sum of _in_flight (read without the lock by the layer gate)
        self._long_owners: collections.Counter[ThreadId] = collections.Counter()
        self.peak_running = 0
        self.long_prefills = 0
        self.short_prefills = 0
        self.short_requests = 0
        self.pieces = 0
        self.waits = 0  # times a long prefill waited (for a slot, or a pause for short work)
        self.wait_s = 0.0  # every second long prefills waited (for a slot or for short work)
        self.yields = 0  # pauses for short work
        self.yield_s = 0.0  # seconds of those pauses
        self.forced = 0  # pauses that ran out of yield_max_s with short work still in flight
        self.gated_models = 0  # models whose decoder layers carry the pause point

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

    # --- short work -------------------------------------------------------------------------
    def short_request(self, owner: ThreadId) -> ShortTicket:
        """Count a short request in flight on the worker thread ``owner`` until the ticket is
        closed (the server: from submit to its first token)."""
        with self._cond:
            self._add_short(owner)
            self.short_requests += 1
        return ShortTicket(self, owner)

    def _add_short(self, owner: ThreadId) -> None:  # caller holds _cond
        self._in_flight[owner] += 1
        self._n_in_flight += 1

    def _end_short(self, owner: ThreadId, *, prefill: bool = False) -> None:
        with self._cond:
            assert self._in_flight[owner] > 0, "a short request ended twice"
            self._in_flight[owner] -= 1
            if not self._in_flight[owner]:
                del self._in_flight[owner]
            self._n_in_flight -= 1
            if prefill:
                self._shorts -= 1
            self._cond.notify_all()

    def _shorts_elsewhere(self, owner: ThreadId) -> int:  # caller holds _cond
        return sum(n for t, n in self._in_flight.items()
                   if t != owner and t not in self._long_owners)

    @contextmanager
    def _short(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            self._shorts += 1
            self.short_prefills += 1
            self._add_short(me)
        try:
            yield
        finally:
            self._end_short(me, prefill=True)

    # --- long pieces ------------------------------------------------------------------------
    def _busy(self, long: _Long) -> bool:  # caller holds _cond
        """Must ``long`` wait for short work now (the bounds aside)?"""
        if self.yield_to_short:
            return self._shorts_elsewhere(long.owner) > 0
        return self._shorts > 0 and self._shorts + self._running >= self.cores

    def _yield(self, long: _Long) -> None:  # caller holds _cond
        """One pause of ``long`` while it must yield to short work: at most ``yield_max_s``;
        when that runs out, it computes ``yield_run_s`` before it pauses again."""
        t = time.perf_counter()
        if t < long.run_until or not self._busy(long):
            return
        self.yields += 1
        self.waits += 1
        deadline = t + self.yield_max_s
        while self._busy(long):
            left = deadline - time.perf_counter()
            if left <= 0:
                self.forced += 1
                long.run_until = time.perf_counter() + self.yield_run_s
                break
            self._cond.wait(left)
        dt = time.perf_counter() - t
        self.yield_s += dt
        self.wait_s += dt

    def _gate(self, long: _Long) -> None:
        """The pause point between two decoder layers of a running piece."""
        if (not self.yield_to_short or self._n_in_flight == 0  # fast path, no lock
                or time.perf_counter() < long.run_until):
            return
        with self._cond:
            self._yield(long)

    @contextmanager
    def _slot(self, long: _Long) -> Iterator[None]:
        me = object()
        with self._cond:
            self._queue.append(me)
            if not (self._queue[0] is me and self._running < self.slots):
                self.waits += 1
                t = time.perf_counter()
                while not (self._queue[0] is me and self._running < self.slots):
                    self._cond.wait()
                self.wait_s += time.perf_counter() - t
            self._yield(long)  # at the head with a free slot: now only short work holds it
            self._queue.popleft()
            self._running += 1
            self.peak_running = max(self.peak_running, self._running)
            self.pieces += 1
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
        owner = threading.get_ident()
        with self._cond:
            self.long_prefills += 1
            self._long_owners[owner] += 1
            self._cond.notify_all()  # requests queued behind this worker no longer count
        try:
            logits = None
            pieces = self.cuts(int(cache.get_seq_length()), n, align) if align > 0 else [(0, n)]
            pool = self._executor()
            long = _Long(owner=owner)
            for a, b in pieces:
                with self._slot(long):
                    if pool is None:
                        logits = _compute(self, long, runner, ids[:, a:b], cache)
                    else:  # the caller waits; the piece computes on a lower-priority thread
                        logits = pool.submit(_compute, self, long, runner, ids[:, a:b],
                                             cache).result()
        finally:
            with self._cond:
                self._long_owners[owner] -= 1
                if not self._long_owners[owner]:
                    del self._long_owners[owner]
        return logits

    def attach(self, model: Any) -> None:
        """Put the pause point on the decoder layers of a model this process loaded and serves
        (once per model; a forward pre-hook that reads one thread-local when no long piece
        computes on the thread): with ``yield_to_short`` a running piece of a long prefill can
        then pause between two layers. Without it, pieces yield only between themselves."""
        if self.yield_to_short and _install_gate(model):
            with self._cond:
                self.gated_models += 1

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
                    "yield": self.yield_to_short, "yield_max_ms": self.yield_max_s * 1e3,
                    "yield_run_ms": self.yield_run_s * 1e3,
                    "running": self._running, "waiting": len(self._queue),
                    "short_in_flight": self._n_in_flight,
                    "peak_running": self.peak_running, "long_prefills": self.long_prefills,
                    "short_prefills": self.short_prefills,
                    "short_requests": self.short_requests, "pieces": self.pieces,
                    "waits": self.waits, "wait_s": round(self.wait_s, 6),
                    "yields": self.yields, "yield_s": round(self.yield_s, 6),
                    "forced": self.forced, "gated_models": self.gated_models}


def _compute(sched: PrefillScheduler, long: _Long, runner: Any, ids: Any, cache: Any) -> Any:
    """One piece's forward on this thread, its decoder layers gated for ``long``."""
    import torch

    _TLS.gate = (sched, long)
    try:
        with torch.no_grad():  # grad mode is per thread: the engine's caller set it on its own
            return runner.forward(ids, cache)
    finally:
        _TLS.gate = None


def _layer_gate(_module: Any, _args: Any) -> None:
    """Forward pre-hook on a decoder layer: a long piece computing on this thread may pause
    here (every other forward passes at the cost of one thread-local read)."""
    gate = getattr(_TLS, "gate", None)
    if gate is not None:
        gate[0]._gate(gate[1])


_GATED: weakref.WeakSet[Any] = weakref.WeakSet()  # models whose layers carry _layer_gate
_GATED_LOCK = threading.Lock()


def _decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers: its first ``nn.ModuleList`` of ``num_hidden_layers``."""
    import torch

    cfg: Any = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        return []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return list(m)
    return []


def _install_gate(model: Any) -> bool:
    """Put the pause point on ``model``'s decoder layers (once); True when newly installed."""
    if model is None:
        return False
    with _GATED_LOCK:
        if model in _GATED:
            return False
        layers = _decoder_layers(model)
        if not layers:
            log.info("no decoder layer list found in %s: long prefills yield between pieces "
                     "only", type(model).__name__)
            return False
        for layer in layers:
            layer.register_forward_pre_hook(_layer_gate)
        _GATED.add(model)
        return True


_SCHEDULERS: dict[tuple[int, int, int, int, bool, float, float], PrefillScheduler] = {}
_SCHEDULERS_LOCK = threading.Lock()


def prefill_scheduler(slots: int | None, long_tokens: int, piece_tokens: int,
                      nice: int = 0, *, yield_to_short: bool = True, yield_max_s: float = 0.5,
                      yield_run_s: float = 0.1) -> PrefillScheduler | None:
    """The process's scheduler for these settings (None when ``slots == 0``: off).

    ``slots=None`` means ``max(1, cores - 1)``. Every gateway in a process with the same
    settings shares one scheduler: the cores are the process's, whatever serves the model.
    """
    if slots == 0:
        return None
    n = slots if slots is not None else max(1, _cores() - 1)
    key = (n, long_tokens, piece_tokens, nice, yield_to_short, yield_max_s, yield_run_s)
    with _SCHEDULERS_LOCK:
        sched = _SCHEDULERS.get(key)
        if sched is None:
            sched = _SCHEDULERS[key] = PrefillScheduler(
                slots=n, long_tokens=long_tokens, piece_tokens=piece_tokens, nice=nice,
                yield_to_short=yield_to_short, yield_max_s=yield_max_s,
                yield_run_s=yield_run_s)
        return sched
