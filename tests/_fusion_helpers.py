"""Shared setup for the fusion tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from semcomm.fusion import FusionExample

__all__ = ["WORDS", "_one_thread", "word_examples"]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models on shared cores: one intra-op thread is ~40x faster than two under load.

    Autouse in every fusion test module that imports it.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


WORDS = ["fox", "dog", "café", "東京", "river", "tower", "red", "blue"]


def word_examples(n: int = 24) -> list[FusionExample]:
    """Training examples whose answer is the context's 3rd word: learnable only by reading the
    (fused) context."""
    out = []
    for i in range(n):
        w = [WORDS[(i * 3 + k) % len(WORDS)] for k in range(4)]
        out.append(FusionExample(shared=" ".join(w), answer=f" {w[2]}"))
    return out
