"""Helpers for the semantic-cache tests: a tiny deterministic embedder and a fake clock."""

from __future__ import annotations

import hashlib
import re

import numpy as np


def bow_embed(texts: list[str], dim: int = 64) -> np.ndarray:
    """Bag-of-words hashed into ``dim`` buckets: texts sharing words have high cosine."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for i, t in enumerate(texts):
        for w in re.findall(r"[a-z0-9']+", t.lower()):
            h = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little")
            out[i, h % dim] += 1.0
        if not out[i].any():
            out[i, 0] = 1.0
    return out


def unit(v: np.ndarray) -> np.ndarray:
    """``v`` scaled to unit length, as float32."""
    return (v / np.linalg.norm(v)).astype(np.float32)


def at(base: np.ndarray, other: np.ndarray, cos: float) -> np.ndarray:
    """A unit vector at cosine ``cos`` from unit ``base``, towards ``other``."""
    o = other - (other @ base) * base
    o = o / np.linalg.norm(o)
    return unit(cos * base + np.sqrt(1 - cos * cos) * o)


class Clock:
    """A settable clock for TTL tests."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


import pytest


@pytest.fixture(scope="session")
def minilm():  # type: ignore[no-untyped-def]
    """The real all-MiniLM-L6-v2 embedder (a process-wide singleton: loaded once)."""
    from semcomm.semantic import default_embedder

    emb = default_embedder()
    emb.embed(["warm up"])
    return emb
