"""DiskStore.prefetch: chunk files paged out of memory are read back ahead of the get.

Residency is checked with ``mincore`` on a mapping of the file that touches no page (a read of
any kind would start the kernel's own read-ahead).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

import pytest

from semcomm.kv import DiskStore, MemoryStore, TieredStore

from ._kvchunks import chain

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not sys.platform.startswith(
    "linux"), reason="needs posix_fadvise and mincore (Linux)")

_LIBC = ctypes.CDLL(None, use_errno=True)


def _file(store: DiskStore, key: bytes) -> str:
    h = key.hex()
    return str(store.path / h[:2] / f"{h}.sckv")


def _resident(path: str) -> bool:
    """Every page of the file in the page cache (``mincore`` of a mapping that touches none)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        ref = ctypes.c_char.from_buffer(m)
        try:
            if _LIBC.mincore(ctypes.c_void_p(ctypes.addressof(ref)), ctypes.c_size_t(size),
                             vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del ref
        return all(v & 1 for v in vec)
    finally:
        m.close()


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written back first: clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _dropped(store: DiskStore, keys: list[bytes]) -> list[str]:
    paths = [_file(store, k) for k in keys]
    for p in paths:
        _drop(p)
    if any(_resident(p) for p in paths):
        pytest.skip("this filesystem keeps the pages (cannot test a head start here)")
    return paths


def _wait_resident(paths: list[str], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_resident(p) for p in paths):
            return True
        time.sleep(0.01)
    return False


def test_prefetch_reads_paged_out_chunks_back_into_memory(tmp_path: Path) -> None:
    items = chain(6, payload=256 << 10)
    store = DiskStore(tmp_path, refresh_s=None)
    store.put_many(items)
    paths = _dropped(store, [k for k, _ in items])
    store.prefetch([k for k, _ in items])  # returns at once; a helper thread asks the OS
    assert _wait_resident(paths)
    assert all(store.get(k) == v for k, v in items)  # still verified, still the same bytes


def test_prefetch_skips_missing_keys_and_an_empty_list(tmp_path: Path) -> None:
    items = chain(3, payload=64 << 10)
    store = DiskStore(tmp_path, refresh_s=None)
    store.put(*items[0])
    paths = _dropped(store, [items[0][0]])
    store.prefetch([])
    store.prefetch([items[1][0], items[0][0], items[2][0]])  # two of them have no file
    assert _wait_resident(paths)
    assert store.get(items[1][0]) is None and store.get(items[0][0]) == items[0][1]


def test_a_tiered_store_prefetches_its_disk_tier(tmp_path: Path) -> None:
    items = chain(4, payload=128 << 10)
    disk = DiskStore(tmp_path, refresh_s=None)
    tiered = TieredStore([MemoryStore(), disk])
    tiered.put_many(items)
    paths = _dropped(disk, [k for k, _ in items])
    tiered.prefetch([k for k, _ in items])
    assert _wait_resident(paths)
