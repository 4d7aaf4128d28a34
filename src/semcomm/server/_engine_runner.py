"""The KV-reusing runner: serves batches of jobs through ``semcomm.engine.HFEngine``.

One engine per tenant (each has its own salted namespace), all sharing one model and one store.

* A batch of one job runs ``engine.generate(..., stream=True)``: exactly the engine's greedy
  path (token for token what the model's own ``generate`` gives, docs/architecture.md, invariant 2).
* A batch of several jobs prefills each job through ``engine.prefill`` (longest cached prefix
  restored, the rest computed, new chunks stored: per-sequence prefix hits), then decodes all
  of them together, one forward per step, over a left-padded batch cache built from the
  per-job caches. Padding changes the shapes of the matrix products, so a batched greedy token
  can in rare near-ties differ from the single-sequence one; callers that need bit-exact
  output use ``max_batch = 1``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ._batching import Delta, Finished, GenOutput, Job, Started
from ._direct import BatchDecode, decode_batch, pad_id_for

__all__ = ["EngineRunner", "engine_runner"]

log = logging.getLogger(__name__)


def engine_runner(model: Any, tokenizer: Any, *, model_id: str, store: Any, salter: Any,
                  chunk_size: int | None, codec: str | None) -> tuple[Any, str]:
    """Return ``(runner, note)``; ``runner`` is None when the engine cannot serve this model."""
    try:
        from ..engine import DEFAULT_CHUNK_SIZE, HFEngine
    except ImportError as exc:
        return None, f"semcomm.engine.HFEngine unavailable ({exc}); plain batched decoding"
    try:
        runner = EngineRunner(HFEngine, model, tokenizer, model_id=model_id, store=store,
                              salter=salter, chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                              codec=codec or "lossless")
    except Exception as exc:  # unsupported model family etc.: serve it plainly, say why
        log.warning("model %s served without KV reuse: %s", model_id, exc)
        return None, f"HFEngine refused the model ({exc}); plain batched decoding"
    return runner, (f"HFEngine: KV prefix reuse, chunk {runner.chunk_size}, codec "
                    f"{runner.codec}, store {getattr(store, 'name', type(store).__name__)}")


def _kv_extra(st: Any) -> dict[str, Any]:
    """The engine's per-request KV statistics, as reported in ``GenOutput.extra["kv"]``."""
    return {"hit_tokens": st.hit_tokens, "tier": st.tier,
            "bytes_loaded": st.bytes_loaded, "bytes_stored": st.bytes_stored,
            "load_ms": round(st.load_ms, 3), "prefill_ms": round(st.prefill_ms, 3)}


class EngineRunner:
    """Runs batches of jobs on per-tenant ``HFEngine`` s over one shared model (see module doc)."""

    def __init__(self, engine_cls: Any, model: Any, tokenizer: Any, *, model_id: str, store: Any,
                 salter: Any, chunk_size: int, codec: str) -> None:
        self.engine_cls = engine_cls
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.store = store
        self.salter = salter
        self.chunk_size = chunk_size
        self.codec = codec
        self._engines: dict[tuple[str | None, bool], Any] = {}
        self._lock = threading.Lock()
        first = self.engine(None)  # validates the model family once, up front
        self._windowed = bool(first.layout.sliding)  # any sliding-window layer
        self.max_positions = int(first.max_positions or 2048)
        self.eos_ids = set(first.eos_token_ids)
        self.pad_id = pad_id_for(tokenizer, self.eos_ids)

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
                eng = self.engine_cls(self.model, self.tokenizer,
                                      store=None if isolate else self.store,
                                      chunk_size=self.chunk_size, codec=self.codec,
                                      tenant=tenant, salter=self.salter)
                self._engines[(tenant, isolate)] = eng
        if digest is not None and eng.namespace.tenant != digest:
            raise RuntimeError(f"KV namespace digest {eng.namespace.tenant!r} differs from the "
                               f"admitted tenant digest {digest!r}")
        return eng

    def namespaces(self) -> set[bytes]:
        """The KV namespace digests of this runner's engines (one per tenant served so far)."""
        with self._lock:
            return {bytes(e.namespace_digest) for e in self._engines.values()}

    def _engine_for(self, job: Job) -> Any:
        return self.engine(job.tenant, job.digest, isolate=job.isolate)

    # ------------------------------------------------------------------ one job
    def _run_one(self, job: Job) -> None:
        eng = self._engine_for(job)
        hit = eng.cached_tokens(job.prompt_ids) if job.snapshot is None else 0
        # at least one token is always recomputed (docs/architecture.md, invariant 3)
        hit = min(hit, len(job.prompt_ids) - 1)
        job.emit(Started(prompt_tokens=len(job.prompt_ids), hit_tokens=hit))
        stream = eng.generate(list(job.prompt_ids), max_new_tokens=job.max_new_tokens,
                              temperature=job.temperature, top_p=job.top_p, seed=job.seed,
                              stop=job.stop or None, stream=True, snapshot=job.snapshot)
        for piece in stream:
            if job.cancelled.is_set():
                stream.close() if hasattr(stream, "close") else None
                return
            if piece:
                job.emit(Delta(str(piece)))
        res = stream.result
        st = res.stats
        finish = "stop" if st.finish_reason in ("eos", "stop") else "length"
        job.emit(Finished(GenOutput(
            token_ids=list(res.token_ids), text=res.text or "", finish_reason=finish,
            prompt_tokens=st.prompt_tokens, hit_tokens=st.hit_tokens, hit_tiers=st.hit_tiers,
            ttft_s=st.ttft_s,
            extra={"kv": _kv_extra(st)},
        )))

    # ------------------------------------------------------------------ a batch
    def run(self, jobs: list[Job]) -> None:
        if len(jobs) == 1:
            self._run_one(jobs[0])
            return
        if self._windowed:
            # a restored sliding-window layer holds only its window, not the left-paddable
            # whole prompt the batched path below needs: such models run one job at a time
            for job in jobs:
                self._run_one(job)
            return
        import torch
        from transformers import DynamicCache

        t0 = time.perf_counter()
        pres = []
        for job in jobs:
            eng = self._engine_for(job)
            pre = eng.prefill(list(job.prompt_ids), snapshot=job.snapshot)
            pres.append(pre)
            job.emit(Started(prompt_tokens=pre.stats.prompt_tokens,
                             hit_tokens=pre.stats.hit_tokens, hit_tiers=pre.stats.hit_tiers))
        device = pres[0].last_logits.device
        bsz = len(jobs)
        lens = [len(p.input_ids) for p in pres]
        width = max(lens)
        # left-pad each job's per-layer [1, H, T, D] keys/values to [B, H, width, D]
        layers = []
        n_layers = len(pres[0].cache.layers)
        for li in range(n_layers):
            ks, vs = [], []
            for p, n in zip(pres, lens):
                k, v = p.cache.layers[li].keys, p.cache.layers[li].values
                if n < width:
                    pad_k = k.new_zeros((1, k.shape[1], width - n, k.shape[3]))
                    pad_v = v.new_zeros((1, v.shape[1], width - n, v.shape[3]))
                    k, v = torch.cat([pad_k, k], 2), torch.cat([pad_v, v], 2)
                ks.append(k)
                vs.append(v)
            layers.append((torch.cat(ks, 0), torch.cat(vs, 0)))
        for p in pres:
            p.cache = None  # free the per-job caches
        cache = DynamicCache(ddp_cache_data=layers)
        mask = torch.zeros((bsz, width), dtype=torch.long, device=device)
        for row, n in enumerate(lens):
            mask[row, width - n:] = 1
        pos = torch.tensor([[n - 1] for n in lens], dtype=torch.long, device=device)
        dec = BatchDecode(jobs, self.tokenizer, prompt_lens=lens, eos_ids=self.eos_ids,
                          pad_id=self.pad_id, max_positions=self.max_positions, t0=t0)
        logits = torch.stack([p.last_logits for p in pres])
        with torch.inference_mode():
            decode_batch(self.model, dec, logits, cache, mask, pos)

        def fields(row: int) -> dict[str, Any]:
            st = pres[row].stats
            return {"prompt_tokens": st.prompt_tokens, "hit_tokens": st.hit_tokens,
                    "hit_tiers": st.hit_tiers, "extra": {"kv": _kv_extra(st), "batch": bsz}}

        dec.finish(fields)
