"""The one module that touches the transformers Cache API (transformers 5.x).

Everything version-specific lives here: building a ``DynamicCache`` from tensors, reading its
per-layer keys/values, cropping (v5 takes a *negative* count), the forward call (``cache=``
replaces ``past_key_values=``; positions come from ``cache.get_seq_length()``, so the
attention mask must span cache + new tokens), and the check that a model's cache can be
restored from an arbitrary prefix (only full-attention ``DynamicLayer`` layers can).

Tensor shapes: the cache holds per layer ``[batch=1, kv_heads, seq, head_dim]`` keys (post-RoPE)
and values; the engine moves chunks as ``[layers, kv_heads, seq, head_dim]`` stacks.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from ..errors import UnsupportedModelError

__all__ = [
    "KVLayout",
    "ModelRunner",
    "cache_from_stacks",
    "cache_kwargs",
    "cache_length",
    "check_supported",
    "copy_cache",
    "crop_cache",
    "layer_tensors",
    "new_cache",
    "probe_layout",
    "stack_range",
    "stacks_of",
]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of a model's KV cache, measured once by a one-token forward."""

    num_layers: int
    kv_heads: int
    k_dim: int  # key head dim
    v_dim: int  # value head dim
    dtype: torch.dtype


def _decoder_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def check_supported(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless every layer is a full-attention layer."""
    config = _decoder_config(model.config)
    mtype = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{mtype}: encoder-decoder models are not supported (only decoder-only causal LMs)"
        )
    try:
        layer_types, _ = get_layer_types_and_kwargs(config)
    except Exception as exc:
        raise UnsupportedModelError(f"{mtype}: cannot determine its cache layer types ({exc})") from exc
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        why = {
            "sliding_attention": "sliding-window layers keep only the last window of keys, so a "
            "cached prefix cannot be restored exactly (set config.sliding_window=None if the "
            "model does not need it)",
            "chunked_attention": "chunked-attention layers keep only the current chunk",
            "linear_attention": "linear-attention/SSM layers keep a recurrent state, not per-token KV",
            "hybrid": "hybrid layers mix a recurrent state with attention",
            "conv": "convolution layers keep a recurrent state, not per-token KV",
        }
        reasons = "; ".join(f"{t}: {why.get(t, 'not a full-attention layer')}" for t in other)
        raise UnsupportedModelError(
            f"{mtype} is not supported for exact KV reuse: it has {', '.join(other)} layers "
            f"({reasons})"
        )
    sw = getattr(config, "sliding_window", None)
    if sw is not None and getattr(config, "use_sliding_window", True) and not isinstance(sw, bool):
        raise UnsupportedModelError(
            f"{mtype} uses a sliding window of {sw} tokens; a cached prefix cannot be restored "
            "exactly (set config.sliding_window=None if the model does not need it)"
        )
    if "cache" not in inspect.signature(model.forward).parameters and (
        "past_key_values" not in inspect.signature(model.forward).parameters
    ):
        raise UnsupportedModelError(f"{mtype}: its forward() takes no KV cache")


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}``, or ``{"past_key_values": cache}`` for a transformers version whose
    forward still takes that name (5.x before the rename). A wrong name is not an error there:
    ``**kwargs`` swallows it and the cache is silently ignored, so the name is inspected."""
    params = inspect.signature(model.forward).parameters
    return {("cache" if "cache" in params else "past_key_values"): cache}


def new_cache() -> DynamicCache:
    """An empty cache of plain (full-attention) dynamic layers."""
    return DynamicCache()


def cache_from_stacks(keys: torch.Tensor, values: torch.Tensor, device: torch.device) -> DynamicCache:
    """Build a cache from ``[L, H, T, D]`` stacks (one view per layer, moved to ``device``).

    The layers take the views as they are (no ``torch.cat`` with an empty tensor, which is what
    ``DynamicCache(ddp_cache_data=...)`` would do): restoring costs no copy beyond the move.
    """
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
    """Per-layer ``([1, H, T, D] keys, values)`` of a cache (views, not copies)."""
    layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


def stack_range(cache: DynamicCache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of tokens ``[start, end)`` stacked over layers: ``[L, H, end-start, D]``."""
    layers: list[Any] = list(cache.layers)
    k = torch.stack([layer.keys[0, :, start:end] for layer in layers])
    v = torch.stack([layer.values[0, :, start:end] for layer in layers])
    return k, v


class ModelRunner:
    """Calls a model's forward with a cache; the call convention is inspected once."""

    def __init__(self, model: Any):
        params = inspect.signature(model.forward).parameters
        self.model = model
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_logits = "logits_to_keep" in params

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
        mask = torch.ones((1, past + n), dtype=torch.long, device=input_ids.device)
        kw: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            self._cache_kw: cache,
            "use_cache": True,
        }
        if last_only and self._keep_logits:
            kw["logits_to_keep"] = 1
        logits = self.model(**kw).logits[0]
        return (logits[-1] if last_only else logits).float()


def probe_layout(model: Any, device: torch.device) -> KVLayout:
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
    return KVLayout(
        num_layers=len(layers),
        kv_heads=kshape[1],
        k_dim=kshape[3],
        v_dim=vshape[3],
        dtype=layers[0].keys.dtype,
    )


def copy_cache(cache: DynamicCache) -> DynamicCache:
    """An independent copy (``generate`` and our decode loop mutate caches)."""
    return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in layer_tensors(cache)])


def stacks_of(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, H, T, D]`` stacks from per-layer ``[1, H, T, D]`` tensors."""
    return torch.stack([k[0] for k, _ in layers]), torch.stack([v[0] for _, v in layers])
