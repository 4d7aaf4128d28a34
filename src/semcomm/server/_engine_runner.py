"""The server's runners: each turns a batch of queued jobs into one ``semcomm.engine`` call.

* :class:`EngineRunner` serves a model through per-tenant ``semcomm.engine.HFEngine`` s (each
  has its own salted KV namespace), all sharing one model and one store: KV prefix reuse.
* :class:`DirectRunner` serves a model the engine does not support, without KV reuse.
* The engines' prefills run through the process's ``PrefillScheduler`` (``_prefill``: long
  prefills in pieces, bounded, yielding to short requests), re-exported here.

Both hand the batch to one ``semcomm.engine.BatchDecoder`` (the one decode loop: sampling,
detokenizing, stop strings, batching; a batch of one with an engine is exactly
``HFEngine.generate``, docs/architecture.md, invariant 2) and turn its callbacks and results
into the worker's events. Neither touches KV tensors nor the transformers cache API.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..engine import BatchDecoder, BatchRequest, BatchResult, GenerationStats, SamplingParams
from ._batching import Delta, Event, Finished, GenOutput, Job, Started
from ._prefill import PrefillScheduler, prefill_scheduler

__all__ = ["DirectRunner", "EngineRunner", "PrefillScheduler", "engine_runner",
           "prefill_scheduler"]

log = logging.getLogger(__name__)


def engine_runner(model: Any, tokenizer: Any, *, model_id: str, store: Any, salter: Any,
                  chunk_size: int | None, codec: str | None,
                  scheduler: PrefillScheduler | None = None,
                  keep_logits: bool = True) -> tuple[Any, str]:
    """Return ``(runner, note)``; ``runner`` is None when the engine cannot serve this model."""
    try:
        from ..engine import DEFAULT_CHUNK_SIZE, HFEngine
    except ImportError as exc:
        return None, f"semcomm.engine.HFEngine unavailable ({exc}); plain batched decoding"
    try:
        runner = EngineRunner(HFEngine, model, tokenizer, model_id=model_id, store=store,
                              salter=salter, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                              codec=codec or "lossless", scheduler=scheduler,
                              keep_logits=keep_logits)
    except Exception as exc:  # unsupported model family etc.: serve it plainly, say why
        log.warning("model %s served without KV reuse: %s", model_id, exc)
        return None, f"HFEngine refused the model ({exc}); plain batched decoding"
    return runner, (f"HFEngine: KV prefix reuse, chunk {runner.chunk_size}, codec "
                    f"{runner.codec}, store {getattr(store, 'name', type(store).__name__)}")


def _kv_extra(st: GenerationStats) -> dict[str, Any]:
    """The engine's per-request KV statistics, as reported in ``GenOutput.extra["kv"]``."""
    return {"hit_tokens": st.hit_tokens, "tier": st.tier,
            "bytes_loaded": st.bytes_loaded, "bytes_stored": st.bytes_stored,
            "load_ms": round(st.load_ms, 3), "prefill_ms": round(st.prefill_ms, 3)}


def _request(job: Job, engine: Any = None) -> BatchRequest:
    """The engine's request for ``job``: its events go to ``job.emit``."""
    def started(st: GenerationStats) -> None:
        # a whole hit with its stored logits restores every prompt token (docs/architecture.md,
        # invariant 3)
        job.emit(Started(prompt_tokens=st.prompt_tokens, hit_tokens=st.hit_tokens,
                         hit_tiers=st.hit_tiers))

    def text(piece: str) -> None:
        job.emit(Delta(piece))

    return BatchRequest(
        prompt_ids=list(job.prompt_ids), max_new_tokens=job.max_new_tokens,
        params=SamplingParams(temperature=job.temperature, top_p=job.top_p, seed=job.seed),
        stop=tuple(job.stop), engine=engine, snapshot=job.snapshot, on_start=started,
        on_text=text, cancelled=job.cancelled.is_set)


def _finished(res: BatchResult, *, kv: bool) -> Event | None:
    """The ``Finished`` event of a result (None for a cancelled job: nobody listens)."""
    if res.finish_reason == "cancelled":
        return None
    st = res.stats
    extra: dict[str, Any] = {"kv": _kv_extra(st)} if kv else {}
    if res.batch > 1 and kv:
        extra["batch"] = res.batch
    return Finished(GenOutput(
        token_ids=res.token_ids, text=res.text,
        finish_reason="length" if res.finish_reason == "length" else "stop",
        prompt_tokens=st.prompt_tokens, hit_tokens=st.hit_tokens, hit_tiers=st.hit_tiers,
        ttft_s=st.ttft_s, extra=extra))


def _emit_all(jobs: list[Job], results: list[BatchResult], *, kv: bool) -> None:
    for job, res in zip(jobs, results):
        ev = _finished(res, kv=kv)
        if ev is not None:
            job.emit(ev)


class EngineRunner:
    """Runs batches of jobs on per-tenant ``HFEngine`` s over one shared model (see module doc)."""

    def __init__(self, engine_cls: Any, model: Any, tokenizer: Any, *, model_id: str, store: Any,
                 salter: Any, chunk_size: int, codec: str,
                 scheduler: PrefillScheduler | None = None, keep_logits: bool = True) -> None:
        self.engine_cls = engine_cls
        self.scheduler = scheduler
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.store = store
        self.salter = salter
        self.chunk_size = chunk_size
        self.codec = codec
        self.keep_logits = keep_logits
        self._engines: dict[tuple[str | None, bool], Any] = {}
        self._lock = threading.Lock()
        first = self.engine(None)  # validates the model family once, up front
        self.decoder = BatchDecoder.for_engine(first)
        self.max_positions = self.decoder.max_positions

    def engine(self, tenant: str | None, digest: str | None = None, *,
               isolate: bool = False) -> Any:
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
                eng = self.engine_cls(self.model, self.tokenizer,
                                      store=None if isolate else self.store,
                                      chunk_size=self.chunk_size, codec=self.codec,
                                      tenant=tenant, salter=self.salter, kv_pool_bytes=0,
                                      keep_logits=self.keep_logits)
                eng.prefill_scheduler = self.scheduler
                self._engines[(tenant, isolate)] = eng
        if digest is not None and eng.namespace.tenant != digest:
            raise RuntimeError(f"KV namespace digest {eng.namespace.tenant!r} differs from the "
                               f"admitted tenant digest {digest!r}")
        return eng

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

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.decoder = BatchDecoder(model, tokenizer)
        self.max_positions = self.decoder.max_positions

    def run(self, jobs: list[Job]) -> None:
        _emit_all(jobs, self.decoder.generate([_request(job) for job in jobs]), kv=False)
