"""The runners: each turns a batch of queued jobs into one ``semcomm.engine`` call.

* :class:`EngineRunner` serves a model through per-tenant ``semcomm.engine.HFEngine`` s (each
  has its own salted KV namespace), all sharing one model and one store: KV prefix reuse.
* :class:`DirectRunner` serves a model the engine does not support, without KV reuse.
* The engines' prefills run through the process's :class:`PrefillScheduler` (long prefills in
  pieces, bounded, yielding to short requests), given to each engine at construction.

Both hand the batch to one ``semcomm.engine.BatchDecoder`` (the one decode loop: sampling,
detokenizing, stop strings, batching; a batch of one with an engine is exactly
``HFEngine.generate``, docs/architecture.md, invariant 2) and turn its callbacks and results
into the job's events: ``Started``, ``Delta`` pieces, one ``Completion``. Neither touches KV
tensors nor the transformers cache API.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from ..engine import (
    DEFAULT_CHUNK_SIZE,
    AnchorPool,
    BatchDecoder,
    BatchRequest,
    BatchResult,
    GenerationStats,
    HFEngine,
    SamplingParams,
)
from ..kv import ChunkKey, ChunkStore
from ..security import TenantContext, TenantSalter
from ._batching import Job
from ._events import Completion, Delta, Started
from ._prefill import PrefillScheduler

__all__ = ["DirectRunner", "EngineRunner", "engine_runner"]

log = logging.getLogger(__name__)


def engine_runner(model: Any, tokenizer: Any, *, model_id: str, store: ChunkStore,
                  salter: TenantSalter, chunk_size: int | None, codec: str | None,
                  scheduler: PrefillScheduler | None = None,
                  keep_logits: bool = True,
                  anchors: AnchorPool | None = None) -> tuple[EngineRunner | None, str]:
    """Return ``(runner, note)``; ``runner`` is None when the engine cannot serve this model."""
    try:
        runner = EngineRunner(model, tokenizer, model_id=model_id, store=store, salter=salter,
                              chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                              codec=codec or "lossless", scheduler=scheduler,
                              keep_logits=keep_logits, anchors=anchors)
    except Exception as exc:  # unsupported model family etc.: serve it plainly, say why
        log.warning("model %s served without KV reuse: %s", model_id, exc)
        return None, f"HFEngine refused the model ({exc}); plain batched decoding"
    pool = (f", anchor pool {anchors.budget_bytes / 2**20:g} MiB" if anchors is not None
            else "")
    return runner, (f"HFEngine: KV prefix reuse, chunk {runner.chunk_size}, codec "
                    f"{runner.codec}, store {store.name}{pool}")


def _kv_extra(st: GenerationStats) -> dict[str, Any]:
    """The engine's per-request KV statistics, as reported in ``Completion.meta["kv"]``."""
    return {"hit_tokens": st.hit_tokens, "tier": st.tier,
            "bytes_loaded": st.bytes_loaded, "bytes_stored": st.bytes_stored,
            "load_ms": round(st.load_ms, 3), "prefill_ms": round(st.prefill_ms, 3)}


def _request(job: Job, engine: HFEngine | None = None) -> BatchRequest:
    """The engine's request for ``job``: its events go to ``job.emit``."""
    def started(st: GenerationStats) -> None:
        # a whole hit with its stored logits restores every prompt token (docs/architecture.md,
        # invariant 3); a prompt with documents reports its exact prefix as KV and the reused
        # document tokens as a layer of their own
        doc = st.documents
        if doc is None:
            job.emit(Started(prompt_tokens=st.prompt_tokens, hit_tokens=st.hit_tokens,
                             hit_tiers=st.hit_tiers))
        else:
            job.emit(Started(prompt_tokens=st.prompt_tokens,
                             hit_tokens=int(doc["prefix_hit_tokens"]),
                             layers=(f"docs:{doc['reused_tokens']}",)))

    def text(piece: str) -> None:
        job.emit(Delta(piece))

    return BatchRequest(
        prompt_ids=list(job.prompt_ids), max_new_tokens=job.max_new_tokens,
        params=SamplingParams(temperature=job.temperature, top_p=job.top_p, seed=job.seed),
        stop=tuple(job.stop), engine=engine, snapshot=job.snapshot, on_start=started,
        on_text=text, cancelled=job.cancelled.is_set,
        keys=job.keys if engine is not None and not job.isolate else None,
        segments=job.segments if engine is not None else None, selector=job.selector,
        recompute=job.recompute, margin=job.margin, watch=job.watch)


def _completion(res: BatchResult, *, kv: bool) -> Completion:
    st = res.stats
    meta: dict[str, Any] = {}
    hits = [f"kv:{st.hit_tokens}"] if st.hit_tokens else []
    if kv:
        meta["kv"] = _kv_extra(st)
        if res.batch > 1:
            meta["batch"] = res.batch
        if st.hit_tiers:
            meta["kv_tiers"] = sorted(set(st.hit_tiers))
        if st.documents is not None:  # what the documents reused and recomputed
            doc = meta["documents"] = dict(st.documents)
            prefix = int(doc["prefix_hit_tokens"])
            hits = [f"kv:{prefix}"] if prefix else []
            hits.append(f"docs:{doc['reused_tokens']}")
    return Completion(
        text=res.text, finish_reason="length" if res.finish_reason == "length" else "stop",
        prompt_tokens=st.prompt_tokens, completion_tokens=len(res.token_ids),
        hits=hits, hit_tokens=st.hit_tokens, ttft_s=st.ttft_s, meta=meta)


def _emit_all(jobs: Sequence[Job], results: Sequence[BatchResult], *, kv: bool) -> None:
    for job, res in zip(jobs, results):
        if res.finish_reason != "cancelled":  # a cancelled job: nobody listens
            job.emit(_completion(res, kv=kv))


class EngineRunner:
    """Runs batches of jobs on per-tenant ``HFEngine`` s over one shared model (see module doc).

    The runner owns the model it serves: with a scheduler, the scheduler's pause point goes on
    the model's decoder layers here, once (``PrefillScheduler.attach``). ``anchors``: one
    :class:`~semcomm.engine.AnchorPool` every tenant's engine shares (its keys are
    tenant-bound), not the isolated ones (they keep nothing).
    """

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str, store: ChunkStore,
                 salter: TenantSalter, chunk_size: int, codec: str,
                 scheduler: PrefillScheduler | None = None, keep_logits: bool = True,
                 anchors: AnchorPool | None = None) -> None:
        self.scheduler = scheduler
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.store = store
        self.salter = salter
        self.chunk_size = chunk_size
        self.codec = codec
        self.keep_logits = keep_logits
        self.anchors = anchors
        self._engines: dict[tuple[str | None, bool], HFEngine] = {}
        self._lock = threading.Lock()
        first = self.engine(None)  # validates the model family once, up front
        self.decoder = BatchDecoder.for_engine(first)
        self.max_positions = self.decoder.max_positions
        if scheduler is not None:
            scheduler.attach(self.model)

    def engine(self, tenant: str | None, digest: str | None = None, *,
               isolate: bool = False) -> HFEngine:
        """The engine serving ``tenant``: its KV namespace carries the tenant's salt digest.

        ``digest`` is the digest admission decided (``TenantContext.digest``); the engine's
        namespace must carry exactly it (a mismatch is a wiring bug, refused). ``isolate``
        gives an engine without a store: nothing is restored from or written to shared KV.
        """
        with self._lock:
            eng = self._engines.get((tenant, isolate))
            if eng is None:
                # no idle K/V buffers kept between requests: the server's memory plan counts
                # live and cached KV only (engine/_pool.py)
                eng = HFEngine(self.model, self.tokenizer,
                               store=None if isolate else self.store,
                               chunk_size=self.chunk_size, codec=self.codec,
                               tenant=tenant, salter=self.salter, kv_pool_bytes=0,
                               keep_logits=self.keep_logits, prefill_scheduler=self.scheduler,
                               anchors=None if isolate else self.anchors)
                self._engines[(tenant, isolate)] = eng
        if digest is not None and eng.namespace.tenant != digest:
            raise RuntimeError(f"KV namespace digest {eng.namespace.tenant!r} differs from the "
                               f"admitted tenant digest {digest!r}")
        return eng

    def keys(self, ids: Sequence[int], ctx: TenantContext) -> list[ChunkKey] | None:
        """The chunk keys of ``ids`` in the namespace ``ctx``'s engine stores under (None for an
        isolated context: it reads and writes no shared KV)."""
        if ctx.isolate:
            return None
        return self.engine(ctx.tenant, ctx.digest or None).chunk_keys(ids)

    def namespaces(self) -> set[bytes]:
        """The KV namespace digests of this runner's engines (one per tenant served so far)."""
        with self._lock:
            return {bytes(e.namespace_digest) for e in self._engines.values()}

    def run(self, jobs: list[Job]) -> None:
        reqs = [_request(job, self.engine(job.tenant, job.digest, isolate=job.isolate))
                for job in jobs]
        _emit_all(jobs, self.decoder.generate(reqs), kv=True)


class DirectRunner:
    """Serves batches of jobs on a plain transformers causal LM (no KV prefix cache)."""

    scheduler: PrefillScheduler | None = None

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.decoder = BatchDecoder(model, tokenizer)
        self.max_positions = self.decoder.max_positions

    def keys(self, ids: Sequence[int], ctx: TenantContext) -> list[ChunkKey] | None:
        return None  # no KV reuse

    def engine(self, tenant: str | None, digest: str | None = None, *,
               isolate: bool = False) -> HFEngine | None:
        return None  # no KV reuse

    def namespaces(self) -> set[bytes]:
        return set()

    def run(self, jobs: list[Job]) -> None:
        _emit_all(jobs, self.decoder.generate([_request(job) for job in jobs]), kv=False)
