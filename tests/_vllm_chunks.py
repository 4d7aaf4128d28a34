"""Random bfloat16 chunks of one prompt saved through the vLLM connector's saver, for the
connector's load tests (they run without vLLM: ``semcomm.integrations._vllm_core``)."""

from __future__ import annotations

from typing import Any

import torch

from semcomm.integrations._vllm_core import ChunkSaver, NamespaceFactory, SaveSpec
from semcomm.kv import chunk_keys, get_codec


def save_random_chunks(store: Any, n: int, *, layers: int, heads: int, chunk: int,
                       head_size: int, seed: int) -> tuple[bytes, list[Any]]:
    """``n`` chunks of ``chunk`` tokens with seeded random keys and values
    (``[layers, heads, chunk, head_size]`` each), saved into ``store``; returns the
    namespace and the prompt's chunk keys."""
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="bfloat16",
                          codec="lossless").digest(None)
    keys = chunk_keys(ns, list(range(n * chunk + 1)), chunk, include_partial=False)
    g = torch.Generator().manual_seed(seed)
    items = []
    for c in range(n):
        k, v = (torch.randn(layers, heads, chunk, head_size, generator=g).to(torch.bfloat16)
                for _ in range(2))
        items.append((SaveSpec(ns, keys[c], keys[c - 1] if c else None, c * chunk, ()), k, v))
    saver = ChunkSaver(store, codec=get_codec("lossless"), dtype="bfloat16")
    saver.submit(ns, items)  # type: ignore[arg-type]
    saver.close()
    return ns, keys
