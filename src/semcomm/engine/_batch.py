"""BatchDecoder: queued requests decoded together, one forward per step, on one model.

A batch is a list of :class:`BatchRequest` (Params in); :meth:`BatchDecoder.generate` returns
one :class:`BatchResult` per request (Result out) and streams each request's text through its
``on_text`` callback as it is decided. Each request's sampling, detokenization, stop strings
and end is one :class:`~semcomm.engine.DecodeState`, the same as in
:meth:`HFEngine.generate`, so a stream's pieces joined equal the final text
(docs/architecture.md, invariant 7).

How a batch is run:

* Requests with an ``engine`` are prefilled by it (longest cached prefix restored from its
  store, the rest computed, new chunks stored: per-request prefix hits under each request's
  own KV namespace). A batch of one is exactly :meth:`HFEngine.generate` (the cache never
  changes its answer, invariant 2); several are decoded together over a left-padded
  batch cache assembled from the per-request caches. Padding changes the shapes of the matrix
  products, so a batched greedy token can in rare near-ties differ from the single-sequence
  one; callers that need bit-exact output batch one request at a time. A model with sliding
  window layers always runs its requests one at a time (a restored sliding layer holds only
  its window, not the whole prompt the left-padded batch needs).
* Requests without an engine are prefilled together on the plain model (left-padded, no KV
  reuse): the "plain serving" path for models the engine does not support.

Every step feeds all rows (finished ones get the pad token) in one forward; the cache object
the model returns is passed back to it opaquely.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidInputError
from . import _cache_adapter as ca
from ._decode import DecodeState, FinishReason, SamplingParams, decode_steps
from ._snapshot import KVSnapshot
from ._types import GenerationStats

if TYPE_CHECKING:
    from ..kv import ChunkKey
    from ._documents import SegmentedPrompt
    from ._engine import HFEngine

__all__ = ["BatchDecoder", "BatchRequest", "BatchResult"]

_MAX_POS_ATTRS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
_DEFAULT_MAX_POSITIONS = 2048  # a config that names no position limit


@dataclass(slots=True)
class BatchRequest:
    """One queued request: its prompt, how to decode it, and where its text goes."""

    prompt_ids: list[int]  # the full prompt, tokenized
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()  # stop strings (cut from the text)
    # prefills with KV reuse (its namespace and store); None: a plain prefill, nothing reused
    engine: HFEngine | None = None
    snapshot: KVSnapshot | None = None  # KV to continue from (requests with an engine only)
    on_start: Callable[[GenerationStats], None] | None = None  # after its prefill, before text
    on_text: Callable[[str], None] | None = None  # each released piece, on the decoding thread
    cancelled: Callable[[], bool] | None = None  # polled every step; True ends the request
    keys: Sequence[ChunkKey] | None = None  # the engine's chunk keys of the prompt, if known
    # a prompt with documents (``prompt_ids`` are its ids): run alone through
    # HFEngine.generate, its documents' KV reused at their positions (engine/_documents.py)
    segments: SegmentedPrompt | None = None
    selector: str | None = None  # with segments: which tokens to recompute (None: default)
    recompute: float | None = None  # with segments: the share recomputed (None: default)
    margin: float | None = None  # with segments: the confidence test (None: none)
    watch: float | None = None  # with segments: rebuild the KV when a later step is unsure


@dataclass(slots=True)
class BatchResult:
    """What one request produced (``finish_reason == "cancelled"``: it was abandoned)."""

    token_ids: list[int]  # generated tokens (an end-of-sequence token included)
    text: str  # cut at a stop string; equals the pieces given to ``on_text`` joined
    finish_reason: FinishReason
    stats: GenerationStats  # prompt and hit tokens, tiers, bytes, TTFT (engine requests: all)
    batch: int = 1  # requests decoded together with this one (itself included)


def _max_positions(model: Any) -> int:
    cfg = model.config
    for attr in _MAX_POS_ATTRS:
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return _DEFAULT_MAX_POSITIONS


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(i) for i in ([eos] if isinstance(eos, int) else eos) if i is not None)


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class _PaddedForward:
    """One decode step of a left-padded batch: the mask grows by a column, every row's
    position by one; the model's cache object is passed back to it opaquely."""

    def __init__(self, model: Any, cache: Any, mask: torch.Tensor, pos: torch.Tensor) -> None:
        self.model = model
        self.cache = cache
        self.mask = mask  # [B, T] 1 on real tokens, 0 on the left padding
        self.pos = pos  # [B, >=1]: the last column is each row's last position

    def __call__(self, nxt: list[int]) -> torch.Tensor:
        bsz = self.mask.shape[0]
        self.mask = torch.cat([self.mask, self.mask.new_ones((bsz, 1))], 1)
        self.pos = self.pos[:, -1:] + 1
        ids = torch.tensor(nxt, dtype=torch.long, device=self.mask.device).unsqueeze(1)
        with torch.no_grad():  # not across the caller's yields: its code runs in between
            out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=self.pos,
                             use_cache=True, **ca.cache_kwargs(self.model, self.cache))
        self.cache = _cache_of(out)
        return out.logits[:, -1, :].float()


class BatchDecoder:
    """Decodes batches of :class:`BatchRequest` on one model (see the module docstring).

    ``eos_ids`` and ``max_positions`` default to the model's generation config and position
    limit; a request stops at an end-of-sequence token, or at ``length`` when its prompt plus
    its tokens reach ``max_positions``. Not thread-safe: one thread runs a decoder's batches.
    """

    def __init__(self, model: Any, tokenizer: Any, *, eos_ids: Sequence[int] | None = None,
                 max_positions: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids: frozenset[int] = (_eos_ids(model, tokenizer) if eos_ids is None
                                        else frozenset(eos_ids))
        self.max_positions = int(max_positions or _max_positions(model))
        pad = getattr(tokenizer, "pad_token_id", None)
        # the tokenizer's pad id, else the smallest end-of-sequence id, else 0
        self.pad_id = int(pad) if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)

    @classmethod
    def for_engine(cls, engine: HFEngine) -> BatchDecoder:
        """A decoder over ``engine``'s model, with its end-of-sequence ids and position limit."""
        return cls(engine.model, engine.tokenizer, eos_ids=sorted(engine.eos_token_ids),
                   max_positions=engine.max_positions)

    # ------------------------------------------------------------------ entry
    def generate(self, requests: Sequence[BatchRequest]) -> list[BatchResult]:
        """Run ``requests`` to the end; one result per request, in order."""
        if not requests:
            return []
        with_engine = [r.engine is not None for r in requests]
        if any(with_engine) and not all(with_engine):
            raise ValueError("a batch mixes requests with and without an engine")
        if not all(with_engine):
            if any(r.snapshot is not None for r in requests):
                raise ValueError("a KV snapshot needs a request with an engine")
            return self._plain(requests)
        engines = [r.engine for r in requests if r.engine is not None]
        if len(requests) == 1 or any(e.layout.sliding for e in engines):
            return [self._one(r, e) for r, e in zip(requests, engines)]
        if any(r.segments is not None for r in requests):  # those run alone, the rest batched
            alone = {i for i, r in enumerate(requests) if r.segments is not None}
            rest = [i for i in range(len(requests)) if i not in alone]
            out: dict[int, BatchResult] = {i: self._one(requests[i], engines[i]) for i in alone}
            if len(rest) == 1:
                out[rest[0]] = self._one(requests[rest[0]], engines[rest[0]])
            elif rest:
                out.update(zip(rest, self._batched([requests[i] for i in rest],
                                                   [engines[i] for i in rest])))
            return [out[i] for i in range(len(requests))]
        return self._batched(requests, engines)

    # ------------------------------------------------------------ one request
    def _one(self, req: BatchRequest, eng: HFEngine) -> BatchResult:
        """A request alone: exactly :meth:`HFEngine.generate`, streamed."""
        if req.segments is not None:
            stream = eng.generate(req.segments, max_new_tokens=req.max_new_tokens,
                                  temperature=req.params.temperature, top_p=req.params.top_p,
                                  top_k=req.params.top_k, seed=req.params.seed,
                                  stop=list(req.stop) or None, stream=True,
                                  on_prefill=req.on_start, selector=req.selector,
                                  recompute=req.recompute, margin=req.margin,
                                  watch=req.watch)
        else:
            stream = eng.generate(list(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                                  temperature=req.params.temperature, top_p=req.params.top_p,
                                  top_k=req.params.top_k, seed=req.params.seed,
                                  stop=list(req.stop) or None, stream=True,
                                  snapshot=req.snapshot, on_prefill=req.on_start, keys=req.keys)
        for piece in stream:
            if req.cancelled is not None and req.cancelled():
                stream.close()
                return BatchResult(token_ids=[], text="", finish_reason="cancelled",
                                   stats=GenerationStats(prompt_tokens=len(req.prompt_ids)))
            if piece and req.on_text is not None:
                req.on_text(str(piece))
        res = stream.result
        assert res is not None
        return BatchResult(token_ids=list(res.token_ids), text=res.text or "",
                           finish_reason=res.stats.finish_reason or "length",  # type: ignore[arg-type]
                           stats=res.stats)

    # ---------------------------------------------------------------- batches
    def _states(self, requests: Sequence[BatchRequest], lens: Sequence[int],
                device: torch.device) -> list[DecodeState]:
        return [DecodeState(self.tokenizer, r.params, device, max_new_tokens=r.max_new_tokens,
                            stop=r.stop, eos_ids=self.eos_ids, prompt_tokens=n,
                            max_positions=self.max_positions)
                for r, n in zip(requests, lens)]

    def _plain(self, requests: Sequence[BatchRequest]) -> list[BatchResult]:
        """Left-padded prefill of every prompt on the plain model, then the batched loop."""
        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        bsz = len(requests)
        lens = [len(r.prompt_ids) for r in requests]
        width = max(lens)
        ids = torch.full((bsz, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.long)
        for row, r in enumerate(requests):
            n = lens[row]
            ids[row, width - n:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[row, width - n:] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        stats = [GenerationStats(prompt_tokens=n, recomputed_tokens=n) for n in lens]
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            for r, st in zip(requests, stats):
                if r.on_start is not None:
                    r.on_start(st)
            states = self._states(requests, lens, device)
            self._loop(requests, states, stats, out.logits[:, -1, :].float(), _cache_of(out),
                       mask, pos, t0)
        return self._results(requests, states, stats, t0)

    def _batched(self, requests: Sequence[BatchRequest],
                 engines: Sequence[HFEngine]) -> list[BatchResult]:
        """Each request prefilled by its engine, then decoded together over one batch cache."""
        t0 = time.perf_counter()
        pres = []
        for r, eng in zip(requests, engines):
            pre = eng.prefill(list(r.prompt_ids), snapshot=r.snapshot, keys=r.keys)
            pres.append(pre)
            if r.on_start is not None:
                r.on_start(pre.stats)
        device = pres[0].last_logits.device
        lens = [len(p.input_ids) for p in pres]
        cache, mask = ca.left_padded_batch([p.cache for p in pres], lens)
        for p in pres:
            p.cache = None  # the batch cache holds the rows now
        pos = torch.tensor([[n - 1] for n in lens], dtype=torch.long, device=device)
        logits = torch.stack([p.last_logits for p in pres])
        stats = [p.stats for p in pres]
        states = self._states(requests, lens, device)
        with torch.inference_mode():
            self._loop(requests, states, stats, logits, cache, mask, pos, t0)
        return self._results(requests, states, stats, t0)

    def _loop(self, requests: Sequence[BatchRequest], states: list[DecodeState],
              stats: list[GenerationStats], logits: torch.Tensor, cache: Any,
              mask: torch.Tensor, pos: torch.Tensor, t0: float) -> None:
        """The batched decode after a prefill: :func:`decode_steps` over a padded forward,
        each row's pieces handed to its ``on_text``."""
        forward = _PaddedForward(self.model, cache, mask, pos)
        steps = decode_steps(states, logits, forward, pad_id=self.pad_id,
                             cancelled=[r.cancelled for r in requests])
        for i, released in enumerate(steps):
            for row, (req, piece) in enumerate(zip(requests, released)):
                if i == 0 and piece is not None:
                    stats[row].ttft_s = time.perf_counter() - t0
                if piece and req.on_text is not None:
                    req.on_text(str(piece))

    # ------------------------------------------------------------ KV given
    def continue_greedy(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
                        feed_ids: Sequence[int], *, start_pos: int,
                        max_new_tokens: int) -> Iterator[int]:
        """Greedy decoding of one sequence from KV the caller built (fusion's fused cache).

        ``layers`` holds per layer ``([1, H, start_pos, D]`` keys, values) for positions
        ``[0, start_pos)`` (or is None: nothing cached); ``feed_ids`` are the prompt tokens not
        yet in it (at least one). Yields token ids; ends at an end-of-sequence id (not
        yielded) or after ``max_new_tokens``. The given tensors are not mutated. Closing the
        iterator stops decoding.
        """
        if not feed_ids:
            raise InvalidInputError("at least one prompt token must be fed to the model")
        if max_new_tokens <= 0:
            return
        device = next(self.model.parameters()).device
        cache = ca.cache_from_layers([(k.clone(), v.clone()) for k, v in layers]) if layers else None
        n = len(feed_ids)
        mask = torch.ones((1, start_pos + n), dtype=torch.long, device=device)
        pos = torch.arange(start_pos, start_pos + n, device=device)[None]
        state = DecodeState(None, SamplingParams(), device, max_new_tokens=max_new_tokens,
                            eos_ids=self.eos_ids, prompt_tokens=start_pos + n,
                            max_positions=self.max_positions)
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([list(feed_ids)], device=device),
                             attention_mask=mask, position_ids=pos, use_cache=True,
                             **ca.cache_kwargs(self.model, cache))
        forward = _PaddedForward(self.model, _cache_of(out), mask, pos)
        for (tok,) in decode_steps([state], out.logits[:, -1, :].float(), forward,
                                   pad_id=self.pad_id):
            if state.finish_reason == "eos":
                return  # the end-of-sequence token is not part of the answer
            if isinstance(tok, int):
                yield tok

    def _results(self, requests: Sequence[BatchRequest], states: list[DecodeState],
                 stats: list[GenerationStats], t0: float) -> list[BatchResult]:
        """Release each row's held-back tail through ``on_text`` and build the results."""
        results = []
        for req, st, s in zip(requests, states, stats):
            if st.finish_reason != "cancelled":
                tail = st.finish()
                if tail and req.on_text is not None:
                    req.on_text(tail)
            s.new_tokens = len(st.token_ids)
            s.finish_reason = st.finish_reason or "length"
            s.total_s = time.perf_counter() - t0
            results.append(BatchResult(token_ids=list(st.token_ids), text=st.text or "",
                                       finish_reason=st.finish_reason or "length", stats=s,
                                       batch=len(states)))
        return results
