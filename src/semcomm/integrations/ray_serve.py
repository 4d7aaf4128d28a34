"""Ray Serve: route requests among a deployment's replicas with semcomm's replica policy.

:class:`SemcommRequestRouter` is a Ray Serve custom request router (``ray.serve.request_router``
API, Ray >= 2.4x). Configure it on a deployment::

    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(
        num_replicas=4,
        request_router_config=RequestRouterConfig(
            request_router_class="semcomm.integrations.ray_serve.SemcommRequestRouter",
            request_router_kwargs={"policy": "default", "chunk_size": 256,
                                   "namespace_hex": engine.namespace_digest.hex()},
        ),
    )
    class Model: ...

Each request's first argument (or the ``request`` keyword) carries the full rendered prompt's
token ids: a dict with ``token_ids`` (or ``prompt_token_ids``), an object with such an attribute,
or a plain list of ints; an optional ``namespace_hex`` field gives the request's own KV
namespace digest (per tenant), otherwise the router's ``namespace_hex`` is used. The router computes the KV store's chunk keys for them (same namespace
and chunk size as the engines, so they equal the engines' keys), plans a replica with a
:class:`semcomm.routing.ReplicaRouter` over the live replica set, and ranks the rest by load as
fallbacks. The decision is recorded at once and moved if Ray reports that the request went
(a fallback rank moves it, ``on_request_routed``) and released in ``on_request_completed``. Requests without token ids
(text only) go by load alone, recorded at once like the others (Ray's queue-length cache can be
stale for a burst of them and send all to one replica). The index is the approximate one (the
router's own history); engines' store events live in the replica processes.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

from ..errors import MissingDependencyError
from ..kv import chunk_keys
from ..routing import ReplicaRouter, RouteDecision

try:
    from ray.serve.request_router import (
        PendingRequest,
        ReplicaID,
        RequestRouter,
        RunningReplica,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        "Ray Serve is not installed; install it with: pip install 'semcomm[ray]'"
    ) from exc

__all__ = ["SemcommRequestRouter", "extract_namespace", "extract_token_ids"]

logger = logging.getLogger(__name__)

_TOKEN_FIELDS = ("token_ids", "prompt_token_ids", "input_ids")


def _ids_from(obj: Any, fields: Sequence[str]) -> list[int] | None:
    if isinstance(obj, dict):
        for f in fields:
            v = obj.get(f)
            if isinstance(v, (list, tuple)) and v and all(isinstance(t, int) for t in v[:4]):
                return [int(t) for t in v]
        return None
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, int) and not isinstance(t, bool) for t in obj):
        return [int(t) for t in obj]
    for f in fields:
        v = getattr(obj, f, None)
        if isinstance(v, (list, tuple)) and v and all(isinstance(t, int) for t in v[:4]):
            return [int(t) for t in v]
    return None


def extract_namespace(args: Sequence[Any], kwargs: dict[str, Any]) -> bytes | None:
    """A per-request KV namespace digest (``namespace_hex``, e.g. per tenant), or None."""
    for c in [*args[:1], kwargs.get("request"), kwargs]:
        v = c.get("namespace_hex") if isinstance(c, dict) else getattr(c, "namespace_hex", None)
        if isinstance(v, str) and v:
            try:
                return bytes.fromhex(v)
            except ValueError:
                logger.warning("ignoring a malformed namespace_hex in a request")
                return None
    return None


def extract_token_ids(args: Sequence[Any], kwargs: dict[str, Any], fields: Sequence[str] = _TOKEN_FIELDS) -> list[int] | None:
    """Token ids of a Serve request (first positional argument or ``request=``), or None."""
    candidates = list(args[:1]) + [kwargs[k] for k in ("request", "body") if k in kwargs]
    candidates.append(kwargs)
    for c in candidates:
        ids = _ids_from(c, fields)
        if ids:
            return ids
    return None


class SemcommRequestRouter(RequestRouter):
    """A Ray Serve request router applying a semcomm replica policy (see the module docstring).

    No ``FIFOMixin``: a replica chosen for a request's prefix must serve that request, not the
    oldest pending one (Ray's base router matches the replica to the request it was chosen for).
    """

    def initialize_state(
        self,
        policy: str = "default",
        chunk_size: int = 256,
        namespace_hex: str = "",
        capacity_chunks: int = 4096,
        slo_ttft_s: float = 2.0,
        policy_options: dict[str, Any] | None = None,
        token_fields: Sequence[str] = _TOKEN_FIELDS,
        probe_deadline_s: float | None = None,
        **_: Any,
    ) -> None:
        """Called by Ray Serve with ``request_router_kwargs``.

        ``probe_deadline_s`` raises Ray's queue-length probe deadline (0.1 s by default): a
        replica that misses it is skipped for the request, which costs the prefix hit on a
        loaded host, so affinity-heavy deployments may want a longer one.
        """
        if probe_deadline_s is not None:
            self.queue_len_response_deadline_s = float(probe_deadline_s)
            self.max_queue_len_response_deadline_s = max(self.max_queue_len_response_deadline_s,
                                                         float(probe_deadline_s))
        self._policy = policy
        self._chunk_size = chunk_size
        self._namespace = bytes.fromhex(namespace_hex)
        self._capacity = capacity_chunks
        self._slo = slo_ttft_s
        self._policy_options = dict(policy_options or {})
        self._token_fields = tuple(token_fields)
        self._semcomm: ReplicaRouter | None = None
        self._planned: dict[int, RouteDecision] = {}  # id(pending_request) -> plan
        self._inflight: dict[tuple[str, str], RouteDecision] = {}  # (replica, request id) -> decision
        self.decisions: list[RouteDecision] = []  # recent recorded decisions (bounded), for inspection
        self.replica_set_changes = 0  # how often the live replica set changed (diagnostics)
        self.fallbacks = 0  # requests Ray sent to a fallback rank instead of the planned replica

    # -- replica set ------------------------------------------------------------------------
    def _sync(self) -> ReplicaRouter | None:
        names = sorted(rid.to_full_id_str() for rid in self._replica_id_set)
        if not names:
            return None
        if self._semcomm is None:
            self._semcomm = ReplicaRouter(
                names, policy=self._policy, namespace=self._namespace, chunk_size=self._chunk_size,
                capacity_chunks=self._capacity, slo_ttft_s=self._slo, policy_options=self._policy_options,
            )
        elif self._semcomm.names != names:
            logger.info("replica set changed: %s -> %s", self._semcomm.names, names)
            self._semcomm.set_replicas(names)
            self.replica_set_changes += 1
        return self._semcomm

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._sync()

    # -- routing ----------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        router = self._sync()
        ids = None
        if pending_request is not None:
            ids = extract_token_ids(pending_request.args, pending_request.kwargs, self._token_fields)
        by_name = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        if router is None or pending_request is None:
            pick = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            return [sorted(pick, key=lambda r: self._queue_len(r.replica_id))]
        # Record at once: Ray may plan the next request before this one is reported routed, and
        # that plan must already see this request's load and prefix.
        old = self._planned.pop(id(pending_request), None)
        if old is not None:  # a retry of the same request: release its previous plan
            router.complete(old)
        ns = extract_namespace(pending_request.args, pending_request.kwargs)
        if ids is None:  # nothing to key: by load alone, counted at once like any other request
            plan = router.route(keys=[], num_tokens=1)
        elif ns is None:
            plan = router.route(ids)
        else:  # the request's own namespace (e.g. its tenant's): keys equal that tenant's KV keys
            plan = router.route(keys=chunk_keys(ns, ids, router.chunk_size), num_tokens=len(ids))
        self._planned[id(pending_request)] = plan
        while len(self._planned) > 10_000:  # requests cancelled before routing: release the oldest
            router.complete(self._planned.pop(next(iter(self._planned))))
        first = by_name.get(plan.replica)
        rest = sorted(
            (r for n, r in by_name.items() if n != plan.replica),
            key=lambda r: int(router.inflight[router.slot(r.replica_id.to_full_id_str())]),
        )
        ranks = [[first]] if first is not None else []
        if rest:
            ranks.append(rest)
        return ranks

    def _queue_len(self, rid: ReplicaID) -> int:
        q = self.replica_queue_len_cache.get(rid)
        return int(q) if q is not None else 0

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        plan = self._planned.pop(id(pending_request), None)
        router = self._semcomm
        if plan is None or router is None:
            return
        name = replica_id.to_full_id_str()
        if name != plan.replica:
            self.fallbacks += 1
        try:
            decision = router.reassign(plan, name)  # no-op when it went where planned
        except ValueError:
            logger.debug("replica %s left before the request was recorded", name)
            router.complete(plan)
            return
        rid = str(pending_request.metadata.internal_request_id)
        self._inflight[(name, rid)] = decision
        self.decisions.append(decision)
        if len(self.decisions) > 1024:
            del self.decisions[:512]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        decision = self._inflight.pop((replica_id.to_full_id_str(), str(internal_request_id)), None)
        if decision is not None and self._semcomm is not None:
            self._semcomm.complete(decision)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sync()
