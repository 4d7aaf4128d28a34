"""vLLM KV connector: the vLLM-independent logic with plain tensors, and (opt-in) real vLLM.

The fast tests need neither vLLM nor a model: they pin down the paged-layout conversion against
a reference of vLLM's CPU cache writes, the key plans, tenant selection and that every failure
to load is a miss. The end-to-end tests run vLLM itself in its own environment; they take
several minutes, so they run only when ``SEMCOMM_VLLM_PYTHON`` names that environment's python
(``make vllm-test`` sets it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from semcomm.errors import ConfigError
from semcomm.integrations._vllm_core import (
    ChunkSaver,
    ConnectorSettings,
    LayerwiseLoad,
    LoadSpec,
    NamespaceFactory,
    RequestPlan,
    build_store,
    chunk_size_for,
    gather_chunk,
    iter_chunks,
    load_chunks,
    load_into,
    load_slot_bytes,
    model_dir_fingerprint,
    open_streamed,
    ordered_layers,
    read_slots,
    scatter_chunk,
    spec_slice,
    streamable,
    tenant_of,
)
from semcomm.kv import DiskStore, MemoryStore, chunk_keys, get_codec

from ._vllm_chunks import save_random_chunks

ROOT = Path(__file__).resolve().parents[1]
SECRET = "0123456789abcdef0123456789abcdef"
L, H, BS, D = 3, 2, 4, 8  # layers, kv heads, block size, head size


# ---- a reference of vLLM's CPU paged KV cache ------------------------------------------------

def _regions(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's split of a ``[nb, H, bs, 2D]`` CPU cache (cpu_attn.py): viewed as
    ``[nb, H, 2 * bs, D]`` and chunked at ``bs``: each block and head has a K region of
    ``bs * D`` elements, then a V region of ``bs`` token rows."""
    nb, h, bs, d2 = cache.shape
    return cache.view(nb, h, 2 * bs, d2 // 2).chunk(2, dim=2)


def vllm_write(cache: torch.Tensor, slots: list[int], k: torch.Tensor, v: torch.Tensor,
               key_layout: str = "d_bs") -> None:
    """What vLLM's CPU attention stores for tokens at ``slots`` (``k``/``v`` are ``[T, H, D]``).

    With the ``vec`` ISA the K region is ``[D, bs]`` (matched against transformers' keys for
    SmolLM2 in vLLM 0.32: cosine 1.00000 this way, 0.02 read as token rows).
    """
    kr, vr = _regions(cache)
    nb, h, bs, d = kr.shape
    for t, s in enumerate(slots):
        b, off = divmod(s, bs)
        vr[b, :, off] = v[t]
        if key_layout == "d_bs":
            kr[b].reshape(h, d, bs)[:, :, off] = k[t]
        else:
            kr[b, :, off] = k[t]


def vllm_read(cache: torch.Tensor, slots: list[int], key_layout: str = "d_bs"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    kr, vr = _regions(cache)
    nb, h, bs, d = kr.shape
    if key_layout == "d_bs":
        ks = [kr[s // bs].reshape(h, d, bs)[:, :, s % bs] for s in slots]
    else:
        ks = [kr[s // bs, :, s % bs] for s in slots]
    vs = [vr[s // bs, :, s % bs] for s in slots]
    return torch.stack(ks), torch.stack(vs)  # [T, H, D]


def slots_of(blocks: list[int]) -> list[int]:
    return [b * BS + o for b in blocks for o in range(BS)]


@pytest.fixture
def caches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(10, H, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]


@pytest.mark.parametrize("layout", ["d_bs", "bs_d"])
def test_gather_reads_what_vllm_wrote(caches: list[torch.Tensor], layout: str) -> None:
    blocks = [7, 2]  # a chunk of two blocks, not in order
    g = torch.Generator().manual_seed(1)
    ks = [torch.randn(2 * BS, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    vs = [torch.randn(2 * BS, H, D, generator=g).to(torch.bfloat16) for _ in range(L)]
    for c, k, v in zip(caches, ks, vs):
        vllm_write(c, slots_of(blocks), k, v, layout)
    k, v = gather_chunk(caches, blocks, key_layout=layout)
    assert k.shape == v.shape == (L, H, 2 * BS, D)
    for layer in range(L):  # semcomm layout: [L, H, T, D], token t of the chunk at T = t
        assert torch.equal(k[layer], ks[layer].permute(1, 0, 2))
        assert torch.equal(v[layer], vs[layer].permute(1, 0, 2))


@pytest.mark.parametrize("layout", ["d_bs", "bs_d"])
def test_scatter_writes_what_vllm_reads(caches: list[torch.Tensor], layout: str) -> None:
    g = torch.Generator().manual_seed(2)
    k = torch.randn(L, H, 2 * BS, D, generator=g).to(torch.bfloat16)
    v = torch.randn(L, H, 2 * BS, D, generator=g).to(torch.bfloat16)
    before = [c.clone() for c in caches]
    scatter_chunk(caches, [3, 5], k, v, key_layout=layout)
    for layer, c in enumerate(caches):
        rk, rv = vllm_read(c, slots_of([3, 5]), layout)
        assert torch.equal(rk.permute(1, 0, 2), k[layer])
        assert torch.equal(rv.permute(1, 0, 2), v[layer])
        untouched = [b for b in range(10) if b not in (3, 5)]
        assert torch.equal(c[untouched], before[layer][untouched])


def test_scatter_skips_blocks_vllm_already_holds(caches: list[torch.Tensor]) -> None:
    k = torch.ones(L, H, 2 * BS, D, dtype=torch.bfloat16)
    before = [c.clone() for c in caches]
    scatter_chunk(caches, [3, 5], k, k, skip_blocks=1)
    for layer, c in enumerate(caches):
        assert torch.equal(c[3], before[layer][3])  # shared prefix block: left alone
        assert not torch.equal(c[5], before[layer][5])


def test_scatter_refuses_mismatched_shapes(caches: list[torch.Tensor]) -> None:
    k = torch.zeros(L, H, 3 * BS, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_chunk(caches, [1, 2], k, k)


def test_layers_are_ordered_by_index() -> None:
    t = torch.zeros(1)
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn",
             "model.layers.0.self_attn.attn"]
    assert [n for n, _ in ordered_layers(dict.fromkeys(names, t))] == [
        names[2], names[1], names[0]]


# ---- settings, namespaces, tenants ----------------------------------------------------------

@pytest.mark.parametrize(("extra", "match"), [
    ({"stroe": "memory"}, "unknown"), ({"store": "s3://bucket"}, "unknown store tier"),
    ({"store": []}, "tier spec"), ({"chunk_size": 0}, "chunk_size"),
    ({"codec": "zip"}, "codec"), ({"seal": "yes"}, "seal"), ({"disk_bytes": -1}, "disk_bytes"),
    ({"layerwise_load": "yes"}, "layerwise_load"),
])
def test_bad_settings_are_refused(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorSettings.from_extra_config(extra)


@pytest.mark.parametrize(("name", "env"), [("layerwise_load", "SEMCOMM_VLLM_LAYERWISE_LOAD"),
                                         ("streamed_reads", "SEMCOMM_VLLM_STREAMED_READS")])
def test_load_switches_and_their_environment_defaults(
        monkeypatch: pytest.MonkeyPatch, name: str, env: str) -> None:
    def setting(extra: dict[str, object]) -> object:
        return getattr(ConnectorSettings.from_extra_config(extra), name)

    monkeypatch.delenv(env, raising=False)
    assert setting({}) is True  # the default
    assert setting({name: False}) is False
    monkeypatch.setenv(env, "0")
    assert setting({}) is False
    assert setting({name: True}) is True
    monkeypatch.setenv(env, "1")
    assert setting({}) is True
    monkeypatch.setenv(env, "maybe")
    with pytest.raises(ConfigError, match=env):
        setting({})
    with pytest.raises(ConfigError, match=name):
        setting({name: "yes"})


def test_settings_and_tiered_store(tmp_path: Path) -> None:
    s = ConnectorSettings.from_extra_config({"store": ["memory", f"disk:{tmp_path}"],
                                             "codec": "int8"})
    assert s.store == ("memory", f"disk:{tmp_path}") and s.codec.startswith("int8")
    store = build_store(s)
    assert [t.name for t in store.tiers] == ["memory", "disk"]


@pytest.mark.parametrize(("block", "requested", "expect"), [
    (128, None, 128), (16, None, 16), (96, None, 96), (16, 64, 64), (128, 256, 256)])
def test_chunk_size_is_whole_blocks(block: int, requested: int | None, expect: int) -> None:
    assert chunk_size_for(block, requested) == expect


def test_chunk_size_must_be_whole_blocks() -> None:
    with pytest.raises(ConfigError, match="multiple"):
        chunk_size_for(128, 200)


@pytest.mark.parametrize(("params", "salt", "expect"), [
    ({"semcomm_tenant": "acme"}, "x", "acme"), (None, "s1", "cache_salt:s1"),
    ({}, None, None), ({"other": 1}, None, None),
])
def test_tenant_selection(params: dict[str, object] | None, salt: str | None,
                          expect: str | None) -> None:
    assert tenant_of(params, salt) == expect


def test_tenant_must_be_a_string() -> None:
    with pytest.raises(ConfigError):
        tenant_of({"semcomm_tenant": 7}, None)


def test_namespaces_differ_per_tenant_and_are_stable() -> None:
    f = NamespaceFactory(model="m", tokenizer="t", dtype="bfloat16", codec="lossless",
                         secret=SECRET)
    g = NamespaceFactory(model="m", tokenizer="t", dtype="bfloat16", codec="lossless",
                         secret=SECRET)
    assert f.digest("acme") == g.digest("acme")  # another process, same secret
    assert len({f.digest("acme"), f.digest("globex"), f.digest(None)}) == 3
    assert f.digest("acme", "lora:x") != f.digest("acme")
    other_secret = NamespaceFactory(model="m", tokenizer="t", dtype="bfloat16",
                                    codec="lossless", secret="f" * 32)
    assert other_secret.digest("acme") != f.digest("acme")
    assert other_secret.digest(None) == f.digest(None)  # public data needs no secret


def test_model_dir_fingerprint_follows_the_files(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 8, "a": 1}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    blob = len(header).to_bytes(8, "little") + header + np.arange(4, dtype="<f4").tobytes()
    (d / "model.safetensors").write_bytes(blob)
    a = model_dir_fingerprint(d)
    (d / "config.json").write_text(json.dumps({"a": 1, "hidden_size": 8}))  # same JSON
    assert model_dir_fingerprint(d) == a
    (d / "model.safetensors").write_bytes(blob[:-4] + np.float32(9).tobytes())
    assert model_dir_fingerprint(d) != a


# ---- plans ----------------------------------------------------------------------------------

CS = 2 * BS  # chunk: two blocks


def stored_chain(store: MemoryStore, ns: bytes, tokens: list[int], n: int) -> None:
    codec = get_codec("lossless")
    saver = ChunkSaver(store, codec=codec, dtype="float32")
    keys = chunk_keys(ns, tokens, CS, include_partial=False)
    from semcomm.integrations._vllm_core import SaveSpec

    items = []
    for c in range(n):
        k = torch.full((L, H, CS, D), float(c))
        items.append((SaveSpec(ns, keys[c], keys[c - 1] if c else None, c * CS, ()), k, -k))
    saver.submit(ns, items)  # type: ignore[arg-type]
    saver.flush()
    saver.close()


def test_plan_matches_stored_chunks_and_keeps_the_last_token() -> None:
    store = MemoryStore()
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="float32", codec="lossless").digest(None)
    tokens = list(range(3 * CS))  # exactly three chunks
    stored_chain(store, ns, tokens, 3)
    plan = RequestPlan.new("r", ns, tokens, CS, BS, store)
    assert plan.hit_chunks == 2  # the third holds the last token ...
    assert plan.tail_blocks == 1  # ... so only its first block is loaded, vLLM computes one
    assert plan.matched_tokens(0) == 2 * CS + BS == len(tokens) - BS
    assert plan.matched_tokens(BS) == 2 * CS  # vLLM's own cache holds one block
    assert plan.matched_tokens(2 * CS + BS) == 0
    # a prompt ending inside the third chunk's first block: nothing of that chunk is loaded
    short = tokens[: 2 * CS + 2]
    p2 = RequestPlan.new("s", ns, short, CS, BS, store)
    assert p2.hit_chunks == 2 and p2.tail_blocks == 0 and p2.matched_tokens(0) == 2 * CS
    # a prompt whose last chunk is partial: that chunk has no key, nothing of it is loaded
    p3 = RequestPlan.new("p", ns, tokens + [1], CS, BS, store)
    assert (p3.hit_chunks, p3.tail_blocks) == (3, 0) and p3.matched_tokens(0) == 3 * CS


def _saved_from_blocks(tmp_path: Path, caches: list[torch.Tensor], tokens: list[int]
                       ) -> tuple[bytes, RequestPlan]:
    """Save the first two chunks of ``tokens`` from blocks 4, 1, 8, 6 of ``caches`` to disk."""
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="bfloat16", codec="lossless").digest(None)
    plan = RequestPlan.new("w", ns, tokens, CS, BS, DiskStore(tmp_path))
    plan.block_ids = [4, 1, 8, 6]
    saver = ChunkSaver(DiskStore(tmp_path), codec=get_codec("lossless"), dtype="bfloat16")
    saver.submit(ns, [(s, *gather_chunk(caches, s.block_ids)) for s in plan.take_saves(2 * CS)])
    saver.close()
    return ns, plan


def test_the_last_chunk_is_loaded_up_to_the_last_tokens_block(tmp_path: Path,
                                                              caches: list[torch.Tensor]) -> None:
    tokens = list(range(2 * CS))  # two chunks; the last token sits in chunk 2's second block
    ns, _ = _saved_from_blocks(tmp_path, caches, tokens)
    codec = get_codec("lossless")
    plan = RequestPlan.new("r", ns, tokens, CS, BS, DiskStore(tmp_path))
    assert (plan.hit_chunks, plan.tail_blocks) == (1, 1)
    plan.load_tokens = plan.matched_tokens(0)
    plan.block_ids = [0, 2, 3, 9]
    spec = plan.take_load()
    assert spec is not None and spec.partial_last and spec.block_ids == ((0, 2), (3,))
    fresh = [torch.zeros_like(c) for c in caches]
    got = load_chunks(DiskStore(tmp_path), spec, chunk_size=CS, dtype="bfloat16", codec=codec)
    for j, (blocks, (k, v)) in enumerate(zip(spec.block_ids, got)):
        scatter_chunk(fresh, blocks, *spec_slice(spec, j, k, v, BS))
    for c, f in zip(caches, fresh):
        assert torch.equal(f[[0, 2, 3]], c[[4, 1, 8]])  # every block before the last token's
        assert not f[9].any()  # the last token's block is left for vLLM to compute


def test_plan_load_and_saves(caches: list[torch.Tensor]) -> None:
    store = MemoryStore()
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="float32", codec="lossless").digest(None)
    tokens = list(range(4 * CS + 3))
    stored_chain(store, ns, tokens, 2)
    plan = RequestPlan.new("r", ns, tokens, CS, BS, store)
    assert plan.hit_chunks == 2 and plan.next_save == 2
    plan.load_tokens = plan.matched_tokens(BS)  # one block from vLLM's own prefix cache
    plan.block_ids = list(range(9))
    load = plan.take_load()
    assert load is not None and load.first_chunk == 0 and load.skip_blocks == 1
    assert load.block_ids == ((0, 1), (2, 3)) and plan.take_load() is None
    # chunked prefill: saves follow the computed tokens, each chunk once
    assert plan.take_saves(3 * CS - 1) == []
    saves = plan.take_saves(3 * CS)
    assert [s.start for s in saves] == [2 * CS] and saves[0].parent == plan.keys[1]
    assert [s.block_ids for s in plan.take_saves(len(tokens))] == [(6, 7)]
    assert plan.take_saves(len(tokens)) == []


def test_tenants_never_see_each_others_chunks() -> None:
    store = MemoryStore()
    f = NamespaceFactory(model="m", tokenizer="t", dtype="float32", codec="lossless",
                         secret=SECRET)
    tokens = list(range(3 * CS + 1))
    stored_chain(store, f.digest("acme"), tokens, 3)
    assert RequestPlan.new("a", f.digest("acme"), tokens, CS, BS, store).hit_chunks == 3
    assert RequestPlan.new("g", f.digest("globex"), tokens, CS, BS, store).hit_chunks == 0
    assert RequestPlan.new("p", f.digest(None), tokens, CS, BS, store).hit_chunks == 0


# ---- loads: every failure is a miss ---------------------------------------------------------

def _spec(ns: bytes, tokens: list[int], n: int) -> LoadSpec:
    keys = chunk_keys(ns, tokens, CS, include_partial=False)[:n]
    return LoadSpec("r", ns, tuple(keys), 0, tuple((2 * c, 2 * c + 1) for c in range(n)), 0)


def test_load_round_trip_is_exact_in_bf16(tmp_path: Path, caches: list[torch.Tensor]) -> None:
    """One 'process' saves from its caches, another loads into fresh caches: equal bits."""
    ns, plan = _saved_from_blocks(tmp_path, caches, list(range(2 * CS + 1)))
    codec = get_codec("lossless")
    fresh = [torch.zeros_like(c) for c in caches]
    spec = LoadSpec("r2", ns, tuple(plan.keys[:2]), 0, ((0, 2), (3, 9)), 0)
    got = load_chunks(DiskStore(tmp_path), spec, chunk_size=CS, dtype="bfloat16", codec=codec)
    assert len(got) == 2
    for blocks, (k, v) in zip(spec.block_ids, got):
        scatter_chunk(fresh, blocks, k, v)
    for c, f in zip(caches, fresh):
        assert torch.equal(f[[0, 2, 3, 9]], c[[4, 1, 8, 6]])


def _three_chunks_on_disk(tmp_path: Path) -> tuple[bytes, list[int], MemoryStore, DiskStore, list[Any]]:
    """Three stored chunks of one prompt, in a memory store and copied to a disk store."""
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="float32", codec="lossless").digest(None)
    tokens = list(range(3 * CS + 1))
    mem = MemoryStore()
    stored_chain(mem, ns, tokens, 3)
    disk = DiskStore(tmp_path)
    keys = chunk_keys(ns, tokens, CS, include_partial=False)
    for k in keys:
        disk.put(k, mem.get(k))  # type: ignore[arg-type]
    return ns, tokens, mem, disk, keys


def test_load_stops_at_a_tampered_chunk(tmp_path: Path) -> None:
    ns, tokens, mem, disk, keys = _three_chunks_on_disk(tmp_path)
    f = tmp_path / keys[1].hex()[:2] / f"{keys[1].hex()}.sckv"
    raw = bytearray(f.read_bytes())
    raw[-100] ^= 1
    f.write_bytes(bytes(raw))
    got = load_chunks(disk, _spec(ns, tokens, 3), chunk_size=CS, dtype="float32",
                      codec=get_codec("lossless"))
    assert len(got) == 1 and torch.equal(got[0][0], torch.zeros(L, H, CS, D))


def test_load_from_a_store_of_ones_own_stops_at_a_tampered_chunk(tmp_path: Path) -> None:
    """A store whose get does not verify (ChunkStoreBase's fetch checks it): the connector's
    loads, plain and buffered, stop at the altered chunk as with a DiskStore."""
    from ._kvchunks import DictStore, tampered

    ns, tokens, mem, _, keys = _three_chunks_on_disk(tmp_path)
    mine = DictStore()
    for k in keys:
        mine.put(k, mem.get(k))  # type: ignore[arg-type]
    mine.data[keys[1]] = tampered(mine.data[keys[1]], at=-100)
    codec = get_codec("lossless")
    got = load_chunks(mine, _spec(ns, tokens, 3), chunk_size=CS, dtype="float32", codec=codec)
    assert len(got) == 1 and torch.equal(got[0][0], torch.zeros(L, H, CS, D))
    mine.data[keys[1]] = tampered(mem.get(keys[1]) or b"", at=-100)  # dropped by that read
    buf = bytearray(len(mem.get(keys[2]) or b"") + 4096)
    n = sum(1 for _ in iter_chunks(mine, _spec(ns, tokens, 3), chunk_size=CS, dtype="float32",
                                   codec=codec, buffer=buf))
    assert n == 1


def test_buffered_load_reads_into_one_buffer_and_stops_at_tampering(tmp_path: Path) -> None:
    ns, tokens, mem, disk, keys = _three_chunks_on_disk(tmp_path)
    codec = get_codec("lossless")
    want = load_chunks(disk, _spec(ns, tokens, 3), chunk_size=CS, dtype="float32", codec=codec)
    buf = bytearray(len(mem.get(keys[2]) or b"") + 4096)
    lo, hi = _address(buf), _address(buf) + len(buf)
    got = []
    for k, v in iter_chunks(disk, _spec(ns, tokens, 3), chunk_size=CS, dtype="float32",
                            codec=codec, buffer=buf):
        assert lo <= k.data_ptr() < hi and lo <= v.data_ptr() < hi  # views of the buffer
        got.append((k.clone(), v.clone()))  # valid until the next chunk is read
    assert len(got) == 3
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want))
    f = tmp_path / keys[1].hex()[:2] / f"{keys[1].hex()}.sckv"
    raw = bytearray(f.read_bytes())
    raw[-100] ^= 1
    f.write_bytes(bytes(raw))
    n = sum(1 for _ in iter_chunks(disk, _spec(ns, tokens, 3), chunk_size=CS, dtype="float32",
                                   codec=codec, buffer=buf))
    assert n == 1


def _address(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _six_random_chunks(store: Any) -> tuple[bytes, list[Any]]:
    """Six bf16 chunks of one prompt with random keys and values, saved through the saver."""
    return save_random_chunks(store, 6, layers=L, heads=H, chunk=CS, head_size=D, seed=7)


def _reference_load(store: Any, spec: LoadSpec, caches: list[torch.Tensor], layout: str) -> int:
    """The chunk-by-chunk path: iter_chunks, then scatter_chunk of each."""
    done = 0
    for k, v in iter_chunks(store, spec, chunk_size=CS, dtype="bfloat16",
                            codec=get_codec("lossless")):
        scatter_chunk(caches, spec.block_ids[done], *spec_slice(spec, done, k, v, BS),
                      skip_blocks=spec.skip_blocks if done == 0 else 0, key_layout=layout)
        done += 1
    return done


_BLOCKS = {  # the blocks of six two-block chunks in a 40-block cache
    "consecutive": tuple((3 + 2 * c, 4 + 2 * c) for c in range(6)),
    "scattered": ((30, 31), (5, 6), (7, 8), (20, 2), (9, 10), (11, 12)),
}


def _six_loaded_by_reference(store: Any, blocks: str, skip: int, partial: bool, layout: str
                             ) -> tuple[LoadSpec, list[torch.Tensor], list[torch.Tensor]]:
    """Six random chunks saved in ``store``, a spec loading them into ``_BLOCKS[blocks]``
    (the last chunk's first block only when ``partial``), the caches the chunk-by-chunk path
    fills from them (``want``) and empty ones of the same shape (``got``)."""
    ns, keys = _six_random_chunks(store)
    ids = _BLOCKS[blocks][:5] + ((_BLOCKS[blocks][5][:1],) if partial else _BLOCKS[blocks][5:])
    spec = LoadSpec("r", ns, tuple(keys), 0, ids, skip, partial_last=partial)
    want = [torch.zeros(40, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    assert _reference_load(store, spec, want, layout) == 6
    return spec, want, [torch.zeros_like(c) for c in want]


@pytest.mark.parametrize("layout", ["d_bs", "bs_d"])
@pytest.mark.parametrize(("blocks", "skip", "partial", "slots", "sealed"), [
    ("consecutive", 0, False, 4, False),  # two batches (4 + 2 chunks), whole groups
    ("consecutive", 1, True, 3, False),  # vLLM holds block 1; the last chunk's first block only
    ("scattered", 0, False, 6, False),  # groups broken where the blocks jump
    ("consecutive", 0, False, 1, False),  # a buffer of one slot
    ("consecutive", 1, True, 4, True),  # sealed: plaintext in new memory, chunk by chunk
])
def test_load_into_writes_what_chunk_by_chunk_loading_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, blocks: str, skip: int,
        partial: bool, slots: int, sealed: bool) -> None:
    from semcomm.integrations import _vllm_core
    from semcomm.security import ChunkSealer, TenantKeyring

    sealer = ChunkSealer(TenantKeyring(SECRET)) if sealed else None
    store = DiskStore(tmp_path, sealer=sealer)
    spec, want, got = _six_loaded_by_reference(store, blocks, skip, partial, layout)
    copies = []
    real = _vllm_core._copy_group
    monkeypatch.setattr(_vllm_core, "_copy_group",
                        lambda *a, **kw: (copies.append(a[4]), real(*a, **kw)))
    slot = load_slot_bytes(got, CS, BS)
    n = load_into(store, spec, got, chunk_size=CS, block_size=BS, dtype="bfloat16",
                  codec=get_codec("lossless"), key_layout=layout,
                  buffer=bytearray(slots * slot), slot_bytes=slot)
    assert n == 6
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if sealed:
        assert copies == []  # nothing lies in the buffer: every chunk on its own
    else:  # every chunk from the buffer (one whose own blocks jump: on its own) ...
        assert sum(copies) == (5 if blocks == "scattered" else 6)
        if blocks == "consecutive" and slots > 1:
            assert len(copies) < 6  # ... several in one copy per layer


def _flip_a_byte(root: Path, key: bytes) -> None:
    """Flip one bit in the middle of ``key``'s chunk file in the DiskStore at ``root``."""
    f = root / key.hex()[:2] / f"{key.hex()}.sckv"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 1
    f.write_bytes(bytes(raw))


def _six_chunks_one_tampered(root: Path, at: int) -> tuple[Any, LoadSpec, list[torch.Tensor],
                                                            int]:
    """Six saved chunks in a DiskStore at ``root`` with chunk ``at`` tampered: the store, a
    spec loading all six into consecutive blocks, empty caches for them and the slot size."""
    store = DiskStore(root)
    ns, keys = _six_random_chunks(store)
    _flip_a_byte(root, keys[at])
    spec = LoadSpec("r", ns, tuple(keys), 0, _BLOCKS["consecutive"], 0)
    got = [torch.zeros(40, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    return store, spec, got, load_slot_bytes(got, CS, BS)


def test_load_into_stops_at_a_tampered_chunk_and_leaves_the_rest(tmp_path: Path) -> None:
    store, spec, got, slot = _six_chunks_one_tampered(tmp_path, 3)
    n = load_into(store, spec, got, chunk_size=CS, block_size=BS, dtype="bfloat16",
                  codec=get_codec("lossless"), buffer=bytearray(6 * slot), slot_bytes=slot)
    assert n == 3
    for c in got:
        assert c[3:9].any() and not c[9:].any()  # chunks 0-2 written, nothing from 3 on


def _read_all_six(store: Any, spec: LoadSpec, layout: str
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], int, memoryview, Any]:
    """The batched load of ``spec`` (``want``), empty caches of its shape (``got``), and all six
    chunks read into a buffer for a layer-by-layer load: ``(want, got, slot, view, batch)``."""
    want = [torch.zeros(40, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    assert _reference_load(store, spec, want, layout) == 6
    got = [torch.zeros_like(c) for c in want]
    slot = load_slot_bytes(got, CS, BS)
    view = memoryview(bytearray(6 * slot))
    batch = read_slots(store, spec, 0, 6, view, slot, chunk_size=CS, dtype="bfloat16",
                       codec=get_codec("lossless"))
    return want, got, slot, view, batch


@pytest.mark.parametrize("layout", ["d_bs", "bs_d"])
@pytest.mark.parametrize(("blocks", "skip", "partial"), [
    ("consecutive", 0, False), ("consecutive", 1, True), ("scattered", 0, False)])
def test_layerwise_load_writes_each_layer_as_the_batched_load(
        tmp_path: Path, layout: str, blocks: str, skip: int, partial: bool) -> None:
    store = DiskStore(tmp_path)
    ns, keys = _six_random_chunks(store)
    ids = _BLOCKS[blocks][:5] + ((_BLOCKS[blocks][5][:1],) if partial else _BLOCKS[blocks][5:])
    spec = LoadSpec("r", ns, tuple(keys), 0, ids, skip, partial_last=partial)
    want, got, slot, view, batch = _read_all_six(store, spec, layout)
    assert len(batch) == 6
    load = LayerwiseLoad(got, [(spec, view, batch)], slot_bytes=slot, block_size=BS,
                         key_layout=layout)
    load.wait(0)  # layer 0 is in place once wait returns, whatever the thread does next
    assert torch.equal(got[0], want[0])
    load.wait(None)
    assert load.join() == set() and not load.alive
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_layerwise_load_runs_in_layer_order_and_reports_a_failed_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from semcomm.integrations import _vllm_core

    store = DiskStore(tmp_path)
    ns, keys = _six_random_chunks(store)
    spec = LoadSpec("r", ns, tuple(keys), 0, _BLOCKS["consecutive"], 0)
    _, got, slot, view, batch = _read_all_six(store, spec, "d_bs")
    order: list[int] = []
    real = _vllm_core.write_slots

    def flaky(*a: Any, layers: range, **kw: Any) -> None:
        order.append(layers.start)
        if layers.start == 1:
            raise MemoryError("layer 1")
        real(*a, layers=layers, **kw)

    monkeypatch.setattr(_vllm_core, "write_slots", flaky)
    load = LayerwiseLoad(got, [(spec, view, batch)], slot_bytes=slot, block_size=BS,
                         key_layout="d_bs", steal=False)  # every layer on the thread
    load.wait(L - 1)  # never hangs: a failed copy releases every layer
    bad = load.join()
    assert order == [0, 1]  # layer order; nothing after the failure
    assert bad == {b for ids in _BLOCKS["consecutive"] for b in ids}  # all of it recomputed
    assert load.failed_requests == {"r"}  # and nothing its step computed is saved
    assert got[0].any() and not got[2].any()


def test_a_waiting_forward_copies_the_layers_the_thread_has_not_reached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from semcomm.integrations import _vllm_core

    store = DiskStore(tmp_path)
    ns, keys = _six_random_chunks(store)
    spec = LoadSpec("r", ns, tuple(keys), 0, _BLOCKS["consecutive"], 0)
    want, got, slot, view, batch = _read_all_six(store, spec, "d_bs")
    stalled, release = threading.Event(), threading.Event()
    copied_by: dict[int, str] = {}
    real = _vllm_core.write_slots

    def slow_thread(*a: Any, layers: range, **kw: Any) -> None:
        name = threading.current_thread().name
        copied_by[layers.start] = name
        if name == "semcomm-kv-load":  # the copy thread stalls in its first layer
            stalled.set()
            assert release.wait(10)
        real(*a, layers=layers, **kw)

    monkeypatch.setattr(_vllm_core, "write_slots", slow_thread)
    load = LayerwiseLoad(got, [(spec, view, batch)], slot_bytes=slot, block_size=BS,
                         key_layout="d_bs")
    assert stalled.wait(10)  # the thread holds layer 0 and is stuck in it
    # the forward needs every layer: it copies layers 1.. (unclaimed) and layer 0 (the
    # thread's, in flight) itself, and returns while the thread is still stuck
    load.wait(L - 1)
    assert load.stolen == L and all(load._written) and load.alive
    assert copied_by[0] == "MainThread" and all(copied_by[i] == "MainThread"
                                                for i in range(1, L))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    release.set()  # the thread's own write of layer 0: the same bytes
    assert load.join() == set() and not load.alive
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the same bytes as one load


def test_layerwise_read_stops_at_a_tampered_chunk(tmp_path: Path) -> None:
    store, spec, got, slot = _six_chunks_one_tampered(tmp_path, 2)
    batch = read_slots(store, spec, 0, 6, memoryview(bytearray(6 * slot)), slot,
                       chunk_size=CS, dtype="bfloat16", codec=get_codec("lossless"))
    assert len(batch) == 2  # known before the forward starts: the rest is a miss


def _open_six(store: Any, spec: LoadSpec, slot: int) -> tuple[memoryview, Any, Any]:
    """The spec's chunks opened for a streamed load: ``(view, batch, streams)``."""
    view = memoryview(bytearray(len(spec.keys) * slot))
    batch, streams = open_streamed(store, spec, view, slot, chunk_size=CS, dtype="bfloat16",
                                   codec=get_codec("lossless"))
    return view, batch, streams


@pytest.mark.parametrize("layout", ["d_bs", "bs_d"])
@pytest.mark.parametrize(("blocks", "skip", "partial", "steal"), [
    ("consecutive", 0, False, True), ("consecutive", 1, True, True),
    ("scattered", 0, False, True), ("consecutive", 0, False, False)])
def test_streamed_load_reads_each_layer_behind_the_forward_and_writes_the_batched_load(
        tmp_path: Path, layout: str, blocks: str, skip: int, partial: bool,
        steal: bool) -> None:
    store = DiskStore(tmp_path)
    spec, want, got = _six_loaded_by_reference(store, blocks, skip, partial, layout)
    slot = load_slot_bytes(got, CS, BS)
    view, batch, streams = _open_six(store, spec, slot)
    assert len(batch) == len(streams) == 6
    assert not any(k.any() or v.any() for k, v in batch)  # headers only: no KV read yet
    load = LayerwiseLoad(got, [(spec, view, batch)], slot_bytes=slot, block_size=BS,
                         key_layout=layout, steal=steal, streams=[streams])
    load.wait(0)  # layer 0 read and in place once wait returns
    assert torch.equal(got[0], want[0])
    load.wait(None)
    assert load.join() == set() and not load.alive and load.failed_requests == set()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(s.pieces.finish() is not None for s in streams)  # every chunk verified whole
    assert store.stats().hits == 12 and store.stats().corrupt == 0


@pytest.mark.parametrize("steal", [True, False])
@pytest.mark.parametrize("where", ["middle", "checksum"])
def test_streamed_load_reports_a_chunk_that_fails_verification(
        tmp_path: Path, steal: bool, where: str) -> None:
    store = DiskStore(tmp_path)
    ns, keys = _six_random_chunks(store)
    if where == "middle":
        _flip_a_byte(tmp_path, keys[3])
    else:  # a byte the layers never read: only the whole-chunk check sees it
        f = tmp_path / keys[3].hex()[:2] / f"{keys[3].hex()}.sckv"
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 1
        f.write_bytes(bytes(raw))
    spec = LoadSpec("r", ns, tuple(keys), 0, _BLOCKS["consecutive"], 0)
    got = [torch.zeros(40, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    slot = load_slot_bytes(got, CS, BS)
    view, batch, streams = _open_six(store, spec, slot)
    assert len(batch) == 6  # the headers parse: the damage shows only when verified
    load = LayerwiseLoad(got, [(spec, view, batch)], slot_bytes=slot, block_size=BS,
                         key_layout="d_bs", steal=steal, streams=[streams])
    load.wait(None)
    bad = load.join()
    # chunk 3 and everything after it: vLLM drops the step and recomputes from there, and the
    # connector saves nothing this step computed for the request
    assert bad == {b for ids in _BLOCKS["consecutive"][3:] for b in ids}
    assert load.failed_requests == {"r"}
    assert store.stats().corrupt == 1 and not store.contains(keys[3])
    assert all(store.contains(k) for k in keys[:3] + keys[4:])


def test_streamed_open_stops_where_a_chunk_cannot_be_used(tmp_path: Path) -> None:
    from semcomm.security import ChunkSealer, TenantKeyring

    store = DiskStore(tmp_path / "plain")
    ns, keys = _six_random_chunks(store)
    (tmp_path / "plain" / keys[2].hex()[:2] / f"{keys[2].hex()}.sckv").unlink()
    spec = LoadSpec("r", ns, tuple(keys), 0, _BLOCKS["consecutive"], 0)
    got = [torch.zeros(40, H, BS, 2 * D, dtype=torch.bfloat16) for _ in range(L)]
    slot = load_slot_bytes(got, CS, BS)
    _, batch, streams = _open_six(store, spec, slot)
    assert len(batch) == len(streams) == 2  # absent from chunk 2 on: a miss from there
    other = LoadSpec("r", b"\x01" * 32, tuple(keys), 0, _BLOCKS["consecutive"], 0)
    assert _open_six(store, other, slot)[1] == []  # another namespace (tenant) never loads
    assert streamable(store, get_codec("lossless"))
    assert not streamable(store, get_codec("int8"))
    assert not streamable(DiskStore(tmp_path / "sealed",
                                    sealer=ChunkSealer(TenantKeyring(SECRET))),
                          get_codec("lossless"))
    assert not streamable(MemoryStore(), get_codec("lossless"))


@pytest.mark.parametrize("case", ["absent", "other_namespace", "wrong_dtype", "sealed_other"])
def test_load_failures_are_misses(tmp_path: Path, case: str) -> None:
    f = NamespaceFactory(model="m", tokenizer="t", dtype="float32", codec="lossless",
                         secret=SECRET)
    ns = f.digest("acme")
    tokens = list(range(2 * CS + 1))
    mem = MemoryStore()
    codec = get_codec("lossless")
    dtype = "float32"
    store: object = mem
    if case != "absent":
        stored_chain(mem, ns, tokens, 2)
    if case == "other_namespace":  # bytes copied under another tenant's keys
        other = f.digest("globex")
        for a, b in zip(chunk_keys(ns, tokens, CS, include_partial=False),
                        chunk_keys(other, tokens, CS, include_partial=False)):
            mem._data[b] = mem.get(a)  # type: ignore[assignment]  # a forged copy
        ns = other
    if case == "wrong_dtype":
        dtype = "bfloat16"
    if case == "sealed_other":
        from semcomm.security import ChunkSealer, TenantKeyring

        sealed = DiskStore(tmp_path / "a", sealer=ChunkSealer(TenantKeyring("a" * 32)))
        for k in chunk_keys(ns, tokens, CS, include_partial=False):
            sealed.put(k, mem.get(k))  # type: ignore[arg-type]
        store = DiskStore(tmp_path / "a", sealer=ChunkSealer(TenantKeyring("b" * 32)))
    got = load_chunks(store, _spec(ns, tokens, 2), chunk_size=CS, dtype=dtype,  # type: ignore[arg-type]
                      codec=codec)
    assert got == []


def test_redis_down_is_a_miss_not_an_error() -> None:
    import socket

    from semcomm.kv import RedisStore

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    ns = NamespaceFactory(model="m", tokenizer="t", dtype="float32", codec="lossless").digest(None)
    tokens = list(range(2 * CS + 1))
    with pytest.warns(Warning):
        plan = RequestPlan.new("r", ns, tokens, CS, BS, store)
        assert plan.hit_chunks == 0
        assert load_chunks(store, _spec(ns, tokens, 2), chunk_size=CS, dtype="float32",
                           codec=get_codec("lossless")) == []
        saver = ChunkSaver(store, codec=get_codec("lossless"), dtype="float32")
        k = torch.zeros(L, H, CS, D)
        plan.block_ids = [0, 1, 2, 3]
        saver.submit(ns, [(s, k, k) for s in plan.take_saves(2 * CS)])
        saver.close()  # writes were no-ops, nothing raised


# ---- saver ----------------------------------------------------------------------------------

def test_saver_bounds_pending_work_and_survives_store_failures() -> None:
    class Broken(MemoryStore):
        def put(self, key: bytes, value: bytes) -> None:  # type: ignore[override]
            raise OSError("disk full")

    ns = NamespaceFactory(model="m", tokenizer="t", dtype="float32", codec="lossless").digest(None)
    tokens = list(range(2 * CS + 1))
    plan = RequestPlan.new("r", ns, tokens, CS, BS, MemoryStore())
    plan.block_ids = [0, 1, 2, 3]
    specs = plan.take_saves(2 * CS)
    k = torch.zeros(L, H, CS, D)
    small = ChunkSaver(MemoryStore(), codec=get_codec("lossless"), dtype="float32",
                       max_pending_bytes=k.numel() * 4)  # room for half a chunk
    assert small.submit(ns, [(specs[0], k, k)]) is False and small.dropped == 1
    small.close()
    broken = ChunkSaver(Broken(), codec=get_codec("lossless"), dtype="float32")
    broken.submit(ns, [(s, k, k) for s in specs])
    broken.flush()
    assert broken.failed == 2 and broken.saved == 0
    broken.close()


# ---- the connector module itself ------------------------------------------------------------

def test_connector_module_says_how_to_install_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"semcomm\[vllm\]"):
            import semcomm.integrations.vllm  # noqa: F401
    else:  # pragma: no cover - only where vLLM is installed
        from semcomm.integrations.vllm import SemcommConnector

        assert SemcommConnector.__name__ == "SemcommConnector"


# ---- real vLLM (opt-in: several minutes) ----------------------------------------------------

VLLM_PY = os.environ.get("SEMCOMM_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(not VLLM_PY, reason="set SEMCOMM_VLLM_PYTHON (make vllm-test)")


def _bench(tmp_path: Path, *extra: str) -> dict[str, object]:
    from semcomm.models import model_path

    out = tmp_path / "check.json"
    subprocess.run([sys.executable, "-m", "benchmarks.vllm.check", "--model",
                    str(model_path("smollm2-135m-instruct")), "--vllm-python", str(VLLM_PY),
                    "--tokens", "1024", "--max-tokens", "12", "--out", str(out), *extra],
                   check=True, timeout=1500, cwd=str(ROOT))
    return json.loads(out.read_text())


@needs_vllm
@pytest.mark.slow
def test_vllm_second_process_loads_and_matches_cold(tmp_path: Path) -> None:
    r = _bench(tmp_path, "--store", f"disk:{tmp_path / 'kv'}", "--tamper")
    assert r["same_text"] is True
    # a chunk damaged on disk (its header intact, so a streamed load reads it behind the
    # forward and finds it only when verifying): vLLM recomputed, the file is gone
    assert r["tampered"]["same_text"] is True  # type: ignore[index]
    assert r["tampered"]["file_dropped"] is True  # type: ignore[index]
    assert r["hit_tokens"] == 896  # seven of eight 128-token blocks; the last one recomputed
    # every repeat (vLLM's own cache emptied first) loaded the prefix through semcomm again,
    # and the connector's timing log saw each load
    assert r["warm_repeats_hit_tokens"] == [896] * 4
    timelines, control = r["warm_timelines"], r["apc_local_ttft_samples_s"]
    assert isinstance(timelines, list) and isinstance(control, list)
    assert all(t and t["load_chunks"] == 7 and t["load_ms"] > 0 for t in timelines)
    assert r["repeats_same_first_tokens"] is True and len(control) == 5
    t = r["tenant"]
    assert t["other_tenant_hit_tokens"] == 0 and t["tenant_hit_tokens"] > 0  # type: ignore[index]
    # as the cold run, or (a bf16 near tie) exactly what vLLM's own prefix cache produced
    assert t["same_text"] is True or t.get("same_as_apc") is True  # type: ignore[index,union-attr]


@needs_vllm
@pytest.mark.slow
def test_vllm_restarted_redis_gives_misses_not_errors(tmp_path: Path) -> None:
    r = _bench(tmp_path, "--redis")
    assert r["same_text"] is True and r["hit_tokens"] == 896
    assert r["redis_restart"] == {"hit_tokens": 0, "same_text": True}
    assert r["redis_down"] == {"hit_tokens": 0, "same_text": True}
