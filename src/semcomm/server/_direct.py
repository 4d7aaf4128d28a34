"""A batched decode loop over a plain transformers model, without KV reuse.

This runner serves batches of queued requests in one forward pass per step (left-padded
prompts, per-row positions from the attention mask, per-row stopping and sampling). It is the
"plain serving" baseline and the path for models without a KV prefix cache; the KV-reusing
path goes through ``semcomm.engine`` (see ``_engine_runner``). The cache object transformers
returns is passed back opaquely: this module never reads or edits KV tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..engine._cache_adapter import cache_kwargs
from ._batching import Delta, Finished, GenOutput, Job, Started

__all__ = ["BatchDecode", "DirectRunner", "TextStream", "decode_batch", "pad_id_for",
           "sample_next"]


class TextStream:
    """Incremental detokenization: emits only text that can no longer change.

    Byte-level tokenizers split multi-byte characters across tokens; a trailing U+FFFD means
    the character is incomplete, so it is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token and return the new text that is safe to emit ('' when none)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.text = text
        if self.stop:
            for s in self.stop:
                idx = text.find(s)
                if idx != -1:
                    self.text = text[:idx]
                    self.stopped = True
                    out = self.text[self.sent:]
                    self.sent = len(self.text)
                    return out
            # hold back a tail that could be the start of a stop string
            hold = max(len(s) - 1 for s in self.stop)
        else:
            hold = 0
        safe = len(text) - hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        out = text[self.sent:safe]
        self.sent = safe
        return out

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


def sample_next(logits: Any, temperature: float, top_p: float, generator: Any) -> int:
    """Greedy when ``temperature == 0``; otherwise temperature + nucleus sampling."""
    import torch

    if temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(0, idx, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator).item())


def pad_id_for(tokenizer: Any, eos_ids: set[int]) -> int:
    """The tokenizer's pad id, else the smallest end-of-sequence id, else 0."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else (min(eos_ids) if eos_ids else 0)


class BatchDecode:
    """Per-row sampling, stopping and streaming state of one batched decode loop.

    The runners own the forward passes; each step they hand the last logits to
    :meth:`select`, which picks every active row's next token, streams its text and decides
    whether the row stops. :meth:`finish` then flushes the streams and emits the results.
    """

    def __init__(self, jobs: list[Job], tokenizer: Any, *, prompt_lens: list[int],
                 eos_ids: set[int], pad_id: int, max_positions: int, t0: float) -> None:
        import torch

        self.jobs = jobs
        self.prompt_lens = prompt_lens
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.max_positions = max_positions
        self.t0 = t0
        self.gens: list[Any] = []
        for job in jobs:
            g = None
            if job.temperature > 0:
                g = torch.Generator(device="cpu")
                g.manual_seed(job.seed if job.seed is not None else int(time.time_ns() % 2**63))
            self.gens.append(g)
        bsz = len(jobs)
        self.streams = [TextStream(tokenizer, j.stop) for j in jobs]
        self.active = [True] * bsz
        self.finish_reasons = ["length"] * bsz
        self.ttft = [0.0] * bsz
        self.step = 0

    @property
    def done(self) -> bool:
        return not any(self.active)

    def select(self, logits: Any) -> list[int]:
        """Pick each active row's next token from ``logits`` ([B, V]); pad for the others."""
        jobs, streams, active, finish = self.jobs, self.streams, self.active, self.finish_reasons
        nxt = [self.pad_id] * len(jobs)
        greedy = logits.argmax(-1).tolist()  # one call for every greedy row
        for row, job in enumerate(jobs):
            if not active[row]:
                continue
            if job.cancelled.is_set():
                active[row], finish[row] = False, "cancelled"
                continue
            tok = (greedy[row] if job.temperature <= 0 else
                   sample_next(logits[row], job.temperature, job.top_p, self.gens[row]))
            if self.step == 0:
                self.ttft[row] = time.perf_counter() - self.t0
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
                  or self.prompt_lens[row] + len(streams[row].ids) >= self.max_positions):
                active[row], finish[row] = False, "length"
        self.step += 1
        return nxt

    def finish(self, fields: Callable[[int], dict[str, Any]]) -> None:
        """Flush and emit ``Finished`` for every row not cancelled.

        ``fields(row)`` gives the runner's own ``GenOutput`` fields (``prompt_tokens`` and
        any cache statistics); tokens, text, finish reason and TTFT come from the decode.
        """
        for row, job in enumerate(self.jobs):
            if self.finish_reasons[row] == "cancelled":
                continue
            stream = self.streams[row]
            tail = stream.flush()
            if tail:
                job.emit(Delta(tail))
            job.emit(Finished(GenOutput(
                token_ids=list(stream.ids), text=stream.text,
                finish_reason=self.finish_reasons[row], ttft_s=self.ttft[row], **fields(row),
            )))


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def decode_batch(model: Any, dec: BatchDecode, logits: Any, cache: Any, mask: Any,
                 pos: Any) -> None:
    """The server's one batched decode loop, after a prefill (both runners end in it).

    ``logits`` [B, V] are the prefill's last-position logits, ``cache`` the batch's KV cache
    (passed back to the model opaquely), ``mask`` [B, T] the attention mask (left padding is 0)
    and ``pos`` [B, >=1] the position ids, whose last column is each row's last position.
    :class:`BatchDecode` picks tokens, streams text, applies stop strings and decides when
    each row ends; every step feeds all rows (finished ones get the pad token) in one forward.
    """
    import torch

    bsz = mask.shape[0]
    while True:
        nxt = dec.select(logits)
        if dec.done:
            return
        mask = torch.cat([mask, mask.new_ones((bsz, 1))], 1)
        pos = pos[:, -1:] + 1
        ids = torch.tensor(nxt, dtype=torch.long, device=mask.device).unsqueeze(1)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                    **cache_kwargs(model, cache))
        cache = _cache_of(out)
        logits = out.logits[:, -1, :].float()


class DirectRunner:
    """Serves batches of jobs on one plain transformers causal LM (no KV prefix cache)."""

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = pad_id_for(tokenizer, self.eos_ids)

    def run(self, jobs: list[Job]) -> None:
        import torch

        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        bsz = len(jobs)
        width = max(len(j.prompt_ids) for j in jobs)
        ids = torch.full((bsz, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.long)
        for row, job in enumerate(jobs):
            n = len(job.prompt_ids)
            ids[row, width - n:] = torch.tensor(job.prompt_ids, dtype=torch.long)
            mask[row, width - n:] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        dec = BatchDecode(jobs, self.tokenizer, prompt_lens=[len(j.prompt_ids) for j in jobs],
                          eos_ids=self.eos_ids, pad_id=self.pad_id,
                          max_positions=self.max_positions, t0=t0)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            cache = _cache_of(out)
            logits = out.logits[:, -1, :]
            for job in jobs:
                job.emit(Started(prompt_tokens=len(job.prompt_ids), hit_tokens=0))
            decode_batch(self.model, dec, logits, cache, mask, pos)
        dec.finish(lambda row: {"prompt_tokens": len(jobs[row].prompt_ids)})
