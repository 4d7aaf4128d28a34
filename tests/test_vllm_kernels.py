"""The compiled key copy into vLLM's ``vec`` block layout writes exactly numpy's bytes.

``load_into`` with the kernel and without it (``_vllm_kernels._shared`` set to False, what
``SEMCOMM_VLLM_KERNEL=0`` or a missing compiler gives) must leave identical caches, for the
8x8-tile path (block and head sizes multiples of 8) and the plain loop (other sizes), with
blocks vLLM already holds skipped and a partial last chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from semcomm.integrations import _vllm_kernels
from semcomm.integrations._vllm_core import (
    ChunkSaver,
    LoadSpec,
    NamespaceFactory,
    SaveSpec,
    load_into,
    load_slot_bytes,
)
from semcomm.kv import DiskStore, chunk_keys, get_codec, staging_buffer


@pytest.fixture
def kernel() -> Iterator[_vllm_kernels.KeysKernel]:
    k = _vllm_kernels.keys_kernel()
    if k is None:
        pytest.skip("no C compiler here: the numpy copy is the only path")
    yield k
    _vllm_kernels._shared = k


def _load(tmp_path: Path, layers: int, heads: int, bs: int, d: int, *,
          skip: int, partial: bool) -> list[torch.Tensor]:
    cs = 4 * bs
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="bfloat16",
                          codec="lossless").digest(None)
    keys = chunk_keys(ns, list(range(3 * cs + 1)), cs, include_partial=False)
    g = torch.Generator().manual_seed(11)
    store = DiskStore(tmp_path, refresh_s=None)
    saver = ChunkSaver(store, codec=get_codec("lossless"), dtype="bfloat16")
    saver.submit(ns, [(SaveSpec(ns, keys[c], keys[c - 1] if c else None, c * cs, ()),
                       *(torch.randn(layers, heads, cs, d, generator=g).to(torch.bfloat16)
                         for _ in range(2))) for c in range(3)])  # type: ignore[misc]
    saver.close()
    caches = [torch.zeros(20, heads, bs, 2 * d, dtype=torch.bfloat16) for _ in range(layers)]
    blocks = [tuple(range(2 + 4 * c, 6 + 4 * c)) for c in range(3)]
    if partial:
        blocks[-1] = blocks[-1][:2]
    spec = LoadSpec(req_id="r", namespace=ns, keys=tuple(keys[:3]), first_chunk=0,
                    block_ids=tuple(blocks), skip_blocks=skip, partial_last=partial)
    slot = load_slot_bytes(caches, cs, bs)
    n = load_into(store, spec, caches, chunk_size=cs, block_size=bs, dtype="bfloat16",
                  codec=get_codec("lossless"), buffer=staging_buffer(3 * slot),
                  slot_bytes=slot)
    assert n == 3
    return caches


@pytest.mark.parametrize(("bs", "d", "skip", "partial"), [
    (32, 64, 0, False),  # make vllm-check's shape: the 8x8-tile path
    (16, 8, 1, True),   # tiles, with held blocks skipped and a partial last chunk
    (4, 6, 0, True),    # neither a multiple of 8: the plain loop
])
def test_the_kernel_writes_what_numpy_writes(tmp_path: Path, kernel: _vllm_kernels.KeysKernel,
                                             monkeypatch: pytest.MonkeyPatch, bs: int, d: int,
                                             skip: int, partial: bool) -> None:
    calls: list[int] = []
    real = kernel.copy

    def counted(*args: object, **kw: object) -> None:
        calls.append(1)
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel, "copy", counted)
    fast = _load(tmp_path / "a", 3, 2, bs, d, skip=skip, partial=partial)
    assert calls, "the load did not use the compiled copy"
    _vllm_kernels._shared = False  # numpy's copy, as without a compiler
    slow = _load(tmp_path / "b", 3, 2, bs, d, skip=skip, partial=partial)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    assert any(bool(c.any()) for c in fast)


def test_the_kernel_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_vllm_kernels, "_shared", None)
    monkeypatch.setenv(_vllm_kernels.KERNEL_ENV, "0")
    assert _vllm_kernels.keys_kernel() is None
