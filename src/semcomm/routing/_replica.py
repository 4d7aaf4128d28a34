"""The replica router: which worker of one model serves a request.

A :class:`ReplicaRouter` turns the full rendered prompt's token ids into the KV store's chunk
keys (``semcomm.kv.chunk_keys`` with the model's namespace digest, so its keys *are* the store's
keys), asks its :class:`~semcomm.routing.PrefixIndex` which replica holds how much of that
prefix, lets a policy choose, and tracks per-replica load (requests in flight and predicted
prefill backlog). Callers report progress with :meth:`ReplicaRouter.prefill_done` and
:meth:`ReplicaRouter.complete`; the simulator makes exactly the same calls.

KV headroom (token-aware balancing): a caller that knows how many KV bytes each replica may
still hold sets them with :meth:`ReplicaRouter.set_kv_free` and passes a request's need as
``route(..., kv_bytes=...)``. Replicas without room for it are charged ``kv_wait_s`` of extra
backlog in the policy's view (the load term), and the router never picks one of them while
another has room; when none has room, the one with the most goes (it waits the least).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError, InvalidInputError
from ..kv import chunk_keys
from ._cost import CostModel
from ._index import ApproximateIndex, PreciseIndex, PrefixIndex
from ._policies import Policy, RouteView, make_policy, predicted_ttft

__all__ = ["DecisionState", "ReplicaRouter", "RouteDecision"]

logger = logging.getLogger(__name__)


class DecisionState(enum.Enum):
    """Lifecycle: PLANNED -> ROUTED (recorded) -> PREFILLED -> COMPLETED (PREFILLED optional)."""

    PLANNED = "planned"
    ROUTED = "routed"
    PREFILLED = "prefilled"
    COMPLETED = "completed"


@dataclass(slots=True)
class RouteDecision:
    """Where a request went and why (returned by :meth:`ReplicaRouter.route`)."""

    replica: str  # chosen replica's name
    slot: int  # chosen replica's dense index in the router
    policy: str  # policy that chose it
    num_tokens: int  # prompt tokens
    matched_chunks: int  # consecutive chunks the index says the replica holds
    cached_tokens: int  # tokens predicted to be restored from cache
    predicted_ttft_s: float  # predicted TTFT on the chosen replica
    keys: tuple[Hashable, ...] = field(repr=False)  # the prompt's chunk keys
    backlog_s: float = field(default=0.0, repr=False)  # prefill seconds this request adds to the backlog
    match: dict[int, int] = field(default_factory=dict, repr=False)  # index match at planning time
    state: DecisionState = DecisionState.PLANNED  # advanced only by the router
    kv_fit: bool = True  # the chosen replica had KV headroom for the request (or none was known)


class ReplicaRouter:
    """Prefix-aware replica router for one model (one KV namespace).

    Args:
        replicas: replica names, or a count (names become ``"0".."n-1"``).
        policy: registry name (see :data:`semcomm.routing.POLICIES`) or a policy object.
        index: ``"approximate"`` (learn from own decisions), ``"precise"`` (fed by store events
            via :meth:`apply_event` / :meth:`subscriber`) or a :class:`PrefixIndex`.
        namespace: the KV namespace digest (``Namespace(...).digest``) the engines store under.
        chunk_size: tokens per chunk, as configured in the engines' KV cache.
        capacity_chunks: each replica's KV capacity in chunks (bounds the index).
        cost: cost model for TTFT prediction.
        slo_ttft_s: TTFT objective used by SLO-aware policies.
        policy_options: keyword options for the policy factory.
        kv_wait_s: backlog (seconds) charged to a replica without KV headroom for a request.
    """

    def __init__(
        self,
        replicas: Sequence[str] | int,
        *,
        policy: str | Policy = "default",
        index: str | PrefixIndex = "approximate",
        namespace: bytes = b"",
        chunk_size: int = 256,
        capacity_chunks: int = 4096,
        cost: CostModel | None = None,
        slo_ttft_s: float = 2.0,
        policy_options: dict[str, Any] | None = None,
        kv_wait_s: float = 1.0,
    ) -> None:
        names = [str(i) for i in range(replicas)] if isinstance(replicas, int) else list(replicas)
        if not names:
            raise ConfigError("a replica router needs at least one replica")
        if len(set(names)) != len(names):
            raise ConfigError(f"replica names must be unique, got {names}")
        if chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
        self.names: list[str] = names
        self._slot_of = {n: i for i, n in enumerate(names)}
        self.namespace = bytes(namespace)
        self.chunk_size = chunk_size
        self.capacity_chunks = capacity_chunks
        self.cost = cost or CostModel()
        self.slo_ttft_s = slo_ttft_s
        self.policy: Policy = (
            make_policy(policy, **(policy_options or {})) if isinstance(policy, str) else policy
        )
        if isinstance(index, str):
            if index == "approximate":
                self.index: PrefixIndex = ApproximateIndex(len(names), capacity_chunks)
            elif index == "precise":
                self.index = PreciseIndex(len(names), capacity_chunks)
            else:
                raise ConfigError(f"unknown index source {index!r}; use 'approximate' or 'precise'")
        else:
            self.index = index
        n = len(names)
        self.inflight = np.zeros(n, dtype=np.int64)  # requests routed, not completed
        self.backlog_s = np.zeros(n, dtype=np.float64)  # predicted prefill seconds not yet done
        self.routed = np.zeros(n, dtype=np.int64)  # total requests routed per replica
        # KV bytes each replica may still hold (NaN: unknown, never filters); set_kv_free
        self.kv_free = np.full(n, np.nan, dtype=np.float64)
        self.kv_wait_s = kv_wait_s

    # -- routing ------------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return len(self.names)

    def keys_for(self, token_ids: Sequence[int] | np.ndarray) -> list[Hashable]:
        """The chunk keys the KV store writes for this prompt (partial tail included)."""
        return list(chunk_keys(self.namespace, token_ids, self.chunk_size))

    def _sizes(self) -> np.ndarray:
        return np.fromiter(
            (self.index.size(r) for r in range(self.num_replicas)),
            dtype=np.float64,
            count=self.num_replicas,
        )

    def route(
        self,
        token_ids: Sequence[int] | np.ndarray | None = None,
        *,
        keys: Sequence[Hashable] | None = None,
        num_tokens: int | None = None,
        kv_bytes: int | None = None,
    ) -> RouteDecision:
        """Choose a replica for a prompt given as the full conversation's token ids, and record it.

        Pass ``token_ids`` (keys are computed like the KV store does), or precomputed ``keys``
        with ``num_tokens``; ``kv_bytes``: the KV the request will hold (prompt plus output),
        weighed against :attr:`kv_free`. The decision is recorded: the approximate index learns
        it and the replica's load grows until :meth:`complete`. Same as ``record(plan(...))``.
        """
        return self.record(self.plan(token_ids, keys=keys, num_tokens=num_tokens,
                                     kv_bytes=kv_bytes))

    def plan(
        self,
        token_ids: Sequence[int] | np.ndarray | None = None,
        *,
        keys: Sequence[Hashable] | None = None,
        num_tokens: int | None = None,
        kv_bytes: int | None = None,
    ) -> RouteDecision:
        """Choose a replica without recording anything (for callers that may send elsewhere)."""
        if token_ids is not None:
            n = len(token_ids)
            if n == 0:
                raise InvalidInputError("cannot route an empty prompt (no token ids)")
            ks: Sequence[Hashable] = self.keys_for(token_ids)
        elif keys is not None:
            ks = keys
            n = num_tokens if num_tokens is not None else len(keys) * self.chunk_size
            if n <= 0:
                raise InvalidInputError("cannot route an empty prompt (num_tokens <= 0)")
        else:
            raise InvalidInputError("route() needs token_ids or keys")
        match = self.index.match(ks)
        fit = None
        backlog = self.backlog_s
        if kv_bytes is not None and kv_bytes > 0:
            fit = ~(self.kv_free < kv_bytes)  # NaN (unknown) compares False: counts as room
            if fit.all():
                fit = None
            else:  # the load term: a replica without room would make the request wait
                backlog = self.backlog_s + np.where(fit, 0.0, self.kv_wait_s)
        view = RouteView(
            num_tokens=n,
            keys=ks,
            match=match,
            chunk_size=self.chunk_size,
            inflight=self.inflight,
            backlog_s=backlog,
            sizes=self._sizes,
            capacity_chunks=self.capacity_chunks,
            cost=self.cost,
            slo_ttft_s=self.slo_ttft_s,
        )
        r = self.policy.choose(view)
        assert 0 <= r < self.num_replicas, f"policy {self.policy.name} returned slot {r}"
        if fit is not None and not fit[r]:
            room = np.flatnonzero(fit)
            if len(room):  # the cheapest replica that has room
                ttft = predicted_ttft(view)
                r = int(room[np.argmin(ttft[room])])
            else:  # nobody has room: the one with the most waits the least
                r = int(np.nanargmax(self.kv_free))
        decision = self._decision(r, n, ks, match)
        decision.kv_fit = fit is None or bool(fit[r])
        return decision

    def set_kv_free(self, free: Sequence[float | None] | np.ndarray) -> None:
        """KV bytes each replica may still hold, in slot order (None or NaN: unknown)."""
        arr = np.array([np.nan if f is None else float(f) for f in free], dtype=np.float64)
        if arr.shape != (self.num_replicas,):
            raise ValueError(f"set_kv_free needs {self.num_replicas} values, got {len(arr)}")
        self.kv_free = arr

    def _decision(self, r: int, n: int, ks: Sequence[Hashable], match: dict[int, int]) -> RouteDecision:
        m = match.get(r, 0)
        cached = min(m * self.chunk_size, max(n - 1, 0))
        slow = 1.0 + self.cost.prefill_slowdown_per_decode * float(self.inflight[r])
        own = self.cost.prefill_s(n - cached, cached) * slow
        return RouteDecision(
            replica=self.names[r],
            slot=r,
            policy=self.policy.name,
            num_tokens=n,
            matched_chunks=m,
            cached_tokens=cached,
            predicted_ttft_s=float(self.backlog_s[r]) + own,
            keys=tuple(ks),
            backlog_s=own,
            match=match,
        )

    def record(self, decision: RouteDecision, replica: str | int | None = None) -> RouteDecision:
        """Record a planned decision, optionally on another replica than planned (returned)."""
        if decision.state is not DecisionState.PLANNED:
            raise RuntimeError(f"record() on a request in state {decision.state.value}")
        if replica is not None:
            want = self.slot(replica)
            if want != decision.slot or self.names[want] != decision.replica:
                decision = self._decision(want, decision.num_tokens, decision.keys, decision.match)
        r = self._slot_of.get(decision.replica)
        if r is None:
            raise ValueError(f"replica {decision.replica!r} is no longer in the router")
        self.inflight[r] += 1
        self.backlog_s[r] += decision.backlog_s
        self.routed[r] += 1
        self.index.on_routed(r, decision.keys)
        decision.state = DecisionState.ROUTED
        return decision

    def reassign(self, decision: RouteDecision, replica: str | int) -> RouteDecision:
        """The request recorded by ``decision`` actually went to ``replica``: move its load there.

        (The approximate index keeps what it learned for the first replica; it ages out by LRU.)
        """
        r = self.slot(replica)
        if self.names[r] == decision.replica:
            return decision
        self.complete(decision)
        moved = self._decision(r, decision.num_tokens, decision.keys, decision.match)
        return self.record(moved)

    def prefill_done(self, decision: RouteDecision) -> None:
        """The replica finished this request's prefill (its first token is out)."""
        if decision.state is not DecisionState.ROUTED:
            raise RuntimeError(f"prefill_done on a request in state {decision.state.value}")
        self._release_backlog(decision)
        self._settle(decision)
        decision.state = DecisionState.PREFILLED

    def complete(self, decision: RouteDecision) -> None:
        """The request finished (or failed); its replica's load drops."""
        if decision.state is DecisionState.COMPLETED:
            raise RuntimeError("complete() called twice for one request")
        if decision.state is DecisionState.PLANNED:
            raise RuntimeError("complete() on a decision that was never recorded")
        if decision.state is DecisionState.ROUTED:
            self._release_backlog(decision)
            self._settle(decision)
        r = self._slot_of.get(decision.replica)
        if r is not None:  # the replica may have left the set meanwhile
            self.inflight[r] = max(0, int(self.inflight[r]) - 1)
        decision.state = DecisionState.COMPLETED

    def _settle(self, d: RouteDecision) -> None:
        r = self._slot_of.get(d.replica)
        if r is not None:
            self.index.on_settled(r, d.keys)

    def _release_backlog(self, d: RouteDecision) -> None:
        r = self._slot_of.get(d.replica)
        if r is not None:
            self.backlog_s[r] = max(0.0, float(self.backlog_s[r]) - d.backlog_s)

    def predict(self, token_ids: Sequence[int] | np.ndarray) -> dict[str, float]:
        """Predicted TTFT per replica for a prompt, without routing it (diagnostics)."""
        ks = self.keys_for(token_ids)
        view = RouteView(
            num_tokens=len(token_ids), keys=ks, match=self.index.match(ks),
            chunk_size=self.chunk_size, inflight=self.inflight, backlog_s=self.backlog_s,
            sizes=self._sizes, capacity_chunks=self.capacity_chunks, cost=self.cost,
            slo_ttft_s=self.slo_ttft_s,
        )
        return dict(zip(self.names, predicted_ttft(view).tolist(), strict=True))

    # -- external state -------------------------------------------------------------------------
    def slot(self, replica: str | int) -> int:
        if isinstance(replica, int):
            if not 0 <= replica < self.num_replicas:
                raise ValueError(f"replica slot {replica} out of range")
            return replica
        try:
            return self._slot_of[replica]
        except KeyError:
            raise ValueError(f"unknown replica {replica!r}; known: {self.names}") from None

    def set_load(self, replica: str | int, *, inflight: int | None = None, backlog_s: float | None = None) -> None:
        """Overwrite a replica's load with measured values (e.g. from engine metrics)."""
        r = self.slot(replica)
        if inflight is not None:
            self.inflight[r] = inflight
        if backlog_s is not None:
            self.backlog_s[r] = backlog_s

    def apply_event(self, replica: str | int, event: Any) -> bool:
        """Feed one engine store/evict event (``semcomm.kv.StoreEvent``) to a precise index."""
        if not isinstance(self.index, PreciseIndex):
            raise ConfigError("apply_event needs index='precise'")
        return self.index.apply(self.slot(replica), event)

    def subscriber(self, replica: str | int) -> Callable[[Any], None]:
        """A ``ChunkStore.subscribe`` callback feeding ``replica``'s events to the index."""
        r = self.slot(replica)
        name = self.names[r]

        def _cb(event: Any) -> None:
            if self._slot_of.get(name) is not None:
                self.apply_event(name, event)

        return _cb

    def set_replicas(self, names: Sequence[str]) -> None:
        """Change the replica set, keeping index entries and load of replicas that stay."""
        names = list(names)
        if not names:
            raise ConfigError("a replica router needs at least one replica")
        keep = [self._slot_of.get(n, -1) for n in names]
        self.index.resize(len(names), keep)

        def carry(arr: np.ndarray) -> np.ndarray:
            out = np.zeros(len(names), dtype=arr.dtype)
            for i, o in enumerate(keep):
                if o >= 0:
                    out[i] = arr[o]
            return out

        self.inflight = carry(self.inflight)
        self.backlog_s = carry(self.backlog_s)
        self.routed = carry(self.routed)
        self.kv_free = np.full(len(names), np.nan, dtype=np.float64)
        self.names = names
        self._slot_of = {n: i for i, n in enumerate(names)}
        logger.info("replica set changed: %d replicas", len(names))
