"""A batched decode loop over a plain transformers model, without KV reuse.

This runner serves batches of queued requests in one forward pass per step (left-padded
prompts, per-row positions from the attention mask, per-row stopping and sampling). It is the
"plain serving" baseline and the path for models without a KV prefix cache; the KV-reusing
path goes through ``semcomm.engine`` (see ``_engine_runner``). The cache object transformers
returns is passed back opaquely: this module never reads or edits KV tensors.
"""

from __future__ import annotations

import time
from typing import Any

from ._batching import Delta, Finished, GenOutput, Job, Started

__all__ = ["DirectRunner", "TextStream", "sample_next"]


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


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


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
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)

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
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            cache = _cache_of(out)
            logits = out.logits[:, -1, :]
            for job in jobs:
                job.emit(Started(prompt_tokens=len(job.prompt_ids), hit_tokens=0))
            step = 0
            while any(active):
                nxt = [self.pad_id] * bsz
                greedy = logits.argmax(-1).tolist()  # one call for every greedy row
                for row, job in enumerate(jobs):
                    if not active[row]:
                        continue
                    if job.cancelled.is_set():
                        active[row] = False
                        finish[row] = "cancelled"
                        continue
                    tok = (greedy[row] if job.temperature <= 0 else
                           sample_next(logits[row], job.temperature, job.top_p, gens[row]))
                    if step == 0:
                        ttft[row] = time.perf_counter() - t0
                    if tok in self.eos_ids:
                        active[row] = False
                        finish[row] = "stop"
                        continue
                    nxt[row] = tok
                    delta = streams[row].push(tok)
                    if delta:
                        job.emit(Delta(delta))
                    if streams[row].stopped:
                        active[row] = False
                        finish[row] = "stop"
                    elif len(streams[row].ids) >= job.max_new_tokens or len(job.prompt_ids) + len(streams[row].ids) >= self.max_positions:
                        active[row] = False
                        finish[row] = "length"
                if not any(active):
                    break
                step += 1
                mask = torch.cat([mask, torch.ones((bsz, 1), dtype=mask.dtype, device=device)], 1)
                pos = pos[:, -1:] + 1
                step_ids = torch.tensor(nxt, dtype=torch.long, device=device).unsqueeze(1)
                out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                                 cache=cache, use_cache=True)
                cache = _cache_of(out)
                logits = out.logits[:, -1, :]
        for row, job in enumerate(jobs):
            if finish[row] == "cancelled":
                continue
            tail = streams[row].flush()
            if tail:
                job.emit(Delta(tail))
            job.emit(Finished(GenOutput(
                token_ids=list(streams[row].ids),
                text=streams[row].text,
                finish_reason=finish[row],
                prompt_tokens=len(job.prompt_ids),
                ttft_s=ttft[row],
            )))
