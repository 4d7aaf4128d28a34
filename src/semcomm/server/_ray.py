"""Scale-out: in-process models become Ray Serve replicas behind semcomm's replica router.

The gateway (auth, admission, semantic cache, model router, pipelines, metrics, dashboard)
stays one process; each ``kind = "hf"`` model becomes a Ray Serve deployment of
``ray.replicas`` :class:`EngineReplica` s. Every replica runs the same KV-reusing engine over a
KV store whose shared tier is Redis (``ray.redis_url``, or ``kv.redis_url``), so a prefix
computed on one replica is a hit on every other one. Requests carry their rendered prompt's
token ids, from which :class:`semcomm.integrations.ray_serve.SemcommRequestRouter` computes the
KV chunk keys and picks the replica most likely to hold the prefix, balanced against load.

Replica streams are not forwarded token by token: a streaming client gets the replica's answer
as one chunk (the first-token time includes the whole generation).

Errors cross the process boundary as data, never as a traceback: a replica answers
``{"error": ...}`` (:func:`error_to_wire`) and the gateway raises the same typed
:mod:`semcomm.errors` error with the same client-facing message (:func:`error_from_wire`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from .. import errors as _errors
from ..errors import ConfigError, SemcommError, UpstreamError, require
from ..runtime import Completion, Delta, Started, StreamItem
from ..security import TenantContext
from ._backends import BackendStatus, GenRequest, PreparedPrompt, collect, render_prompt
from ._config import ServerConfig

__all__ = ["EngineReplica", "RayBackend", "deploy_models", "error_from_wire", "error_to_wire",
           "serve_ray"]

log = logging.getLogger(__name__)


def error_to_wire(exc: BaseException, model: str) -> dict[str, Any]:
    """A replica's error as plain data: its :mod:`semcomm.errors` class and client message.

    A semcomm error keeps its class (the nearest one defined in ``semcomm.errors``), message,
    ``param``, ``status`` and ``retry_after_s``; anything else is an internal failure whose
    details stay in the replica's log.
    """
    if isinstance(exc, SemcommError):
        cls = next(c for c in type(exc).__mro__
                   if issubclass(c, SemcommError) and getattr(_errors, c.__name__, None) is c)
        out: dict[str, Any] = {"type": cls.__name__, "message": str(exc)}
        for attr in ("param", "status", "retryable", "retry_after_s", "status_code"):
            v = getattr(exc, attr, None)
            if isinstance(v, int | float | str | bool):
                out[attr] = v
        return out
    log.error("model %s failed inside a replica", model, exc_info=exc)
    return {"type": "UpstreamError", "status": 502,
            "message": f"model {model!r} failed inside its replica ({type(exc).__name__}); "
                       "see the replica's log"}


def error_from_wire(data: dict[str, Any]) -> SemcommError:
    """The typed error :func:`error_to_wire` described (same class, same message)."""
    cls = getattr(_errors, str(data.get("type", "")), None)
    if not (isinstance(cls, type) and issubclass(cls, SemcommError)):
        cls = UpstreamError
    msg = str(data.get("message", "the replica failed"))
    exc: SemcommError
    if cls is UpstreamError:
        exc = UpstreamError(msg, status=data.get("status"), retryable=bool(data.get("retryable")))
    elif issubclass(cls, _errors.OverloadedError):
        exc = cls(msg, retry_after_s=float(data.get("retry_after_s", 1.0)))
    else:
        exc = cls(msg)
    for attr in ("param", "status_code"):
        if attr in data:
            setattr(exc, attr, data[attr])
    return exc


class EngineReplica:
    """One Ray Serve replica: a model, its KV-reusing engine and a batching worker."""

    def __init__(self, name: str, config_json: str) -> None:
        from ..security import TenantSalter
        from ._backends import LocalBackend
        from ._config import ServerConfig
        from ._wiring import _local_backend, build_kv_store

        cfg = ServerConfig.model_validate_json(config_json)
        store, note = build_kv_store(cfg)
        self.backend: LocalBackend = _local_backend(
            name, cfg.models[name], cfg, store, TenantSalter(cfg.server.secret), {})
        self.name = name
        self.note = note
        try:
            from ray import serve

            self.replica = serve.get_replica_context().replica_id.to_full_id_str()
        except Exception:  # outside Serve (tests of the class itself)
            self.replica = "local"

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request; failures come back as ``{"error": ...}`` (see :func:`error_to_wire`)."""
        tenant = request.get("tenant")
        ctx = TenantContext(tenant, str(request.get("digest") or ""),
                            bool(request.get("isolate", False)))
        req = GenRequest(model=self.name, messages=request.get("messages"),
                         prompt=request.get("prompt"), max_tokens=int(request["max_tokens"]),
                         temperature=float(request.get("temperature", 0.0)),
                         top_p=float(request.get("top_p", 1.0)),
                         stop=list(request.get("stop") or []), seed=request.get("seed"),
                         tenant=tenant, request_id=request.get("request_id", ""),
                         ctx=ctx if ctx.digest else None)
        try:
            final = await collect(self.backend.stream(req))
        except Exception as exc:
            return {"error": error_to_wire(exc, self.name)}
        return {"text": final.text, "finish_reason": final.finish_reason,
                "prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
                "hit_tokens": final.hit_tokens, "ttft_s": final.ttft_s,
                "meta": {**final.meta, "replica": self.replica}}

    def namespace_fields(self) -> dict[str, Any]:
        """This replica's KV namespace without its tenant part (the gateway adds the digest)."""
        import dataclasses

        eng = self.backend.runner.engine(None)
        if eng is None:
            return {}
        return {k: v for k, v in dataclasses.asdict(eng.namespace).items() if k != "tenant"}

    def stats(self) -> dict[str, Any]:
        st = self.backend.status()
        out: dict[str, Any] = {"replica": self.replica, "queue_depth": st.queue_depth,
                               "kv": self.note}
        eng = self.backend.runner.engine(None)
        if eng is not None:
            out["namespace"] = eng.namespace_digest.hex()
            out["store"] = repr(eng.store.stats()) if eng.store is not None else None
            out["namespace_fields"] = {k: str(getattr(eng.namespace, k)) for k in
                                       ("model", "tokenizer", "dtype", "codec", "tenant")}
        return out


class RayBackend:
    """A model served by Ray Serve replicas (a :class:`~semcomm.server.ModelBackend`)."""

    kind = "hf"
    kv_reuse = True  # every replica reuses KV prefixes through the shared store
    max_positions = None  # the replicas' (their own limit applies)

    def __init__(self, name: str, handle: Any, tokenizer: Any, replicas: int,
                 namespace_fields: dict[str, Any] | None = None) -> None:
        self.name = name
        self.namespace_fields = dict(namespace_fields or {})  # replicas' namespace, no tenant
        self.handle = handle
        self.tokenizer = tokenizer
        self.replicas = replicas
        self._in_flight = 0
        self._up = True
        self._detail = f"Ray Serve, {replicas} replicas"

    def status(self) -> BackendStatus:
        return BackendStatus(up=self._up, detail=self._detail, in_flight=self._in_flight)

    def namespace_hex(self, ctx: TenantContext) -> str:
        """The KV namespace digest the replicas store this tenant's chunks under ("" unknown)."""
        if not self.namespace_fields:
            return ""
        from ..kv import Namespace

        return Namespace(**{**self.namespace_fields, "tenant": ctx.digest}).digest.hex()

    def prepare(self, req: GenRequest) -> PreparedPrompt:
        """The rendered prompt's token ids: Ray's router computes the KV chunk keys from them,
        under the tenant's namespace (the same keys as the replicas' KV store)."""
        prep = req.prepared.get(self.name)
        if prep is None:
            ids = render_prompt(self.tokenizer, req)
            prep = req.prepared[self.name] = PreparedPrompt(ids, None,
                                                            kv_tokens=len(ids) + req.max_tokens)
        return prep

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        prep = req.prepared.get(self.name)
        if prep is None:  # a request built outside the gateway
            prep = await asyncio.to_thread(self.prepare, req)
        ids = prep.ids
        ctx = req.tenant_ctx
        body = {"token_ids": ids, "messages": req.messages, "prompt": req.prompt,
                "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "stop": req.stop, "seed": req.seed, "tenant": ctx.tenant, "digest": ctx.digest,
                "isolate": ctx.isolate, "namespace_hex": self.namespace_hex(ctx),
                "request_id": req.request_id}
        self._in_flight += 1
        try:
            out = await self.handle.generate.remote(body)
            self._up, self._detail = True, f"Ray Serve, {self.replicas} replicas"
        except Exception as exc:  # Ray itself failed (replica died, ...): no traceback out
            self._up, self._detail = False, f"Ray Serve failed: {exc.__class__.__name__}"
            log.error("model %s: Ray Serve call failed", self.name, exc_info=exc)
            raise UpstreamError(f"model {self.name!r}: its Ray Serve replica failed "
                                f"({exc.__class__.__name__})", status=502) from None
        finally:
            self._in_flight -= 1
        if "error" in out:
            raise error_from_wire(out["error"])
        hits = [f"kv:{out['hit_tokens']}"] if out["hit_tokens"] else []
        yield Started(prompt_tokens=out["prompt_tokens"], hit_tokens=out["hit_tokens"],
                      replica=str(out["meta"].get("replica", "")))
        if out["text"]:
            yield Delta(out["text"])
        yield Completion(text=out["text"], finish_reason=out["finish_reason"],
                         prompt_tokens=out["prompt_tokens"],
                         completion_tokens=out["completion_tokens"], hits=hits,
                         hit_tokens=out["hit_tokens"], ttft_s=out["ttft_s"], meta=out["meta"])

    async def aclose(self) -> None:
        return None


def _shared_kv(cfg: ServerConfig) -> ServerConfig:
    """The replicas' config: a Redis tier shared by all replicas (required)."""
    url = cfg.ray.redis_url or cfg.kv.redis_url
    if not url:
        raise ConfigError("serve --ray: set ray.redis_url (or kv.redis_url): the replicas share "
                          "their KV prefix cache through Redis")
    tiers = [t for t in cfg.kv.tiers if t != "disk"]  # replicas may live on other machines
    if "redis" not in tiers:
        tiers.append("redis")
    return cfg.model_copy(update={"kv": cfg.kv.model_copy(update={"tiers": tiers,
                                                                 "redis_url": url})})


def deploy_models(cfg: ServerConfig) -> dict[str, RayBackend]:
    """Deploy every in-process model of ``cfg`` on Ray Serve; returns their backends."""
    require("ray", "ray")
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from ..security import load_server_secret

    rcfg = _shared_kv(cfg)
    # every replica must derive the same salts and chunk authentication keys as the gateway:
    # they share the server secret (through the replicas' environment, never the config file)
    secret = cfg.server.secret or load_server_secret().hex()
    actor_options: dict[str, Any] = {"num_cpus": cfg.ray.num_cpus_per_replica,
                                     "runtime_env": {"env_vars": {"SEMCOMM_SECRET": secret}}}
    backends: dict[str, RayBackend] = {}
    for name, mcfg in cfg.models.items():
        if mcfg.kind != "hf":
            continue
        from ._wiring import load_hf

        _, tok, _ = load_hf(mcfg, name)  # the gateway only needs the tokenizer
        chunk = mcfg.chunk_size or rcfg.kv.chunk_size or 256
        deployment: Any = serve.deployment
        dep = deployment(EngineReplica).options(
            name=f"semcomm-{name}", num_replicas=cfg.ray.replicas, max_ongoing_requests=64,
            ray_actor_options=actor_options,
            request_router_config=RequestRouterConfig(
                request_router_class="semcomm.integrations.ray_serve.SemcommRequestRouter",  # type: ignore[arg-type]
                request_router_kwargs={"policy": rcfg.routing.replica_policy,
                                       "chunk_size": chunk}))
        handle = serve.run(dep.bind(name, rcfg.model_dump_json()), name=f"semcomm-{name}",
                           route_prefix=None)
        fields = handle.namespace_fields.remote().result()
        backends[name] = RayBackend(name, handle, tok, cfg.ray.replicas, fields)
        log.info("model %s deployed on Ray Serve: %d replicas", name, cfg.ray.replicas)
    return backends


def serve_ray(cfg: ServerConfig) -> None:
    """``semcomm serve --ray``: start Ray (or join ``ray.address``), deploy, serve the gateway."""
    ray = require("ray", "ray")
    import uvicorn
    from ray import serve

    from ._app import create_app
    from ._wiring import build_gateway

    ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    try:
        gw = build_gateway(cfg, backends=deploy_models(cfg))
        gw.notes["ray"] = f"{cfg.ray.replicas} replicas per model, KV shared through Redis"
        app = create_app(gateway=gw)
        uvicorn.run(app, host=cfg.server.host, port=cfg.server.port, access_log=False)
    finally:
        serve.shutdown()
        ray.shutdown()

