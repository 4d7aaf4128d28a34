"""Keys are copied into vLLM's ``vec`` block layout (``[head_size, block_size]`` per block and
head, values as token rows after them): ``load_into`` checked block by block against the
stored arrays, with blocks vLLM already holds skipped and a partial last chunk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from semcomm.integrations._vllm_core import (
    ChunkSaver,
    LoadSpec,
    NamespaceFactory,
    SaveSpec,
    load_into,
    load_slot_bytes,
)
from semcomm.kv import DiskStore, chunk_keys, get_codec, staging_buffer


def _load(tmp_path: Path, layers: int, heads: int, bs: int, d: int, *,
          skip: int, partial: bool
          ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]],
                     list[tuple[int, ...]]]:
    cs = 4 * bs
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="bfloat16",
                          codec="lossless").digest(None)
    keys = chunk_keys(ns, list(range(3 * cs + 1)), cs, include_partial=False)
    g = torch.Generator().manual_seed(11)
    store = DiskStore(tmp_path, refresh_s=None)
    saver = ChunkSaver(store, codec=get_codec("lossless"), dtype="bfloat16")
    kv = [tuple(torch.randn(layers, heads, cs, d, generator=g).to(torch.bfloat16)
                for _ in range(2)) for _ in range(3)]
    saver.submit(ns, [(SaveSpec(ns, keys[c], keys[c - 1] if c else None, c * cs, ()),
                       *kv[c]) for c in range(3)])  # type: ignore[misc]
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
    return caches, kv, blocks  # type: ignore[return-value]


@pytest.mark.parametrize(("bs", "d", "skip", "partial"), [
    (32, 64, 0, False),  # make vllm-check's shape
    (16, 8, 1, True),   # held blocks skipped and a partial last chunk
    (4, 6, 0, True),    # sizes that are not multiples of 8
])
def test_keys_land_transposed_in_each_block_and_values_as_rows(
        tmp_path: Path, bs: int, d: int, skip: int, partial: bool) -> None:
    caches, kv, blocks = _load(tmp_path, 3, 2, bs, d, skip=skip, partial=partial)
    written = 0
    for c, chunk_blocks in enumerate(blocks):
        k, v = kv[c]
        for j, blk in enumerate(chunk_blocks):
            for layer, cache in enumerate(caches):
                # a block's memory per head: the K region ([D, bs]), then the V region
                regions = cache[blk].reshape(2, 2, bs * d)  # [H, K/V, bs * D]
                got_k = regions[:, 0].reshape(2, d, bs)
                got_v = regions[:, 1].reshape(2, bs, d)
                if c == 0 and j < skip:  # vLLM holds it: untouched
                    assert not got_k.any() and not got_v.any()
                    continue
                want_k = k[layer, :, j * bs:(j + 1) * bs]  # [H, bs, D]
                assert torch.equal(got_k, want_k.transpose(1, 2))
                assert torch.equal(got_v, v[layer, :, j * bs:(j + 1) * bs])
                written += 1
    assert written > 0
