"""The KV-reusing runner: serves batches of jobs through ``semcomm.engine.HFEngine``.

One engine per tenant (each has its own salted namespace), all sharing one model and one store.

* A batch of one job runs ``engine.generate(..., stream=True)``: exactly the engine's greedy
  path (token for token what the model's own ``generate`` gives, DESIGN invariant 2).
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
from ._direct import TextStream, sample_next

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
        self._engines: dict[str | None, Any] = {}
        self._lock = threading.Lock()
        first = self.engine(None)  # validates the model family once, up front
        self.max_positions = int(first.max_positions or 2048)
        self.eos_ids = set(first.eos_token_ids)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)

    def engine(self, tenant: str | None) -> Any:
        with self._lock:
            eng = self._engines.get(tenant)
            if eng is None:
                eng = self.engine_cls(self.model, self.tokenizer, store=self.store,
                                      chunk_size=self.chunk_size, codec=self.codec,
                                      tenant=tenant, salter=self.salter)
                self._engines[tenant] = eng
            return eng

    # ------------------------------------------------------------------ one job
    def _run_one(self, job: Job) -> None:
        eng = self.engine(job.tenant)
        hit = eng.cached_tokens(job.prompt_ids) if job.snapshot is None else 0
        # at least one token is always recomputed (DESIGN invariant 3)
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
            extra={"kv": {"hit_tokens": st.hit_tokens, "tier": st.tier,
                          "bytes_loaded": st.bytes_loaded, "bytes_stored": st.bytes_stored,
                          "load_ms": round(st.load_ms, 3), "prefill_ms": round(st.prefill_ms, 3)}},
        )))

    # ------------------------------------------------------------------ a batch
    def run(self, jobs: list[Job]) -> None:
        if len(jobs) == 1:
            self._run_one(jobs[0])
            return
        import torch
        from transformers import DynamicCache

        t0 = time.perf_counter()
        pres = []
        for job in jobs:
            eng = self.engine(job.tenant)
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
        gens = []
        for job in jobs:
            g = None
            if job.temperature > 0:
                g = torch.Generator(device="cpu")
                g.manual_seed(job.seed if job.seed is not None else int(time.time_ns() % 2**63))
            gens.append(g)
        streams = [TextStream(self.tokenizer, j.stop) for j in jobs]
        active = [True] * bsz
        finish = ["length"] * bsz
        ttft = [0.0] * bsz
        logits = torch.stack([p.last_logits for p in pres])
        kw_name = "cache"
        step = 0
        with torch.inference_mode():
            while True:
                nxt = [self.pad_id] * bsz
                greedy = logits.argmax(-1).tolist()  # one call for every greedy row
                for row, job in enumerate(jobs):
                    if not active[row]:
                        continue
                    if job.cancelled.is_set():
                        active[row], finish[row] = False, "cancelled"
                        continue
                    tok = (greedy[row] if job.temperature <= 0 else
                           sample_next(logits[row], job.temperature, job.top_p, gens[row]))
                    if step == 0:
                        ttft[row] = time.perf_counter() - t0
                    if tok in self.eos_ids:
                        active[row], finish[row] = False, "stop"
                        continue
                    nxt[row] = tok
                    delta = streams[row].push(tok)
                    if delta:
                        job.emit(Delta(delta))
                    if streams[row].stopped:
                        active[row], finish[row] = False, "stop"
                    elif (len(streams[row].ids) >= job.max_new_tokens
                          or lens[row] + len(streams[row].ids) >= self.max_positions):
                        active[row], finish[row] = False, "length"
                if not any(active):
                    break
                step += 1
                mask = torch.cat([mask, torch.ones((bsz, 1), dtype=mask.dtype, device=device)], 1)
                pos = pos + 1
                ids = torch.tensor(nxt, dtype=torch.long, device=device).unsqueeze(1)
                try:
                    out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                     use_cache=True, **{kw_name: cache})
                except TypeError:  # older transformers: past_key_values=
                    kw_name = "past_key_values"
                    out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                     use_cache=True, **{kw_name: cache})
                logits = out.logits[:, -1, :].float()
        for row, job in enumerate(jobs):
            if finish[row] == "cancelled":
                continue
            tail = streams[row].flush()
            if tail:
                job.emit(Delta(tail))
            st = pres[row].stats
            job.emit(Finished(GenOutput(
                token_ids=list(streams[row].ids), text=streams[row].text,
                finish_reason=finish[row], prompt_tokens=st.prompt_tokens,
                hit_tokens=st.hit_tokens, hit_tiers=st.hit_tiers, ttft_s=ttft[row],
                extra={"kv": {"hit_tokens": st.hit_tokens, "tier": st.tier,
                              "bytes_loaded": st.bytes_loaded, "bytes_stored": st.bytes_stored,
                              "load_ms": round(st.load_ms, 3),
                              "prefill_ms": round(st.prefill_ms, 3)},
                       "batch": bsz},
            )))
