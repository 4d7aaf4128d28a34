"""Documents reused at any position: per-document KV, re-rotated keys, selective recompute.

A prompt is a sequence of segments (:class:`System`, :class:`User`, :class:`Assistant`,
:class:`Text`, :class:`Document`). A document's tokens are its own tokenization (never a
separator string that must tokenize the same way in every context), and its KV is computed
once, alone after a fixed *anchor* (the model's chat header, so the document's first tokens
are not attention sinks of their own), and stored in the engine's chunk store under a key root
of its own (``H("semcomm.doc/1" || namespace digest || key mode || anchor tokens)``, then the
usual chain over the document's tokens): one copy per (model namespace incl. tenant, anchor,
document tokens), whatever prompt or position it later appears in.

At use (:meth:`DocumentReuse.prefill` / :meth:`DocumentReuse.generate`) the stored KV is
restored at the document's position in the prompt with its keys re-rotated (RoPE: a key computed
at position ``p`` is ``R(p) k``; ``R(q - p) R(p) k = R(q) k``, with the model's own inverse
frequencies), then a share ``r`` of the document tokens is recomputed in context, with every
token outside the documents (the instructions, the labels between documents, the question and
everything after the last document), in position order, in blocks whose fresh KV is written
over the reused copies at their positions, so that each recomputed token sees the reused KV of
the earlier positions and the fresh KV of the earlier recomputed ones. Which document tokens (the *selector*):

* ``cacheblend``: the tokens whose KV deviates most at an early layer (layer 1) between the
  reused copy and a fresh computation of layers 0-1 over the whole prompt (CacheBlend,
  EuroSys'25); those layers' fresh KV is kept for every position.
* ``epic``: the first ``ceil(r * n)`` tokens of each document (EPIC/LegoLink, ICML'25).
* ``prophet``: the tokens the question attends to most (ProphetKV, ICML'26): a first pass runs
  the non-document tokens over the reused KV and scores every document token by the attention
  the question's tokens give it (a quarter of the layers, all heads).
* ``concat`` (``r = 0`` whatever the selector) and ``full`` (every document token) are the bounds.

Models whose positions cannot be moved are refused with :class:`UnsupportedModelError` naming
why: ALiBi, learned absolute positions, no rotary embedding, rotary frequencies that depend on
the sequence length (dynamic/longrope scaling), keys that do not move by the rotate-half
rotation (checked on the model's own layer-0 keys at load), and sliding-window layers shorter
than the prompt.

After a blended prompt its KV is stored under a blend root that names the selector, ``r`` and
the document spans (``H("semcomm.blend/1" || ...)``), with its last-position logits beside it,
so the same prompt repeated restores everything and runs no forward; the exactly computed
chunks before the first document go under the ordinary prefix keys; stored documents are never
overwritten (and approximate KV never lands under an exact prefix key).

With an :class:`AnchorPool` (engine/_anchors.py) a document's in-context KV from an earlier
prompt or answer is used before the stored one, a prompt with no document at hand is prefilled
in full, and the documents of a prompt computed wholly in context and its answer are captured
as anchors; a blend over anchors is never stored whole. With ``offsets`` an anchor placed in a
prompt layout seen before gets that slot's learned offset added (engine/_anchors.py).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import re
import struct
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import (
    BackendUnavailableError,
    CorruptEntryError,
    InvalidInputError,
    NamespaceMismatchError,
    StoreError,
    UnsupportedModelError,
)
from ..kv import ChunkKey, chunk_keys, chunk_spans, decode_chunk, encode_chunk, logits_key
from . import _cache_adapter as ca
from ._anchors import AnchorPool
from ._decode import DecodeState, SamplingParams, decode_steps

__all__ = [
    "DEFAULT_RECOMPUTE",
    "DEFAULT_SELECTOR",
    "SELECTORS",
    "Assistant",
    "BlendResult",
    "BlendStats",
    "Document",
    "DocumentReuse",
    "RopeSpec",
    "Segment",
    "SegmentedPrompt",
    "System",
    "Text",
    "User",
    "blend_root",
    "build_prompt",
    "document_root",
    "generation_result",
    "is_segmented",
    "rope_spec",
    "rotate_keys",
]

logger = logging.getLogger("semcomm.engine")

SELECTORS = ("cacheblend", "epic", "prophet", "concat", "full")
DEFAULT_SELECTOR = "prophet"
DEFAULT_RECOMPUTE = 0.15
KEY_MODES = ("rotated", "unrotated")
_DOC_TAG = b"semcomm.doc/1"
_BLEND_TAG = b"semcomm.blend/1"
_CHECK_LAYER = 1  # CacheBlend's deviation layer (layer 0's KV does not depend on context)
_RUN_BLOCK = 256  # recomputed tokens per forward of a blended prefill
_LOGITS_CODEC = "logits"


# ------------------------------------------------------------------------------ segments
@dataclass(frozen=True)
class Segment:
    """A piece of a prompt: text (tokenized alone) or token ids."""

    text: str | None = None
    tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.tokens is None):
            raise InvalidInputError(f"{type(self).__name__} takes text or tokens (exactly one)")
        if self.tokens is not None:
            toks = tuple(int(t) for t in self.tokens)
            object.__setattr__(self, "tokens", toks)


class System(Segment):
    """The system message (chat models)."""


class User(Segment):
    """Text of the user's message; Documents and Text around it join the same message."""


class Assistant(Segment):
    """An earlier assistant turn."""


class Text(Segment):
    """Text inside the current message (or raw, for a prompt without chat roles)."""


class Document(Segment):
    """A document whose KV is computed once and reused at any position (in any prompt)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.text == "" or self.tokens == ():
            raise InvalidInputError("a Document is empty")


_ROLE = {System: "system", Assistant: "assistant"}


@dataclass(frozen=True)
class SegmentedPrompt:
    """Token ids of a segmented prompt and where its documents lie."""

    ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]  # [start, end) of each document, in prompt order

    @property
    def document_tokens(self) -> int:
        return sum(b - a for a, b in self.spans)


def _tokens(tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        raise InvalidInputError("text segments need a tokenizer; pass tokens= instead")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _adds_bos(tokenizer: Any) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    ids = list(tokenizer("a")["input_ids"])
    return [int(bos)] if ids and ids[0] == bos else []


def build_prompt(tokenizer: Any, segments: Sequence[Segment]) -> SegmentedPrompt:
    """Token ids and document spans of ``segments``.

    With a chat role among them (System/User/Assistant) and a tokenizer with a chat template,
    the messages go through the template (generation prompt added): System opens a system
    message, Assistant an assistant one, User/Text/Document pieces join the current user
    message as written (no separator is added). Each piece is tokenized alone; a document's
    tokens are its own tokenization, spliced in. Without roles the pieces are concatenated
    (after the tokenizer's BOS where it adds one).
    """
    if not segments or not all(isinstance(s, Segment) for s in segments):
        raise InvalidInputError("a segmented prompt is a non-empty list of Segment objects")
    if not any(isinstance(s, Document) for s in segments):
        logger.debug("a segmented prompt without documents")
    doc_toks = [list(s.tokens) if s.tokens is not None else _tokens(tokenizer, s.text or "")
                for s in segments if isinstance(s, Document)]
    if any(not t for t in doc_toks):
        raise InvalidInputError("a Document tokenizes to no tokens")
    chat = (any(type(s) in (System, User, Assistant) for s in segments) and tokenizer is not None
            and getattr(tokenizer, "chat_template", None))
    # pieces: str (text to tokenize), list[int] (tokens), or int (document index)
    pieces: list[Any] = []
    if chat:
        if any(s.tokens is not None and not isinstance(s, Document) for s in segments):
            raise InvalidInputError("chat segments take text, not tokens")
        messages: list[dict[str, str]] = []
        di = 0
        for s in segments:
            role = _ROLE.get(type(s), "user")
            if isinstance(s, Document):
                piece = f"\ue000semcomm-doc-{di}\ue001"
                di += 1
            else:
                piece = s.text or ""
            if messages and messages[-1]["role"] == role == "user":
                messages[-1]["content"] += piece
            else:
                messages.append({"role": role, "content": piece})
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        for i, part in enumerate(re.split("\ue000semcomm-doc-(\\d+)\ue001", rendered)):
            pieces.append(int(part) if i % 2 else part)
        if sum(isinstance(p, int) for p in pieces) != len(doc_toks):
            raise InvalidInputError("the chat template dropped or repeated a document")
    else:
        if tokenizer is not None:
            pieces.append(_adds_bos(tokenizer))
        di = 0
        for s in segments:
            if isinstance(s, Document):
                pieces.append(di)
                di += 1
            else:
                pieces.append(list(s.tokens) if s.tokens is not None else s.text)
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for p in pieces:
        if isinstance(p, int):
            spans.append((len(ids), len(ids) + len(doc_toks[p])))
            ids.extend(doc_toks[p])
        elif isinstance(p, str):
            ids.extend(_tokens(tokenizer, p))
        else:
            ids.extend(p)
    return SegmentedPrompt(ids=tuple(ids), spans=tuple(spans))


# -------------------------------------------------------------------------------- RoPE
@dataclass(frozen=True)
class RopeSpec:
    """How a model's keys move: ``rot_dim`` leading dims rotated (rotate-half pairs) by
    ``position * inv_freq``."""

    inv_freq: torch.Tensor  # float64 [rot_dim / 2]
    rot_dim: int
    head_dim: int


_SPECS: weakref.WeakKeyDictionary[Any, RopeSpec | UnsupportedModelError] = (
    weakref.WeakKeyDictionary())


def _decoder_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def rope_spec(model: Any) -> RopeSpec:
    """The model's rotary parameters, or :class:`UnsupportedModelError` naming why its
    positions cannot be moved. Checked once a model on its own layer-0 keys (a probe at two
    offsets: rotating the first by the difference must give the second)."""
    known = _SPECS.get(model)  # kept beside the model, never written onto it
    if isinstance(known, RopeSpec):
        return known
    if isinstance(known, UnsupportedModelError):
        raise known
    try:
        spec = _rope_spec(model)
    except UnsupportedModelError as exc:
        _SPECS[model] = exc
        raise
    _SPECS[model] = spec
    return spec


def _rope_spec(model: Any) -> RopeSpec:
    cfg = _decoder_config(model.config)
    mtype = getattr(cfg, "model_type", type(model).__name__)
    why = f"{mtype}: documents cannot be reused at another position"
    if (getattr(cfg, "alibi", False) or getattr(cfg, "position_embedding_type", "") == "alibi"
            or mtype in ("bloom", "mpt")):
        raise UnsupportedModelError(f"{why}: ALiBi attention biases are not a rotation of "
                                    "stored keys")
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Embedding) and leaf in ("wpe", "embed_positions",
                                                             "position_embeddings"):
            raise UnsupportedModelError(f"{why}: it has learned absolute position embeddings "
                                        f"({name}), mixed into every layer's keys and values")
    rot = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not rot:
        raise UnsupportedModelError(f"{why}: it has no rotary position embedding")
    for m in rot:
        rtype = str(getattr(m, "rope_type", "default"))
        if rtype in ("dynamic", "longrope"):
            raise UnsupportedModelError(f"{why}: its rotary frequencies ({rtype} scaling) depend "
                                        "on the sequence length")
    freqs = rot[0].inv_freq.detach().double().cpu()
    if any(m.inv_freq.shape != freqs.shape or not torch.allclose(
            m.inv_freq.detach().double().cpu(), freqs) for m in rot[1:]):
        raise UnsupportedModelError(f"{why}: its layers use different rotary frequencies")
    layout = ca.probe_layout(model, next(model.parameters()).device)
    spec = RopeSpec(inv_freq=freqs, rot_dim=2 * freqs.numel(), head_dim=layout.k_dim)
    if spec.rot_dim > spec.head_dim:
        raise UnsupportedModelError(f"{why}: rotary dims {spec.rot_dim} > head dim "
                                    f"{spec.head_dim}")
    # the check: layer-0 keys of the same tokens at positions 0.. and 37.. differ by R(37)
    dev = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().num_embeddings)
    gen = torch.Generator().manual_seed(7)
    probe = torch.randint(3, max(4, vocab), (1, 8), generator=gen).to(dev)
    keys = []
    with torch.no_grad():
        for off in (0, 37):
            cache = ca.new_cache()
            pos = torch.arange(off, off + 8, device=dev)[None]
            model(input_ids=probe, position_ids=pos, attention_mask=torch.ones_like(probe),
                  use_cache=True, **ca.cache_kwargs(model, cache))
            keys.append(ca.cache_layers(cache)[0][0].float())
    moved = rotate_keys(keys[0], 37, spec)
    scale = float(keys[1].abs().max()) or 1.0
    # a rotation in another convention is off by O(1); rounding is off by a few ulps of the
    # model's dtype (bfloat16 keys: ~1e-2)
    tol = max(1e-3, 5 * torch.finfo(layout.dtype).eps)
    if not torch.allclose(moved, keys[1], atol=tol * scale, rtol=tol):
        raise UnsupportedModelError(
            f"{why}: its keys do not move by the rotate-half rotation of its rotary embedding "
            f"(max error {float((moved - keys[1]).abs().max()):.3g} at scale {scale:.3g})")
    return spec


def rotate_keys(keys: torch.Tensor, delta: int | torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Keys ``[..., T, D]`` moved by ``delta`` positions (an int, or ``[T]`` per token):
    the leading ``rot_dim`` dims rotated by ``delta * inv_freq`` (angles in float64), the
    rest unchanged. Returns a new tensor of the keys' dtype."""
    t = keys.shape[-2]
    d = (torch.full((t,), float(delta), dtype=torch.float64) if isinstance(delta, int)
         else delta.detach().to("cpu", torch.float64).reshape(t))
    ang = d[:, None] * spec.inv_freq[None, :]  # [T, rot/2]
    work = torch.float32 if keys.dtype in (torch.bfloat16, torch.float16) else keys.dtype
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(keys.device, work)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(keys.device, work)
    k = keys.to(work)
    r = spec.rot_dim
    kr = k[..., :r]
    half = r // 2
    rh = torch.cat([-kr[..., half:], kr[..., :half]], -1)
    out = torch.cat([kr * cos + rh * sin, k[..., r:]], -1) if r < k.shape[-1] else kr * cos + rh * sin
    return out.to(keys.dtype)


# ------------------------------------------------------------------------------- keys
def _u32(ids: Sequence[int]) -> bytes:
    return np.asarray(list(ids), dtype="<u4").tobytes()


def document_root(namespace: bytes, anchor: Sequence[int], mode: str) -> bytes:
    """Root of a document's key chain: never a prefix chain's (those root at the namespace)."""
    h = hashlib.blake2b(_DOC_TAG, digest_size=32)
    h.update(bytes(namespace))
    h.update(mode.encode() + b"\0")
    h.update(struct.pack("<I", len(anchor)) + _u32(anchor))
    return h.digest()


def blend_root(namespace: bytes, anchor: Sequence[int], mode: str, selector: str, r: float,
               spans: Sequence[tuple[int, int]]) -> bytes:
    """Root of a blended prompt's key chain (its KV depends on the spans, selector and r)."""
    h = hashlib.blake2b(_BLEND_TAG, digest_size=32)
    h.update(document_root(namespace, anchor, mode))
    h.update(f"{selector}:{r!r}".encode() + b"\0")
    h.update(_u32([x for s in spans for x in s]))
    return h.digest()


# ------------------------------------------------------------------------------ results
@dataclass
class BlendStats:
    """What a segmented request reused and recomputed."""

    prompt_tokens: int = 0
    document_tokens: int = 0  # tokens inside documents
    documents: int = 0
    documents_hit: int = 0  # documents whose KV came from the store
    documents_computed: int = 0  # documents computed alone (and stored) by this request
    documents_anchored: int = 0  # documents whose KV came from an anchor (engine/_anchors.py)
    anchored_tokens: int = 0  # the tokens of those documents
    anchors_captured: int = 0  # segments this request kept as anchors (documents, its answer)
    reused_tokens: int = 0  # document tokens whose reused KV was kept
    recomputed_document_tokens: int = 0
    recomputed_tokens: int = 0  # every prompt token run through the model in context
    prefix_hit_tokens: int = 0  # exact prefix restored from the ordinary prefix chain
    blend_hit: bool = False  # the whole blended prompt was stored: restored, no forward
    selector: str = ""
    recompute: float = 0.0  # the requested r
    bytes_loaded: int = 0
    bytes_stored: int = 0
    chunks_stored: int = 0
    load_ms: float = 0.0
    select_ms: float = 0.0
    prefill_ms: float = 0.0
    store_ms: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    finish_reason: str = ""
    margin: float | None = None  # the confidence test's threshold (None: no test)
    first_margin: float | None = None  # top-1 minus top-2 probability of the first token
    fallback: bool = False  # the test failed: the prompt was prefilled in full instead
    watch: float | None = None  # rebuild the KV in full at the first decode step below it
    repaired_at: int | None = None  # ``watch``: the answer token after which KV was rebuilt
    full_prefill: bool = False  # nothing to reuse (no anchor, no stored document): in full
    offsets_applied: int = 0  # anchored documents that got their slot's learned offset
    offsets_learned: int = 0  # documents of an exact prompt whose offset was learned
    offset_warmup: bool = False  # in full so that a slot's offset learns (``offsets``)

    @property
    def recompute_share(self) -> float:
        """Share of document tokens recomputed."""
        return self.recomputed_document_tokens / self.document_tokens if self.document_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["recompute_share"] = self.recompute_share
        return out


@dataclass
class BlendResult:
    token_ids: list[int]
    text: str | None
    stats: BlendStats
    prompt_ids: list[int]
    last_logits: torch.Tensor | None = None  # the prompt's last-position logits (float32)


@dataclass
class _Prefilled:
    cache: Any
    last_logits: torch.Tensor
    prompt: SegmentedPrompt
    stats: BlendStats
    store_jobs: list[Callable[[], None]] = field(default_factory=list)


class _Stop(Exception):
    pass


# ------------------------------------------------------------------------------ engine
class DocumentReuse:
    """Position-independent document KV for one :class:`HFEngine` (same store, namespace,
    chunk size and codec).

    Args:
        engine: the engine (its ``model``, ``tokenizer``, ``store``, ``layout``, ``_runner``,
            ``namespace_digest``, ``chunk_size``, ``codec``).
        anchor: token ids every document is computed after (default: the chat template's
            header before a user message's content, else the BOS token, else nothing).
        key_mode: ``"rotated"`` (keys stored as computed, at the anchor's positions, moved by
            the difference at use) or ``"unrotated"`` (keys stored at position 0, moved by
            their target position).
        keep_blended: store each blended prompt whole (so the same prompt repeated restores
            it and runs no forward); False keeps only documents and exact prefix chunks. A
            blend that placed a document from an anchor is never stored whole: its KV is not
            a function of the documents' own KV.
        pool: an :class:`AnchorPool` (engine/_anchors.py; :meth:`HFEngine.documents` passes
            the engine's ``anchors``); None: documents come from the store. With a pool a
            document is looked up there first (the most recent in-context copy, re-rotated),
            then in the store; a prompt none of whose documents is in either is prefilled in
            full (computing them alone costs more, and is further from their in-context KV);
            the documents of a prompt computed wholly in context (in full, a fallback,
            ``r = 1``) and the answer it generates are captured as anchors.
        offsets: KVCOMM's offsets (engine/_anchors.py), for prompts whose layout repeats
            (an agent pipeline): a document placed from an anchor gets the mean difference
            between exact and anchored KV of the same slot (this prompt layout, this segment,
            an anchor from the same source layout), learned from the exact prompts of that
            slot; while a slot has fewer than ``offsets`` samples the prompt is prefilled in
            full to learn one (``stats.offset_warmup``). 0 (default): off. Needs a pool.
    """

    def __init__(self, engine: Any, anchor: Sequence[int] | None = None,
                 key_mode: str = "rotated", keep_blended: bool = True,
                 pool: AnchorPool | None = None, offsets: int = 0):
        if key_mode not in KEY_MODES:
            raise InvalidInputError(f"key_mode must be one of {KEY_MODES}, got {key_mode!r}")
        if isinstance(offsets, bool) or not isinstance(offsets, int) or offsets < 0:
            raise InvalidInputError(f"offsets must be a sample count >= 0, got {offsets!r}")
        if offsets and pool is None:
            raise InvalidInputError("offsets need an anchor pool (pool=AnchorPool(...))")
        self.engine = engine
        self.model = engine.model
        self.spec = rope_spec(engine.model)
        self.key_mode = key_mode
        self.keep_blended = bool(keep_blended)
        lay = engine.layout
        self.layout = ca.KVLayout(lay.num_layers, lay.kv_heads, lay.k_dim, lay.v_dim, lay.dtype)
        self.windows = tuple(w for w in (lay.windows or ()) if w is not None)
        self.anchor: tuple[int, ...] = tuple(anchor) if anchor is not None else self._default_anchor()
        self.root = document_root(engine.namespace_digest, self.anchor, key_mode)
        self.device = engine.device
        self.pool = pool
        self.offsets = offsets

    def _default_anchor(self) -> tuple[int, ...]:
        tok = self.engine.tokenizer
        if tok is None:
            return ()
        if getattr(tok, "chat_template", None):
            mark = "\ue000semcomm-anchor\ue001"
            text = tok.apply_chat_template([{"role": "user", "content": mark}],
                                           add_generation_prompt=True, tokenize=False)
            head = text.split(mark)[0]
            return tuple(_tokens(tok, head))
        return tuple(_adds_bos(tok))

    # ------------------------------------------------------------------ documents
    def document_tokens(self, doc: Document | str | Sequence[int]) -> list[int]:
        if isinstance(doc, str):
            doc = Document(doc)
        elif not isinstance(doc, Document):
            doc = Document(tokens=tuple(doc))
        toks = list(doc.tokens) if doc.tokens is not None else _tokens(self.engine.tokenizer,
                                                                        doc.text or "")
        if not toks:
            raise InvalidInputError("a Document tokenizes to no tokens")
        self._validate(toks)
        return toks

    def _validate(self, ids: Sequence[int], max_new_tokens: int = 0) -> None:
        eng = self.engine
        if not ids:
            raise InvalidInputError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= eng.vocab_size:
            bad = [t for t in ids if t < 0 or t >= eng.vocab_size][:5]
            raise InvalidInputError(f"token ids out of the vocabulary [0, {eng.vocab_size}): {bad}")
        limit = getattr(eng, "max_positions", None)
        if limit is not None and len(ids) + max_new_tokens > limit:
            raise InvalidInputError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"maximum of {limit} positions")

    def document_keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        return chunk_keys(self.root, tokens, self.engine.chunk_size)

    def is_stored(self, doc: Document | str | Sequence[int]) -> bool:
        store = self.engine.store
        if store is None:
            return False
        keys = self.document_keys(self.document_tokens(doc))
        return store.lookup(keys).num_chunks == len(keys)

    def precompute(self, doc: Document | str | Sequence[int]) -> int:
        """Compute a document's KV alone (after the anchor) and store it, unless stored.

        Returns the chunks written (0 when it was stored already). Raises
        :class:`InvalidInputError` without a store.
        """
        if self.engine.store is None:
            raise InvalidInputError("precompute needs an engine with a store")
        toks = self.document_tokens(doc)
        keys = self.document_keys(toks)
        if self.engine.store.lookup(keys).num_chunks == len(keys):
            return 0
        k, v = self._compute_alone(toks)
        return self._store_document(toks, keys, k, v)[0]

    def _compute_alone(self, toks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[L, H, n, D]`` KV of a document computed after the anchor (keys as computed)."""
        ids = list(self.anchor) + toks
        self._check_length(len(ids))
        cache = ca.new_cache()
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.engine._runner.forward(x, cache)
            k, v = ca.stack_range(cache, len(self.anchor), len(ids))
        return k, v

    def _store_document(self, toks: list[int], keys: list[ChunkKey], k: torch.Tensor,
                        v: torch.Tensor) -> tuple[int, int]:
        eng = self.engine
        a = len(self.anchor)
        if self.key_mode == "unrotated":
            k = rotate_keys(k, -torch.arange(a, a + len(toks)), self.spec)
        k, v = k.cpu(), v.cpu()
        batch = []
        store = eng.store
        for i, (s, e) in enumerate(chunk_spans(len(toks), eng.chunk_size)):
            try:
                if store.contains(keys[i]):  # a stored original is never overwritten
                    continue
            except (StoreError, BackendUnavailableError):
                return 0, 0
            enc = eng.codec.encode(k[:, :, s:e], v[:, :, s:e])
            batch.append((keys[i], encode_chunk(
                namespace=eng.namespace_digest, key=keys[i], parent=keys[i - 1] if i else None,
                num_tokens=e - s, start=a + s, dtype=eng.namespace.dtype, codec=eng.codec.name,
                codec_params={**eng.codec.params, "spec": eng.codec.spec}, arrays=enc.arrays,
                bf16_names=enc.bf16_names,
                meta={"layers": self.layout.num_layers, "kind": "document",
                      "keys": self.key_mode})))
        try:
            store.put_many(batch)
        except (StoreError, BackendUnavailableError) as exc:
            logger.warning("KV store put of a document failed (%s)", exc)
            return 0, 0
        return len(batch), sum(len(d) for _, d in batch)

    def _fetch_document(self, keys: list[ChunkKey], n: int, out_k: torch.Tensor,
                        out_v: torch.Tensor, at: int, stats: BlendStats) -> bool:
        """Decode a stored document into ``out[:, :, at:at+n]`` (keys as stored); False when
        any chunk is missing or unusable (the caller computes the document instead)."""
        eng = self.engine
        spans = chunk_spans(n, eng.chunk_size)
        try:
            if eng.store is None or eng.store.lookup(keys).num_chunks < len(keys):
                return False
            fetched = [eng.store.fetch(key) for key in keys]
        except (StoreError, BackendUnavailableError) as exc:
            logger.warning("KV store read of a document failed (%s); computing it", exc)
            return False
        a = len(self.anchor)
        for key, f, (s, e) in zip(keys, fetched, spans):
            if f is None:
                return False
            try:
                chunk = decode_chunk(f.value, expect_key=key,
                                     expect_namespace=eng.namespace_digest, verify=False)
            except (CorruptEntryError, NamespaceMismatchError) as exc:
                logger.warning("a document chunk is unusable (%s); computing it", exc)
                return False
            h = chunk.header
            if (h.num_tokens != e - s or h.start != a + s or h.codec != eng.codec.name
                    or h.dtype != eng.namespace.dtype):
                logger.warning("document chunk %s does not match its span", h.key[:16])
                return False
            eng.codec.decode_into(chunk.arrays, out_k, out_v, at + s, e - s)
            stats.bytes_loaded += len(f.value)
        return True

    # ------------------------------------------------------------------- anchors
    def segment_key(self, tokens: Sequence[int]) -> bytes:
        """A segment's anchor key: the last link of its document key chain (namespace incl.
        tenant, anchor, tokens)."""
        return bytes(self.document_keys(list(tokens))[-1])

    def available(self, tokens: Sequence[int]) -> bool:
        """Whether a document's KV is at hand: an anchor of it, or its stored chunks."""
        if self.pool is not None and self.pool.has(self.segment_key(tokens)):
            return True
        return self.is_stored(list(tokens))

    def capture(self, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, start: int,
                source: str, context: bytes = b"") -> bool:
        """Keep ``[L, H, n, D]`` KV of a segment computed in context at positions ``start..``
        as an anchor (``context``: where, :meth:`span_context`); False without a pool or
        when it alone exceeds the pool's budget."""
        if self.pool is None:
            return False
        if k.shape[2] != len(tokens):
            raise InvalidInputError("an anchor's KV must cover its segment's tokens")
        return self.pool.put(self.segment_key(tokens), k, v, start, source, context)

    # a prompt's layout: its tokens with each document's left out (an agent's role, labels and
    # ask), under the namespace root (tenant included); where an anchor was computed, and
    # where it is placed, are named by it
    def layout_key(self, prompt: SegmentedPrompt) -> bytes:
        h = hashlib.blake2b(b"semcomm.layout/1", digest_size=16)
        h.update(self.root)
        at = 0
        for s, e in prompt.spans:
            h.update(struct.pack("<I", s - at) + _u32(prompt.ids[at:s]) + b"\xffdoc")
            at = e
        h.update(struct.pack("<I", len(prompt.ids) - at) + _u32(prompt.ids[at:]))
        return h.digest()

    @staticmethod
    def span_context(layout: bytes, what: int | str) -> bytes:
        """The context of a prompt's document ``what`` (its index) or of its ``"answer"``."""
        return hashlib.blake2b(layout + str(what).encode(), digest_size=16).digest()

    @staticmethod
    def _slot(layout: bytes, i: int, source: bytes) -> bytes:
        return hashlib.blake2b(b"slot" + layout + struct.pack("<I", i) + source,
                               digest_size=16).digest()

    @staticmethod
    def _usable(a: Any, n: int, own: bytes) -> bool:
        """An anchor of ``n`` tokens, not computed in the very context it would go to."""
        return bool(a.k.shape[2] == n and not (own and a.context == own))

    def _candidates(self, tokens: Sequence[int], own: bytes) -> list[Any]:
        """The anchors a prompt could place for a document (its own context's excluded)."""
        if self.pool is None:
            return []
        return [a for a in self.pool.anchors(self.segment_key(tokens))
                if self._usable(a, len(tokens), own)]

    def _needs_warmup(self, prompt: SegmentedPrompt, lay: bytes) -> bool:
        """``offsets``: a document would be placed from an anchor, and no anchor of it has a
        slot with ``offsets`` samples learned (``lay``: the prompt's layout key)."""
        if not self.offsets or self.pool is None:
            return False
        for i, (s, e) in enumerate(prompt.spans):
            cands = [a for a in self._candidates(prompt.ids[s:e], self.span_context(lay, i))
                     if a.context]
            if cands and max(self.pool.offset_samples(self._slot(lay, i, a.context))
                             for a in cands) < self.offsets:
                return True
        return False

    def capture_prompt(self, prompt: SegmentedPrompt, cache: Any, source: str = "prompt",
                       stats: BlendStats | None = None) -> int:
        """Every document of a prompt whose cache was computed wholly in context, as anchors;
        returns how many were kept. With ``offsets``, first the difference between each
        document's exact KV and the anchor it would have been placed from is learned."""
        if self.pool is None:
            return 0
        kept = 0
        lay = self.layout_key(prompt)
        for i, (s, e) in enumerate(prompt.spans):
            k, v = ca.stack_range(cache, s, e)
            toks = prompt.ids[s:e]
            own = self.span_context(lay, i)
            if self.offsets:  # one sample for the slot of every anchor it could be placed from
                k0 = rotate_keys(k.float(), -s, self.spec)  # keys in the position-0 frame
                for a in self._candidates(toks, own):
                    if a.context and self.pool.learn(
                            self._slot(lay, i, a.context),
                            k0 - rotate_keys(a.k.float(), -a.start, self.spec),
                            v.float() - a.v.float()) and stats is not None:
                        stats.offsets_learned += 1
            kept += self.capture(toks, k, v, s, source, own)
        return kept

    def capture_answer(self, tokens: Sequence[int], cache: Any, at: int,
                       source: str = "answer", prompt: SegmentedPrompt | None = None) -> bool:
        """The decode KV of ``tokens`` generated after a prompt of ``at`` tokens, as an anchor
        keyed by those tokens (its context: ``prompt``'s answer); the last tokens the decode
        loop chose but never ran are run first (one forward)."""
        toks = list(tokens)
        if self.pool is None or not toks:
            return False
        missing = at + len(toks) - ca.cache_length(cache)
        if missing > 0:
            x = torch.tensor([toks[len(toks) - missing:]], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                self.engine._runner.forward(x, cache)
        k, v = ca.stack_range(cache, at, at + len(toks))
        context = self.span_context(self.layout_key(prompt), "answer") if prompt is not None else b""
        return self.capture(toks, k, v, at, source, context)

    def _place_anchor(self, tokens: Sequence[int], s: int, bk: torch.Tensor, bv: torch.Tensor,
                      stats: BlendStats, layout: bytes = b"", i: int = 0) -> bool:
        """The segment's anchor into ``[:, :, s:s+n]`` (the most recent; with ``offsets``, the
        one whose slot learned the most samples), its keys moved from where they were
        computed to ``s`` (exact for RoPE), plus its slot's learned offset (``offsets``,
        ``layout`` and ``i``: the prompt's layout and the document's index); False when the
        pool has none."""
        e = s + len(tokens)
        pool = self.pool
        if pool is None:
            return False
        own = self.span_context(layout, i) if layout else b""
        learned = self.offsets and layout

        def rank(a: Any) -> tuple[bool, int]:  # usable first, then the most samples learned
            ok = self._usable(a, e - s, own)
            n = pool.offset_samples(self._slot(layout, i, a.context)) if (
                ok and learned and a.context) else 0
            return ok, n

        a = pool.get(self.segment_key(tokens), rank)
        if a is None or not rank(a)[0]:
            return False
        bk[:, :, s:e] = rotate_keys(a.k, s - a.start, self.spec) if s != a.start else a.k
        bv[:, :, s:e] = a.v
        o = (pool.offset(self._slot(layout, i, a.context), e - s, self.offsets)
             if learned and a.context else None)
        if o is not None:
            dk, dv, m = o
            bk[:, :, s:s + m] += rotate_keys(dk, s, self.spec).to(bk.dtype)
            bv[:, :, s:s + m] += dv.to(bv.dtype)
            stats.offsets_applied += 1
        stats.documents_anchored += 1
        stats.anchored_tokens += e - s
        return True

    def prefill_in_full(self, prompt: SegmentedPrompt, stats: BlendStats, capacity: int = 0,
                        ) -> _Prefilled:
        """The prompt prefilled by the engine itself (its exact prefix cache included, the
        new chunks stored by the returned job): every document token computed in context.
        ``stats`` is updated to say so."""
        eng = self.engine
        ids = list(prompt.ids)
        t1 = time.perf_counter()
        pre, keys = eng._prefill(ids, None, t1, capacity=max(capacity, len(ids)))
        hit = int(pre.stats.hit_tokens)
        stats.prefix_hit_tokens = hit
        stats.reused_tokens = 0
        stats.recomputed_tokens = len(ids) - hit
        stats.recomputed_document_tokens = prompt.document_tokens
        stats.bytes_loaded += pre.stats.bytes_loaded
        stats.prefill_ms += (time.perf_counter() - t1) * 1e3

        def store() -> None:
            if eng.store is None:
                return
            ts = time.perf_counter()
            eng._store_chunks(pre, keys)
            stats.chunks_stored += pre.stats.chunks_stored
            stats.bytes_stored += pre.stats.bytes_stored
            stats.store_ms += (time.perf_counter() - ts) * 1e3

        return _Prefilled(pre.cache, pre.last_logits, prompt, stats, [store])

    # -------------------------------------------------------------------- checks
    def _check_length(self, n: int) -> None:
        if self.windows and n > min(self.windows):
            raise UnsupportedModelError(
                f"{getattr(self.model.config, 'model_type', '')}: a prompt of {n} tokens is longer "
                f"than its sliding window of {min(self.windows)}: document KV cannot be moved "
                "into a sliding-window layer")

    def _budget(self, r: float) -> float:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise InvalidInputError(f"recompute must be a share in [0, 1], got {r!r}")
        return float(r)

    # ------------------------------------------------------------------- prefill
    def prepare(self, segments: Sequence[Segment] | SegmentedPrompt) -> SegmentedPrompt:
        if isinstance(segments, SegmentedPrompt):
            prompt = segments
        else:
            prompt = build_prompt(self.engine.tokenizer, segments)
        self._validate(list(prompt.ids))
        self._check_length(len(prompt.ids))
        return prompt

    def prefill(self, segments: Sequence[Segment] | SegmentedPrompt, *,
                selector: str = DEFAULT_SELECTOR, recompute: float = DEFAULT_RECOMPUTE,
                capacity: int = 0, store: bool = True) -> _Prefilled:
        """The prompt's cache (documents reused, a share recomputed) and its last logits.

        ``store``: write the blended prompt and its exact head (run the returned
        ``store_jobs`` yourself when False is not what you want: :meth:`generate` runs them
        after the first token)."""
        t0 = time.perf_counter()
        if selector not in SELECTORS:
            raise InvalidInputError(f"unknown selector {selector!r}; one of {', '.join(SELECTORS)}")
        r = self._budget(recompute)
        if selector == "concat":
            r = 0.0
        elif selector == "full":
            r = 1.0
        prompt = self.prepare(segments)
        pre = self._prefill(prompt, selector, r, capacity, t0)
        pre.stats.recompute = float(recompute)
        if store:
            for job in pre.store_jobs:
                job()
            pre.store_jobs = []
        return pre

    def _blend_keys(self, prompt: SegmentedPrompt, selector: str, r: float) -> list[ChunkKey]:
        root = blend_root(self.engine.namespace_digest, self.anchor, self.key_mode, selector, r,
                          prompt.spans)
        return chunk_keys(root, prompt.ids, self.engine.chunk_size)

    def _prefill(self, prompt: SegmentedPrompt, selector: str, r: float, capacity: int,
                 t0: float) -> _Prefilled:
        eng = self.engine
        lay = self.layout
        ids = list(prompt.ids)
        n = len(ids)
        stats = BlendStats(prompt_tokens=n, document_tokens=prompt.document_tokens,
                           documents=len(prompt.spans), selector=selector)
        stats.recompute = r
        # room after the prompt for the prophet pass's question tokens (appended, then dropped)
        cap = max(capacity, n) + n - max((e for _, e in prompt.spans), default=0) + 1
        # not zeroed (page faults of a large zeroed buffer cost TTFT): every position is
        # restored or computed before it is read, and the stale ones a forward may see
        # (masked, but a NaN survives an additive mask) are zeroed below
        bk = torch.empty((lay.num_layers, lay.kv_heads, cap, lay.k_dim), dtype=lay.dtype,
                         device=self.device)
        bv = torch.empty((lay.num_layers, lay.kv_heads, cap, lay.v_dim), dtype=lay.dtype,
                         device=self.device)
        jobs: list[Callable[[], None]] = []
        # 1. the same blended prompt stored whole: restore it and its logits, no forward
        bkeys = self._blend_keys(prompt, selector, r)
        logits = (self._restore_chain(bkeys, n, bk, bv, stats, whole=True)
                  if self.keep_blended else None)
        if logits is not None:
            stats.blend_hit = True
            stats.reused_tokens = prompt.document_tokens
            stats.load_ms = (time.perf_counter() - t0) * 1e3
            cache = ca.buffer_cache(lay, cap, self.device, n, (bk, bv))
            stats.ttft_s = time.perf_counter() - t0
            return _Prefilled(cache, logits, prompt, stats)
        # with anchors: nothing of the documents at hand, or a slot still learning its offset
        # (``offsets``): the prompt in full (then captured)
        lay_key = self.layout_key(prompt) if self.offsets else b""
        warm = self._needs_warmup(prompt, lay_key)
        if self.pool is not None and (warm or not any(self.available(ids[s:e])
                                                      for s, e in prompt.spans)):
            stats.full_prefill = True
            stats.offset_warmup = warm
            pre = self.prefill_in_full(prompt, stats, capacity)
            stats.load_ms = (time.perf_counter() - t0) * 1e3
            stats.ttft_s = time.perf_counter() - t0
            return pre
        # 2. documents: an anchor, else stored KV, at their positions (computed alone and
        # stored on a miss)
        a = len(self.anchor)
        doc_jobs = []
        for i, (s, e) in enumerate(prompt.spans):
            toks = ids[s:e]
            keys = self.document_keys(toks)
            if self._place_anchor(toks, s, bk, bv, stats, lay_key, i):
                continue
            delta: int | torch.Tensor = s - a  # keys as computed after the anchor
            if self._fetch_document(keys, e - s, bk, bv, s, stats):
                stats.documents_hit += 1
                if self.key_mode == "unrotated":  # stored at position 0: each to its own
                    delta = torch.arange(s, e)
            else:
                k, v = self._compute_alone(toks)
                bk[:, :, s:e].copy_(k)
                bv[:, :, s:e].copy_(v)
                stats.documents_computed += 1
                if eng.store is not None:
                    doc_jobs.append((toks, keys, k, v))
            if not isinstance(delta, int) or delta:
                bk[:, :, s:e] = rotate_keys(bk[:, :, s:e], delta, self.spec)
        # 3. the exact prefix from the ordinary chain (restored over anything placed above)
        h = self._restore_prefix(ids, bk, bv, stats)
        stats.load_ms = (time.perf_counter() - t0) * 1e3
        in_doc = torch.zeros(n, dtype=torch.bool)
        for s, e in prompt.spans:
            in_doc[s:e] = True
        first_doc = next((s for s, e in prompt.spans if e > h), n)
        head_end = max(h, min(first_doc, n - 1))  # exact head: [h, head_end), one forward
        t1 = time.perf_counter()
        with torch.inference_mode():
            if head_end > h:
                cache = ca.buffer_cache(lay, cap, self.device, h, (bk, bv))
                x = torch.tensor([ids[h:head_end]], dtype=torch.long, device=self.device)
                # cut at chunk boundaries as the engine's own prefill is, so the head's chunks
                # stored under the ordinary prefix keys are what the engine would compute
                getattr(eng, "_chunked", eng._runner).forward(x, cache)
            stats.recomputed_tokens = head_end - h
            # candidates: document tokens after the exact head; fixed: everything else there
            pos = torch.arange(n)
            cand = pos[(pos >= head_end) & in_doc]
            fixed = pos[(pos >= head_end) & ~in_doc]
            if fixed.numel() == 0 or int(fixed[-1]) != n - 1:
                fixed = torch.cat([fixed, torch.tensor([n - 1])])
                cand = cand[cand != n - 1]
            idx = fixed.to(self.device)
            bk[:, :, idx] = 0  # stale until recomputed (masked out of every forward)
            bv[:, :, idx] = 0
            budget = min(cand.numel(), math.ceil(r * prompt.document_tokens - 1e-9))
            ts = time.perf_counter()
            chosen = self._select(selector, budget, ids, prompt, cand, fixed, head_end, bk, bv,
                                  cap)
            stats.select_ms = (time.perf_counter() - ts) * 1e3
            run = torch.unique(torch.cat([fixed, chosen]))  # sorted
            logits = self._placed_forward(ids, run, bk, bv)
        stats.recomputed_document_tokens = int(in_doc[run].sum()) + int(in_doc[h:head_end].sum())
        stats.recomputed_tokens += run.numel()
        stats.reused_tokens = prompt.document_tokens - stats.recomputed_document_tokens - int(
            in_doc[:h].sum())
        stats.prefill_ms = (time.perf_counter() - t1) * 1e3
        cache = ca.buffer_cache(lay, cap, self.device, n, (bk, bv))
        stats.ttft_s = time.perf_counter() - t0

        def store_all() -> None:
            ts0 = time.perf_counter()
            for toks, keys, k, v in doc_jobs:
                c, b = self._store_document(toks, keys, k, v)
                stats.chunks_stored += c
                stats.bytes_stored += b
            self._store_head(ids, head_end, bk, bv, stats)
            # a blend over anchors depends on the prompts they came from, not on the
            # documents alone: never stored under the documents' blend keys
            if self.keep_blended and not stats.documents_anchored:
                self._store_blend(bkeys, n, bk, bv, logits, stats)
            stats.store_ms += (time.perf_counter() - ts0) * 1e3

        jobs.append(store_all)
        return _Prefilled(cache, logits, prompt, stats, jobs)

    # ------------------------------------------------------------------ selection
    def _select(self, selector: str, budget: int, ids: list[int], prompt: SegmentedPrompt,
                cand: torch.Tensor, fixed: torch.Tensor, head_end: int, bk: torch.Tensor,
                bv: torch.Tensor, cap: int) -> torch.Tensor:
        empty = torch.zeros(0, dtype=torch.long)
        if budget <= 0 or cand.numel() == 0:
            return empty
        if budget >= cand.numel():
            return cand
        if selector == "epic":
            share = budget / cand.numel()
            per = [cand[(cand >= s) & (cand < e)] for s, e in prompt.spans]
            take = [math.floor(share * c.numel()) for c in per]
            for j in range(len(per)):  # the remainder, one more token each, in order
                if sum(take) >= budget:
                    break
                if take[j] < per[j].numel():
                    take[j] += 1
            out = [c[:t] for c, t in zip(per, take)]
            return torch.cat(out) if out else empty
        if selector == "cacheblend":
            score = self._deviation(ids, cand, head_end, bk, bv)
        elif selector == "prophet":
            score = self._query_attention(ids, prompt, cand, fixed, head_end, bk, bv, cap)
        else:  # pragma: no cover - the bounds never reach here
            raise InvalidInputError(f"selector {selector!r} does not select")
        top = torch.topk(score, budget).indices
        return cand[top]

    def _deviation(self, ids: list[int], cand: torch.Tensor, head_end: int, bk: torch.Tensor,
                   bv: torch.Tensor) -> torch.Tensor:
        """Per candidate: squared distance between the reused and a fresh KV at layer 1 (fresh
        layers 0..1 over the prompt after the exact head; kept for every position)."""
        c = min(_CHECK_LAYER, self.layout.num_layers - 1)
        n = len(ids)
        cache = ca.cache_from_stacks(bk[: c + 1, :, :head_end], bv[: c + 1, :, :head_end],
                                     self.device)
        layers = self._decoder_layers()
        def stop(*_: Any) -> None:  # layers after c are not needed: end the forward here
            raise _Stop

        hook = layers[c].register_forward_hook(stop)
        try:
            x = torch.tensor([ids[head_end:]], dtype=torch.long, device=self.device)
            self.engine._runner.forward(x, cache)
        except _Stop:
            pass
        finally:
            hook.remove()
        fresh = ca.cache_layers(cache)
        k1, v1 = fresh[c]
        idx = cand.to(self.device)
        dk = (k1[0, :, idx].float() - bk[c, :, idx].float()).pow(2).sum((0, 2))
        dv = (v1[0, :, idx].float() - bv[c, :, idx].float()).pow(2).sum((0, 2))
        for li in range(c + 1):  # layers 0..c are exact now for every position
            kf, vf = fresh[li]
            bk[li, :, head_end:n] = kf[0, :, head_end:n]
            bv[li, :, head_end:n] = vf[0, :, head_end:n]
        return (dk + dv).cpu()

    def _decoder_layers(self) -> Any:
        base = self.engine._runner.base_model()
        n = self.layout.num_layers
        for mod in (base or self.model).modules():
            if isinstance(mod, torch.nn.ModuleList) and len(mod) == n:
                return mod
        raise UnsupportedModelError("cannot find the model's decoder layers for cacheblend")

    def _attention_modules(self) -> list[Any]:
        mods = [m for m in self.model.modules()
                if hasattr(m, "q_proj") and isinstance(getattr(m, "layer_idx", None), int)]
        if len(mods) != self.layout.num_layers:
            raise UnsupportedModelError(
                "the prophet selector needs attention modules with a q_proj and layer_idx "
                f"(found {len(mods)} of {self.layout.num_layers} layers)")
        return sorted(mods, key=lambda m: m.layer_idx)

    def _query_attention(self, ids: list[int], prompt: SegmentedPrompt, cand: torch.Tensor,
                         fixed: torch.Tensor, head_end: int, bk: torch.Tensor, bv: torch.Tensor,
                         cap: int) -> torch.Tensor:
        """Per candidate: the attention the question (every token after the last document)
        gives it over a quarter of the layers, from a first pass of the question's tokens
        alone over the reused KV (the other non-document tokens hidden: not computed yet)."""
        n = len(ids)
        last_doc = max((e for _, e in prompt.spans), default=0)
        mods = self._attention_modules()
        L = len(mods)
        chosen = sorted({min(L - 1, round(i * (L - 1) / max(1, L // 4 - 1)))
                         for i in range(max(1, L // 4))})
        captured: dict[int, tuple[torch.Tensor, Any]] = {}

        def pre_hook(mod: Any, args: Any, kwargs: Any) -> None:
            hs = kwargs.get("hidden_states", args[0] if args else None)
            captured[mod.layer_idx] = (hs, kwargs.get("position_embeddings"))

        hooks = [mods[i].register_forward_pre_hook(pre_hook, with_kwargs=True) for i in chosen]
        question = fixed[fixed >= last_doc]  # never empty: the last position is fixed
        try:
            self._masked_forward(ids, question, n, bk, bv, cap, hide=fixed)
        finally:
            for hk in hooks:
                hk.remove()
        m = question.numel()
        score = torch.zeros(n, dtype=torch.float32)
        for li in chosen:
            hs, pe = captured[li]
            mod = mods[li]
            q = self._queries(mod, hs, pe)  # [Hq, m, D]
            hq, hkv = q.shape[0], self.layout.kv_heads
            k_ctx = bk[li, :, :n].float()  # reused/exact context (stale at fixed positions)
            k_new = bk[li, :, n : n + m].float()  # the question's tokens, fresh
            k_ctx = k_ctx.repeat_interleave(hq // hkv, 0)
            k_new = k_new.repeat_interleave(hq // hkv, 0)
            scale = float(getattr(mod, "scaling", 1 / math.sqrt(q.shape[-1])))
            s_ctx = torch.einsum("hqd,hkd->hqk", q.float(), k_ctx) * scale
            s_new = torch.einsum("hqd,hkd->hqk", q.float(), k_new) * scale
            qp = question
            vis_ctx = (torch.arange(n)[None, :] < qp[:, None])
            vis_ctx[:, fixed] = False
            vis_new = question[None, :] <= qp[:, None]
            s_ctx = s_ctx.masked_fill(~vis_ctx.to(s_ctx.device)[None], float("-inf"))
            s_new = s_new.masked_fill(~vis_new.to(s_new.device)[None], float("-inf"))
            p = torch.softmax(torch.cat([s_ctx, s_new], -1), -1)[..., :n]
            score += p.sum((0, 1)).cpu()
        return score[cand]

    @staticmethod
    def _queries(mod: Any, hs: torch.Tensor, pe: Any) -> torch.Tensor:
        """Post-rotary queries ``[Hq, m, D]`` of an attention module's input (q_proj, an
        optional q_norm, the rotary embedding it was given)."""
        d = int(getattr(mod, "head_dim", 0)) or None
        q = mod.q_proj(hs)  # [1, m, Hq * D]
        norm = getattr(mod, "q_norm", None)
        if d is None:
            raise UnsupportedModelError("the prophet selector needs the attention's head_dim")
        if norm is not None and getattr(norm, "weight", None) is not None and \
                norm.weight.numel() != d:
            q = norm(q)
            norm = None
        q = q.view(1, q.shape[1], -1, d)
        if norm is not None:
            q = norm(q)
        q = q.transpose(1, 2)[0]  # [Hq, m, D]
        if pe is None:
            raise UnsupportedModelError("the prophet selector needs the rotary embedding the "
                                        "attention receives (position_embeddings)")
        cos, sin = pe
        cos, sin = cos[0].to(q.dtype), sin[0].to(q.dtype)  # [m, rot]
        r = cos.shape[-1]
        qr = q[..., :r]
        rh = torch.cat([-qr[..., r // 2:], qr[..., : r // 2]], -1)
        return torch.cat([qr * cos + rh * sin, q[..., r:]], -1)

    # -------------------------------------------------------------- the forward
    def _masked_forward(self, ids: list[int], run: torch.Tensor, n: int, bk: torch.Tensor,
                        bv: torch.Tensor, cap: int, hide: torch.Tensor) -> torch.Tensor:
        """Run the tokens at positions ``run`` (sorted) over the prompt's KV in the buffers,
        their fresh KV appended at ``[n, n + m)`` (the positions themselves untouched): a
        position ``p`` of the run sees the context positions ``< p`` outside the run and
        ``hide`` (stale ones) and the run's positions ``<= p``. Returns the last run
        position's logits."""
        cache = ca.buffer_cache(self.layout, cap, self.device, n, (bk, bv))
        allowed_ctx = torch.arange(n)[None, :] < run[:, None]
        allowed_ctx[:, run] = False
        allowed_ctx[:, hide] = False
        allowed_new = run[None, :] <= run[:, None]
        return self._forward_at(ids, run, torch.cat([allowed_ctx, allowed_new], 1), cache)

    def _placed_forward(self, ids: list[int], run: torch.Tensor, bk: torch.Tensor,
                        bv: torch.Tensor) -> torch.Tensor:
        """Run the tokens at positions ``run`` (sorted) in blocks of about ``_RUN_BLOCK``, each
        block's KV written at its positions in the buffers and attending over the positions up
        to its last one (a position sees every position ``<=`` its own): what one forward with
        the run's KV appended and masked computes, without the attention over the positions
        after each block (most of a long prompt's recompute time otherwise). Returns the last
        position's logits."""
        cache = ca.placed_cache(bk, bv)
        logits = None
        for part in torch.tensor_split(run, max(1, round(run.numel() / _RUN_BLOCK))):
            end = int(part[-1]) + 1
            ca.place(cache, part.to(self.device), end)
            logits = self._forward_at(ids, part, torch.arange(end)[None, :] <= part[:, None],
                                      cache)
        assert logits is not None
        return logits

    def _forward_at(self, ids: list[int], positions: torch.Tensor, allowed: torch.Tensor,
                    cache: Any) -> torch.Tensor:
        """One forward of the tokens at ``positions`` over ``cache``; ``allowed[i, j]``: the
        i-th token sees the cache's j-th key. Returns the last token's logits."""
        dtype = self._mask_dtype()
        mask = torch.zeros((1, 1, *allowed.shape), dtype=dtype)
        mask.masked_fill_(~allowed[None, None], torch.finfo(dtype).min)
        x = torch.tensor([[ids[int(p)] for p in positions]], dtype=torch.long,
                         device=self.device)
        kw = {"input_ids": x, "attention_mask": mask.to(self.device),
              "position_ids": positions[None].to(self.device), "use_cache": True,
              **ca.cache_kwargs(self.model, cache)}
        if "logits_to_keep" in self._params():
            kw["logits_to_keep"] = 1
        return self.model(**kw).logits[0, -1].float()

    def _mask_dtype(self) -> torch.dtype:
        dtype = self.model.get_input_embeddings().weight.dtype
        return dtype if dtype.is_floating_point else torch.float32

    def _params(self) -> Any:
        params = getattr(self, "_fwd_params", None)
        if params is None:
            params = self._fwd_params = inspect.signature(self.model.forward).parameters
        return params

    # ------------------------------------------------------------- prefix chains
    def _restore_chain(self, keys: list[ChunkKey], n: int, bk: torch.Tensor, bv: torch.Tensor,
                       stats: BlendStats, whole: bool) -> torch.Tensor | None:
        """A blended prompt stored whole: its chunks into the buffers and its logits."""
        eng = self.engine
        if eng.store is None:
            return None
        try:
            if eng.store.lookup(keys).num_chunks < len(keys):
                return None
            lf = eng.store.fetch(logits_key(keys[-1]))
            if lf is None:
                return None
            fetched = [eng.store.fetch(k) for k in keys]
        except (StoreError, BackendUnavailableError):
            return None
        spans = chunk_spans(n, eng.chunk_size)
        try:
            for key, f, (s, e) in zip(keys, fetched, spans):
                if f is None:
                    return None
                chunk = decode_chunk(f.value, expect_key=key,
                                     expect_namespace=eng.namespace_digest, verify=False)
                if chunk.header.num_tokens != e - s or chunk.header.start != s:
                    return None
                eng.codec.decode_into(chunk.arrays, bk, bv, s, e - s)
                stats.bytes_loaded += len(f.value)
            entry = decode_chunk(lf.value, expect_key=logits_key(keys[-1]),
                                 expect_namespace=eng.namespace_digest, verify=False)
        except (CorruptEntryError, NamespaceMismatchError):
            return None
        arr = entry.arrays.get("logits")
        if arr is None or entry.header.codec != _LOGITS_CODEC:
            return None
        return torch.from_numpy(np.array(arr, dtype="<f4")).to(self.device)

    def _restore_prefix(self, ids: list[int], bk: torch.Tensor, bv: torch.Tensor,
                        stats: BlendStats) -> int:
        """The longest exact prefix in the ordinary chain (at most ``len - 1`` tokens)."""
        eng = self.engine
        if eng.store is None:
            return 0
        keys = eng.chunk_keys(ids)
        spans = chunk_spans(len(ids), eng.chunk_size)
        try:
            hit = eng.store.lookup(keys).num_chunks
        except (StoreError, BackendUnavailableError):
            return 0
        got = 0
        for i in range(hit):
            s, e = spans[i]
            if e > len(ids) - 1:
                break
            try:
                f = eng.store.fetch(keys[i])
                if f is None:
                    break
                chunk = decode_chunk(f.value, expect_key=keys[i],
                                     expect_namespace=eng.namespace_digest, verify=False)
            except (StoreError, BackendUnavailableError, CorruptEntryError,
                    NamespaceMismatchError):
                break
            if chunk.header.start != s or chunk.header.num_tokens != e - s:
                break
            eng.codec.decode_into(chunk.arrays, bk, bv, s, e - s)
            stats.bytes_loaded += len(f.value)
            got = e
        stats.prefix_hit_tokens = got
        return got

    def _store_head(self, ids: list[int], head_end: int, bk: torch.Tensor, bv: torch.Tensor,
                    stats: BlendStats) -> None:
        """Full chunks inside the exactly computed head, under the ordinary prefix keys."""
        eng = self.engine
        keys = eng.chunk_keys(ids)
        batch = []
        for i, (s, e) in enumerate(chunk_spans(len(ids), eng.chunk_size)):
            if e > head_end or e - s < eng.chunk_size:
                break
            try:
                if eng.store.contains(keys[i]):
                    continue
            except (StoreError, BackendUnavailableError):
                return
            batch.append((keys[i], self._encode(keys, i, s, e, bk, bv, "prefix")))
        self._put(batch, stats)

    def _store_blend(self, keys: list[ChunkKey], n: int, bk: torch.Tensor, bv: torch.Tensor,
                     logits: torch.Tensor, stats: BlendStats) -> None:
        eng = self.engine
        batch = []
        for i, (s, e) in enumerate(chunk_spans(n, eng.chunk_size)):
            try:
                if eng.store.contains(keys[i]):
                    continue
            except (StoreError, BackendUnavailableError):
                return
            batch.append((keys[i], self._encode(keys, i, s, e, bk, bv, "blend")))
        lk = logits_key(keys[-1])
        x = logits.detach().to("cpu", torch.float32).contiguous().numpy()
        batch.append((lk, encode_chunk(
            namespace=eng.namespace_digest, key=lk, parent=keys[-1], num_tokens=0, start=n,
            dtype=eng.namespace.dtype, codec=_LOGITS_CODEC, codec_params={"bf16": []},
            arrays={"logits": x}, meta={"kind": "logits"})))
        self._put(batch, stats)

    def _encode(self, keys: list[ChunkKey], i: int, s: int, e: int, bk: torch.Tensor,
                bv: torch.Tensor, kind: str) -> bytes:
        eng = self.engine
        enc = eng.codec.encode(bk[:, :, s:e].cpu(), bv[:, :, s:e].cpu())
        return encode_chunk(
            namespace=eng.namespace_digest, key=keys[i], parent=keys[i - 1] if i else None,
            num_tokens=e - s, start=s, dtype=eng.namespace.dtype, codec=eng.codec.name,
            codec_params={**eng.codec.params, "spec": eng.codec.spec}, arrays=enc.arrays,
            bf16_names=enc.bf16_names, meta={"layers": self.layout.num_layers, "kind": kind})

    def _put(self, batch: list[tuple[ChunkKey, bytes]], stats: BlendStats) -> None:
        if not batch:
            return
        try:
            self.engine.store.put_many(batch)
        except (StoreError, BackendUnavailableError) as exc:
            logger.warning("KV store put failed (%s)", exc)
            return
        stats.chunks_stored += len(batch)
        stats.bytes_stored += sum(len(d) for _, d in batch)

    # ------------------------------------------------------------------ generate
    def generate(self, segments: Sequence[Segment] | SegmentedPrompt, max_new_tokens: int = 32,
                 *, selector: str = DEFAULT_SELECTOR, recompute: float = DEFAULT_RECOMPUTE,
                 stop: Sequence[str | int] | str | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> BlendResult:
        """Generate after a segmented prompt (documents reused, a share ``recompute`` of their
        tokens recomputed by ``selector``); greedy unless ``temperature > 0``."""
        gen = self.generate_iter(segments, max_new_tokens, selector=selector,
                                 recompute=recompute, stop=stop, temperature=temperature,
                                 top_p=top_p, top_k=top_k, seed=seed)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                result: BlendResult = done.value
                return result

    def generate_iter(self, segments: Sequence[Segment] | SegmentedPrompt,
                      max_new_tokens: int = 32, *, selector: str = DEFAULT_SELECTOR,
                      recompute: float = DEFAULT_RECOMPUTE,
                      stop: Sequence[str | int] | str | None = None, temperature: float = 0.0,
                      top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                      t_start: float | None = None,
                      on_prefill: Callable[[BlendStats], None] | None = None,
                      margin: float | None = None, watch: float | None = None,
                      ) -> Generator[Any, None, BlendResult]:
        """:meth:`generate` as a generator of released text pieces (token ids without a
        tokenizer) whose return value is the :class:`BlendResult`; the prompt's KV is stored
        after the first token is chosen, before its text is released. ``on_prefill`` gets the
        stats once the prompt is in cache, before the first token is chosen.

        ``margin``: a confidence test on the blended prefill: when the first token's top-1
        probability exceeds the top-2 by less than ``margin``, the reused KV is not trusted and
        the prompt is prefilled in full instead (``stats.fallback``; the answer is then full
        prefill's). None or 0: no test.

        ``watch``: the first token is not the only one reused KV can change. While decoding
        after a reused prefill, the first step whose top-1 minus top-2 probability is below
        ``watch`` has the KV rebuilt in full (the prompt and the tokens so far, one prefill)
        and decoding goes on from exact KV (``stats.repaired_at``); the first token, the TTFT,
        stays the reused prefill's. None or 0: off."""
        t0 = time.perf_counter() if t_start is None else t_start
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        eng = self.engine
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        stops = [stop] if isinstance(stop, (str, int)) else list(stop or [])
        stop_strs = [s for s in stops if isinstance(s, str) and s]
        if stop_strs and eng.tokenizer is None:
            raise InvalidInputError("stop strings need a tokenizer; pass stop token ids instead")
        prompt = self.prepare(segments)
        self._validate(list(prompt.ids), max_new_tokens)
        for name, v in (("margin", margin), ("watch", watch)):
            if v is not None and not 0 <= v <= 1:
                raise InvalidInputError(f"{name} must be in [0, 1], got {v!r}")
        return self._generate_iter(prompt, max_new_tokens, params, stop_strs,
                                   {int(s) for s in stops if isinstance(s, int)}, selector,
                                   recompute, t0, on_prefill, margin or None, watch or None)

    def _generate_iter(self, prompt: SegmentedPrompt, max_new_tokens: int,
                       params: SamplingParams, stop_strs: list[str], stop_ids: set[int],
                       selector: str, recompute: float, t0: float,
                       on_prefill: Callable[[BlendStats], None] | None = None,
                       margin: float | None = None, watch: float | None = None,
                       ) -> Generator[Any, None, BlendResult]:
        eng = self.engine
        pre = self.prefill(prompt, selector=selector, recompute=recompute,
                           capacity=len(prompt.ids) + max_new_tokens, store=False)
        ids = list(pre.prompt.ids)
        seq = DecodeState(eng.tokenizer, params, self.device, max_new_tokens=max_new_tokens,
                          stop=stop_strs, stop_ids=stop_ids, eos_ids=eng.eos_token_ids)
        cache, logits = pre.cache, pre.last_logits
        step = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        stats = pre.stats
        if margin is not None and stats.recomputed_document_tokens < stats.document_tokens:
            stats.margin, stats.first_margin = margin, round(_margin(logits), 4)
            if stats.first_margin < margin:  # not sure of its first token: full prefill
                full = self.prefill_in_full(pre.prompt, stats, len(ids) + max_new_tokens)
                cache, logits = full.cache, full.last_logits
                stats.fallback = True
                pre.store_jobs += full.store_jobs
        if on_prefill is not None:
            on_prefill(stats)
        reused = stats.recomputed_document_tokens < stats.document_tokens and not stats.fallback
        stats.watch = watch if reused else None

        def forward(nxt: list[int]) -> torch.Tensor:
            nonlocal cache
            step.fill_(nxt[0])
            with torch.inference_mode():
                out = eng._runner.forward(step, cache)[None]
            if stats.watch and stats.repaired_at is None and _margin(out[0]) < stats.watch:
                stats.repaired_at = len(seq.token_ids)  # unsure: go on from exact KV
                pre = eng.prefill(ids + list(seq.token_ids), store=False)
                cache, out = pre.cache, pre.last_logits[None]
            return out

        for i, (piece,) in enumerate(decode_steps([seq], logits[None], forward)):
            if i == 0:
                stats.ttft_s = time.perf_counter() - t0
                for job in pre.store_jobs:
                    job()
            if isinstance(piece, int) or piece:
                yield piece
        tail = seq.finish()
        if tail:
            yield tail
        if self.pool is not None:  # anchors: in-context documents, and the answer
            exact = stats.reused_tokens == 0 or stats.repaired_at is not None
            if stats.document_tokens and exact and not stats.blend_hit:
                stats.anchors_captured += self.capture_prompt(pre.prompt, cache, stats=stats)
            toks = list(seq.token_ids)
            while toks and (toks[-1] in eng.eos_token_ids or toks[-1] in stop_ids):
                toks.pop()
            stats.anchors_captured += self.capture_answer(toks, cache, len(ids),
                                                          prompt=pre.prompt)
        stats.new_tokens = len(seq.token_ids)
        stats.finish_reason = seq.finish_reason or "length"
        stats.total_s = time.perf_counter() - t0
        return BlendResult(token_ids=list(seq.token_ids), text=seq.text, stats=stats,
                           prompt_ids=ids, last_logits=logits)


def _margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 probability of one row of logits."""
    top = torch.topk(torch.softmax(logits.float(), -1), 2).values
    return float(top[0] - top[1])


def is_segmented(prompt: Any) -> bool:
    """Whether a prompt is a list of :class:`Segment` (or a :class:`SegmentedPrompt`)."""
    if isinstance(prompt, SegmentedPrompt):
        return True
    return (isinstance(prompt, (list, tuple)) and bool(prompt)
            and all(isinstance(s, Segment) for s in prompt))


def generation_result(res: BlendResult, codec: str) -> Any:
    """A :class:`BlendResult` as the engine's ``GenerationResult`` (``stats.documents`` holds
    what was reused and recomputed)."""
    from ._types import GenerationResult

    return GenerationResult(token_ids=res.token_ids, text=res.text,
                            stats=generation_stats(res.stats, codec), prompt_ids=res.prompt_ids)


def generation_stats(st: BlendStats, codec: str) -> Any:
    """:class:`BlendStats` as the engine's ``GenerationStats``: every prompt token not run
    through the model in context counts as hit; ``documents`` holds the blend's own figures."""
    from ._types import GenerationStats

    gs = GenerationStats(
        prompt_tokens=st.prompt_tokens,
        hit_tokens=st.prompt_tokens - st.recomputed_tokens,
        recomputed_tokens=st.recomputed_tokens, logits_restored=st.blend_hit,
        bytes_loaded=st.bytes_loaded, bytes_stored=st.bytes_stored,
        chunks_stored=st.chunks_stored, load_ms=st.load_ms, prefill_ms=st.prefill_ms,
        store_ms=st.store_ms, ttft_s=st.ttft_s, new_tokens=st.new_tokens, total_s=st.total_s,
        codec=codec, finish_reason=st.finish_reason)
    gs.hit_tiers = ("documents",) if gs.hit_tokens else ()
    gs.documents = st.to_dict()
    return gs
