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
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ..kv import Namespace, chunk_keys
from ..routing import ReplicaRouter
from ..security import TenantContext
from ._backends import (
    BackendStatus,
    Completion,
    GenRequest,
    LocalBackend,
    ModelBackend,
    StreamItem,
)
from ._batching import Started

__all__ = ["ReplicatedBackend", "local_replicas", "upstream_replicas"]


def _text(req: GenRequest) -> str:
    if req.messages is None:
        return req.prompt or ""
    return "".join(f"{m['role']}: {m['content']}\n" for m in req.messages)


class ReplicatedBackend:
    """A model served by several replica backends (see the module docstring).

    Invariant: every routed request is completed in the router exactly once (its load drops
    when the stream ends, fails or is abandoned).
    """

    def __init__(self, name: str, replicas: Sequence[ModelBackend], names: Sequence[str], *,
                 prompt_ids: Callable[[GenRequest], list[int]],
                 namespace: Callable[[TenantContext], bytes], chunk_size: int,
                 policy: str = "default") -> None:
        if len(replicas) < 2 or len(replicas) != len(names):
            raise ValueError("a replicated backend needs two or more named replicas")
        self.name = name
        self.replicas = list(replicas)
        self.kind = self.replicas[0].kind
        self.kv_reuse = bool(getattr(self.replicas[0], "kv_reuse", False))
        self._prompt_ids = prompt_ids
        self._namespace = namespace
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

    def keys(self, req: GenRequest) -> tuple[list[Any], int]:
        """The chunk keys of the request's prompt under its tenant's namespace, and its length."""
        ids = self._prompt_ids(req)
        ns = self._namespace(req.tenant_ctx)
        return list(chunk_keys(ns, ids, self.chunk_size)), len(ids)

    def kv_need(self, req: GenRequest, prompt_tokens: int) -> int | None:
        """KV bytes the request will reserve, and the replicas' headroom set in the router
        (None when the replicas report none: upstreams, or no memory plan)."""
        free = [getattr(r, "kv_headroom", lambda: None)() for r in self.replicas]
        if all(f is None for f in free):
            return None
        first: Any = self.replicas[0]
        limit = int(getattr(first, "max_positions", prompt_tokens + req.max_tokens))
        tokens = prompt_tokens + max(0, min(req.max_tokens, limit - prompt_tokens))
        need = first.memory.need_bytes(self.name, tokens)
        self.router.set_kv_free(free)
        return None if need is None else int(need)

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        keys, n = await asyncio.to_thread(self.keys, req)  # tokenizing: off the event loop
        decision = self.router.route(keys=keys, num_tokens=max(n, 1),
                                     kv_bytes=self.kv_need(req, n))
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


def _engine_namespace(backend: LocalBackend) -> Callable[[TenantContext], bytes] | None:
    engine_of = getattr(backend.runner, "engine", None)
    if not callable(engine_of):
        return None
    fields = {k: v for k, v in dataclasses.asdict(engine_of(None).namespace).items()
              if k != "tenant"}

    def namespace(ctx: TenantContext) -> bytes:
        return bytes(Namespace(**{**fields, "tenant": ctx.digest}).digest)

    return namespace


def _named_namespace(name: str) -> Callable[[TenantContext], bytes]:
    def namespace(ctx: TenantContext) -> bytes:
        return hashlib.blake2b(f"semcomm/replicas/{name}\x00{ctx.digest}".encode(),
                               digest_size=32).digest()

    return namespace


def local_replicas(name: str, workers: Sequence[LocalBackend], *, chunk_size: int,
                   policy: str) -> ReplicatedBackend:
    """In-process workers of one model (same weights, same KV store).

    Every worker restores a prefix from the one shared store, so no worker holds a prefix the
    others lack: the "default" policy (which prices each replica's own cached prefix) is
    least-loaded here, and the router still sends a request only to a worker with KV headroom
    for it. Upstream replicas keep "default": each has its own cache.
    """
    first = workers[0]
    if policy == "default":
        policy = "least-loaded"
    return ReplicatedBackend(
        name, workers, [f"worker-{i}" for i in range(len(workers))],
        prompt_ids=first.prompt_ids,  # refuses a prompt too long for the context
        namespace=_engine_namespace(first) or _named_namespace(name),
        chunk_size=chunk_size, policy=policy)


def upstream_replicas(name: str, upstreams: Sequence[ModelBackend], *, chunk_size: int,
                      policy: str) -> ReplicatedBackend:
    """Upstream servers of one model, one per base URL."""
    return ReplicatedBackend(
        name, upstreams, [f"upstream-{i}" for i in range(len(upstreams))],
        prompt_ids=lambda req: list(_text(req).encode("utf-8")),
        namespace=_named_namespace(name), chunk_size=chunk_size, policy=policy)
