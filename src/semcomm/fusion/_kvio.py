"""Moving KV tensors in and out of transformers caches, and the batched fused forward.

Everything here works on batches padded on the left (prompts) with explicit position ids,
so that padded and unpadded runs compute the same values for real tokens. Fusion is post-hoc
and per layer, as in C2C: the receiver prefills the prompt without its last token, each
layer's cache is fused, and the last prompt token is then fed through the fused cache so
that the first generated token already sees the fused context.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine import cache_from_layers, cache_kwargs, cache_layers
from ..engine import output_cache as output_cache

__all__ = [
    "KVLayers",
    "align_layers",
    "cache_kwargs",
    "cache_to_layers",
    "layers_to_cache",
    "output_cache",
    "positions_from_mask",
    "prefill_layers",
]

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: ([B, H, N, D], [B, H, N, D])


def cache_to_layers(cache: Any) -> KVLayers:
    """Per-layer (keys, values) of a transformers cache (the engine's cache adapter reads it)."""
    return cache_layers(cache)


def layers_to_cache(layers: KVLayers) -> Any:
    """A fresh cache holding ``layers`` (the tensors are not copied)."""
    return cache_from_layers(layers)


def positions_from_mask(mask: torch.Tensor, start: torch.Tensor | int = 0) -> torch.Tensor:
    """Position ids for a left-padded batch: real tokens count from ``start``; pads get 0.

    mask: [B, T] of 0/1; start: [B] or int (tokens already in the cache).
    """
    pos = mask.long().cumsum(-1) - 1
    if isinstance(start, torch.Tensor):
        pos = pos + start[:, None]
    else:
        pos = pos + start
    return pos.clamp_min(0) * mask.long()


def prefill_layers(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> KVLayers:
    """Run ``model`` on a left-padded batch and return its KV per layer (no grad)."""
    with torch.no_grad():
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions_from_mask(mask),
            use_cache=True,
            logits_to_keep=1,
        )
    return cache_to_layers(output_cache(out))


def align_layers(layers: KVLayers, weights: torch.Tensor) -> KVLayers:
    """Sharer KV gathered onto receiver tokens.

    layers: per sharer layer ([B, Hs, M, Ds], ...); weights: [B, N, M] (rows of the
    alignment matrix). Returns per sharer layer ([B, Hs, N, Ds], ...).
    """
    w = weights.to(layers[0][0].dtype)
    return [
        (torch.einsum("bnm,bhmd->bhnd", w, k), torch.einsum("bnm,bhmd->bhnd", w, v))
        for k, v in layers
    ]
