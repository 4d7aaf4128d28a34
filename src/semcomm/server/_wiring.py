"""``build_gateway(config)``: the gateway and all its parts, built from the config in one step.

Parts: the KV store, the semantic layer, the models (in-process engines, several workers or
upstream URLs behind the replica router, upstreams), pipelines over them with their C2C
fusion registry, the admission guard and the model router.

Each part comes from its own package (``semcomm.engine``, ``semcomm.kv``, ``semcomm.semantic``,
``semcomm.security``, ``semcomm.routing``, ``semcomm.fusion``, ``semcomm.reference``). What
could not be wired is recorded in the gateway's ``notes`` (shown by ``/health``) and logged, never
silently dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, SemcommError
from ..kv import ChunkStore
from ..runtime import (
    BatchingWorker,
    KVAccountant,
    MemoryMonitor,
    MemoryPlan,
    PrefillScheduler,
    Runner,
    prefill_scheduler,
)
from ..security import TenantSalter
from ._backends import LocalBackend, ModelBackend
from ._c2c import FusionRegistry
from ._config import ModelConfig, ServerConfig
from ._faults import FaultyBackend
from ._gateway import Admitter, Gateway, ModelChooser
from ._pipeline import PipelineBackend
from ._upstream import UpstreamBackend

__all__ = ["AutoModel", "build_gateway", "build_kv_store", "build_semantic", "load_hf"]

log = logging.getLogger(__name__)


def _reference_path(which: str) -> Path | None:
    """The shipped reference model ``which`` ("sharer" or "receiver"), if it is installed."""
    from ..reference import receiver_path, sharer_path

    p = Path((sharer_path if which == "sharer" else receiver_path)())
    return p if (p / "config.json").exists() else None


def _model_source(cfg: ModelConfig, name: str) -> tuple[str | None, str | None]:
    """``(directory or hub id, catalog name)`` of an in-process model entry; ``(None, None)``
    for the config-built tiny model."""
    path = cfg.path or "auto"
    if path == "auto":
        ref = _reference_path("receiver")
        return (str(ref), None) if ref is not None else (None, None)
    if path == "tiny":
        return None, None
    if path.startswith("reference:"):
        which = path.split(":", 1)[1]
        ref = _reference_path(which)
        if ref is None:
            raise ConfigError(f"models.{name}.path: reference model {which!r} is not available "
                              "(run `semcomm reference build`)")
        return str(ref), None
    from ..models import is_catalog_name, resolve_model

    if is_catalog_name(path):
        try:
            return resolve_model(path), path  # pulled and converted on first use
        except SemcommError as exc:
            raise ConfigError(f"models.{name}.path: catalog model {cfg.path!r} is not "
                              f"available: {exc}") from exc
    return path, None


def load_hf(cfg: ModelConfig, name: str) -> tuple[Any, Any, str]:
    """Load ``(model, tokenizer, model_id)`` for an in-process model entry."""
    from ..reference import TINY_MODEL_ID, build_tiny_model

    path, model_id = _model_source(cfg, name)  # model_id: a catalog name, shown as the id
    if path is None:
        model, tok = build_tiny_model()
        return model, tok, TINY_MODEL_ID
    from transformers import AutoTokenizer

    from ..engine import load_model

    try:
        model = load_model(path, dtype=cfg.dtype, device=cfg.device or "cpu")
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"models.{name}.path: cannot load {path!r}: {exc}") from exc
    return model, tok, model_id or path


def _kv_memory_bytes(config: ServerConfig) -> int:
    """KV store memory the plan counts: the memory tier's budget and a write-behind queue."""
    kv = config.kv
    if not kv.enabled:
        return 0
    queue = kv.disk_max_pending_bytes if kv.disk_durability == "write-behind" else 0
    return ((kv.memory_bytes if "memory" in kv.tiers else 0)
            + (queue if "disk" in kv.tiers else 0))


def build_kv_store(config: ServerConfig) -> tuple[Any, str]:
    """The ChunkStore shared by in-process engines (None when unavailable), and a note."""
    kv = config.kv
    if not kv.enabled:
        return None, "disabled in config"
    from ..kv import DiskStore, MemoryStore, RedisStore, TieredStore

    tiers: list[ChunkStore] = []
    sealer = _chunk_sealer(config)
    for tier in kv.tiers:
        if tier == "memory":
            tiers.append(MemoryStore(capacity_bytes=kv.memory_bytes, eviction=kv.memory_eviction))
        elif tier == "disk":
            path = Path(kv.disk_path).expanduser() if kv.disk_path else config.state_dir() / "kv"
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"kv.disk_path: cannot create {path}: "
                                  f"{exc.strerror or exc}") from None
            tiers.append(DiskStore(path, capacity_bytes=kv.disk_bytes, sealer=sealer,
                                   durability=kv.disk_durability,
                                   max_pending_bytes=kv.disk_max_pending_bytes))
        else:  # "redis" (the config allows no other)
            tiers.append(RedisStore(url=str(kv.redis_url), sealer=sealer))
    if not tiers:
        return None, "no KV store tier configured"
    note = f"tiers {[t.name for t in tiers]}"
    return (tiers[0] if len(tiers) == 1 else TieredStore(tiers)), note


def _keyring(config: ServerConfig) -> Any:
    from ..security import keyring_from_config

    return keyring_from_config({"seal_secrets": config.security.seal_secrets},
                               config.server.secret)


def _chunk_sealer(config: ServerConfig) -> Any:
    """AES-GCM sealing of KV chunks at rest (disk, Redis), unless ``security.seal_at_rest = false``."""
    if not config.security.seal_at_rest:
        return None
    from ..security import ChunkSealer

    return ChunkSealer(_keyring(config))


def _entry_sealer(config: ServerConfig) -> Any:
    """AES-GCM sealing of semantic entries at rest (SQLite, Redis), unless ``seal_at_rest = false``."""
    if not config.security.seal_at_rest:
        return None
    from ..security import EntrySealer

    return EntrySealer(_keyring(config))


def build_semantic(config: ServerConfig, salter: TenantSalter | Any) -> tuple[Any, str]:
    """The gateway's semantic layer (None when disabled or unavailable) and a note.

    ``salter``: the server's :class:`~semcomm.security.TenantSalter` (or anything holding it
    as ``.salter``, e.g. a :class:`Gateway`).
    """
    salter = getattr(salter, "salter", salter)
    sc = config.semantic
    if not sc.enabled:
        return None, "disabled in config"
    from ..semantic import SemanticCache
    from ._semantic_layer import SemanticLayer

    kw: dict[str, Any] = {}
    sealer = _entry_sealer(config)
    if sc.backend == "sqlite":
        path = Path(sc.path).expanduser() if sc.path else config.state_dir() / "semantic.sqlite3"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"semantic.path: cannot create {path.parent}: "
                              f"{exc.strerror or exc}") from None
        if sealer is None:
            kw["path"] = str(path)
        else:
            from ..semantic import SQLiteEntryStore

            kw["store"] = SQLiteEntryStore(path, sealer=sealer)
    elif sc.backend == "redis":
        kw["store"] = _redis_semantic_store(sc.redis_url, sealer)
    if sc.threshold is not None:
        kw["threshold"] = sc.threshold
    if sc.cross_encoder is not None:
        kw["cross_encoder"] = sc.cross_encoder
    if sc.intent_check is not None:
        kw["intent_check"] = sc.intent_check
    if sc.mode == "shadow":  # every request goes to the model; `semcomm cache report` reads the log
        kw["mode"] = "shadow"
        kw["shadow_log"] = str(config.state_dir() / "semantic_shadow.jsonl")
    if sc.hnsw:
        kw["hnsw"] = dict(sc.hnsw)
    if sc.ivf:
        kw["ivf"] = dict(sc.ivf)
    try:
        cache = SemanticCache(salter=salter, context_turns=sc.context_turns, **kw)
    except Exception as exc:  # a broken semantic backend must not stop the server: loud, not silent
        log.error("semantic cache (%s) could not start: %s", sc.backend, exc)
        return None, f"{sc.backend} semantic cache could not start: {exc}"
    layer = SemanticLayer(cache, ttl_s=sc.ttl_s, backend=sc.backend, salter=salter)
    return layer, f"{sc.backend} semantic cache"


def _redis_semantic_store(url: str | None, sealer: Any = None) -> Any:
    from .. import semantic

    cls = getattr(semantic, "RedisEntryStore", None)
    if cls is None:
        raise ConfigError("semantic.backend = 'redis': semcomm.semantic has no Redis store")
    return cls(url) if sealer is None else cls(url, sealer=sealer)


def scheduler_for(server: Any) -> PrefillScheduler | None:
    """The process's prefill scheduler for a ``[server]`` config section (None: turned off)."""
    return prefill_scheduler(server.long_prefill_slots, server.long_prefill_tokens,
                             server.long_prefill_piece_tokens, server.long_prefill_nice,
                             yield_to_short=server.long_prefill_yield,
                             yield_max_s=server.long_prefill_yield_max_ms / 1e3,
                             yield_run_s=server.long_prefill_yield_run_ms / 1e3)


def _anchor_pool(cfg: ModelConfig) -> Any:
    """The model's anchor pool (``anchor_bytes``; None when 0): documents' in-context KV."""
    from ..engine import AnchorPool

    return AnchorPool(cfg.anchor_bytes) if cfg.anchor_bytes else None


def _build_worker(name: str, cfg: ModelConfig, config: ServerConfig, store: Any,
                  salter: TenantSalter, notes: dict[str, str], loaded: tuple[Any, Any, str],
                  worker_name: str | None, anchors: Any = None) -> tuple[BatchingWorker, bool]:
    """A batching worker over a loaded model (engine runner with KV reuse when it can, its
    engines given the model's anchor pool ``anchors``), and whether it reuses KV."""
    from ..runtime import DirectRunner, engine_runner

    model, tok, model_id = loaded
    runner: Runner | None = None
    if cfg.kv_cache and store is not None:
        runner, why = engine_runner(model, tok, model_id=model_id, store=store, salter=salter,
                                    chunk_size=cfg.chunk_size or config.kv.chunk_size,
                                    codec=config.kv.codec,
                                    scheduler=scheduler_for(config.server),
                                    keep_logits=config.kv.keep_logits, anchors=anchors)
        notes[f"model:{name}"] = why
    kv_reuse = runner is not None
    if runner is None:
        runner = DirectRunner(model, tok, model_id=model_id)
        notes.setdefault(f"model:{name}", "plain batched decoding (no KV reuse)")
    worker = BatchingWorker(runner, max_batch=cfg.max_batch or config.server.max_batch,
                            max_queue=cfg.max_queue or config.server.max_queue,
                            name=worker_name or name,
                            batch_wait_s=config.server.batch_wait_ms / 1000)
    return worker, kv_reuse


def _keep_alive(name: str, cfg: ModelConfig, config: ServerConfig,
                notes: dict[str, str]) -> float | None:
    """The model's effective keep-alive: None when pinned (pin wins) or when a C2C handoff
    may hold its weights (a fuser keeps the model object it was built over)."""
    if cfg.keep_alive_s is None:
        return None
    if cfg.pin:
        notes[f"keep_alive:{name}"] = "pinned: never unloaded (pin wins over keep_alive_s)"
        return None
    for pname, p in config.pipelines.items():
        models = {st.model for st in p.stages}
        if name in models and len(models) > 1 and p.handoff in ("auto", "c2c"):
            notes[f"keep_alive:{name}"] = (f"stays loaded: pipeline {pname!r} may hand off "
                                           "by C2C, whose fuser holds the model")
            return None
    notes[f"keep_alive:{name}"] = f"unloaded after {cfg.keep_alive_s:g} s idle"
    return cfg.keep_alive_s


def _local_backend(name: str, cfg: ModelConfig, config: ServerConfig, store: Any,
                   salter: TenantSalter, notes: dict[str, str],
                   loaded: tuple[Any, Any, str] | None = None,
                   worker_name: str | None = None,
                   memory: KVAccountant | None = None, anchors: Any = None) -> LocalBackend:
    """One in-process worker; ``anchors``: the pool its model's workers share (default: a pool
    of its own, dropped with the worker when keep-alive unloads it, as the plan counts)."""
    first = loaded if loaded is not None else load_hf(cfg, name)
    pool = anchors if anchors is not None else _anchor_pool(cfg)
    worker, kv_reuse = _build_worker(name, cfg, config, store, salter, notes, first, worker_name,
                                     pool)
    del first  # the worker's runner holds the model; keep-alive must be able to drop it
    keep = _keep_alive(name, cfg, config, notes) if worker_name is None else None
    reload = None
    if keep is not None:
        def reload() -> BatchingWorker:  # a fresh model and worker, as at start-up
            return _build_worker(name, cfg, config, store, salter, {}, load_hf(cfg, name),
                                 None, _anchor_pool(cfg))[0]
    return LocalBackend(name, worker, kv_reuse=kv_reuse, reload=reload, keep_alive_s=keep,
                        memory=memory)


def _chunk(cfg: ModelConfig, config: ServerConfig) -> int:
    from ..engine import DEFAULT_CHUNK_SIZE

    return cfg.chunk_size or config.kv.chunk_size or DEFAULT_CHUNK_SIZE


def _upstream(name: str, mcfg: ModelConfig, config: ServerConfig) -> ModelBackend:
    """One upstream, or several (``base_urls``) behind the replica router."""
    ups: list[ModelBackend] = [
        UpstreamBackend(name, base_url=url, api_key=mcfg.api_key,
                        upstream_model=mcfg.upstream_model, timeout_s=mcfg.timeout_s,
                        connect_timeout_s=mcfg.connect_timeout_s, max_retries=mcfg.max_retries,
                        forward_tenant=mcfg.forward_tenant)
        for url in mcfg.replica_urls]
    if len(ups) == 1:
        return ups[0]
    from ._replicas import upstream_replicas

    return upstream_replicas(name, ups, chunk_size=_chunk(mcfg, config),
                             policy=config.routing.replica_policy)


def _local_workers(name: str, mcfg: ModelConfig, config: ServerConfig, store: Any,
                   salter: TenantSalter, notes: dict[str, str], loaded: tuple[Any, Any, str],
                   memory: KVAccountant | None) -> ModelBackend:
    """``workers`` in-process workers over one loaded model, behind the replica router."""
    from ._replicas import local_replicas

    pool = _anchor_pool(mcfg)  # one for the model: a stage's anchors serve the next anywhere
    workers = [_local_backend(name, mcfg, config, store, salter, notes, loaded=loaded,
                              worker_name=f"{name}/worker-{i}", memory=memory, anchors=pool)
               for i in range(mcfg.workers)]
    notes[f"model:{name}"] += f"; {mcfg.workers} workers, replica router"
    return local_replicas(name, workers, chunk_size=_chunk(mcfg, config),
                          policy=config.routing.replica_policy)


def build_models(config: ServerConfig, store: Any, salter: TenantSalter,
                 notes: dict[str, str], *, loaded: dict[str, tuple[Any, Any, str]],
                 memory: KVAccountant | None, given: Mapping[str, ModelBackend] | None = None
                 ) -> dict[str, ModelBackend]:
    """Every configured model's backend (``given`` ones, e.g. Ray deployments, used as they
    are); in-process ones over the ``loaded`` models (taken out of the dict: the workers then
    hold the only reference, so keep-alive can drop them)."""
    models: dict[str, ModelBackend] = dict(given or {})
    for name, mcfg in config.models.items():
        if name in models:
            continue
        backend: ModelBackend
        if mcfg.kind == "upstream":
            backend = _upstream(name, mcfg, config)
            notes[f"model:{name}"] = f"upstream {', '.join(mcfg.replica_urls)}"
        elif mcfg.workers > 1:
            backend = _local_workers(name, mcfg, config, store, salter, notes,
                                     loaded.pop(name), memory)
        else:
            backend = _local_backend(name, mcfg, config, store, salter, notes,
                                     loaded=loaded.pop(name), memory=memory)
        if mcfg.fail_mode != "none":
            log.warning("model %s fails on purpose (fail_mode=%s): test configuration", name,
                        mcfg.fail_mode)
            backend = FaultyBackend(backend, mcfg.fail_mode, delay_s=mcfg.fail_delay_s,
                                    count=mcfg.fail_count)
        models[name] = backend
    return models


def build_gateway(config: ServerConfig, *,
                  backends: Mapping[str, ModelBackend] | None = None) -> Gateway:
    """The gateway of ``config``, every part built and typed, ready to serve.

    ``backends`` supplies models built elsewhere (``serve --ray`` deploys them on Ray Serve);
    every other configured model, the pipelines and the hooks are built here.
    """
    from ._preflight import preflight

    preflight(config)  # paths, the secret, named files: one clear line before any model loads
    if config.server.torch_threads:
        import torch

        torch.set_num_threads(config.server.torch_threads)
    salter = TenantSalter(config.server.secret)
    notes: dict[str, str] = {}
    kv_store, notes["kv"] = build_kv_store(config)
    semantic, notes["semantic"] = build_semantic(config, salter)
    _load_semantic_models(semantic)
    from ..runtime import current_rss_bytes

    # the process before any model is loaded (the semantic embedder and verifier included)
    baseline = current_rss_bytes()
    loaded = {name: load_hf(m, name) for name, m in config.models.items()
              if m.kind == "hf" and name not in (backends or {})}
    plan, accountant = build_plan_for(config, loaded, baseline, notes)
    models = build_models(config, kv_store, salter, notes, loaded=loaded, memory=accountant,
                          given=backends)
    del loaded  # emptied by build_models: the workers hold the models now
    memory = build_monitor(config, plan, accountant, models, kv_store)
    fusions = FusionRegistry(dict(models), notes)
    every: dict[str, ModelBackend] = dict(models)
    for pname, pcfg in config.pipelines.items():
        pipe = PipelineBackend(pname, pcfg, models, fusions)
        every[pname] = pipe
        notes[f"pipeline:{pname}"] = pipe.plan_note()
    guard = build_guard(config, salter, notes)
    router = build_model_router(config, semantic, models, notes)
    prefill = (scheduler_for(config.server)
               if any(m.kind == "hf" for m in config.models.values()) else None)
    return Gateway(config, backends=every, semantic=semantic, kv_store=kv_store, guard=guard,
                   model_router=router, salter=salter, notes=notes, memory=memory,
                   prefill=prefill)


def _load_semantic_models(semantic: Any) -> None:
    """Load the semantic cache's embedder and cross-encoder verifier before the plan's baseline
    is measured (startup's warm-up would load them after the plan was made: about 90 MB each
    it did not count). A failure is left to the warm-up, which marks the layer down."""
    if semantic is None:
        return
    try:
        semantic.load_models()
    except Exception as exc:
        log.warning("semantic models not loaded before the memory plan (%s); warm-up tries "
                    "again", exc)


def plan_config(config: ServerConfig) -> MemoryPlan:
    """The memory plan of ``config`` before start-up (``semcomm serve --check``): weights from
    each model directory's safetensors headers (catalog models are pulled first), the baseline
    a documented default; raises :class:`ConfigError` naming the numbers when it cannot fit."""
    from transformers import AutoConfig

    from ..engine import resolve_dtype
    from ..reference import build_tiny_model
    from ..runtime import (
        DEFAULT_BASELINE_BYTES,
        ModelFacts,
        build_plan,
        weight_bytes,
        weight_bytes_from_dir,
    )

    facts: dict[str, ModelFacts] = {}
    for name, mcfg in config.models.items():
        if mcfg.kind != "hf":
            continue
        path, _ = _model_source(mcfg, name)
        dtype = str(resolve_dtype(mcfg.dtype)).removeprefix("torch.")
        if path is None:
            model, _tok = build_tiny_model()
            hf_config, wbytes, measured = model.config, weight_bytes(model), True
        else:
            try:
                hf_config = AutoConfig.from_pretrained(path)
                wbytes = weight_bytes_from_dir(path, dtype)
                measured = False
            except (OSError, ValueError, SemcommError) as exc:
                raise ConfigError(f"models.{name}.path: cannot plan {path!r}: {exc}") from exc
        workers = max(1, mcfg.workers)
        facts[name] = ModelFacts(config=hf_config, weight_bytes=wbytes, measured=measured,
                                 dtype=dtype, max_context=mcfg.max_context, kv_bytes=mcfg.kv_bytes,
                                 anchor_bytes=mcfg.anchor_bytes, pinned=mcfg.pin,
                                 keep_alive_s=None if mcfg.pin else mcfg.keep_alive_s,
                                 max_batch=(mcfg.max_batch or config.server.max_batch) * workers)
    mem_tier = _kv_memory_bytes(config)
    return build_plan(facts, limit_bytes=config.server.memory_bytes,
                      prefix_cache_bytes=mem_tier, baseline_bytes=DEFAULT_BASELINE_BYTES)


def _local_members(backend: Any) -> list[LocalBackend]:
    """The in-process workers behind a model's backend (one, several, or none if upstream)."""
    from ._replicas import ReplicatedBackend

    inner = backend.inner if isinstance(backend, FaultyBackend) else backend
    if isinstance(inner, LocalBackend):
        return [inner]
    if isinstance(inner, ReplicatedBackend):  # in-process workers (upstreams are not ours)
        return [r for r in inner.replicas if isinstance(r, LocalBackend)]
    return []  # upstream or Ray replicas: their memory is another process's


def build_plan_for(config: ServerConfig, loaded: Mapping[str, tuple[Any, Any, str]],
                   baseline: int, notes: dict[str, str]) -> tuple[MemoryPlan, KVAccountant]:
    """The process's memory plan over the ``loaded`` in-process models, checked against
    ``server.memory_bytes`` (a :class:`ConfigError` naming the numbers when it cannot fit),
    and the KV admission every in-process worker is built with."""
    from ..runtime import ModelFacts, build_plan, weight_bytes

    facts: dict[str, ModelFacts] = {}
    for name, (model, _tok, _id) in loaded.items():
        mcfg = config.models[name]
        workers = max(1, mcfg.workers)
        keep = None if workers > 1 else _keep_alive(name, mcfg, config, notes)
        facts[name] = ModelFacts(
            config=model.config, weight_bytes=weight_bytes(model), measured=True,
            dtype=str(next(model.parameters()).dtype), max_context=mcfg.max_context,
            kv_bytes=mcfg.kv_bytes, anchor_bytes=mcfg.anchor_bytes, pinned=mcfg.pin,
            keep_alive_s=keep,
            max_batch=(mcfg.max_batch or config.server.max_batch) * workers)
    plan = build_plan(facts, limit_bytes=config.server.memory_bytes,
                      prefix_cache_bytes=_kv_memory_bytes(config), baseline_bytes=baseline)
    plan.check()
    accountant = KVAccountant(plan.models, max_wait_s=config.server.kv_wait_s)
    for name in loaded:
        accountant.set_workers(name, max(1, config.models[name].workers))
    limit = config.server.memory_bytes
    notes["memory"] = (f"plan {plan.planned_bytes / 2**20:,.0f} MiB"
                       + (f" of {limit / 2**20:,.0f} MiB" if limit else " (no limit set)"))
    return plan, accountant


def build_monitor(config: ServerConfig, plan: MemoryPlan, accountant: KVAccountant,
                  models: Mapping[str, ModelBackend], kv_store: ChunkStore | None
                  ) -> MemoryMonitor:
    """What ``/health`` and the metrics show of memory: the plan, live KV, cached KV by model
    and each model's residency."""
    members = {name: local for name, b in models.items() if (local := _local_members(b))}
    tier = None
    if kv_store is not None:
        tier = next((t for t in kv_store.tiers if t.namespace_bytes() is not None), None)

    def namespaces() -> dict[str, set[bytes]]:
        out: dict[str, set[bytes]] = {}
        for name, local in members.items():
            for b in local:  # loaded or not: an unloaded model's chunks stay in the store
                out.setdefault(name, set()).update(b.namespaces())
        return out

    def residency() -> dict[str, dict[str, Any]]:
        return {name: local[0].residency.as_dict() for name, local in members.items()}

    return MemoryMonitor(plan, accountant, namespaces=namespaces,
                         tier_bytes=tier.namespace_bytes if tier is not None else None,
                         residency=residency)


def build_guard(config: ServerConfig, salter: TenantSalter, notes: dict[str, str]
                ) -> Admitter | None:
    """Admission from ``[security]``: client salts refused, probe detection, rate limit."""
    sec = config.security
    try:
        from ..security import ProbeConfig, ProbeDetector, RateLimiter, RequestGuard
    except ImportError as exc:  # pragma: no cover
        notes["security"] = f"semcomm.security guard unavailable: {exc}"
        return None
    detector = None
    limiter = None
    if sec.probe_detection:
        pc = sec.probe
        detector = ProbeDetector(ProbeConfig(**{**pc.model_dump(), "exempt_tenants": tuple(
            pc.exempt_tenants)}) if pc is not None else None)
    if sec.rate_limit_rps:
        limiter = RateLimiter(rate_per_s=sec.rate_limit_rps, burst=sec.rate_limit_burst)
    notes["security"] = (f"request guard: client salts refused; probe detection "
                         f"{'on' if detector else 'off'}; rate limit {'on' if limiter else 'off'}")
    return RequestGuard(salter, detector=detector, limiter=limiter)


class AutoModel:
    """Model "auto": the trained model router's choice among the models a request may use."""

    def __init__(self, router: Any, allowed: set[str]) -> None:
        self.router = router  # semcomm.routing.ModelRouter (embeds the conversation)
        self.allowed = allowed

    def __call__(self, req: Any, available: list[str]) -> str | None:
        convo = req.messages if req.messages is not None else (req.prompt or "")
        choice = self.router.route(convo)
        ok = choice.model in available and choice.model in self.allowed
        return choice.model if ok else None


def build_model_router(config: ServerConfig, semantic: Any, models: Mapping[str, ModelBackend],
                       notes: dict[str, str]) -> ModelChooser | None:
    """Model "auto" from ``routing.model_router`` (None: ``routing.default_model``)."""
    rc = config.routing
    if not rc.model_router:
        notes["model_router"] = "none: 'auto' means routing.default_model"
        return None
    try:
        from ..routing import ModelRouter
    except ImportError as exc:
        raise ConfigError(f"routing.model_router: semcomm.routing is unavailable ({exc})") from exc
    embedder = None
    if semantic is not None:  # share the semantic cache's embedder (one copy in memory)
        embedder = getattr(semantic.cache, "embedder", None)
    router = ModelRouter.load(rc.model_router, embedder=embedder)
    names = [m.name for m in router.models]
    unknown = [n for n in names if n not in models]
    if unknown:
        raise ConfigError(f"routing.model_router: {rc.model_router} routes to models that are "
                          f"not configured: {unknown}")
    notes["model_router"] = f"semcomm.routing.ModelRouter over {names}"
    return AutoModel(router, set(rc.auto_models or names))
