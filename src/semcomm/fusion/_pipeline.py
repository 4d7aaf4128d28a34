"""Inference with a fused cache: sharer prefill (or KV-store restore), receiver prefill, fuse,
then greedy decoding by the receiver.

:class:`FusionPipeline` is the object users hold: it takes a sharer, a receiver (each a
:class:`ModelSide`: model, tokenizer and the prompt text each wraps around the shared
context) and a :class:`~semcomm.fusion.Fuser`. ``pipeline.generate(shared_text)`` returns the
receiver's answer written with the sharer's understanding of the shared text fused into its
cache. With ``sharer_engine`` set (a :class:`semcomm.engine.HFEngine` over the sharer), the
sharer's prompt KV is restored from the KV store when cached instead of recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import BatchDecoder, StopText
from ..errors import InvalidInputError
from ._align import Alignment, EncodedPrompt, PromptParts, align_offsets, encode_prompt
from ._fuser import Fuser
from ._kvio import KVLayers, align_layers, cache_to_layers, output_cache
from ._spec import ModelSpec, model_spec

__all__ = [
    "FusedPrompt",
    "FusionPipeline",
    "Generation",
    "ModelSide",
    "greedy_decode",
    "iter_greedy",
    "text_pieces",
]

log = logging.getLogger(__name__)


@dataclass
class ModelSide:
    """One model of the pair, with the text it puts around the shared context.

    ``prefix``/``suffix`` are this model's own prompt template around the shared text (a
    chat template, an answer cue). ``add_special_tokens`` is passed to its tokenizer.
    """

    model: torch.nn.Module
    tokenizer: Any
    prefix: str = ""
    suffix: str = ""
    add_special_tokens: bool = False
    _spec: ModelSpec | None = field(default=None, repr=False)

    @property
    def spec(self) -> ModelSpec:
        if self._spec is None:
            self._spec = model_spec(self.model, self.tokenizer)
        return self._spec

    def parts(self, shared: str) -> PromptParts:
        return PromptParts(self.prefix, shared, self.suffix)

    def encode(self, shared: str) -> EncodedPrompt:
        return encode_prompt(
            self.tokenizer, self.parts(shared), add_special_tokens=self.add_special_tokens
        )

    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (
            self.tokenizer,
            getattr(self.model, "generation_config", None),
            self.model.config,
        ):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        return ids

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass(slots=True)
class FusedPrompt:
    """Receiver and sharer encodings of one shared text, and their alignment."""

    receiver: EncodedPrompt
    sharer: EncodedPrompt
    alignment: Alignment  # rows: receiver tokens of the prompt *without* its last token


@dataclass(slots=True)
class Generation:
    """Result of one generation."""

    text: str
    token_ids: list[int]
    latency_s: float
    stats: dict[str, Any]  # prompt tokens, fused tokens, sharer KV source, timings


def iter_greedy(
    model: torch.nn.Module,
    layers: KVLayers | None,
    feed_ids: list[int],
    *,
    start_pos: int,
    max_new_tokens: int,
    eos_ids: set[int],
) -> Iterator[int]:
    """Greedy decoding from a (possibly fused) cache, one token id at a time.

    ``layers`` holds KV for positions ``[0, start_pos)`` (or is None); ``feed_ids`` are the
    prompt tokens not yet in the cache (at least one). Stops at an end-of-sequence id (not
    yielded) or after ``max_new_tokens``. The given layers are not mutated. The loop is the
    engine's (:meth:`semcomm.engine.BatchDecoder.continue_greedy`).
    """
    decoder = BatchDecoder(model, None, eos_ids=sorted(eos_ids))
    return decoder.continue_greedy(layers, feed_ids, start_pos=start_pos,
                                   max_new_tokens=max_new_tokens)


def greedy_decode(
    model: torch.nn.Module,
    layers: KVLayers | None,
    feed_ids: list[int],
    *,
    start_pos: int,
    max_new_tokens: int,
    eos_ids: set[int],
    stop: Any = None,
    decode: Any = None,
) -> list[int]:
    """Greedy decoding from a (possibly fused) cache (see :func:`iter_greedy`).

    ``stop(text)`` ends decoding early when it returns True (``decode`` turns ids to text
    for it).
    """
    out_ids: list[int] = []
    for nxt in iter_greedy(
        model,
        layers,
        feed_ids,
        start_pos=start_pos,
        max_new_tokens=max_new_tokens,
        eos_ids=eos_ids,
    ):
        out_ids.append(nxt)
        if stop is not None and decode is not None and stop(decode(out_ids)):
            break
    return out_ids


def text_pieces(tokens: Iterable[int], tokenizer: Any) -> Iterator[str]:
    """The text each token adds, by the engine's incremental detokenizer
    (:class:`semcomm.engine.StopText`: a piece ending in an incomplete UTF-8 sequence is held
    back until the next token completes it; the pieces joined equal the whole decode)."""
    words = StopText(tokenizer)
    for tok in tokens:
        piece, _ = words.push(tok)
        if piece:
            yield piece
    tail = words.finish()
    if tail:
        yield tail


class FusionPipeline:
    """Sharer + receiver + fuser; generates with the fused receiver cache.

    Invariant: only receiver tokens wholly inside the shared text and covered by sharer
    tokens are fused; the receiver's last prompt token is fed after fusion.
    """

    def __init__(
        self,
        sharer: ModelSide,
        receiver: ModelSide,
        fuser: Fuser | None,
        *,
        sharer_engine: Any = None,
        reduce: str = "mean",
        check: bool = True,
    ):
        self.sharer = sharer
        self.receiver = receiver
        self.fuser = fuser
        self.sharer_engine = sharer_engine
        self.reduce = reduce
        if fuser is not None:
            if check:
                fuser.check_models(sharer.spec, receiver.spec)
            fuser.eval()

    # -- encoding ----------------------------------------------------------------------
    def encode(self, shared: str) -> FusedPrompt:
        if not shared:
            raise InvalidInputError("the shared context is empty")
        r = self.receiver.encode(shared)
        s = self.sharer.encode(shared)
        if len(r.input_ids) < 2:
            raise InvalidInputError("the receiver prompt needs at least 2 tokens to fuse into")
        alignment = align_offsets(r.spans[:-1], s.spans, reduce=self.reduce)  # type: ignore[arg-type]
        return FusedPrompt(receiver=r, sharer=s, alignment=alignment)

    # -- KV ----------------------------------------------------------------------------
    def sharer_layers(self, ids: list[int]) -> tuple[KVLayers, dict[str, Any]]:
        """The sharer's prompt KV: from the engine (KV store) when given, else a forward."""
        t0 = time.perf_counter()
        if self.sharer_engine is not None:
            result = self.sharer_engine.prefill(ids)
            layers = cache_to_layers(result.cache)
            stats = getattr(result, "stats", None)
            info = {"sharer_source": "engine", "sharer_engine_stats": _as_dict(stats)}
        else:
            device = self.sharer.device
            with torch.no_grad():
                out = self.sharer.model(
                    input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1
                )
            layers = cache_to_layers(output_cache(out))
            info = {"sharer_source": "forward"}
        n = layers[0][0].shape[2]
        if n != len(ids):
            raise InvalidInputError(f"sharer KV holds {n} tokens, the sharer prompt has {len(ids)}")
        info["sharer_ms"] = (time.perf_counter() - t0) * 1e3
        return layers, info

    def fused_layers(self, fp: FusedPrompt) -> tuple[KVLayers, dict[str, Any]]:
        """Receiver KV for its prompt without the last token, fused with the sharer's."""
        device = self.receiver.device
        r_ids = fp.receiver.input_ids
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.receiver.model(
                input_ids=torch.tensor([r_ids[:-1]], device=device),
                use_cache=True,
                logits_to_keep=1,
            )
        r_layers = cache_to_layers(output_cache(out))
        stats: dict[str, Any] = {"receiver_prefill_ms": (time.perf_counter() - t0) * 1e3}
        if self.fuser is None or fp.alignment.num_fused == 0:
            stats["fused_tokens"] = 0
            return r_layers, stats
        s_layers, s_info = self.sharer_layers(fp.sharer.input_ids)
        s_layers = [(k.to(device), v.to(device)) for k, v in s_layers]  # engine may sit elsewhere
        stats.update(s_info)
        t1 = time.perf_counter()
        with torch.no_grad():
            aligned = align_layers(s_layers, fp.alignment.weights[None].to(device))
            fused = self.fuser.fuse(aligned, r_layers, fp.alignment.mask[None].to(device))
        stats["fuse_ms"] = (time.perf_counter() - t1) * 1e3
        stats["fused_tokens"] = fp.alignment.num_fused
        return fused, stats

    # -- generation --------------------------------------------------------------------
    def _prepare(self, shared: str, fuse: bool) -> tuple[FusedPrompt, KVLayers, dict[str, Any]]:
        fp = self.encode(shared)
        if fuse and self.fuser is not None:
            layers, stats = self.fused_layers(fp)
        else:
            saved, self.fuser = self.fuser, None
            try:
                layers, stats = self.fused_layers(fp)
            finally:
                self.fuser = saved
        return fp, layers, stats

    def stream(
        self,
        shared: str,
        *,
        max_new_tokens: int = 256,
        fuse: bool = True,
        stats: dict[str, Any] | None = None,
    ) -> Generator[str, None, None]:
        """The receiver's greedy answer for ``prefix + shared + suffix`` as text pieces.

        The sharer's KV (from ``sharer_engine``'s KV store when cached) is fused before the
        first piece; each piece is the text one more token adds (a piece is held back while
        it ends in an incomplete UTF-8 sequence). ``stats``, when given, is filled with the
        same figures :meth:`generate` reports (``first_piece_ms`` too) as pieces are made.
        Closing the iterator early stops decoding.
        """
        t0 = time.perf_counter()
        fp, layers, prep = self._prepare(shared, fuse)
        info = stats if stats is not None else {}
        info.update(prep)
        r_ids = fp.receiver.input_ids
        info["receiver_prompt_tokens"] = len(r_ids)
        info["sharer_prompt_tokens"] = len(fp.sharer.input_ids)
        tok = self.receiver.tokenizer
        count = [0]

        def tokens() -> Iterator[int]:
            for t in iter_greedy(
                self.receiver.model,
                layers,
                [r_ids[-1]],
                start_pos=len(r_ids) - 1,
                max_new_tokens=max_new_tokens,
                eos_ids=self.receiver.eos_ids(),
            ):
                count[0] += 1
                info["generated_tokens"] = count[0]
                yield t

        first = True
        for piece in text_pieces(tokens(), tok):
            if first:
                info["first_piece_ms"] = (time.perf_counter() - t0) * 1e3
                first = False
            yield piece
        info.setdefault("generated_tokens", 0)
        info["latency_s"] = time.perf_counter() - t0

    def generate(
        self, shared: str, *, max_new_tokens: int = 16, stop: Any = None, fuse: bool = True
    ) -> Generation:
        """Greedy answer of the receiver for ``prefix + shared + suffix``.

        With ``fuse=False`` (or no fuser) the receiver runs alone, through the same code.
        """
        t0 = time.perf_counter()
        fp, layers, stats = self._prepare(shared, fuse)
        r_ids = fp.receiver.input_ids
        tok = self.receiver.tokenizer
        out = greedy_decode(
            self.receiver.model,
            layers,
            [r_ids[-1]],
            start_pos=len(r_ids) - 1,
            max_new_tokens=max_new_tokens,
            eos_ids=self.receiver.eos_ids(),
            stop=stop,
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        )
        text = tok.decode(out, skip_special_tokens=True)
        stats.update(
            {
                "receiver_prompt_tokens": len(r_ids),
                "sharer_prompt_tokens": len(fp.sharer.input_ids),
                "generated_tokens": len(out),
            }
        )
        return Generation(text=text, token_ids=out, latency_s=time.perf_counter() - t0, stats=stats)


def _as_dict(obj: Any) -> Any:
    if obj is None or isinstance(obj, dict):
        return obj
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    try:
        from dataclasses import asdict, is_dataclass

        if is_dataclass(obj):
            return asdict(obj)  # type: ignore[arg-type]
    except TypeError:
        pass
    return repr(obj)
