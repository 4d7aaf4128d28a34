"""The one module that touches the transformers Cache API (transformers 5.x).

Everything version-specific lives here: the engine's own cache layers (preallocated buffers
that transformers' attention reads in place), reading and cropping them, the forward call
(``cache=`` replaces ``past_key_values=``; positions come from ``cache.get_seq_length()``), and
the check that a model's cache can be restored exactly from a stored prefix.

Which layers can be restored (``check_supported``):

* ``full_attention``: every position of the prefix, restored whole.
* ``sliding_attention`` with window ``w``: transformers masks ``kv_idx > q_idx - w``
  (``masking_utils.sliding_window_overlay``), so a query sees itself and the ``w - 1`` positions
  before it, and its ``DynamicSlidingWindowLayer`` keeps the last ``w - 1`` positions. To continue
  after a prefix of ``n`` tokens such a layer needs only positions ``[max(0, n - w + 1), n)``:
  a hit restores exactly those (``KVLayout.first_needed``).
* everything else (``chunked_attention``, ``linear_attention``, ``hybrid``, ``conv``, KV-sharing
  ``dummy`` layers, ...) keeps state that a prefix of per-token KV cannot rebuild: refused with
  :class:`UnsupportedModelError` naming the layer type.

Tensor shapes: a layer holds ``[batch=1, kv_heads, seq, head_dim]`` keys (post-RoPE) and values;
the engine moves chunks as ``[layers, kv_heads, seq, head_dim]`` stacks. Stored chunks hold every
layer's K/V for their tokens (sliding layers included), so chunk keys and the chunk format do not
depend on which positions a layer needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from ..errors import UnsupportedModelError

__all__ = [
    "BufferLayer",
    "BufferWindowLayer",
    "ChunkedRunner",
    "KVLayout",
    "ModelRunner",
    "PlacedLayer",
    "buffer_cache",
    "cache_from_layers",
    "cache_from_stacks",
    "cache_kwargs",
    "cache_layers",
    "cache_length",
    "check_supported",
    "copy_cache",
    "crop_cache",
    "layer_tensors",
    "layer_windows",
    "left_padded_batch",
    "new_cache",
    "output_cache",
    "place",
    "placed_cache",
    "probe_layout",
    "stack_range",
]

Window = int | None
"""A layer's sliding window in tokens (a query sees itself and ``window - 1`` earlier
positions), or None for a full-attention layer."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of a model's KV cache, measured once by a one-token forward."""

    num_layers: int
    kv_heads: int
    k_dim: int  # key head dim
    v_dim: int  # value head dim
    dtype: torch.dtype
    windows: tuple[Window, ...] = ()  # per layer (empty: every layer is full attention)

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    def first_needed(self, layer: int, n: int) -> int:
        """First position layer ``layer`` needs to continue after ``n`` cached tokens."""
        w = self.windows[layer] if self.windows else None
        return 0 if w is None else max(0, n - w + 1)


def _decoder_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


_REFUSED = {
    "chunked_attention": "chunked-attention layers see only the current attention chunk, whose "
    "boundaries a cached prefix does not carry",
    "linear_attention": "linear-attention/SSM layers keep a recurrent state, not per-token KV",
    "hybrid": "hybrid layers mix a recurrent state with attention",
    "hybrid_sliding": "hybrid layers mix a recurrent state with attention",
    "conv": "convolution layers keep a recurrent state, not per-token KV",
    "dummy": "layers that share another layer's KV (or keep none) are not restored per layer",
}


def layer_windows(model: Any) -> tuple[Window, ...]:
    """Per-layer sliding windows of a model (None = full attention); refuses the rest.

    Raises :class:`UnsupportedModelError` naming every layer type that cannot be restored.
    """
    config = _decoder_config(model.config)
    mtype = getattr(config, "model_type", type(model).__name__)
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    except Exception as exc:
        raise UnsupportedModelError(f"{mtype}: cannot determine its cache layer types ({exc})") from exc
    other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other:
        reasons = "; ".join(f"{t}: {_REFUSED.get(t, 'not a full or sliding-window attention layer')}"
                            for t in other)
        raise UnsupportedModelError(
            f"{mtype} is not supported for exact KV reuse: it has {', '.join(other)} layers "
            f"({reasons})"
        )
    windows: list[Window] = []
    for t, kw in zip(layer_types, layer_kwargs):
        if t == "full_attention":
            windows.append(None)
            continue
        w = kw.get("sliding_window")
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise UnsupportedModelError(
                f"{mtype}: a sliding_attention layer has no usable window ({w!r})"
            )
        windows.append(int(w))
    return tuple(windows)


def check_supported(model: Any) -> tuple[Window, ...]:
    """Raise :class:`UnsupportedModelError` unless the model's cache can be restored exactly.

    Returns the per-layer windows (see :func:`layer_windows`).
    """
    config = _decoder_config(model.config)
    mtype = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{mtype}: encoder-decoder models are not supported (only decoder-only causal LMs)"
        )
    windows = layer_windows(model)
    if "cache" not in inspect.signature(model.forward).parameters and (
        "past_key_values" not in inspect.signature(model.forward).parameters
    ):
        raise UnsupportedModelError(f"{mtype}: its forward() takes no KV cache")
    return windows


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}``, or ``{"past_key_values": cache}`` for a transformers version whose
    forward still takes that name (5.x before the rename). A wrong name is not an error there:
    ``**kwargs`` swallows it and the cache is silently ignored, so the name is inspected."""
    params = inspect.signature(model.forward).parameters
    return {("cache" if "cache" in params else "past_key_values"): cache}


class _OneSequence:
    """The engine's cache layers hold one sequence: batch and beam reshuffles are refused."""

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the engine's cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the engine's cache holds one sequence")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("the engine's cache holds one sequence")


class BufferLayer(_OneSequence, DynamicLayer):
    """A full-attention layer over a preallocated ``[1, H, capacity, D]`` buffer.

    ``update`` writes the new keys/values in place and hands attention a view of the first
    ``length`` positions: no ``torch.cat`` per step (a ``DynamicLayer`` copies its whole cache
    every step). ``keys``/``values`` are those views, as on a ``DynamicLayer``. The buffer grows
    by doubling when a caller decodes past the capacity it asked for.

    Invariant: ``buf_k[:, :, :length]`` are the keys of positions ``[0, length)``.
    """

    def __init__(self, buf_k: torch.Tensor, buf_v: torch.Tensor, length: int = 0):
        super().__init__()
        assert buf_k.shape[2] == buf_v.shape[2] >= length
        self.device = buf_k.device
        self.is_initialized = True
        self._bk, self._bv = buf_k, buf_v
        self._set_length(length)

    # positions held: [start, length); a full layer holds all of them
    @property
    def start(self) -> int:
        return 0

    @property
    def capacity(self) -> int:
        return int(self._bk.shape[2])

    def _set_length(self, n: int) -> None:
        self.length = n
        self.keys = self._bk[:, :, :n]
        self.values = self._bv[:, :, :n]

    def _reserve(self, need: int) -> None:
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        n = self.length
        bk = self._bk.new_empty((*self._bk.shape[:2], cap, self._bk.shape[3]))
        bv = self._bv.new_empty((*self._bv.shape[:2], cap, self._bv.shape[3]))
        bk[:, :, :n].copy_(self._bk[:, :, :n])
        bv[:, :, :n].copy_(self._bv[:, :, :n])
        self._bk, self._bv = bk, bv

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
        n, q = self.length, key_states.shape[-2]
        self._reserve(n + q)
        self._bk[:, :, n : n + q].copy_(key_states)
        self._bv[:, :, n : n + q].copy_(value_states)
        return n

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._append(key_states, value_states)
        self._set_length(n + key_states.shape[-2])
        return self._bk[:, :, : self.length], self._bv[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self._set_length(max(0, self.length + tokens_to_remove))

    def positions(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[H, end - start, D]`` keys and values of positions ``[start, end)`` (views)."""
        if start < self.start or end > self.length:
            raise ValueError(f"positions [{start}, {end}) not held (holds [{self.start}, "
                             f"{self.length}))")
        return self._bk[0, :, start:end], self._bv[0, :, start:end]

    def reset(self) -> None:
        self._set_length(0)

    def clone(self) -> BufferLayer:
        return BufferLayer(self._bk.clone(), self._bv.clone(), self.length)


class BufferWindowLayer(_OneSequence, DynamicSlidingWindowLayer):
    """A sliding-window layer over a preallocated buffer (window ``w``, see the module doc).

    It holds positions ``[start, length)`` at buffer index ``position - base``; attention gets
    the last ``w - 1`` held positions before the new ones, which is what
    ``DynamicSlidingWindowLayer.get_mask_sizes`` (inherited, from ``cumulative_length``)
    promises the mask. Unlike transformers' layer it keeps every position it computed since
    ``start`` (the engine stores the prompt's chunks from them); when the buffer is full it
    compacts to the last ``w - 1`` positions instead of growing.

    Invariants: ``cumulative_length == length``; ``start == 0`` or
    ``start <= length - (w - 1)`` (the window before the next query is held).
    """

    def __init__(self, sliding_window: int, buf_k: torch.Tensor, buf_v: torch.Tensor,
                 length: int = 0, start: int = 0, base: int = 0):
        super().__init__(sliding_window=sliding_window)
        assert base <= start <= length <= base + buf_k.shape[2]
        assert start == 0 or start <= length - (sliding_window - 1)
        self.device = buf_k.device
        self.is_initialized = True
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self._bk, self._bv = buf_k, buf_v
        self.start = start
        self.base = base
        self._set_length(length)

    @property
    def capacity(self) -> int:
        return int(self._bk.shape[2])

    def _set_length(self, n: int) -> None:
        self.length = self.cumulative_length = n
        a, b = self.start - self.base, n - self.base
        self.keys = self._bk[:, :, a:b]
        self.values = self._bv[:, :, a:b]

    def _reserve(self, need: int) -> None:
        if need - self.base <= self.capacity:
            return
        # keep the window the next queries need, drop older positions
        keep_from = max(self.start, self.length - (self.sliding_window - 1))
        kept = self.length - keep_from
        cap = max(self.capacity, need - keep_from)
        bk = self._bk.new_empty((*self._bk.shape[:2], cap, self._bk.shape[3]))
        bv = self._bv.new_empty((*self._bv.shape[:2], cap, self._bv.shape[3]))
        a = keep_from - self.base
        bk[:, :, :kept].copy_(self._bk[:, :, a : a + kept])
        bv[:, :, :kept].copy_(self._bv[:, :, a : a + kept])
        self._bk, self._bv = bk, bv
        self.start = self.base = keep_from

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, q = self.length, key_states.shape[-2]
        self._reserve(n + q)
        i = n - self.base
        self._bk[:, :, i : i + q].copy_(key_states)
        self._bv[:, :, i : i + q].copy_(value_states)
        self._set_length(n + q)
        # the first new query sees positions > n - w: the last w - 1 held ones
        vis = max(self.start, n - (self.sliding_window - 1)) - self.base
        return self._bk[:, :, vis : i + q], self._bv[:, :, vis : i + q]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        n = max(0, self.length + tokens_to_remove)
        if self.start and n - self.start < self.sliding_window - 1:
            raise RuntimeError(
                f"cannot crop a sliding layer holding [{self.start}, {self.length}) to {n} "
                f"tokens: the window before position {n} is not held"
            )
        self._set_length(n)

    def positions(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[H, end - start, D]`` keys and values of positions ``[start, end)`` (views)."""
        if start < self.start or end > self.length:
            raise ValueError(f"positions [{start}, {end}) not held (holds [{self.start}, "
                             f"{self.length}))")
        return (self._bk[0, :, start - self.base : end - self.base],
                self._bv[0, :, start - self.base : end - self.base])

    def reset(self) -> None:
        self.start = self.base = 0
        self._set_length(0)

    def activate_past_recording(self, **kwargs: Any) -> None:  # it always keeps what it computed
        pass

    def clone(self) -> BufferWindowLayer:
        return BufferWindowLayer(self.sliding_window, self._bk.clone(), self._bv.clone(),
                                 self.length, self.start, self.base)


class PlacedLayer(_OneSequence, DynamicLayer):
    """A layer over a ``[1, H, capacity, D]`` buffer that writes the new keys/values at given
    positions (``at``) and hands attention the first ``end`` positions: the KV of tokens
    recomputed inside a prompt whose other positions are already in the buffer (a blended
    prefill). The caller sets ``at``/``end`` before each forward (:func:`place`) and passes the
    attention mask of those ``end`` positions."""

    def __init__(self, buf_k: torch.Tensor, buf_v: torch.Tensor):
        super().__init__()
        self.device = buf_k.device
        self.is_initialized = True
        self._bk, self._bv = buf_k, buf_v
        self.at = torch.zeros(0, dtype=torch.long, device=self.device)
        self.end = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[-2] != self.at.numel():
            raise ValueError(f"{key_states.shape[-2]} new positions for {self.at.numel()} places")
        self._bk.index_copy_(2, self.at, key_states.to(self._bk.dtype))
        self._bv.index_copy_(2, self.at, value_states.to(self._bv.dtype))
        self.keys, self.values = self._bk[:, :, : self.end], self._bv[:, :, : self.end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.end, 0


def placed_cache(bk: torch.Tensor, bv: torch.Tensor) -> DynamicCache:
    """A cache of :class:`PlacedLayer` over ``[L, H, capacity, D]`` key and value buffers."""
    cache = DynamicCache()
    for i in range(bk.shape[0]):
        cache.layers.append(PlacedLayer(bk[i : i + 1], bv[i : i + 1]))
    return cache


def place(cache: DynamicCache, at: torch.Tensor, end: int) -> None:
    """The next forward of ``cache`` (from :func:`placed_cache`) writes its tokens' KV at
    positions ``at`` and attends over positions ``[0, end)``."""
    for layer in cache.layers:
        if not isinstance(layer, PlacedLayer):
            raise TypeError("place() takes a cache from placed_cache()")
        layer.at, layer.end = at, end


def new_cache() -> DynamicCache:
    """An empty cache of plain (full-attention) dynamic layers."""
    return DynamicCache()


def buffer_cache(
    layout: KVLayout, capacity: int, device: torch.device, length: int = 0,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None, holds_all: bool = False,
) -> DynamicCache:
    """A cache of :class:`BufferLayer`/:class:`BufferWindowLayer` with room for ``capacity``
    tokens, holding ``length`` tokens already.

    ``buffers``: ``[L, H, >= capacity, D]`` key and value buffers (on ``device``) whose first
    ``length`` positions hold the restored prefix (a sliding layer ``i`` need only hold
    ``[layout.first_needed(i, length), length)``, or all of them with ``holds_all``);
    default: new, empty ones.
    """
    if buffers is None:
        shape = (layout.num_layers, layout.kv_heads, capacity)
        bk = torch.empty((*shape, layout.k_dim), dtype=layout.dtype, device=device)
        bv = torch.empty((*shape, layout.v_dim), dtype=layout.dtype, device=device)
    else:
        bk, bv = buffers
    assert bk.shape[2] >= max(capacity, length)
    cache = DynamicCache()
    windows = layout.windows or (None,) * layout.num_layers
    for i, w in enumerate(windows):
        ki, vi = bk[i : i + 1], bv[i : i + 1]  # [1, H, cap, D] views of one allocation
        layer: DynamicLayer
        if w is None:
            layer = BufferLayer(ki, vi, length)
        else:
            start = 0 if holds_all else layout.first_needed(i, length)
            layer = BufferWindowLayer(w, ki, vi, length, start=start)
        cache.layers.append(layer)
    return cache


def cache_from_layers(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A plain cache holding per-layer ``([B, H, T, D]`` keys, values) (not copied)."""
    return DynamicCache(ddp_cache_data=[(k, v) for k, v in layers])


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` of any transformers cache (v5 ``cache.layers[i]``)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"expected a transformers Cache with .layers, got {type(cache).__name__}")
    return [(layer.keys, layer.values) for layer in layers]


def output_cache(out: Any) -> Any:
    """The cache of a model output (``cache`` in transformers v5, ``past_key_values`` before)."""
    if "cache" in out:
        return out["cache"]
    return out["past_key_values"]


def cache_from_stacks(keys: torch.Tensor, values: torch.Tensor, device: torch.device) -> DynamicCache:
    """Build a plain cache of full-attention layers from ``[L, H, T, D]`` stacks (one view per
    layer, moved to ``device``; no copy beyond the move)."""
    nb = keys.device.type == "cpu" and device.type == "cuda" and keys.is_pinned()
    k = keys.to(device, non_blocking=nb)
    v = values.to(device, non_blocking=nb)
    cache = DynamicCache()
    for i in range(k.shape[0]):
        layer = DynamicLayer()
        ki, vi = k[i : i + 1], v[i : i + 1]
        layer.lazy_initialization(ki, vi)
        layer.keys, layer.values = ki, vi
        cache.layers.append(layer)
    return cache


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache: DynamicCache, remove: int) -> None:
    """Drop the last ``remove`` tokens (v5 ``crop`` takes a negative count; 0 is a no-op)."""
    if remove > 0:
        cache.crop(-remove)


def layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``([1, H, T, D] keys, values)`` of a cache (views, not copies); a sliding
    layer gives the positions it holds (``layer.start`` onwards)."""
    layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


def left_padded_batch(caches: Sequence[DynamicCache], lens: Sequence[int]
                      ) -> tuple[DynamicCache, torch.Tensor]:
    """One batch cache from single-sequence caches of ``lens`` tokens, left-padded with zeros.

    Each cache's per-layer ``[1, H, n, D]`` keys/values become rows of ``[B, H, width, D]``
    (``width = max(lens)``); returns the batch cache and its ``[B, width]`` attention mask
    (0 on the padding). The caches must hold every position (no restored sliding layer).
    """
    width = max(lens)
    per_layer = [layer_tensors(c) for c in caches]
    layers = []
    for li in range(len(per_layer[0])):
        ks, vs = [], []
        for tensors, n in zip(per_layer, lens):
            k, v = tensors[li]
            assert k.shape[2] == n, "a cache that does not hold every position cannot be batched"
            if n < width:
                k = torch.cat([k.new_zeros((1, k.shape[1], width - n, k.shape[3])), k], 2)
                v = torch.cat([v.new_zeros((1, v.shape[1], width - n, v.shape[3])), v], 2)
            ks.append(k)
            vs.append(v)
        layers.append((torch.cat(ks, 0), torch.cat(vs, 0)))
    device = layers[0][0].device
    mask = torch.zeros((len(lens), width), dtype=torch.long, device=device)
    for row, n in enumerate(lens):
        mask[row, width - n:] = 1
    return DynamicCache(ddp_cache_data=layers), mask


def stack_range(cache: DynamicCache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of tokens ``[start, end)`` stacked over layers: ``[L, H, end-start, D]``.

    Raises ValueError when a layer does not hold those positions (a restored sliding layer
    holds only the window it needs).
    """
    ks, vs = [], []
    layers: list[Any] = list(cache.layers)
    for layer in layers:
        if isinstance(layer, (BufferLayer, BufferWindowLayer)):
            k, v = layer.positions(start, end)
        else:
            k, v = layer.keys[0, :, start:end], layer.values[0, :, start:end]
        ks.append(k)
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)


class ModelRunner:
    """Calls a model's forward with a cache; the call convention is inspected once."""

    def __init__(self, model: Any):
        params = inspect.signature(model.forward).parameters
        self.model = model
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_logits = "logits_to_keep" in params
        self._ones = torch.ones((1, 0), dtype=torch.long)

    def _mask(self, n: int, device: torch.device) -> torch.Tensor:
        """An all-ones ``[1, n]`` attention mask (a view of one buffer, grown as needed)."""
        if self._ones.shape[1] < n or self._ones.device != device:
            self._ones = torch.ones((1, max(n, 2 * self._ones.shape[1], 1024)), dtype=torch.long,
                                    device=device)
        return self._ones[:, :n]

    def forward(
        self, input_ids: torch.Tensor, cache: DynamicCache, *, last_only: bool = True
    ) -> torch.Tensor:
        """Run ``input_ids`` ``[1, n]`` on top of ``cache`` (mutated in place).

        Returns float32 logits of the last position ``[vocab]`` (``[n, vocab]`` when
        ``last_only`` is False). The attention mask spans cached + new tokens, as v5 requires
        (positions are derived from ``cache.get_seq_length()``).
        """
        past = cache_length(cache)
        n = input_ids.shape[1]
        kw: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": self._mask(past + n, input_ids.device),
            self._cache_kw: cache,
            "use_cache": True,
        }
        if last_only and self._keep_logits:
            kw["logits_to_keep"] = 1
        logits = self.model(**kw).logits[0]
        return (logits[-1] if last_only else logits).float()

    def base_model(self) -> Any:
        """The model without its LM head (``model.<base_model_prefix>``), or None."""
        base = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        return base if isinstance(base, torch.nn.Module) and base is not self.model else None



class ChunkedRunner:
    """A :class:`ModelRunner` whose prefills run one KV chunk at a time.

    Every piece ends at an absolute position that is a multiple of ``chunk_size``, so the
    forward that computes a chunk's KV has the same inputs and shapes whether the positions
    before it were restored from a store or computed in the same call: with a lossless codec
    the cache never changes what is computed (docs/architecture.md, invariant 2), on any CPU,
    without relying on a kernel's rounding being independent of its shapes.
    """

    def __init__(self, runner: ModelRunner, chunk_size: int) -> None:
        self.runner = runner
        self.model = runner.model  # the scheduler gates this model's decoder layers
        self.chunk_size = chunk_size

    def forward(self, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """``ModelRunner.forward`` of ``input_ids`` ``[1, n]`` piece by piece: the last
        position's float32 logits ``[vocab]``."""
        start, n = cache_length(cache), int(input_ids.shape[1])
        c = self.chunk_size
        a = 0
        logits = None
        while a < n:
            b = min(n, ((start + a) // c + 1) * c - start)
            logits = self.runner.forward(input_ids[:, a:b], cache)
            a = b
        assert logits is not None, "a prefill computes at least one token"
        return logits


def probe_layout(model: Any, device: torch.device, windows: Sequence[Window] = ()) -> KVLayout:
    """Measure the cache layout with a one-token forward (checks the layers are DynamicLayer)."""
    cache = new_cache()
    with torch.no_grad():
        ModelRunner(model).forward(torch.zeros((1, 1), dtype=torch.long, device=device), cache)
    layers: list[Any] = list(cache.layers)
    bad = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if bad:
        raise UnsupportedModelError(f"model produced cache layers {bad}; only DynamicLayer is supported")
    shapes = {(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in layers}
    if len(shapes) != 1:
        raise UnsupportedModelError(f"layers have different KV shapes {sorted(shapes)}")
    (kshape, vshape), = shapes
    if windows and len(windows) != len(layers):
        raise UnsupportedModelError(
            f"the config names {len(windows)} cache layers, the model produced {len(layers)}"
        )
    return KVLayout(
        num_layers=len(layers),
        kv_heads=kshape[1],
        k_dim=kshape[3],
        v_dim=vshape[3],
        dtype=layers[0].keys.dtype,
        windows=tuple(windows) if any(w is not None for w in windows) else (),
    )


def copy_cache(cache: DynamicCache) -> DynamicCache:
    """An independent copy (``generate`` and our decode loop mutate caches)."""
    layers: list[Any] = list(cache.layers)
    if all(isinstance(layer, (BufferLayer, BufferWindowLayer)) for layer in layers):
        out = DynamicCache()
        out.layers.extend(layer.clone() for layer in layers)
        return out
    return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in layer_tensors(cache)])
