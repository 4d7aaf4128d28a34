"""Foundation invariants: deterministic chunk keys, the self-describing chunk format, tenant salts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from semcomm.errors import CorruptEntryError, NamespaceMismatchError, TenantError
from semcomm.kv import (
    Namespace,
    chunk_key,
    chunk_keys,
    chunk_spans,
    decode_chunk,
    encode_chunk,
    read_header,
)
from semcomm.security import NO_TENANT_DIGEST, TenantSalter

NS = Namespace(model="m", tokenizer="t", dtype="float32", codec="lossless", tenant=NO_TENANT_DIGEST)


def test_chunk_keys_follow_the_documented_hash_chain() -> None:
    import hashlib

    toks = list(range(10))
    keys = chunk_keys(NS.digest, toks, 4)
    assert len(keys) == 3  # 4 + 4 + partial 2
    parent = NS.digest
    for (s, e), k in zip(chunk_spans(10, 4), keys, strict=True):
        h = hashlib.blake2b(parent, digest_size=32)
        h.update(np.asarray(toks[s:e], dtype="<u4").tobytes())
        assert k == h.digest()
        parent = k
    assert chunk_keys(NS.digest, toks, 4, include_partial=False) == keys[:2]


def test_keys_depend_on_whole_prefix_and_namespace() -> None:
    a = chunk_keys(NS.digest, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chunk_keys(NS.digest, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second chunk, different prefix
    other = Namespace(model="m", tokenizer="t", dtype="float32", codec="int8", tenant=NO_TENANT_DIGEST)
    assert chunk_keys(other.digest, [1, 2, 3, 4], 4) != chunk_keys(NS.digest, [1, 2, 3, 4], 4)
    # a partial tail never collides with a full chunk of the same parent
    assert chunk_key(NS.digest, [1, 2]) != chunk_key(NS.digest, [1, 2, 0, 0])


def test_keys_identical_in_another_process() -> None:
    code = (
        "from semcomm.kv import Namespace, chunk_keys;"
        "ns=Namespace(model='m',tokenizer='t',dtype='float32',codec='lossless',tenant='public');"
        "print(','.join(k.hex() for k in chunk_keys(ns.digest, list(range(37)), 8)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ",".join(k.hex() for k in chunk_keys(NS.digest, list(range(37)), 8))


def _chunk(key: bytes = b"k" * 32) -> bytes:
    rng = np.random.default_rng(0)
    return encode_chunk(
        namespace=NS.digest, key=key, parent=None, num_tokens=4, start=0, dtype="float32",
        codec="lossless", codec_params={},
        arrays={"k.0": rng.standard_normal((1, 2, 4, 8)).astype(np.float32),
                "v.0": rng.standard_normal((1, 2, 4, 8)).astype(np.float32)},
    )


def test_chunk_round_trip() -> None:
    data = _chunk()
    chunk = decode_chunk(data, expect_key=b"k" * 32, expect_namespace=NS.digest)
    assert chunk.header.num_tokens == 4 and chunk.arrays["k.0"].shape == (1, 2, 4, 8)
    assert read_header(data).key == (b"k" * 32).hex()


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-1],  # truncated
        lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:],  # bit flip in the header
        lambda b: b[:-30] + bytes([b[-30] ^ 0x80]) + b[-29:],  # bit flip in the payload
        lambda b: b"XXXX" + b[4:],  # bad magic
        lambda b: b"",
    ],
)
def test_corrupt_chunks_are_rejected(damage) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CorruptEntryError):
        decode_chunk(damage(_chunk()))


def test_swapped_chunk_and_foreign_namespace_are_rejected() -> None:
    data = _chunk(b"a" * 32)
    with pytest.raises(CorruptEntryError):
        decode_chunk(data, expect_key=b"b" * 32)
    with pytest.raises(NamespaceMismatchError):
        decode_chunk(data, expect_namespace=b"z" * 32)


def test_tenant_salts_are_server_side_deterministic_and_distinct() -> None:
    s1 = TenantSalter(secret="0" * 64)
    s2 = TenantSalter(secret="0" * 64)
    assert s1.digest("acme") == s2.digest("acme")
    assert s1.digest("acme") != s1.digest("globex")
    assert s1.digest(None) == NO_TENANT_DIGEST
    assert TenantSalter(secret="1" * 64).digest("acme") != s1.digest("acme")
    v2 = s1.rotate("2" * 64)
    assert s1.digest("acme") != s1.digest("acme", version=1)
    assert s1.digest("acme", version=1) == s2.digest("acme") and v2 == 2
    with pytest.raises(TenantError):
        s1.salt("")
    with pytest.raises(TenantError):
        TenantSalter(secret=b"short")


def test_default_secret_is_shared_between_processes() -> None:
    code = "from semcomm.security import TenantSalter; print(TenantSalter().digest('acme'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == TenantSalter().digest("acme")
