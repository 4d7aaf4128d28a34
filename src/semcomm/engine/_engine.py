"""HFEngine: a transformers causal LM with an exact, persistent KV prefix cache.

Request path (``generate``): tokenize -> longest cached prefix (``store.lookup``) -> fetch,
verify and decode those chunks straight into one preallocated ``[L, H, prompt + new, D]``
buffer (a sliding-window layer gets only the last ``window - 1`` positions it needs) -> the
engine's cache over that buffer (via the cache adapter) -> prefill the rest (a fully cached
prompt whose last-position logits are stored beside its final chunk runs no forward at all;
otherwise at least its last chunk is computed, one chunk a forward) -> choose the first token (TTFT) -> store the
prompt's new chunks (full chunks and the partial tail; chunks already stored are skipped) and
its last-position logits -> decode in place (no per-step copy of the cache), detokenizing
incrementally.

Every prefill forward ends at a chunk boundary, so the cache never changes what is computed
(docs/architecture.md, invariant 2). The namespace (model fingerprint, tokenizer fingerprint,
dtype, codec spec, tenant salt digest) roots every chunk key, so two engines share chunks only
when every one of those matches.
An engine is not thread-safe: serialize calls (the server runs one engine per worker).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Literal, cast, overload

import numpy as np
import torch

from ..errors import (
    BackendUnavailableError,
    CorruptEntryError,
    InvalidInputError,
    NamespaceMismatchError,
    StoreError,
)
from ..kv import (
    Chunk,
    ChunkKey,
    KVCodec,
    Namespace,
    NamespaceDigest,
    chunk_keys,
    chunk_spans,
    decode_chunk,
    encode_chunk,
    get_codec,
    logits_key,
)
from ..security import NO_TENANT_DIGEST, TenantSalter
from . import _cache_adapter as ca
from ._anchors import AnchorPool
from ._decode import DecodeState, SamplingParams, decode_steps
from ._documents import (
    DEFAULT_RECOMPUTE,
    DEFAULT_SELECTOR,
    Document,
    DocumentReuse,
    Segment,
    SegmentedPrompt,
    generation_result,
    generation_stats,
    is_segmented,
)
from ._fingerprint import model_fingerprint, tokenizer_fingerprint
from ._options import (
    load_model,
    resolve_dtype,
    use_fast_attention,
)
from ._pool import DEFAULT_KV_POOL_BYTES, KVBufferPool
from ._snapshot import KVSnapshot
from ._types import (
    GenerationResult,
    GenerationStats,
    PrefillResult,
    PrefillRunner,
    TokenStream,
)

__all__ = ["DEFAULT_CHUNK_SIZE", "HFEngine"]

logger = logging.getLogger("semcomm.engine")

DEFAULT_CHUNK_SIZE = 256
"""Tokens per chunk. Measured in benchmarks/kv/ttft.py (see docs/engine.md): at 2k
prompt tokens the per-chunk overhead (header, checksum, one store call) is a few percent of
the hit path at 256 and grows quickly below 64; larger chunks lose reuse granularity."""

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MAX_POS_ATTRS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
_LOGITS_CODEC = "logits"  # the codec name in the header of a stored last-position logits entry

_Pair = tuple[torch.Tensor, torch.Tensor]

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]] | np.ndarray | torch.Tensor
# what generate takes: a prompt, or one with documents (engine/_documents.py)
GenPrompt = Prompt | SegmentedPrompt | Sequence[Segment]



def _as_generation(gen: Generator[Any, None, Any], codec: str
                   ) -> Generator[Any, None, GenerationResult]:
    """A document prompt's pieces, returning the engine's :class:`GenerationResult`."""
    blended = yield from gen
    result: GenerationResult = generation_result(blended, codec)
    return result


class HFEngine:
    """A transformers causal LM that reuses KV chunks from a :class:`semcomm.kv.ChunkStore`.

    Args:
        model: a loaded ``PreTrainedModel``, a :mod:`semcomm.models` catalog name
            (``"smollm2-135m-instruct"``: pulled and converted on first use), or a hub id/path
            (``AutoModelForCausalLM``).
        tokenizer: a loaded tokenizer, an id/path, or None (then prompts are token ids; when
            ``model`` is a string the tokenizer is loaded from the same place).
        store: where chunks live (``MemoryStore``, ``DiskStore``, ``RedisStore``,
            ``TieredStore``); None disables reuse.
        chunk_size: tokens per chunk (see :data:`DEFAULT_CHUNK_SIZE`).
        codec: codec spec or object (``"lossless"``, ``"fp8"``, ``"int8"``, ``"int4:g32"``...).
        tenant: tenant id; its salt digest goes into the namespace (None = public data).
        salter: the server's :class:`~semcomm.security.TenantSalter` (default: a new one from
            the local secret).
        device: ``"cuda"``/``"cpu"``/a ``torch.device``; default cuda when available.
        dtype: weight and KV dtype: ``"float32"``, ``"bfloat16"``, ``"float16"``, a
            ``torch.dtype``, ``"auto"`` (bfloat16 on a CPU with native bfloat16 arithmetic,
            else float32: engine/_options.py) or None (the model's own; the default).
        adapter: fingerprint of a LoRA/adapter applied to the model ("" for none).
        keep_logits: store each prompt's last-position logits beside its final chunk (one
            ``[vocab]`` entry: 2 bytes a token id for a bfloat16 model, 4 otherwise), so a
            whole-prompt hit restores them and runs no forward (docs/architecture.md,
            invariant 3). False: every hit recomputes the prompt's last chunk.
        kv_pool_bytes: on the CPU, idle K/V buffer bytes kept for the next request, so a
            restore writes into memory that is already mapped (engine/_pool.py); 0: none.
            ``engine.kv_pool`` may be set to a pool shared by several engines.
        greedy_head, lean_decode: accepted for compatibility and ignored (the decode-step
            shortcuts they named were replaced by ``dtype``).
        prefill_scheduler: runs the prefill forwards (:class:`PrefillRunner`); None: the
            engine runs them itself.
        anchors: an :class:`AnchorPool` (engine/_anchors.py) for prompts with documents: a
            document's in-context KV captured from another prompt (one prefilled in full, or
            an answer this engine generated) is used before its stored KV; None: documents
            come from the store only. Keyed under this engine's namespace (tenant included),
            so engines of several tenants may share one pool.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        store: Any = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        codec: str | KVCodec = "lossless",
        tenant: str | None = None,
        salter: TenantSalter | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        adapter: str = "",
        keep_logits: bool = True,
        kv_pool_bytes: int = DEFAULT_KV_POOL_BYTES,
        greedy_head: bool | None = None,
        lean_decode: bool | None = None,
        prefill_scheduler: PrefillRunner | None = None,
        anchors: AnchorPool | None = None,
    ):
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidInputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.codec: KVCodec = get_codec(codec)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        tdtype = resolve_dtype(dtype, self.device)
        for flag, value in (("greedy_head", greedy_head), ("lean_decode", lean_decode)):
            if value is not None:
                warnings.warn(f"HFEngine({flag}=...) has no effect any more; see dtype= "
                              "(docs/engine.md)", DeprecationWarning, stacklevel=2)
        if isinstance(model, str):
            from transformers import AutoTokenizer

            from ..models import resolve_model

            path = resolve_model(model)  # a catalog name becomes its converted directory
            model = load_model(path, dtype=tdtype, device=self.device)
            tdtype = None  # loaded at it
            if tokenizer is None:
                try:
                    tokenizer = AutoTokenizer.from_pretrained(path)
                except (OSError, ValueError) as exc:
                    logger.info("no tokenizer at %s (%s); prompts must be token ids", path, exc)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            from ..models import resolve_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(tokenizer))
        if tdtype is not None:
            model = model.to(tdtype)
            use_fast_attention(model, self.device)
        windows = ca.check_supported(model)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.store = store
        self.chunk_size = chunk_size
        if not isinstance(keep_logits, bool):
            raise InvalidInputError(f"keep_logits must be True or False, got {keep_logits!r}")
        self.keep_logits = keep_logits
        try:
            pool = KVBufferPool(kv_pool_bytes)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        self.kv_pool: KVBufferPool | None = pool if kv_pool_bytes > 0 else None
        self.tenant = tenant
        self.layout = ca.probe_layout(self.model, self.device, windows)
        self._runner = ca.ModelRunner(self.model)
        self._chunked = ca.ChunkedRunner(self._runner, chunk_size)
        # optional: runs the prefill's forward (``run(runner, ids, cache, align=chunk_size)``),
        # e.g. semcomm.runtime's scheduler bounding concurrent long prefills; whatever it does,
        # every piece it runs is cut at chunk boundaries (ChunkedRunner)
        self.prefill_scheduler = prefill_scheduler
        self._documents: Any = None  # DocumentReuse, made on first use (engine/_documents.py)
        self.anchors = anchors  # read by DocumentReuse when it is made
        self.dtype: torch.dtype = self.layout.dtype
        if self.dtype not in _DTYPE_NAMES:
            raise InvalidInputError(f"unsupported KV dtype {self.dtype}")
        if tenant is None:
            tenant_digest = NO_TENANT_DIGEST
        else:
            tenant_digest = (salter or TenantSalter()).digest(tenant)
        self.namespace = Namespace(
            model=model_fingerprint(self.model),
            tokenizer=tokenizer_fingerprint(tokenizer),
            dtype=_DTYPE_NAMES[self.dtype],
            codec=self.codec.spec,
            tenant=tenant_digest,
            adapter=adapter,
        )
        self.namespace_digest: NamespaceDigest = self.namespace.digest
        emb = self.model.get_input_embeddings()
        self.vocab_size: int = int(getattr(emb, "num_embeddings", self.model.config.vocab_size))
        cfg = self.model.config
        self.max_positions: int | None = next(
            (int(getattr(cfg, a)) for a in _MAX_POS_ATTRS if isinstance(getattr(cfg, a, None), int)),
            None,
        )
        self.eos_token_ids: frozenset[int] = self._eos_ids()
        logger.info(
            "HFEngine %s on %s: %d layers x %d kv heads, chunk %d, codec %s, namespace %s",
            type(self.model).__name__, self.device, self.layout.num_layers,
            self.layout.kv_heads, chunk_size, self.codec.spec, self.namespace_digest.hex()[:12],
        )

    # ------------------------------------------------------------------ input
    def _eos_ids(self) -> frozenset[int]:
        gc = getattr(self.model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None and self.tokenizer is not None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return frozenset()
        ids = [eos] if isinstance(eos, int) else list(eos)
        return frozenset(int(i) for i in ids)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, chat messages, or token ids (validated)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("the prompt is empty")
            if self.tokenizer is None:
                raise InvalidInputError("a text prompt needs a tokenizer; pass token ids instead")
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (np.ndarray, torch.Tensor)):
            ids = [int(t) for t in prompt.reshape(-1).tolist()]
        elif isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping):
            if self.tokenizer is None:
                raise InvalidInputError("chat messages need a tokenizer with a chat template")
            for m in prompt:
                if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                    raise InvalidInputError(f"chat message must have 'role' and 'content': {m!r}")
            out = self.tokenizer.apply_chat_template(
                [dict(m) for m in prompt if isinstance(m, Mapping)],
                add_generation_prompt=True, tokenize=True,
            )
            if isinstance(out, Mapping) or hasattr(out, "keys"):
                out = out["input_ids"]
            ids = list(out)
        elif isinstance(prompt, Sequence):
            arr = np.asarray(prompt) if prompt else np.empty(0, dtype=np.int64)
            if arr.ndim == 1 and arr.dtype.kind in "iu":  # integers (no bools, floats, text)
                ids = arr.tolist()
            else:  # name the first bad element
                ids = []
                for t in prompt:
                    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                        raise InvalidInputError(f"token ids must be integers, got {t!r}")
                    ids.append(int(t))
        else:
            raise InvalidInputError(
                f"prompt must be text, chat messages or token ids, got {type(prompt).__name__}"
            )
        self._validate_ids(ids)
        return ids

    def _validate_ids(self, ids: Sequence[int], max_new_tokens: int = 0) -> None:
        if not ids:
            raise InvalidInputError("the prompt is empty")
        bad = ([t for t in ids if t < 0 or t >= self.vocab_size]
               if min(ids) < 0 or max(ids) >= self.vocab_size else [])
        if bad:
            raise InvalidInputError(
                f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        if self.max_positions is not None and len(ids) + max_new_tokens > self.max_positions:
            raise InvalidInputError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds the model's "
                f"maximum of {self.max_positions} positions"
            )

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """Text of token ids (special tokens skipped), None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def chunk_keys(self, token_ids: Sequence[int]) -> list[ChunkKey]:
        """This engine's chunk keys for ``token_ids`` (what the replica router indexes)."""
        return chunk_keys(self.namespace_digest, token_ids, self.chunk_size)

    def cached_tokens(self, prompt: Prompt) -> int:
        """How many prompt tokens the store would serve right now (no data moved)."""
        ids = self.tokenize(prompt)
        if self.store is None:
            return 0
        keys = self.chunk_keys(ids)
        match = self.store.lookup(keys)
        spans = chunk_spans(len(ids), self.chunk_size)
        return spans[match.num_chunks - 1][1] if match.num_chunks else 0

    # ---------------------------------------------------------------- restore
    def _check_chunk(self, chunk: Chunk, start: int, end: int) -> None:
        h = chunk.header
        if h.start != start or h.num_tokens != end - start:
            raise CorruptEntryError(
                f"chunk {h.key[:16]} covers [{h.start}, {h.start + h.num_tokens}), expected "
                f"[{start}, {end})"
            )
        if h.dtype != self.namespace.dtype or h.codec != self.codec.name:
            raise CorruptEntryError(f"chunk {h.key[:16]} has dtype/codec {h.dtype}/{h.codec}")

    def _gather_from_store(
        self, ids: list[int], keys: list[ChunkKey], stats: GenerationStats
    ) -> tuple[list[Chunk], list[str], list[bytes]]:
        if self.store is None:
            return [], [], []
        t0 = time.perf_counter()
        try:
            match = self.store.lookup(keys)
        except (StoreError, BackendUnavailableError) as exc:  # a store failure is a miss
            logger.warning("KV store lookup failed (%s); serving without reuse", exc)
            return [], [], []
        stats.lookup_ms = (time.perf_counter() - t0) * 1e3
        spans = chunk_spans(len(ids), self.chunk_size)
        chunks: list[Chunk] = []
        tiers: list[str] = []
        raw: list[bytes] = []
        try:  # one batched call (one round trip to Redis, one pass per tier)
            got = self.store.fetch_many(keys[:match.num_chunks]) if match.num_chunks else []
        except (StoreError, BackendUnavailableError) as exc:
            logger.warning("KV store fetch failed (%s); serving without reuse", exc)
            got = []
        for i, fetched in enumerate(got):
            if fetched is None:  # evicted between lookup and fetch
                break
            try:
                # fetch_many serves only verified bytes (the ChunkStore contract: semcomm's
                # stores checksum on put and on every read from a persistent tier, and
                # ChunkStoreBase.fetch verifies the get of any other store), so the header
                # checks suffice here; a tampered chunk never reaches this point.
                chunk = decode_chunk(
                    fetched.value, expect_key=keys[i], expect_namespace=self.namespace_digest,
                    verify=False,
                )
                self._check_chunk(chunk, *spans[i])
            except (CorruptEntryError, NamespaceMismatchError) as exc:
                logger.warning("chunk %d of the prompt is unusable (%s); treating as a miss", i, exc)
                break
            chunks.append(chunk)
            tiers.append(str(fetched.tier))
            raw.append(fetched.value)
        return chunks, tiers, raw

    def _fetch_logits(self, prompt_key: ChunkKey) -> torch.Tensor | None:
        """The stored last-position logits of a whole cached prompt; None: recompute instead."""
        lk = logits_key(prompt_key)
        try:
            fetched = self.store.fetch(lk)
        except (StoreError, BackendUnavailableError) as exc:
            logger.warning("KV store fetch of the prompt's logits failed (%s); recomputing", exc)
            return None
        if fetched is None:
            return None
        try:
            entry = decode_chunk(fetched.value, expect_key=lk,
                                 expect_namespace=self.namespace_digest, verify=False)
        except (CorruptEntryError, NamespaceMismatchError) as exc:
            logger.warning("the prompt's stored logits are unusable (%s); recomputing", exc)
            return None
        h, arr = entry.header, entry.arrays.get("logits")
        if (h.codec != _LOGITS_CODEC or h.parent != bytes(prompt_key).hex() or arr is None
                or arr.ndim != 1 or arr.shape[0] < self.vocab_size):
            logger.warning("entry %s is not this prompt's logits; recomputing", h.key[:16])
            return None
        if "logits" in h.codec_params.get("bf16", ()):
            t = torch.from_numpy(np.array(arr, dtype="<u2").view("<i2")).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(arr, dtype="<f4"))
        return t.to(self.device, torch.float32)

    def _store_logits(self, pre: PrefillResult, prompt_key: ChunkKey) -> None:
        """Store the prompt's last-position logits beside its final chunk (once per prompt).

        A bfloat16 model's logits are kept as their 16 bits (exact: they were bfloat16 before
        the float32 cast); anything else as float32.
        """
        lg = pre.last_logits
        if lg.ndim != 1 or lg.numel() == 0:  # e.g. a re-chunked snapshot: no logits computed
            return
        lk = logits_key(prompt_key)
        x = lg.detach().to("cpu", torch.float32).contiguous()
        b = x.to(torch.bfloat16)
        if torch.equal(b.float(), x):
            arr, names = b.view(torch.int16).numpy().view("<u2"), frozenset({"logits"})
        else:
            arr, names = x.numpy(), frozenset()
        data = encode_chunk(
            namespace=self.namespace_digest, key=lk, parent=prompt_key, num_tokens=0,
            start=len(pre.input_ids), dtype=self.namespace.dtype, codec=_LOGITS_CODEC,
            codec_params={"bf16": sorted(names)}, arrays={"logits": arr}, bf16_names=names,
            meta={"kind": "logits"},
        )
        try:
            if not self.store.contains(lk):
                self.store.put(lk, data)
        except (StoreError, BackendUnavailableError) as exc:
            logger.warning("KV store put of the prompt's logits failed (%s)", exc)
            return
        pre.stats.bytes_stored += len(data)

    def _gather_from_snapshot(
        self, ids: list[int], snap: KVSnapshot
    ) -> tuple[list[Chunk], list[str], list[bytes]]:
        self._check_snapshot(snap)
        n_common = 0
        for a, b in zip(ids, snap.token_ids):
            if a != b:
                break
            n_common += 1
        snap_keys = chunk_keys(self.namespace_digest, snap.token_ids, snap.chunk_size)
        spans = chunk_spans(len(snap.token_ids), snap.chunk_size)
        chunks: list[Chunk] = []
        raw: list[bytes] = []
        for i, data in enumerate(snap.chunks):
            if spans[i][1] > n_common:
                break
            chunk = decode_chunk(data, expect_key=snap_keys[i], expect_namespace=self.namespace_digest)
            self._check_chunk(chunk, *spans[i])
            chunks.append(chunk)
            raw.append(data)
        return chunks, ["snapshot"] * len(chunks), raw

    def _check_snapshot(self, snap: KVSnapshot) -> None:
        if not isinstance(snap, KVSnapshot):
            raise InvalidInputError(f"expected a KVSnapshot, got {type(snap).__name__}")
        if snap.namespace != self.namespace_digest:
            raise NamespaceMismatchError(
                f"snapshot belongs to namespace {snap.namespace.hex()[:16]}, this engine is "
                f"{self.namespace_digest.hex()[:16]} (different model, tokenizer, dtype, codec or "
                "tenant)"
            )
        if len(snap.chunks) != len(chunk_spans(len(snap.token_ids), snap.chunk_size)):
            raise CorruptEntryError("snapshot chunk count does not match its tokens")

    def _restore(self, chunks: list[Chunk], upto: int, capacity: int,
                 full: bool = False) -> tuple[Any, int, _Pair | None]:
        """Decode chunks into the cache's preallocated buffer.

        Returns ``(cache, tokens, buffers)``: ``buffers`` is the CPU key/value pair behind the
        cache when it came from (and may go back to) ``kv_pool``, else None.

        At most ``upto`` tokens are restored. Each sliding-window layer gets only the positions
        it needs to continue (``KVLayout.first_needed``) unless ``full`` (re-chunking needs
        them all). ``capacity``: tokens the cache must hold without growing.
        """
        stored = sum(c.header.num_tokens for c in chunks)
        total = min(upto, stored)
        lay = self.layout
        cap = max(capacity, stored, 1)  # whole chunks fit (a position past ``total`` is
        on_cpu = self.device.type == "cpu"  # overwritten by the recomputed token)
        pool = self.kv_pool if on_cpu else None
        if total == 0:
            bufs = None if pool is None else self._pooled(pool, cap)
            return ca.buffer_cache(lay, cap, self.device, 0, bufs), 0, bufs
        lo = [0 if full else lay.first_needed(i, total) for i in range(lay.num_layers)]
        # the cache's own buffer on the CPU (from the pool when it has one); a pinned staging
        # buffer for an accelerator
        width = cap if on_cpu else stored
        pin = self.device.type == "cuda"
        if pool is not None:
            out_k, out_v = self._pooled(pool, width)
        else:
            out_k = torch.empty((lay.num_layers, lay.kv_heads, width, lay.k_dim),
                                dtype=self.dtype, pin_memory=pin)
            out_v = torch.empty((lay.num_layers, lay.kv_heads, width, lay.v_dim),
                                dtype=self.dtype, pin_memory=pin)
        pos = 0
        for c in chunks:
            n = c.header.num_tokens
            if not any(lo):  # every layer needs every position: decode the chunk whole
                self.codec.decode_into(c.arrays, out_k, out_v, pos, n)
            else:
                self._decode_layers(c, out_k, out_v, pos, n, lo)
            pos += n
        if on_cpu:
            return (ca.buffer_cache(lay, cap, self.device, total, (out_k, out_v), full), total,
                    (out_k, out_v) if pool is not None else None)
        bk = torch.empty((lay.num_layers, lay.kv_heads, cap, lay.k_dim), dtype=self.dtype,
                         device=self.device)
        bv = torch.empty((lay.num_layers, lay.kv_heads, cap, lay.v_dim), dtype=self.dtype,
                         device=self.device)
        bk[:, :, :stored].copy_(out_k, non_blocking=True)
        bv[:, :, :stored].copy_(out_v, non_blocking=True)
        return ca.buffer_cache(lay, cap, self.device, total, (bk, bv), full), total, None

    def _pooled(self, pool: KVBufferPool, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layout
        return pool.take(lay.num_layers, lay.kv_heads, width, lay.k_dim, lay.v_dim, self.dtype,
                         self.device)

    def _decode_layers(self, chunk: Chunk, out_k: torch.Tensor, out_v: torch.Tensor, pos: int,
                       n: int, lo: list[int]) -> None:
        """Copy the positions ``[max(lo[i], pos), pos + n)`` of each layer ``i`` of a chunk.

        A lossless chunk is copied straight from its bytes, layer by layer, so a sliding layer's
        positions outside its window are never touched; a lossy codec decodes the chunk whole.
        """
        arrays = chunk.arrays
        direct = self.codec.name == "lossless" and "k" in arrays and "v" in arrays
        if not direct:
            k_all, v_all = self.codec.decode(arrays, num_tokens=chunk.header.num_tokens,
                                             dtype=self.namespace.dtype)
        for i, first in enumerate(lo):
            a = max(first, pos)
            if a >= pos + n:
                continue
            s, e = a - pos, n
            if direct:
                for name, out in (("k", out_k), ("v", out_v)):
                    dst = out[i, :, a : pos + n]
                    src = arrays[name][i, :, s:e]
                    if out.dtype == torch.bfloat16:
                        np.copyto(dst.view(torch.int16).numpy(), src.view("<i2"), casting="no")
                    else:
                        np.copyto(dst.numpy(), src, casting="no")
            else:
                out_k[i, :, a : pos + n].copy_(k_all[i, :, s:e])
                out_v[i, :, a : pos + n].copy_(v_all[i, :, s:e])

    # ---------------------------------------------------------------- prefill
    def _prefill(
        self, ids: list[int], snapshot: KVSnapshot | None, t_start: float, capacity: int = 0,
        keys: Sequence[ChunkKey] | None = None,
    ) -> tuple[PrefillResult, list[ChunkKey]]:
        stats = GenerationStats(prompt_tokens=len(ids), codec=self.codec.spec)
        if keys is None:
            keys = self.chunk_keys(ids)
        elif len(keys) != len(chunk_spans(len(ids), self.chunk_size)):
            raise InvalidInputError(f"{len(keys)} chunk keys for a prompt of {len(ids)} tokens "
                                    f"in chunks of {self.chunk_size}")
        keys = list(keys)
        t0 = time.perf_counter()
        if snapshot is not None:
            chunks, tiers, raw = self._gather_from_snapshot(ids, snapshot)
        else:
            chunks, tiers, raw = self._gather_from_store(ids, keys, stats)
        # invariant 3: a whole cached prompt is restored only together with the logits its
        # prefill computed (stored beside its final chunk); otherwise its last chunk is
        # recomputed
        logits: torch.Tensor | None = None
        if (self.keep_logits and snapshot is None and chunks
                and sum(c.header.num_tokens for c in chunks) == len(ids)):
            logits = self._fetch_logits(keys[-1])
        with torch.no_grad():
            # a snapshot's chunks may be cut for other keys (another chunk size, a shorter
            # prompt): they are re-encoded from the cache, so every layer keeps them all
            # without stored logits the prompt's last chunk is recomputed whole, so its
            # forward has the shapes it has with the cache off (invariant 2)
            upto = (len(ids) if logits is not None
                    else (len(ids) - 1) // self.chunk_size * self.chunk_size)
            if snapshot is None:  # the chunks restored, not those fetched beyond them
                used = sum(1 for s, _ in chunk_spans(len(ids), self.chunk_size)[:len(chunks)]
                           if s < upto)
                chunks, tiers, raw = chunks[:used], tiers[:used], raw[:used]
            cache, _, bufs = self._restore(chunks, upto, max(capacity, len(ids)),
                                           full=snapshot is not None)
            stats.load_ms = (time.perf_counter() - t0) * 1e3
            kept = ca.cache_length(cache)
            stats.hit_tokens = kept
            stats.hit_chunks = len(chunks)
            stats.hit_tiers = tuple(tiers)
            stats.bytes_loaded = sum(c.nbytes for c in chunks)
            stats.recomputed_tokens = len(ids) - kept
            stats.logits_restored = logits is not None
            t1 = time.perf_counter()
            if logits is None:
                rest = torch.tensor([ids[kept:]], dtype=torch.long, device=self.device)
                sched = self.prefill_scheduler
                logits = (self._chunked.forward(rest, cache) if sched is None
                          else sched.run(self._chunked, rest, cache, align=self.chunk_size))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            stats.prefill_ms = (time.perf_counter() - t1) * 1e3
        stats.ttft_s = time.perf_counter() - t_start
        assert ca.cache_length(cache) == len(ids)
        result = PrefillResult(
            cache=cache, last_logits=logits, input_ids=ids, stats=stats, buffers=bufs,
            chunk_bytes=[raw[i] if i < len(raw) and chunks[i].header.key == keys[i].hex() else None
                         for i in range(len(keys))],
        )
        return result, keys

    def _store_chunks(self, pre: PrefillResult, keys: list[ChunkKey]) -> None:
        """Write the prompt's chunks that the store lacks (called once the prompt is in cache)."""
        stats = pre.stats
        if self.store is None:
            return
        t0 = time.perf_counter()
        ids = pre.input_ids
        spans = chunk_spans(len(ids), self.chunk_size)
        first = stats.hit_chunks if not stats.hit_tiers or stats.hit_tiers[0] != "snapshot" else 0
        complete = True  # every chunk is in the store (then its logits go beside it)
        try:
            present = self.store.contains_many(keys[first:])
            todo = [first + j for j, there in enumerate(present) if not there]
        except (StoreError, BackendUnavailableError) as exc:
            logger.warning("KV store unavailable (%s); the prompt's chunks are not stored", exc)
            todo, complete = [], False
        # restored chunks (a snapshot's) are stored as the bytes they came in; computed ones
        # are encoded from the cache, where every layer holds them (they follow the restored
        # prefix, and a restored sliding layer holds only its last window)
        have = [pre.chunk_bytes[i] if i < len(pre.chunk_bytes) else None for i in range(len(keys))]
        computed = [i for i in todo if have[i] is None]
        if todo:
            lo = spans[computed[0]][0] if computed else len(ids)
            with torch.no_grad():
                k_all, v_all = ca.stack_range(pre.cache, lo, len(ids))
                k_all, v_all = k_all.cpu(), v_all.cpu()
            batch = []
            for i in todo:
                s, e = spans[i]
                batch.append((keys[i], have[i] or self._encode(
                    keys, i, s, e, k_all[:, :, s - lo : e - lo], v_all[:, :, s - lo : e - lo])))
            # one batch: a DiskStore writes its chunks concurrently (docs/kv.md, put_many)
            try:
                self.store.put_many(batch)
            except (StoreError, BackendUnavailableError) as exc:
                logger.warning("KV store put failed (%s); the prompt's chunks are not all stored",
                               exc)
                complete = False
            else:
                stats.bytes_stored += sum(len(data) for _, data in batch)
                stats.chunks_stored += len(batch)
        if complete and self.keep_logits and keys and not stats.logits_restored:
            self._store_logits(pre, keys[-1])  # beside the final chunk, so a whole hit needs no forward
        stats.store_ms = (time.perf_counter() - t0) * 1e3

    def _encode(
        self, keys: list[ChunkKey], i: int, s: int, e: int, k: torch.Tensor, v: torch.Tensor
    ) -> bytes:
        enc = self.codec.encode(k, v)
        return encode_chunk(
            namespace=self.namespace_digest,
            key=keys[i],
            parent=keys[i - 1] if i else None,
            num_tokens=e - s,
            start=s,
            dtype=self.namespace.dtype,
            codec=self.codec.name,
            codec_params={**self.codec.params, "spec": self.codec.spec},
            arrays=enc.arrays,
            bf16_names=enc.bf16_names,
            meta={"layers": self.layout.num_layers},
        )

    def prefill(self, prompt: Prompt, *, snapshot: KVSnapshot | None = None,
                store: bool = True, keys: Sequence[ChunkKey] | None = None) -> PrefillResult:
        """Restore the longest cached prefix, prefill the rest and (by default) store new chunks.

        Returns the prompt's cache (every prompt token; a restored sliding-window layer only
        its window), the last position's logits, the token ids and stats. The caller owns the
        cache. ``keys``: the prompt's chunk keys when the caller already has them
        (``self.chunk_keys(ids)``, e.g. computed once for the replica router); they must be
        this engine's keys of exactly these tokens.
        """
        t_start = time.perf_counter()
        ids = self.tokenize(prompt)
        pre, keys = self._prefill(ids, snapshot, t_start, keys=keys)
        if store:
            self._store_chunks(pre, keys)
        pre.stats.total_s = time.perf_counter() - t_start
        return pre

    # --------------------------------------------------------------- generate
    @overload
    def generate(
        self, prompt: GenPrompt | None, max_new_tokens: int = ..., *, temperature: float = ...,
        top_p: float = ..., top_k: int = ..., seed: int | None = ...,
        stop: Sequence[str | int] | str | None = ..., stream: Literal[False] = ...,
        snapshot: KVSnapshot | None = ...,
        on_prefill: Callable[[GenerationStats], None] | None = ...,
        selector: str | None = ..., recompute: float | None = ...,
        keys: Sequence[ChunkKey] | None = ..., margin: float | None = ...,
        watch: float | None = ...,
    ) -> GenerationResult: ...

    @overload
    def generate(
        self, prompt: GenPrompt | None, max_new_tokens: int = ..., *, temperature: float = ...,
        top_p: float = ..., top_k: int = ..., seed: int | None = ...,
        stop: Sequence[str | int] | str | None = ..., stream: Literal[True],
        snapshot: KVSnapshot | None = ...,
        on_prefill: Callable[[GenerationStats], None] | None = ...,
        selector: str | None = ..., recompute: float | None = ...,
        keys: Sequence[ChunkKey] | None = ..., margin: float | None = ...,
        watch: float | None = ...,
    ) -> TokenStream: ...

    def generate(
        self,
        prompt: GenPrompt | None,
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str | int] | str | None = None,
        stream: bool = False,
        snapshot: KVSnapshot | None = None,
        on_prefill: Callable[[GenerationStats], None] | None = None,
        selector: str | None = None,
        recompute: float | None = None,
        keys: Sequence[ChunkKey] | None = None,
        margin: float | None = None,
        watch: float | None = None,
    ) -> GenerationResult | TokenStream:
        """Generate a continuation of ``prompt`` (greedy unless ``temperature > 0``).

        ``stop``: strings (need a tokenizer) and/or token ids ending generation (the stop
        string is cut from ``text``). ``stream=True`` returns a :class:`TokenStream` of text
        pieces (token ids without a tokenizer) whose ``.result`` is set at the end; text that
        could begin a stop string is held back until decided, so the pieces joined equal
        ``.result.text``.
        ``snapshot``: continue from a :class:`KVSnapshot` (its tokens must prefix the prompt).
        ``on_prefill``: called with the stats once the prompt is in cache (hit and recomputed
        tokens, tiers), before the first token is chosen.
        A prompt of segments with documents (``[System(...), Document(d1), User(q)]``,
        engine/_documents.py) reuses each document's stored KV at its position and recomputes
        a share ``recompute`` of their tokens picked by ``selector`` (docs/rag.md);
        ``stats.documents`` reports what was reused and recomputed.
        ``keys``: the prompt's chunk keys if already computed (see :meth:`prefill`).
        ``margin`` (a prompt with documents): below this top-1 minus top-2 probability of the
        first token the reused KV is not trusted and the prompt is prefilled in full.
        ``watch`` (a prompt with documents): below this margin at a later decode step the KV
        is rebuilt in full and decoding goes on from exact KV (docs/rag.md).
        """
        t_start = time.perf_counter()
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if is_segmented(prompt):
            if snapshot is not None:
                raise InvalidInputError("a prompt with documents takes no snapshot")
            docs = self.documents()
            dgen = docs.generate_iter(
                prompt,  # type: ignore[arg-type]  # is_segmented checked it
                max_new_tokens, stop=stop, temperature=temperature, top_p=top_p,
                top_k=top_k, seed=seed, t_start=t_start,
                selector=selector or DEFAULT_SELECTOR,
                recompute=DEFAULT_RECOMPUTE if recompute is None else recompute,
                on_prefill=None if on_prefill is None else (
                    lambda st: on_prefill(generation_stats(st, self.codec.spec))),
                margin=margin, watch=watch)
            gen = _as_generation(dgen, self.codec.spec)
        elif (selector is not None or recompute is not None or margin is not None
              or watch is not None):
            raise InvalidInputError("selector, recompute, margin and watch apply to a prompt "
                                    "with documents")
        if is_segmented(prompt):
            if stream:
                return TokenStream(gen)
            while True:
                try:
                    next(gen)
                except StopIteration as done:
                    blended: GenerationResult = done.value
                    return blended
        if prompt is None:
            if snapshot is None:
                raise InvalidInputError("the prompt is empty (None) and no snapshot was given")
            prompt = list(snapshot.token_ids)
        ids = self.tokenize(cast(Prompt, prompt))  # is_segmented ruled the others out
        self._validate_ids(ids, max_new_tokens)
        stops = [stop] if isinstance(stop, (str, int)) else list(stop or [])
        stop_strs = [s for s in stops if isinstance(s, str) and s]
        stop_ids = {int(s) for s in stops if isinstance(s, int)}
        if stop_strs and self.tokenizer is None:
            raise InvalidInputError("stop strings need a tokenizer; pass stop token ids instead")
        gen = self._generate_iter(ids, max_new_tokens, params, stop_strs, stop_ids, snapshot,
                                  t_start, on_prefill, keys)
        if stream:
            return TokenStream(gen)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                result: GenerationResult = done.value
                return result

    def _generate_iter(
        self, ids: list[int], max_new: int, params: SamplingParams, stop_strs: list[str],
        stop_ids: set[int], snapshot: KVSnapshot | None, t_start: float,
        on_prefill: Callable[[GenerationStats], None] | None = None,
        keys: Sequence[ChunkKey] | None = None,
    ) -> Generator[Any, None, GenerationResult]:
        """The decode loop: one forward per token on the cache, written in place."""
        pre, keys = self._prefill(ids, snapshot, t_start, capacity=len(ids) + max_new, keys=keys)
        stats = pre.stats
        if on_prefill is not None:
            on_prefill(stats)
        seq = DecodeState(self.tokenizer, params, self.device, max_new_tokens=max_new,
                          stop=stop_strs, stop_ids=stop_ids, eos_ids=self.eos_token_ids)
        cache, bufs = pre.cache, pre.buffers
        pre.buffers = None
        step = torch.zeros((1, 1), dtype=torch.long, device=self.device)

        def forward(nxt: list[int]) -> torch.Tensor:  # one token on the cache, in place
            step.fill_(nxt[0])
            # inference mode: no version counters or view tracking (a few percent a step here);
            # the cache's buffers stay ordinary tensors written in place
            with torch.inference_mode():
                return self._runner.forward(step, cache)[None]

        t_dec = time.perf_counter()
        for i, (piece,) in enumerate(decode_steps([seq], pre.last_logits[None], forward)):
            if i == 0:  # the first token is chosen: store the prompt's chunks before its text
                stats.ttft_s = time.perf_counter() - t_start
                self._store_chunks(pre, keys)
                pre.cache = None  # the decode loop owns the cache from here
                t_dec = time.perf_counter()
            if isinstance(piece, int) or piece:
                yield piece  # a text piece, or the token id without a tokenizer
        dt = time.perf_counter() - t_dec
        if self.kv_pool is not None and bufs is not None:
            # the decode loop is over: nothing reads the buffers behind its cache any more
            self.kv_pool.give(bufs)
        out = seq.token_ids
        stats.new_tokens = len(out)
        stats.decode_tokens_per_s = (len(out) - 1) / dt if len(out) > 1 and dt > 0 else 0.0
        tail = seq.finish()
        if tail:
            yield tail  # held back (a possible stop string start) or incomplete UTF-8
        stats.finish_reason = seq.finish_reason or "length"
        stats.total_s = time.perf_counter() - t_start
        return GenerationResult(token_ids=out, text=seq.text, stats=stats, prompt_ids=ids)

    # -------------------------------------------------------------- documents
    def documents(self) -> DocumentReuse:
        """This engine's documents reused at any position (engine/_documents.py), made on
        first use; raises :class:`UnsupportedModelError` for a model whose positions cannot
        move (ALiBi, learned absolute positions, ...)."""
        if self._documents is None:
            self._documents = DocumentReuse(self, pool=self.anchors)
        docs: DocumentReuse = self._documents
        return docs

    def precompute(self, document: Document | str | Sequence[int]) -> int:
        """Store a document's KV once (computed alone), for any prompt and position that
        later includes it; returns the chunks written (0: already stored)."""
        return self.documents().precompute(document)

    # -------------------------------------------------------------- snapshots
    def snapshot(self, prompt: Prompt) -> KVSnapshot:
        """Export the KV of ``prompt`` (restored or computed) with this engine's namespace."""
        pre = self.prefill(prompt)
        ids = pre.input_ids
        keys = self.chunk_keys(ids)
        spans = chunk_spans(len(ids), self.chunk_size)
        chunks: list[bytes] = []
        have = [pre.chunk_bytes[i] if i < len(pre.chunk_bytes) else None
                for i in range(len(spans))]
        todo = [i for i, d in enumerate(have) if d is None]
        lo = spans[todo[0]][0] if todo else len(ids)  # computed here, so every layer holds it
        with torch.no_grad():
            k_all, v_all = ca.stack_range(pre.cache, lo, len(ids))
            k_all, v_all = k_all.cpu(), v_all.cpu()
        for i, (s, e) in enumerate(spans):
            data = have[i]
            if data is None:  # computed here: encode (hits keep their stored bytes)
                data = self._encode(keys, i, s, e, k_all[:, :, s - lo : e - lo],
                                    v_all[:, :, s - lo : e - lo])
            chunks.append(data)
        return KVSnapshot(
            namespace=bytes(self.namespace_digest),
            token_ids=tuple(ids),
            chunk_size=self.chunk_size,
            codec=self.codec.spec,
            chunks=tuple(chunks),
        )

    def import_snapshot(self, snap: KVSnapshot | bytes) -> int:
        """Verify a snapshot and put its chunks into this engine's store; returns chunks added.

        Raises :class:`NamespaceMismatchError` for a snapshot of another namespace and
        :class:`CorruptEntryError` for damaged data (nothing is stored then).
        """
        if isinstance(snap, (bytes, bytearray, memoryview)):
            snap = KVSnapshot.from_bytes(bytes(snap))
        self._check_snapshot(snap)
        ids = list(snap.token_ids)
        self._validate_ids(ids)
        chunks, _, raw = self._gather_from_snapshot(ids, snap)  # verifies every chunk first
        if self.store is None:
            return 0
        if snap.chunk_size == self.chunk_size:
            keys = self.chunk_keys(ids)
            added = 0
            for key, data in zip(keys, raw):
                if not self.store.contains(key):
                    self.store.put(key, data)
                    added += 1
            return added
        # another chunking: restore and re-chunk with ours
        with torch.no_grad():
            cache, _, _ = self._restore(chunks, len(ids), len(ids), full=True)
        pre = PrefillResult(cache=cache, last_logits=torch.empty(0), input_ids=ids,
                            stats=GenerationStats(prompt_tokens=len(ids)))
        self._store_chunks(pre, self.chunk_keys(ids))
        return pre.stats.chunks_stored

    def __repr__(self) -> str:
        store = None if self.store is None else self.store.name
        return (
            f"HFEngine({type(self.model).__name__}, device={self.device}, chunk_size="
            f"{self.chunk_size}, codec={self.codec.spec!r}, store={store})"
        )
