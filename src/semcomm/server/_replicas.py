"""One model, several replicas: in-process workers or upstream base URLs, routed per request.

A :class:`ReplicatedBackend` serves a model configured with ``workers = N`` (kind "hf") or
``base_urls = [...]`` (kind "upstream"). Each request's prompt becomes the KV store's chunk keys
(``semcomm.kv.chunk_keys`` under the tenant's namespace: for in-process engines exactly the
namespace the engines store under, so the keys *are* the store's keys) and
``semcomm.routing.ReplicaRouter`` picks the replica: the one most likely to hold the longest
prefix, unless its load says otherwise. In-process workers also report their KV headroom
(what each may still reserve under the memory plan, ``LocalBackend.kv_headroom``): a request's
prompt plus ``max_tokens`` of KV goes to a worker with room for it (token-aware balancing, see
``semcomm.routing.ReplicaRouter.set_kv_free``). The choice is reported in ``Started.replica``
(the ``x-semcomm-replica`` response header) and ``response["semcomm"]["replica"]``.

Upstream replicas have no tokenizer here: their keys are computed over the rendered prompt's
UTF-8 bytes, under a namespace of the model name and the tenant digest (affinity only; the
upstream's own cache is its business).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Sequence

from ..kv import ChunkKey, chunk_keys
from ..routing import ReplicaRouter
from ..runtime import Completion, Started, StreamItem
from ._backends import BackendStatus, GenRequest, LocalBackend, ModelBackend, PreparedPrompt

__all__ = ["ReplicatedBackend", "local_replicas", "upstream_replicas"]


class ReplicatedBackend:
    """A model served by several replica backends (see the module docstring).

    Invariant: every routed request is completed in the router exactly once (its load drops
    when the stream ends, fails or is abandoned).
    """

    def __init__(self, name: str, replicas: Sequence[ModelBackend], names: Sequence[str], *,
                 chunk_size: int, policy: str = "default",
                 workers: Sequence[LocalBackend] = ()) -> None:
        if len(replicas) < 2 or len(replicas) != len(names):
            raise ValueError("a replicated backend needs two or more named replicas")
        self.name = name
        self.replicas = list(replicas)
        self.kind = self.replicas[0].kind
        self.workers = list(workers)  # the in-process workers (empty: upstream replicas)
        self.kv_reuse = bool(self.workers and self.workers[0].kv_reuse)
        self.max_positions = self.workers[0].max_positions if self.workers else None
        self.chunk_size = chunk_size
        # one router for the model (load is per replica, whatever the tenant); the keys carry
        # the tenant's namespace, so one tenant's prefix never attracts another's requests
        self.router = ReplicaRouter(list(names), policy=policy, chunk_size=chunk_size)

    def status(self) -> BackendStatus:
        sts = [r.status() for r in self.replicas]
        up = [s for s in sts if s.up]
        return BackendStatus(up=bool(up), detail=f"{len(up)}/{len(sts)} replicas up; "
                             + "; ".join(f"{n}: {s.detail}" for n, s in
                                         zip(self.router.names, sts)),
                             queue_depth=sum(s.queue_depth for s in sts),
                             in_flight=sum(s.in_flight for s in sts))

    def prepare(self, req: GenRequest) -> PreparedPrompt | None:
        """In-process workers share one model: the first prepares the prompt for all of them
        (its chunk keys are the engines' keys: the router indexes the store's own keys)."""
        return self.workers[0].prepare(req) if self.workers else None

    def keys(self, req: GenRequest) -> tuple[list[ChunkKey], int]:
        """The chunk keys the router sees for ``req`` and its prompt length: the prepared keys
        of in-process workers (none for an isolated request: routed by load alone); for
        upstreams, keys over the prompt's UTF-8 bytes under the model's and tenant's name."""
        prep = self.prepare(req)
        if prep is not None:
            return list(prep.keys or []), len(prep.ids)
        data = req.text.encode("utf-8")
        ns = hashlib.blake2b(f"semcomm/replicas/{self.name}\x00{req.tenant_ctx.digest}"
                             .encode(), digest_size=32).digest()
        return chunk_keys(ns, list(data), self.chunk_size), len(data)

    def kv_need(self, req: GenRequest, prep: PreparedPrompt | None) -> int | None:
        """KV bytes the request will reserve, and the workers' headroom set in the router
        (None when the replicas report none: upstreams, or no memory plan)."""
        if prep is None or not self.workers or self.workers[0].memory is None:
            return None
        self.router.set_kv_free([w.kv_headroom() for w in self.workers])
        need = self.workers[0].memory.need_bytes(self.name, prep.kv_tokens)
        return None if need is None else int(need)

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        if self.workers and self.name not in req.prepared:  # built outside the gateway
            await asyncio.to_thread(self.prepare, req)
        keys, n = self.keys(req)
        decision = self.router.route(keys=keys, num_tokens=max(n, 1),
                                     kv_bytes=self.kv_need(req, req.prepared.get(self.name)))
        backend = self.replicas[decision.slot]
        try:
            async for item in backend.stream(req):
                if isinstance(item, Started):
                    item = dataclasses.replace(item, replica=decision.replica)
                    self.router.prefill_done(decision)
                elif isinstance(item, Completion):
                    item.meta["replica"] = decision.replica
                yield item
        finally:
            self.router.complete(decision)

    async def aclose(self) -> None:
        for r in self.replicas:
            await r.aclose()


def local_replicas(name: str, workers: Sequence[LocalBackend], *, chunk_size: int,
                   policy: str) -> ReplicatedBackend:
    """In-process workers of one model (same weights, same KV store).

    Every worker restores a prefix from the one shared store, so no worker holds a prefix the
    others lack: the "default" policy (which prices each replica's own cached prefix) is
    least-loaded here, and the router still sends a request only to a worker with KV headroom
    for it. Upstream replicas keep "default": each has its own cache.
    """
    if policy == "default":
        policy = "least-loaded"
    return ReplicatedBackend(name, workers, [f"worker-{i}" for i in range(len(workers))],
                             chunk_size=chunk_size, policy=policy, workers=workers)


def upstream_replicas(name: str, upstreams: Sequence[ModelBackend], *, chunk_size: int,
                      policy: str) -> ReplicatedBackend:
    """Upstream servers of one model, one per base URL."""
    return ReplicatedBackend(name, upstreams, [f"upstream-{i}" for i in range(len(upstreams))],
                             chunk_size=chunk_size, policy=policy)
