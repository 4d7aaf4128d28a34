"""The vLLM-independent half of the vLLM KV connector: settings, namespaces, plans, layouts.

Everything here runs without vLLM installed (the connector in :mod:`semcomm.integrations.vllm`
is a thin adapter over it), so it is tested with plain tensors:

* :class:`ConnectorSettings`: the connector's ``kv_connector_extra_config``, validated;
* :func:`build_store`: a semcomm ``ChunkStore`` (memory, disk, Redis or tiered) from them;
* :class:`NamespaceFactory`: semcomm namespaces for a model directory, KV dtype, codec and the
  tenant a request names (:func:`tenant_of`);
* :class:`RequestPlan`: per request, the chunk keys of its prompt, what to load and what to save;
* :func:`gather_chunk` / :func:`scatter_chunk`: vLLM's CPU paged layout
  ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (per block and head: ``block_size``
  key rows, then ``block_size`` value rows) to and from semcomm's ``[L, H, T, D]`` chunks,
  the layout semcomm's HF engine stores too;
* :func:`load_chunks` (a failure of any kind is a miss from that chunk on) and
  :class:`ChunkSaver` (encodes and writes on a background thread, bounded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, SemcommError
from ..kv import (
    ChunkKey,
    ChunkPieces,
    ChunkStore,
    DiskStore,
    MemoryStore,
    Namespace,
    NamespaceDigest,
    TieredStore,
    chunk_keys,
    decode_chunk,
    encode_chunk,
    get_codec,
    tensor_arrays,
)

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "KEY_LAYOUTS",
    "LAYERWISE_ENV",
    "STREAMED_ENV",
    "TENANT_PARAM",
    "TIMINGS_ENV",
    "ChunkSaver",
    "ConnectorSettings",
    "LayerwiseLoad",
    "LoadSpec",
    "NamespaceFactory",
    "RequestPlan",
    "SaveSpec",
    "StreamedChunk",
    "Timings",
    "build_store",
    "chunk_size_for",
    "gather_chunk",
    "iter_chunks",
    "load_chunks",
    "load_into",
    "load_slot_bytes",
    "model_dir_fingerprint",
    "open_streamed",
    "ordered_layers",
    "page_faults",
    "read_slots",
    "scatter_chunk",
    "spec_slice",
    "streamable",
    "tenant_of",
    "tokenizer_dir_fingerprint",
    "write_slots",
]

logger = logging.getLogger("semcomm.integrations.vllm")

DEFAULT_CHUNK_TOKENS = 0
"""Chunk size when the config names none: 0 means one vLLM block (the finest prefix vLLM can
take; set ``chunk_size = 256`` to share chunks with semcomm's HF engine defaults)."""

TENANT_PARAM = "semcomm_tenant"
"""The ``kv_transfer_params`` field naming a request's tenant."""

_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16",
                      torch.bfloat16: "bfloat16"}
_MIB = 1 << 20


TIMINGS_ENV = "SEMCOMM_VLLM_TIMINGS"
"""A file path: each connector process appends one JSON line per store lookup (scheduler side),
load, save and forward end (worker side) with its start (``at``: ``time.monotonic()``, the
clock of vLLM's ``queued_ts`` / ``first_token_ts``) and duration (``benchmarks.vllm.check``
reads it to say where a warm request's time went). Unset: nothing is written."""


def page_faults() -> tuple[int, int]:
    """The process's page faults so far: (minor, major) (``getrusage``; every thread)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return int(r.ru_minflt), int(r.ru_majflt)


class Timings:
    """The ``SEMCOMM_VLLM_TIMINGS`` log: JSON lines, appended with one ``write`` each (lines
    of several processes never interleave); off (a no-op) when the variable is unset."""

    def __init__(self, path: str | None) -> None:
        self.path = path or None

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def record(self, event: str, t0: float, seconds: float, **fields: Any) -> None:
        """One line; ``minflt``/``majflt``: the process's page faults so far (minor, major),
        at the time of the record (differences between two records of one pid say how many
        faults lay between them)."""
        if self.path is None:
            return
        minor, major = page_faults()
        line = json.dumps({"event": event, "at": t0, "ms": round(seconds * 1e3, 3),
                           "pid": os.getpid(), "minflt": minor, "majflt": major, **fields})
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as exc:  # a diagnostic must never fail a request
            logger.warning("SemcommConnector: cannot write %s: %s", self.path, exc)
            self.path = None


# ---- settings and stores --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config`` (see docs/vllm.md for every key)."""

    store: tuple[str, ...]  # tier specs, fastest first: "memory", "disk:/path", "redis://..."
    chunk_size: int | None = None  # tokens per chunk; None: DEFAULT_CHUNK_TOKENS, block aligned
    codec: str = "lossless"  # semcomm codec spec ("lossless", "fp8", "int8", "int4:g32", ...)
    seal: bool = False  # AES-GCM sealing at rest (disk, Redis) under the server secret
    memory_bytes: int = 1 << 30  # budget of a "memory" tier
    disk_bytes: int = 10 << 30  # budget of a "disk:" tier
    redis_ttl_s: int | None = None  # expiry of Redis chunks
    max_pending_bytes: int = 512 * _MIB  # saves queued for the background writer
    tenant_param: str = TENANT_PARAM
    # loads read and verified in start_load_kv, then copied into vLLM's blocks layer by layer
    # on a thread while the forward pass runs (wait_for_layer_load waits for each layer; the
    # default: 5-7 ms less TTFT per 2k-token load here, docs/BENCHMARKS.md); False: read and
    # copied batch by batch inside start_load_kv
    layerwise_load: bool = True
    # with layerwise_load, an unsealed disk store and the lossless codec: the chunks' files are
    # read layer by layer on the copy thread too, behind the forward, and verified whole once
    # every layer is in place (a chunk that fails is reported and recomputed by vLLM); False:
    # read and verified in start_load_kv before the forward starts
    streamed_reads: bool = True

    _KEYS = frozenset({"store", "chunk_size", "codec", "seal", "memory_bytes", "disk_bytes",
                       "redis_ttl_s", "max_pending_bytes", "tenant_param", "layerwise_load",
                       "streamed_reads"})

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Validate ``kv_connector_extra_config``; ``ConfigError`` names a bad key or value."""
        d = dict(extra or {})
        unknown = sorted(set(d) - cls._KEYS)
        if unknown:
            raise ConfigError(f"SemcommConnector: unknown kv_connector_extra_config keys "
                              f"{unknown} (known: {sorted(cls._KEYS)})")
        store = d.get("store", "disk:~/.cache/semcomm/vllm-kv")
        tiers = (store,) if isinstance(store, str) else tuple(store)
        if not tiers or not all(isinstance(t, str) and t for t in tiers):
            raise ConfigError("SemcommConnector: 'store' must be a tier spec or a list of them "
                              "('memory', 'disk:/path', 'redis://host:port/db')")
        for t in tiers:
            _tier_kind(t)
        chunk = d.get("chunk_size")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):
            raise ConfigError(f"SemcommConnector: chunk_size must be a positive int, got "
                              f"{chunk!r}")
        ints = {}
        for name, default in (("memory_bytes", 1 << 30), ("disk_bytes", 10 << 30),
                              ("max_pending_bytes", 512 * _MIB)):
            v = d.get(name, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"SemcommConnector: {name} must be an int >= 0, got {v!r}")
            ints[name] = v
        ttl = d.get("redis_ttl_s")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise ConfigError(f"SemcommConnector: redis_ttl_s must be a positive int, got {ttl!r}")
        codec = d.get("codec", "lossless")
        try:
            codec = get_codec(codec).spec
        except (SemcommError, ValueError) as exc:
            raise ConfigError(f"SemcommConnector: bad codec {codec!r}: {exc}") from None
        seal = d.get("seal", False)
        if not isinstance(seal, bool):
            raise ConfigError(f"SemcommConnector: seal must be true or false, got {seal!r}")
        param = d.get("tenant_param", TENANT_PARAM)
        if not isinstance(param, str) or not param:
            raise ConfigError("SemcommConnector: tenant_param must be a non-empty string")
        layerwise = _switch(d, "layerwise_load", LAYERWISE_ENV)
        streamed = _switch(d, "streamed_reads", STREAMED_ENV)
        return cls(store=tiers, chunk_size=chunk, codec=codec, seal=seal, redis_ttl_s=ttl,
                   tenant_param=param, layerwise_load=layerwise, streamed_reads=streamed,
                   **ints)


def _switch(d: Mapping[str, Any], name: str, env_name: str) -> bool:
    """A true/false setting, its default (true) taken from the environment when absent."""
    value = d.get(name)
    if value is None:
        env = os.environ.get(env_name, "").strip().lower()
        if env not in ("", "0", "1", "false", "true"):
            raise ConfigError(f"SemcommConnector: {env_name} must be 0 or 1, got {env!r}")
        value = env not in ("0", "false")
    if not isinstance(value, bool):
        raise ConfigError(f"SemcommConnector: {name} must be true or false, got {value!r}")
    return value


LAYERWISE_ENV = "SEMCOMM_VLLM_LAYERWISE_LOAD"
"""Environment default of ``layerwise_load`` when ``kv_connector_extra_config`` leaves it out
(``0``/``false`` turns it off, ``1``/``true`` or unset keeps it on); vLLM's worker processes
inherit it."""

STREAMED_ENV = "SEMCOMM_VLLM_STREAMED_READS"
"""Environment default of ``streamed_reads`` (as :data:`LAYERWISE_ENV` for its setting)."""


def _tier_kind(spec: str) -> str:
    if spec == "memory":
        return "memory"
    if spec.startswith("disk:") and len(spec) > 5:
        return "disk"
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return "redis"
    raise ConfigError(f"SemcommConnector: unknown store tier {spec!r} (use 'memory', "
                      "'disk:/path' or 'redis://host:port/db')")


def build_store(settings: ConnectorSettings, *, secret: bytes | str | None = None) -> ChunkStore:
    """The ChunkStore the settings describe (a TieredStore when they name several tiers)."""
    sealer = None
    if settings.seal:
        from ..security import ChunkSealer, TenantKeyring

        sealer = ChunkSealer(TenantKeyring(secret))
    tiers: list[Any] = []
    for spec in settings.store:
        kind = _tier_kind(spec)
        if kind == "memory":
            tiers.append(MemoryStore(capacity_bytes=settings.memory_bytes))
        elif kind == "disk":
            tiers.append(DiskStore(Path(spec[5:]).expanduser(),
                                   capacity_bytes=settings.disk_bytes, sealer=sealer))
        else:
            from ..kv import RedisStore

            tiers.append(RedisStore(spec, ttl_s=settings.redis_ttl_s, sealer=sealer))
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)


def chunk_size_for(block_size: int, requested: int | None) -> int:
    """Tokens per chunk: a multiple of vLLM's block size (chunks are whole blocks)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if requested is None:
        requested = DEFAULT_CHUNK_TOKENS or block_size
        return -(-requested // block_size) * block_size
    if requested % block_size:
        raise ConfigError(f"SemcommConnector: chunk_size {requested} is not a multiple of "
                          f"vLLM's block size {block_size}")
    return requested


# ---- namespaces -----------------------------------------------------------------------------

_SAMPLE_BYTES = 4096
_SAMPLES = 64


def model_dir_fingerprint(path: str | os.PathLike[str]) -> str:
    """Digest naming a model directory's architecture and weights (cheap for big checkpoints).

    BLAKE2b over ``config.json`` (canonical JSON), and for every ``*.safetensors`` file its
    name, size, header (tensor names, dtypes, shapes, offsets) and 64 strided 4 KiB samples.
    The same files give the same digest on any machine. A hub id that is not a local
    directory is fingerprinted by its name (the weights are not at hand).
    """
    root = Path(path).expanduser()
    h = hashlib.blake2b(digest_size=16)
    if not root.is_dir():
        h.update(f"name:{path}".encode())
        return h.hexdigest()
    cfg = root / "config.json"
    if cfg.is_file():
        h.update(json.dumps(json.loads(cfg.read_text()), sort_keys=True,
                            separators=(",", ":")).encode())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}|{size}".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) == 8:
                n = int.from_bytes(head, "little")
                h.update(fh.read(min(n, 1 << 26)))
            step = max(1, size // _SAMPLES)
            for off in range(0, size, step):
                fh.seek(off)
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def tokenizer_dir_fingerprint(path: str | os.PathLike[str] | None) -> str:
    """Digest of a tokenizer directory's files (vocabulary, rules, chat template)."""
    if path is None:
        return ""
    root = Path(path).expanduser()
    h = hashlib.blake2b(digest_size=16)
    if not root.is_dir():
        h.update(f"name:{path}".encode())
        return h.hexdigest()
    for name in _TOKENIZER_FILES:
        f = root / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def tenant_of(kv_transfer_params: Mapping[str, Any] | None, cache_salt: str | None,
              *, param: str = TENANT_PARAM) -> str | None:
    """The tenant a request names: ``kv_transfer_params[param]``, else its ``cache_salt``.

    None means public data (no tenant). Whoever sets these (the gateway, not end users) decides
    isolation: a client that can reach vLLM directly can name any tenant.
    """
    if kv_transfer_params:
        t = kv_transfer_params.get(param)
        if t is not None:
            if not isinstance(t, str) or not t:
                raise ConfigError(f"kv_transfer_params[{param!r}] must be a non-empty string")
            return t
    if cache_salt:
        return f"cache_salt:{cache_salt}"
    return None


class NamespaceFactory:
    """Namespaces of one model, KV dtype and codec; one per tenant (salted with the secret)."""

    def __init__(self, *, model: str, tokenizer: str, dtype: str, codec: str,
                 secret: bytes | str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.codec = codec
        self._secret = secret
        self._salter: Any = None
        self._cache: dict[tuple[str | None, str], NamespaceDigest] = {}

    def namespace(self, tenant: str | None, adapter: str = "") -> Namespace:
        from ..security import NO_TENANT_DIGEST, TenantSalter

        if tenant is None:
            digest = NO_TENANT_DIGEST
        else:
            if self._salter is None:
                self._salter = TenantSalter(self._secret)
            digest = self._salter.digest(tenant)
        return Namespace(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                         codec=self.codec, tenant=digest, adapter=adapter)

    def digest(self, tenant: str | None, adapter: str = "") -> NamespaceDigest:
        key = (tenant, adapter)
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) > 4096:  # bounded: tenants come and go
                self._cache.clear()
            got = self._cache[key] = self.namespace(tenant, adapter).digest
        return got


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _TORCH_DTYPE_NAMES[dtype]
    except KeyError:
        raise ConfigError(f"SemcommConnector: KV cache dtype {dtype} is not supported "
                          f"(use one of {sorted(_TORCH_DTYPE_NAMES.values())})") from None


# ---- per-request plans ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Chunks to copy from the store into a request's blocks before its forward pass."""

    req_id: str
    namespace: NamespaceDigest
    keys: tuple[ChunkKey, ...]  # chunks [first_chunk, first_chunk + len(keys)) of the prompt
    first_chunk: int
    block_ids: tuple[tuple[int, ...], ...]  # the vLLM blocks of each of those chunks
    skip_blocks: int  # leading blocks of the first chunk already valid (vLLM's own cache)
    # the last chunk holds the prompt's last token: only its first ``len(block_ids[-1])``
    # blocks are written (vLLM computes the rest)
    partial_last: bool = False


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """One full chunk of a prompt whose KV this step's forward completed."""

    namespace: NamespaceDigest
    key: ChunkKey
    parent: ChunkKey | None
    start: int  # first token position
    block_ids: tuple[int, ...]
    # the request it belongs to: not saved when that request's load failed in the same step
    # (its forward read blocks the load did not fill, so what it computed is wrong)
    req_id: str = ""


@dataclass(slots=True)
class RequestPlan:
    """Scheduler-side state of one request (its prompt's keys, what is stored, what is saved).

    Created by ``get_num_new_matched_tokens``; ``hit_chunks`` is written once there,
    ``load_tokens`` by ``update_state_after_alloc``, the rest by ``build_connector_meta``.
    """

    req_id: str
    namespace: NamespaceDigest
    keys: list[ChunkKey]  # every full chunk of the prompt
    chunk_size: int
    block_size: int
    num_prompt_tokens: int
    hit_chunks: int  # leading chunks the store holds (never the prompt's last token)
    # whole blocks of the next stored chunk (the one holding the prompt's last token) that
    # come before the last token's block: loaded too, so vLLM computes one block at most
    tail_blocks: int = 0
    load_tokens: int = 0  # tokens vLLM agreed to take from us (0: nothing to load)
    next_save: int = 0  # first chunk not yet saved or known stored
    block_ids: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, req_id: str, namespace: NamespaceDigest, token_ids: Sequence[int],
            chunk_size: int, block_size: int, store: ChunkStore) -> RequestPlan:
        keys = chunk_keys(namespace, token_ids, chunk_size, include_partial=False)
        loadable = max(0, (len(token_ids) - 1) // chunk_size)  # keep >= 1 token to compute
        stored = 0
        if keys:
            try:
                stored = store.lookup(keys).num_chunks
            except Exception as exc:  # any backend trouble is a miss, never an error
                logger.warning("semcomm KV lookup failed (%s); treating as a miss", exc)
        hit = min(stored, loadable)
        tail = 0
        if stored > hit == loadable:  # the chunk holding the last token is stored too
            tail = (len(token_ids) - 1 - hit * chunk_size) // block_size
        return cls(req_id=req_id, namespace=namespace, keys=keys, chunk_size=chunk_size,
                   block_size=block_size, num_prompt_tokens=len(token_ids),
                   hit_chunks=hit, tail_blocks=tail, next_save=stored)

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens the store can supply (whole blocks, never the last token's block)."""
        return self.hit_chunks * self.chunk_size + self.tail_blocks * self.block_size

    def matched_tokens(self, num_computed_tokens: int) -> int:
        """Tokens beyond vLLM's own prefix cache that the store can supply."""
        return max(0, self.hit_tokens - num_computed_tokens)

    def _blocks_of(self, chunk: int) -> tuple[int, ...] | None:
        per = self.chunk_size // self.block_size
        ids = self.block_ids[chunk * per : (chunk + 1) * per]
        return tuple(ids) if len(ids) == per else None

    def take_load(self) -> LoadSpec | None:
        """The load of the agreed tokens (once), or None."""
        if self.load_tokens <= 0:
            return None
        end = self.hit_tokens
        first_token = end - self.load_tokens
        first = first_token // self.chunk_size
        last = self.hit_chunks + (1 if self.tail_blocks else 0)  # chunks [first, last)
        blocks = [self._blocks_of(c) for c in range(first, self.hit_chunks)]
        if self.tail_blocks:
            per = self.chunk_size // self.block_size
            ids = self.block_ids[self.hit_chunks * per : self.hit_chunks * per + self.tail_blocks]
            blocks.append(tuple(ids) if len(ids) == self.tail_blocks else None)
        self.load_tokens = 0
        if any(b is None for b in blocks):  # vLLM allocated fewer blocks than promised
            return None
        return LoadSpec(
            req_id=self.req_id, namespace=self.namespace,
            keys=tuple(self.keys[first:last]), first_chunk=first,
            block_ids=tuple(b for b in blocks if b is not None),
            skip_blocks=(first_token - first * self.chunk_size) // self.block_size,
            partial_last=bool(self.tail_blocks),
        )

    def take_saves(self, computed_tokens: int) -> list[SaveSpec]:
        """Chunks fully computed once ``computed_tokens`` are done, not saved before."""
        out: list[SaveSpec] = []
        while self.next_save < len(self.keys):
            c = self.next_save
            if (c + 1) * self.chunk_size > computed_tokens:
                break
            blocks = self._blocks_of(c)
            if blocks is None:
                break
            out.append(SaveSpec(namespace=self.namespace, key=self.keys[c],
                                parent=self.keys[c - 1] if c else None,
                                start=c * self.chunk_size, block_ids=blocks,
                                req_id=self.req_id))
            self.next_save += 1
        return out


# ---- layouts --------------------------------------------------------------------------------

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def ordered_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Attention layers in model order (by the first integer in each layer name)."""
    def order(item: tuple[str, torch.Tensor]) -> tuple[int, str]:
        m = _LAYER_INDEX.search(item[0])
        return (int(m.group(1)) if m else -1, item[0])

    return sorted(kv_caches.items(), key=order)


KEY_LAYOUTS = ("d_bs", "bs_d")
"""How a block's keys lie in vLLM's CPU cache: ``"d_bs"`` (``[head_size, block_size]`` per block
and head: the ``vec`` attention ISA, checked against transformers' keys) or ``"bs_d"`` (token
rows). Values are always token rows."""


def _paged5(cache: torch.Tensor) -> torch.Tensor:
    """``[nb, H, bs, 2D]`` -> ``[nb, H, 2, bs, D]``: per block and head, the K region, then V."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(f"expected a [num_blocks, kv_heads, block_size, 2 * head_size] KV "
                         f"cache, got shape {tuple(cache.shape)}")
    nb, h, bs, d2 = cache.shape
    return cache.view(nb, h, 2, bs, d2 // 2)


def _check_layout(key_layout: str) -> None:
    if key_layout not in KEY_LAYOUTS:
        raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")


def gather_chunk(caches: Sequence[torch.Tensor], block_ids: Sequence[int], *,
                 key_layout: str = "d_bs") -> tuple[torch.Tensor, torch.Tensor]:
    """Copy one chunk's KV out of vLLM's paged caches: keys, values ``[L, H, T, D]``.

    One strided copy per run of consecutive blocks, per layer, for keys and for values.
    """
    _check_layout(key_layout)
    ids = list(block_ids)
    runs = _runs(ids)
    first = _paged5(caches[0])
    _, h, _, bs, d = first.shape
    m = len(ids)
    k = torch.empty((len(caches), h, m * bs, d), dtype=caches[0].dtype)
    v = torch.empty_like(k)
    for layer, cache in enumerate(caches):
        c5 = _paged5(cache)
        kk = k[layer].view(h, m, bs, d)
        vv = v[layer].view(h, m, bs, d)
        for j, b, n in runs:
            src_k = c5[b : b + n, :, 0]  # [n, H, bs, D] as stored
            if key_layout == "d_bs":  # each region holds [D, bs]
                src_k = src_k.reshape(n, h, d, bs).transpose(-1, -2)
            kk[:, j : j + n].copy_(src_k.permute(1, 0, 2, 3))
            vv[:, j : j + n].copy_(c5[b : b + n, :, 1].permute(1, 0, 2, 3))
    return k, v


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first block, length)`` of each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    for j, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            i, b0, n = runs[-1]
            runs[-1] = (i, b0, n + 1)
        else:
            runs.append((j, b, 1))
    return runs


def scatter_chunk(caches: Sequence[torch.Tensor], block_ids: Sequence[int], k: torch.Tensor,
                  v: torch.Tensor, *, skip_blocks: int = 0, key_layout: str = "d_bs") -> None:
    """Write keys/values ``[L, H, T, D]`` (``T`` = whole blocks) into vLLM's paged caches.

    The first ``skip_blocks`` blocks are left alone (vLLM's own prefix cache filled them, and
    they may be shared with running requests). Each run of consecutive blocks is one strided
    copy per layer for keys and one for values, straight from ``k``/``v`` (no staging copy).
    """
    _check_layout(key_layout)
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != len(caches):
        raise ValueError(f"chunk keys/values {tuple(k.shape)}/{tuple(v.shape)} do not match "
                         f"{len(caches)} layers")
    m = len(block_ids)
    runs = [(j + skip_blocks, b, n) for j, b, n in _runs(list(block_ids)[skip_blocks:])]
    for layer, cache in enumerate(caches):
        c5 = _paged5(cache)
        nb, h, _, bs, d = c5.shape
        if k.shape[1:] != (h, m * bs, d):
            raise ValueError(f"chunk of shape {tuple(k.shape[1:])} does not fit {m} blocks of "
                             f"[{h}, {bs}, {d}]")
        kk = k[layer].view(h, m, bs, d)
        vv = v[layer].view(h, m, bs, d)
        for j, b, n in runs:
            src_k = kk[:, j : j + n].permute(1, 0, 2, 3)  # [n, H, bs, D]
            dst_k = c5[b : b + n, :, 0]  # the K regions of blocks b..b+n-1
            if key_layout == "d_bs":  # each region holds [D, bs]
                dst_k.view(n, h, d, bs).copy_(src_k.transpose(-1, -2))
            else:
                dst_k.copy_(src_k)
            c5[b : b + n, :, 1].copy_(vv[:, j : j + n].permute(1, 0, 2, 3))


# ---- loading and saving ---------------------------------------------------------------------

_NP_OF = {"bfloat16": "<i2", "float16": "<f2", "float32": "<f4"}
_TORCH_OF = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FETCH_BATCH = 4  # chunks fetched per round trip while loading (bounds the memory held)


def _lossless_view(arrays: Mapping[str, Any], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Read-only tensor views of a lossless chunk's bytes (no copy: they are only read)."""
    import warnings

    import numpy as np

    out = []
    with warnings.catch_warnings():  # torch warns about non-writable buffers; nothing writes
        warnings.simplefilter("ignore", UserWarning)
        for name in ("k", "v"):
            a = np.asarray(arrays[name]).view(_NP_OF[dtype])
            out.append(torch.from_numpy(a).view(_TORCH_OF[dtype]))
    return out[0], out[1]


def _check_chunk_kind(h: Any, *, chunk_size: int, dtype: str, codec: Any) -> None:
    """``SemcommError`` unless header ``h`` is a chunk of ``chunk_size`` tokens of ``dtype`` in
    ``codec`` (what a load can use)."""
    if (h.num_tokens != chunk_size or h.dtype != dtype or h.codec != codec.name
            or h.codec_params.get("spec", codec.spec) != codec.spec):
        raise SemcommError(f"chunk {h.key[:16]} is {h.num_tokens} tokens of "
                           f"{h.dtype}/{h.codec}, expected {chunk_size} of "
                           f"{dtype}/{codec.spec}")


def _usable(value: bytes | memoryview, key: ChunkKey, spec: LoadSpec, *, chunk_size: int,
            dtype: str, codec: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(k, v)`` of one fetched chunk, or None (logged) when it cannot be used."""
    try:
        # stores serve only verified bytes (checksum, key; the ChunkStore contract of fetch,
        # fetch_many and get_into): no second checksum here
        chunk = decode_chunk(value, expect_key=key, expect_namespace=spec.namespace,
                             verify=False)
        _check_chunk_kind(chunk.header, chunk_size=chunk_size, dtype=dtype, codec=codec)
        if codec.name == "lossless" and set(chunk.arrays) == {"k", "v"}:
            return _lossless_view(chunk.arrays, dtype)
        kv: tuple[torch.Tensor, torch.Tensor] = codec.decode(chunk.arrays,
                                                              num_tokens=chunk_size,
                                                              dtype=dtype)
        return kv
    except Exception as exc:  # a bad chunk is a miss from here on
        logger.warning("semcomm KV chunk %s not usable (%s); recomputing", key.hex()[:16], exc)
        return None


def iter_chunks(store: ChunkStore, spec: LoadSpec, *, chunk_size: int, dtype: str,
                codec: Any, buffer: bytearray | None = None,
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Decoded ``(k, v)`` of the spec's chunks, in order, stopping at the first that fails.

    Absent, corrupt, sealed for another tenant, from another namespace, of the wrong size or
    codec, or the backend down: that chunk and everything after it is a miss (the caller
    reports those blocks so vLLM recomputes them). Never raises for store trouble. Chunks are
    fetched a few at a time and yielded one by one, so a caller that copies each into place
    before asking for the next holds a few chunks' bytes, not the whole prefix.

    ``buffer``: with a store that reads into a buffer (``store.reads_into``:
    ``DiskStore.get_into``), every chunk is read into this one, so loading allocates no fresh
    memory per chunk (page faults of new memory cost as much as the read here, docs/kv.md);
    each yielded ``(k, v)`` may then view the buffer and is valid only until the next one is
    requested. Other stores ignore it.
    """
    keys = list(spec.keys)
    if buffer is not None and store.reads_into:
        for key in keys:
            try:
                view = store.get_into(key, buffer)
            except Exception as exc:
                logger.warning("semcomm KV fetch failed (%s); recomputing", exc)
                return
            kv = None if view is None else _usable(view, key, spec, chunk_size=chunk_size,
                                                   dtype=dtype, codec=codec)
            if kv is None:
                return
            yield kv
        return
    for i in range(0, len(keys), _FETCH_BATCH):
        batch = keys[i : i + _FETCH_BATCH]
        try:
            got = store.fetch_many(batch)
        except Exception as exc:
            logger.warning("semcomm KV fetch failed (%s); recomputing", exc)
            return
        for key, fetched in zip(batch, got):
            if fetched is None:
                return
            kv = _usable(fetched.value, key, spec, chunk_size=chunk_size, dtype=dtype,
                         codec=codec)
            if kv is None:
                return
            yield kv


def spec_slice(spec: LoadSpec, j: int, k: torch.Tensor, v: torch.Tensor, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of chunk ``j`` of ``spec`` to write: all of it, or for a partial last chunk
    (the one holding the prompt's last token) the positions of its blocks in the spec."""
    if spec.partial_last and j == len(spec.keys) - 1:
        n = len(spec.block_ids[j]) * block_size
        return k[:, :, :n], v[:, :, :n]
    return k, v


def load_slot_bytes(caches: Sequence[torch.Tensor], chunk_size: int, block_size: int) -> int:
    """Bytes of one chunk's slot in a load buffer (:func:`load_into`): the chunk's KV (every
    layer's blocks of one chunk, ``[kv_heads, block_size, 2 * head_size]`` a block) plus 64 KiB
    for its header and checksum, rounded up to whole 4 KiB pages."""
    kv = sum(c[0].numel() * c.element_size() for c in caches) * (chunk_size // block_size)
    return -(-(kv + (1 << 16)) // 4096) * 4096


def load_into(store: ChunkStore, spec: LoadSpec, caches: Sequence[torch.Tensor], *,
              chunk_size: int, block_size: int, dtype: str, codec: Any,
              key_layout: str = "d_bs", buffer: bytearray | memoryview | None = None,
              slot_bytes: int = 0, times: dict[str, float] | None = None) -> int:
    """Copy the spec's chunks into vLLM's paged caches; returns how many chunks were loaded.

    A chunk that fails (absent, corrupt, another tenant's, the wrong size or codec, the
    backend down) ends the load there: it and every later chunk are a miss for the caller to
    report. With a store that reads into a buffer (``DiskStore.get_into``) and ``buffer``
    holding at least one ``slot_bytes`` slot (:func:`load_slot_bytes`), chunks are read a
    batch at a time, one per slot, and then written: consecutive full chunks whose arrays lie
    at the same place in their slots and whose blocks follow each other are one strided copy
    per layer for keys and one for values, straight from the buffer into the blocks (numpy's
    copy, which is faster than torch's for these permutations here; the bytes are the same).
    Any other chunk (the first when vLLM holds some of its blocks, the partial last one, a
    chunk another codec decoded into new memory) is written on its own (:func:`scatter_chunk`).
    Without such a store or buffer: :func:`iter_chunks` and :func:`scatter_chunk`, chunk by
    chunk. ``times`` (the batched path): seconds spent reading and checking chunks
    (``"read_s"``) and copying them into the blocks (``"write_s"``) are added to it, and the
    process's minor page faults during each (``"read_minflt"``, ``"write_minflt"``).
    """
    _check_layout(key_layout)
    view = None if buffer is None else memoryview(buffer)
    if view is not None and (view.readonly or not view.contiguous):
        raise TypeError("load_into needs a writable, contiguous buffer")
    if not store.reads_into or view is None or slot_bytes <= 0 or view.nbytes < slot_bytes:
        done = 0
        plain = buffer if isinstance(buffer, bytearray) else None
        for k, v in iter_chunks(store, spec, chunk_size=chunk_size, dtype=dtype, codec=codec,
                                buffer=plain):
            k, v = spec_slice(spec, done, k, v, block_size)
            scatter_chunk(caches, spec.block_ids[done], k, v,
                          skip_blocks=spec.skip_blocks if done == 0 else 0,
                          key_layout=key_layout)
            done += 1
        return done
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    per_batch = view.nbytes // slot_bytes
    n = len(spec.keys)
    done = 0
    clock = time.perf_counter
    for i0 in range(0, n, per_batch):
        want = min(n, i0 + per_batch) - i0
        f0 = page_faults()[0] if times is not None else 0
        t0 = clock()
        batch = read_slots(store, spec, i0, want, view, slot_bytes, chunk_size=chunk_size,
                           dtype=dtype, codec=codec)
        t1 = clock()
        f1 = page_faults()[0] if times is not None else 0
        _write_batch(caches, spec, i0, batch, view, slot_bytes, block_size, key_layout)
        if times is not None:
            f2 = page_faults()[0]
            times["read_s"] = times.get("read_s", 0.0) + t1 - t0
            times["write_s"] = times.get("write_s", 0.0) + clock() - t1
            times["read_minflt"] = times.get("read_minflt", 0) + f1 - f0
            times["write_minflt"] = times.get("write_minflt", 0) + f2 - f1
        done += len(batch)
        if len(batch) < want:
            break
    return done


def read_slots(store: ChunkStore, spec: LoadSpec, i0: int, want: int, view: memoryview,
               slot_bytes: int, *, chunk_size: int, dtype: str, codec: Any
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Read chunks ``i0 .. i0 + want`` of ``spec`` into consecutive ``slot_bytes`` slots of
    ``view`` (the store's ``get_into``: verified bytes), stopping at the first that fails
    (absent, corrupt, another tenant's, the wrong size or codec, the backend down): the
    usable ``(k, v)`` before it, which may view the slots."""
    into = store.get_into
    batch: list[tuple[torch.Tensor, torch.Tensor]] = []
    for j in range(want):
        key = spec.keys[i0 + j]
        try:
            got = into(key, view[j * slot_bytes : (j + 1) * slot_bytes])
        except Exception as exc:
            logger.warning("semcomm KV fetch failed (%s); recomputing", exc)
            got = None
        kv = None if got is None else _usable(got, key, spec, chunk_size=chunk_size,
                                               dtype=dtype, codec=codec)
        if kv is None:
            break
        batch.append(kv)
    return batch


@dataclass(slots=True)
class StreamedChunk:
    """One chunk of a streamed load (:func:`open_streamed`): its file, open for reading in
    pieces into its slot, and where each layer's keys and values lie in the file."""

    pieces: ChunkPieces
    key_at: int  # file offset of layer 0's keys; layer l's at key_at + l * layer_bytes
    value_at: int
    layer_bytes: int

    def read_layer(self, layer: int) -> None:
        """Read ``layer``'s keys and values into the slot (the same place as in the file)."""
        self.pieces.read(self.key_at + layer * self.layer_bytes, self.layer_bytes)
        self.pieces.read(self.value_at + layer * self.layer_bytes, self.layer_bytes)


def streamable(store: ChunkStore, codec: Any) -> bool:
    """Whether loads from ``store`` can be read layer by layer behind the forward
    (:func:`open_streamed`): an unsealed :class:`DiskStore` and the lossless codec."""
    return (isinstance(store, DiskStore) and store.sealer is None
            and getattr(codec, "name", None) == "lossless")


def open_streamed(store: DiskStore, spec: LoadSpec, view: memoryview, slot_bytes: int, *,
                  chunk_size: int, dtype: str, codec: Any
                  ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[StreamedChunk]]:
    """Open the spec's chunks for a streamed load: each chunk's header is read into its
    ``slot_bytes`` slot of ``view`` and checked as :func:`read_slots` checks a chunk (key,
    namespace, tokens, dtype, codec, tensors), stopping at the first that fails; nothing else
    is read yet. Returns the ``(k, v)`` views of the slots (as :func:`read_slots` does; their
    bytes arrive with :meth:`StreamedChunk.read_layer`) and the open chunks. Nothing may be
    trusted before each chunk's ``pieces.finish()`` verified it (:class:`LayerwiseLoad` does,
    and reports the blocks of a chunk that fails)."""
    batch: list[tuple[torch.Tensor, torch.Tensor]] = []
    streams: list[StreamedChunk] = []
    for j, key in enumerate(spec.keys):
        try:
            pieces = store.open_into(key, view[j * slot_bytes : (j + 1) * slot_bytes], head=0)
        except Exception as exc:
            logger.warning("semcomm KV fetch failed (%s); recomputing", exc)
            pieces = None
        if pieces is None:
            break
        try:
            h = pieces.header
            if h.key != bytes(key).hex():
                raise SemcommError(f"chunk stored under key {key.hex()[:16]} says it is "
                                   f"{h.key[:16]}")
            if h.namespace != bytes(spec.namespace).hex():
                raise SemcommError(f"chunk belongs to namespace {h.namespace[:16]}")
            if h.meta.get("sealed"):
                raise SemcommError(f"chunk {h.key[:16]} is sealed")
            _check_chunk_kind(h, chunk_size=chunk_size, dtype=dtype, codec=codec)
            arrays = tensor_arrays(h, pieces.payload_offset, pieces.view)
            if set(arrays) != {"k", "v"} or arrays["k"].shape != arrays["v"].shape \
                    or arrays["k"].ndim != 4:
                raise SemcommError(f"chunk {h.key[:16]} holds {sorted(arrays)}, not k and v "
                                   "of one [L, H, T, D] shape")
            k, v = _lossless_view(arrays, dtype)
            if k.shape[2] != chunk_size:
                raise SemcommError(f"chunk {h.key[:16]} holds {k.shape[2]} positions of "
                                   f"{dtype}, expected {chunk_size}")
        except Exception as exc:  # a bad chunk is a miss from here on
            pieces.close()
            logger.warning("semcomm KV chunk %s not usable (%s); recomputing", key.hex()[:16],
                           exc)
            break
        spec_of = {t.name: t for t in h.tensors}
        layer_bytes = spec_of["k"].nbytes // k.shape[0]
        streams.append(StreamedChunk(pieces, pieces.payload_offset + spec_of["k"].offset,
                                     pieces.payload_offset + spec_of["v"].offset, layer_bytes))
        batch.append((k, v))
    return batch, streams


def write_slots(caches: Sequence[torch.Tensor], spec: LoadSpec,
                batch: Sequence[tuple[torch.Tensor, torch.Tensor]], view: memoryview,
                slot_bytes: int, *, block_size: int, key_layout: str = "d_bs",
                layers: range | None = None) -> None:
    """Write the chunks :func:`read_slots` read from chunk 0 of ``spec`` into vLLM's blocks,
    of every layer or only of ``layers`` (a layer-by-layer load calls it once per layer)."""
    _check_layout(key_layout)
    _write_batch(caches, spec, 0, batch, view, slot_bytes, block_size, key_layout, layers)


def _write_batch(caches: Sequence[torch.Tensor], spec: LoadSpec, i0: int,
                 batch: Sequence[tuple[torch.Tensor, torch.Tensor]], view: memoryview,
                 slot_bytes: int, block_size: int, key_layout: str,
                 layers: range | None = None) -> None:
    """Write chunks ``i0 ..`` of ``spec``, read into consecutive slots of ``view`` (into the
    blocks of ``layers`` only, when given)."""
    import numpy as np

    sel = range(len(caches)) if layers is None else layers

    if not batch:
        return
    base = np.frombuffer(view, dtype=np.uint8).ctypes.data
    per = batch[0][0].shape[2] // block_size  # blocks of a full chunk
    n = len(spec.keys)

    def place(j: int) -> tuple[int, int] | None:
        """(key offset, value offset) of slot j's arrays: None when they are not in it."""
        k, v = batch[j]
        if k.shape != v.shape or not k.is_contiguous() or not v.is_contiguous():
            return None
        lo = base + j * slot_bytes
        ko, vo = k.data_ptr() - lo, v.data_ptr() - lo
        size = k.numel() * k.element_size()
        if not (0 <= ko and ko + size <= slot_bytes and 0 <= vo and vo + size <= slot_bytes):
            return None  # decoded or opened into new memory
        return ko, vo

    def blocks(j: int) -> tuple[int, tuple[int, ...]]:
        """(first block of the chunk written, vLLM blocks it goes to) of chunk i0 + j."""
        i = i0 + j
        ids = spec.block_ids[i]
        skip = spec.skip_blocks if i == 0 else 0
        if spec.partial_last and i == n - 1:  # the chunk holding the last token: its first
            return skip, tuple(ids[skip:])  # len(ids) blocks only
        return skip, tuple(ids[skip:per])

    j = 0
    while j < len(batch):
        where = place(j)
        skip, ids = blocks(j)
        if where is None or not ids or ids != tuple(range(ids[0], ids[0] + len(ids))):
            k, v = spec_slice(spec, i0 + j, *batch[j], block_size)
            scatter_chunk(caches[sel.start : sel.stop], spec.block_ids[i0 + j],
                          k[sel.start : sel.stop], v[sel.start : sel.stop], skip_blocks=skip,
                          key_layout=key_layout)
            j += 1
            continue
        g = 1  # whole chunks that follow on: the same places, the next blocks
        if skip == 0 and len(ids) == per:
            while j + g < len(batch) and place(j + g) == where and blocks(j + g) == (
                    0, tuple(range(ids[0] + g * per, ids[0] + (g + 1) * per))):
                g += 1
        _copy_group(caches, view, j * slot_bytes, slot_bytes, g, where, skip, len(ids), ids[0],
                    batch[j][0].shape, block_size, key_layout, sel)
        j += g


def _copy_group(caches: Sequence[torch.Tensor], view: memoryview, offset: int,
                slot_bytes: int, g: int, where: tuple[int, int], src_block: int, nblk: int,
                first_block: int, shape: torch.Size, block_size: int, key_layout: str,
                only: range | None = None) -> None:
    """Blocks ``src_block .. src_block + nblk`` of ``g`` chunks in consecutive slots from
    ``offset`` (keys/values ``[L, H, T, D]`` at ``where`` in each slot) into vLLM blocks
    ``first_block ..`` of every layer (of the layers in ``only``, when given): one strided
    copy per layer for keys, one for values."""
    import numpy as np

    layers, h, t, d = shape
    e = caches[0].element_size()
    itype = {2: np.int16, 4: np.int32}[e]
    ttype = {2: torch.int16, 4: torch.int32}[e]
    bs = block_size
    if len(caches) != layers or t % bs or src_block + nblk > t // bs:
        raise ValueError(f"chunk of shape {tuple(shape)} does not fit {len(caches)} layers "
                         f"of {bs}-token blocks")
    # source of each layer and kind: [G, blocks, H, bs, D] (d_bs keys read as [.., D, bs])
    src_strides = (slot_bytes, bs * d * e, t * d * e, d * e, e)
    dst_shape = (g, nblk, h, bs, d)
    sb, sh = h * bs * 2 * d * e, bs * 2 * d * e  # vLLM block and head strides, bytes
    for layer in range(len(caches)) if only is None else only:
        cache = caches[layer]
        nb, ch, cbs, d2 = cache.shape
        if (ch, cbs, d2) != (h, bs, 2 * d) or first_block + g * nblk > nb:
            raise ValueError(f"chunk of shape {tuple(shape[1:])} does not fit blocks of "
                             f"{tuple(cache.shape[1:])} from block {first_block}")
        dst = cache.view(ttype).numpy()  # [nb, H, bs, 2D] over the cache's memory
        lay = layer * h * t * d * e + src_block * bs * d * e
        for kind, src_off in enumerate(where):
            src = np.ndarray(dst_shape, dtype=itype, buffer=view,
                             offset=offset + src_off + lay, strides=src_strides)
            if kind == 0 and key_layout == "d_bs":  # each K region holds [D, bs]
                out = np.ndarray((g, nblk, h, d, bs), dtype=itype, buffer=dst,
                                 offset=first_block * sb,
                                 strides=(nblk * sb, sb, sh, bs * e, e))
                np.copyto(out, src.transpose(0, 1, 2, 4, 3))
            else:  # token rows; a block's V region follows its K region, per head
                out = np.ndarray(dst_shape, dtype=itype, buffer=dst,
                                 offset=first_block * sb + kind * bs * d * e,
                                 strides=(nblk * sb, sb, sh, d * e, e))
                np.copyto(out, src)


class LayerwiseLoad:
    """Chunks already read and verified (:func:`read_slots`), copied into vLLM's blocks on a
    thread, layer by layer in model order, while the forward pass runs.

    With ``streams`` (one list of :class:`StreamedChunk` per job, from :func:`open_streamed`)
    the chunks are not read yet either: each layer's keys and values of every chunk are read
    from their files just before that layer is copied, so neither the read nor the copy holds
    up the forward. Once every layer is written the thread reads the rest of each file and
    verifies every chunk whole (its checksum, as any read does); a chunk that fails reports
    its blocks and those of every later chunk of its request from ``join()``, and vLLM drops
    the step's output for that request and recomputes those blocks (a miss, never a wrong
    token: ``kv_load_failure_policy="recompute"``).

    ``wait(layer)`` blocks until that layer's keys and values are in place (vLLM calls
    ``wait_for_layer_load`` before each layer's attention); ``join()`` waits for the thread and
    returns the blocks to report as failed: every loaded block when a copy raised (the forward
    may have read a half-written layer; vLLM recomputes them), else none. One per step: the
    connector joins it before the step's load errors are collected and before the next load.

    Layers are claimed one at a time, in model order. With ``steal`` (the default) a ``wait``
    for a layer not written yet never just waits: it copies the unclaimed layers up to it
    itself (on the forward's thread, where one layer's copy takes a fraction of a ms), and a
    layer the thread has claimed but not finished it copies too (the same bytes to the same
    place: whichever write lands last, the block holds the same values). So the forward never
    waits for a thread the machine has descheduled (measured in ``make vllm-check`` before
    this: the thread took 47-76 ms for the 30 layers on a shared core, and the forward waited
    up to 10.6 ms for it). ``stolen`` counts the layers the forward copied.
    """

    def __init__(self, caches: Sequence[torch.Tensor],
                 jobs: Sequence[tuple[LoadSpec, memoryview, list[tuple[torch.Tensor,
                                                                       torch.Tensor]]]],
                 *, slot_bytes: int, block_size: int, key_layout: str,
                 cpus: set[int] | None = None, steal: bool = True,
                 streams: Sequence[Sequence[StreamedChunk]] | None = None) -> None:
        self._caches = list(caches)
        self._jobs = list(jobs)
        if streams is not None and (len(streams) != len(self._jobs) or any(
                len(st) != len(job[2]) for st, job in zip(streams, self._jobs))):
            raise ValueError("streams must give one StreamedChunk per chunk of every job")
        self._streams = None if streams is None else [list(st) for st in streams]
        self._unverified: set[int] = set()  # blocks of chunks that failed verification
        self.failed_requests: set[str] = set()  # requests with blocks join() reports
        self.verify_s = 0.0  # the thread's time reading the rest and verifying (streams)
        self._slot = slot_bytes
        self._bs = block_size
        self._layout = key_layout
        self._cpus = cpus
        self._steal = steal
        n = len(self._caches)
        # guarded by _cond: the next layer nobody claimed, which layers are written, and how
        # many leading layers are (every layer once a copy failed: nothing waits for the rest)
        self._next = 0
        self._written = [False] * n
        self._done = 0
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.waited_s = 0.0  # time the forward spent in wait() (its own copies included)
        self.copy_s = 0.0  # the thread's time from start to its last layer
        self.stolen = 0  # layers the forward copied itself
        self._thread = threading.Thread(target=self._run, name="semcomm-kv-load", daemon=True)
        self._thread.start()

    def _claim(self, below: int | None = None) -> int | None:
        """The next unclaimed layer (under ``_cond``), if any (and if ``< below``)."""
        limit = len(self._caches) if below is None else below
        if self.error is not None or self._next >= limit:
            return None
        layer = self._next
        self._next += 1
        return layer

    def _copy(self, layer: int) -> bool:
        """Write one layer of every job; on failure record it and release every layer."""
        try:
            one = range(layer, layer + 1)
            for i, (spec, view, batch) in enumerate(self._jobs):
                if self._streams is not None:
                    for chunk in self._streams[i]:
                        chunk.read_layer(layer)
                write_slots(self._caches, spec, batch, view, self._slot, block_size=self._bs,
                            key_layout=self._layout, layers=one)
        except BaseException as exc:  # reported as failed blocks by join()
            logger.warning("semcomm KV layer-by-layer load failed (%s); recomputing", exc)
            with self._cond:
                self.error = exc
                self._done = len(self._caches)
                self._cond.notify_all()
            return False
        with self._cond:
            self._written[layer] = True
            while self._done < len(self._written) and self._written[self._done]:
                self._done += 1
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        import time

        t0 = time.perf_counter()
        if self._cpus:
            try:  # off the cores the forward's OpenMP threads are bound to
                os.sched_setaffinity(0, self._cpus)
            except OSError:
                pass
        try:
            while True:
                with self._cond:
                    layer = self._claim()
                if layer is None or not self._copy(layer):
                    break
            if self._streams is not None:
                self._verify()
        finally:
            self.copy_s = time.perf_counter() - t0

    def _verify(self) -> None:
        """Streams: once every layer is written (some may be the forward's), read the rest of
        each chunk and verify it; record the blocks of a failed chunk and of those after it."""
        import time

        assert self._streams is not None
        with self._cond:  # a layer the forward copies itself may still be in flight
            while self.error is None and self._done < len(self._caches):
                self._cond.wait()
        t0 = time.perf_counter()
        for (spec, _view, _batch), streams in zip(self._jobs, self._streams):
            failed = None
            for j, chunk in enumerate(streams):
                if failed is not None or self.error is not None:
                    chunk.pieces.close()
                elif chunk.pieces.finish() is None:
                    failed = j
                    logger.warning("semcomm KV chunk %s failed verification after a streamed "
                                   "load; vLLM recomputes it", chunk.pieces.key.hex()[:16])
            if failed is not None:
                self.failed_requests.add(spec.req_id)
                for j in range(failed, len(streams)):
                    skip = spec.skip_blocks if j == 0 else 0
                    self._unverified.update(spec.block_ids[j][skip:])
        self.verify_s = time.perf_counter() - t0

    def wait(self, layer: int | None) -> None:
        """Until ``layer`` (an index in model order; None: every layer) is written."""
        import time

        need = len(self._caches) if layer is None or layer < 0 else min(layer + 1,
                                                                         len(self._caches))
        if self._done >= need:
            return
        t0 = time.perf_counter()
        while True:
            with self._cond:
                if self._done >= need:
                    break
                mine = self._claim(need) if self._steal else None
                if mine is None and self._steal and self.error is None:
                    # every layer up to ``layer`` is claimed: the first one not written yet
                    # is the thread's, in flight; copy it too (the same bytes into the same
                    # place, so the two writes cannot disagree) rather than wait for a thread
                    # the machine may have descheduled
                    mine = self._written.index(False, self._done, need)
                if mine is None:
                    self._cond.wait()
                    continue
            self.stolen += 1
            self._copy(mine)
        self.waited_s += time.perf_counter() - t0

    def join(self) -> set[int]:
        """Wait for the thread; the blocks to report as failed (see the class docstring)."""
        self._thread.join()
        if self.error is None:
            return set(self._unverified)
        bad: set[int] = set(self._unverified)
        for spec, _view, batch in self._jobs:
            self.failed_requests.add(spec.req_id)
            for j in range(len(batch)):
                skip = spec.skip_blocks if j == 0 else 0
                bad.update(spec.block_ids[j][skip:])
        return bad

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def load_chunks(store: ChunkStore, spec: LoadSpec, *, chunk_size: int, dtype: str,
                codec: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`iter_chunks` as a list (every usable chunk held at once)."""
    return list(iter_chunks(store, spec, chunk_size=chunk_size, dtype=dtype, codec=codec))


@dataclass(slots=True)
class _SaveJob:
    namespace: NamespaceDigest
    items: list[tuple[SaveSpec, torch.Tensor, torch.Tensor]]
    nbytes: int


class ChunkSaver:
    """Encodes chunks and writes them to the store on one background thread.

    ``submit`` returns at once (decode is never blocked by a store write); pending work is
    bounded by ``max_pending_bytes`` of KV: beyond it new saves are dropped and counted in
    ``dropped`` (a dropped save is only a future miss). Store failures are logged and counted,
    never raised. ``flush`` waits for the queue to drain; ``close`` flushes and stops.
    """

    def __init__(self, store: ChunkStore, *, codec: Any, dtype: str,
                 max_pending_bytes: int = 512 * _MIB, layers: int | None = None) -> None:
        self.store = store
        self.codec = codec
        self.dtype = dtype
        self.layers = layers
        self.max_pending_bytes = max_pending_bytes
        self.saved = self.dropped = self.failed = 0  # chunks; written by the worker thread
        self._pending = 0  # bytes queued; guarded by _lock
        self._lock = threading.Lock()
        self._queue: queue.Queue[_SaveJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="semcomm-kv-saver", daemon=True)
        self._thread.start()

    def submit(self, namespace: NamespaceDigest,
               items: Iterable[tuple[SaveSpec, torch.Tensor, torch.Tensor]]) -> bool:
        batch = list(items)
        if not batch:
            return True
        nbytes = sum(k.numel() * k.element_size() * 2 for _, k, _ in batch)
        with self._lock:
            if self._pending + nbytes > self.max_pending_bytes:
                self.dropped += len(batch)
                return False
            self._pending += nbytes
        self._queue.put(_SaveJob(namespace, batch, nbytes))
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:
                logger.exception("semcomm KV save failed")
                if job is not None:
                    self.failed += len(job.items)
            finally:
                if job is not None:
                    with self._lock:
                        self._pending -= job.nbytes
                self._queue.task_done()

    def _write(self, job: _SaveJob) -> None:
        encoded: list[tuple[ChunkKey, bytes]] = []
        for spec, k, v in job.items:
            enc = self.codec.encode(k, v)
            encoded.append((spec.key, encode_chunk(
                namespace=job.namespace, key=spec.key, parent=spec.parent,
                num_tokens=int(k.shape[2]), start=spec.start, dtype=self.dtype,
                codec=self.codec.name, codec_params={**self.codec.params, "spec": self.codec.spec},
                arrays=enc.arrays, bf16_names=enc.bf16_names,
                meta={"layers": int(k.shape[0]), "writer": "vllm"},
            )))
        try:
            self.store.put_many(encoded)
            self.saved += len(encoded)
        except Exception as exc:
            logger.warning("semcomm KV store write failed (%s); %d chunks not saved", exc,
                           len(encoded))
            self.failed += len(encoded)

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
