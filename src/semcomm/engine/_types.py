"""Results and statistics returned by :class:`semcomm.engine.HFEngine`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["GenerationResult", "GenerationStats", "PrefillResult", "PrefillRunner", "TokenStream"]


@dataclass(slots=True)
class GenerationStats:
    """What one request cost and what the KV prefix cache saved. Filled in by the engine only."""

    prompt_tokens: int = 0  # tokens in the prompt
    hit_tokens: int = 0  # prompt tokens whose KV was restored (not recomputed)
    hit_chunks: int = 0  # chunks restored
    hit_tiers: tuple[str, ...] = ()  # tier that served each restored chunk, in order
    recomputed_tokens: int = 0  # prompt tokens run through the model (0: whole-prompt hit)
    logits_restored: bool = False  # a whole-prompt hit: its stored last logits, no forward
    bytes_loaded: int = 0  # encoded chunk bytes read from the store or snapshot
    bytes_stored: int = 0  # encoded chunk bytes written
    chunks_stored: int = 0  # new chunks written (already stored chunks are skipped)
    lookup_ms: float = 0.0  # longest-prefix lookup in the store
    load_ms: float = 0.0  # fetch + verify + decode + restore into the model cache (incl. lookup)
    prefill_ms: float = 0.0  # forward over the recomputed prompt tokens
    store_ms: float = 0.0  # encode + write of the new chunks (after the first token)
    ttft_s: float = 0.0  # call start -> first generated token chosen
    decode_tokens_per_s: float = 0.0  # generated tokens after the first, per second
    new_tokens: int = 0  # tokens generated
    total_s: float = 0.0  # call start -> end
    codec: str = "lossless"  # codec spec of the namespace
    finish_reason: str = ""  # "length", "eos", "stop" (or "" for prefill only)
    # a prompt with documents (engine/_documents.py): what was reused and recomputed (BlendStats)
    documents: dict[str, Any] | None = None

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens restored from cache."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tier(self) -> str:
        """The tier that served the hit ('none' on a miss, 'a+b' when several served)."""
        if not self.hit_tiers:
            return "none"
        seen: list[str] = []
        for t in self.hit_tiers:
            if t not in seen:
                seen.append(t)
        return "+".join(seen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_chunks": self.hit_chunks,
            "hit_tiers": list(self.hit_tiers),
            "recomputed_tokens": self.recomputed_tokens,
            "logits_restored": self.logits_restored,
            "bytes_loaded": self.bytes_loaded,
            "bytes_stored": self.bytes_stored,
            "chunks_stored": self.chunks_stored,
            "lookup_ms": self.lookup_ms,
            "load_ms": self.load_ms,
            "prefill_ms": self.prefill_ms,
            "store_ms": self.store_ms,
            "ttft_s": self.ttft_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "new_tokens": self.new_tokens,
            "total_s": self.total_s,
            "codec": self.codec,
            "finish_reason": self.finish_reason,
            **({"documents": self.documents} if self.documents is not None else {}),
        }


@dataclass(slots=True)
class GenerationResult:
    """Output of :meth:`HFEngine.generate`."""

    token_ids: list[int]  # generated tokens only (the prompt excluded)
    text: str | None  # decoded generated text, None without a tokenizer
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as tokenized


@dataclass(slots=True)
class PrefillResult:
    """Output of :meth:`HFEngine.prefill`: the prompt's full KV cache, ready to decode from.

    ``cache`` is a transformers ``DynamicCache`` of the engine's preallocated layers holding the
    prompt (caller owns it and may mutate it or decode on it; a restored sliding-window layer
    holds only the positions from its ``start``, the window the next token needs);
    ``last_logits`` is the float32 ``[vocab]`` next-token distribution's logits.
    """

    cache: Any  # transformers DynamicCache, [1, H, T, D] views per layer
    last_logits: torch.Tensor
    input_ids: list[int]
    stats: GenerationStats
    chunk_bytes: list[bytes | None] = field(default_factory=list)  # fetched encoded chunks (hits)
    # the CPU key/value buffers behind ``cache`` when they came from the engine's buffer pool
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None


class TokenStream:
    """Iterator of generated text pieces (or token ids without a tokenizer).

    After it is exhausted, :attr:`result` holds the :class:`GenerationResult`.
    """

    def __init__(self, gen: Iterator[Any]):
        self._gen = gen
        self.result: GenerationResult | None = None

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
            raise

    def close(self) -> None:
        """Stop decoding (no result is set); later ``next`` calls end the iteration."""
        close = getattr(self._gen, "close", None)
        if close is not None:
            close()


class PrefillRunner(Protocol):
    """Runs an engine's prefill forwards (``HFEngine(prefill_scheduler=...)``), e.g. to bound
    how many long prefills compute at once (``semcomm.runtime.PrefillScheduler``).

    ``run`` must return ``runner.forward(ids, cache)``'s result for ``ids`` of shape ``[1, n]``;
    it may call ``runner.forward`` on consecutive pieces of ``ids`` instead, each ending at a
    multiple of ``align`` (the engine's chunk size), and wait between them: the engine computes
    every chunk in a forward of its own, so that changes when a chunk is computed, never what.
    """

    def run(self, runner: Any, ids: torch.Tensor, cache: Any, *, align: int) -> torch.Tensor: ...
