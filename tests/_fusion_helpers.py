"""Shared setup for the fusion tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

__all__ = ["_one_thread"]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models on shared cores: one intra-op thread is ~40x faster than two under load.

    Autouse in every fusion test module that imports it.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
