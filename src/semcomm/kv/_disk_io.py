"""File I/O of :class:`~semcomm.kv.DiskStore`: plain syscalls and libc, no store state.

* reading a chunk file whole (:func:`read_file`), into a caller's buffer (:func:`read_into`)
  or in pieces (:class:`ChunkPieces`, ``DiskStore.open_into``);
* :func:`staging_buffer`, the reusable huge-page buffer for ``get_into``;
* syncing (:func:`fsync_dir`, :func:`sync_filesystem`: one ``syncfs`` for a batch of files),
  preallocating a file's blocks (:func:`preallocate`, libc's ``fallocate``) and asking the
  kernel to read files ahead (:func:`advise_willneed`);
* small file facts (:func:`same_file`, :func:`pid_alive` for a temporary file's writer).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
from typing import Any, Protocol

from ._format import ChunkHeader
from ._keys import ChunkKey


class _PieceOwner(Protocol):
    """What :class:`ChunkPieces` calls back on its store (``DiskStore``) once it has read."""

    def _read_failed(self, key: ChunkKey, path: str, exc: OSError) -> None: ...

    def _accept(self, key: ChunkKey, path: str,
                loaded: tuple[bytes | memoryview, int] | None) -> bytes | memoryview | None: ...

__all__ = [
    "HEADER_PROBE",
    "ChunkPieces",
    "advise_willneed",
    "fsync_dir",
    "pid_alive",
    "pread_full",
    "preallocate",
    "preallocation_available",
    "read_file",
    "read_into",
    "same_file",
    "staging_buffer",
    "sync_filesystem",
    "syncfs",
]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: str) -> None:
    """Make renames inside ``path`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_file(path: str) -> tuple[bytes, int]:
    """Contents and inode number of a file (plain syscalls: this is every disk hit)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        data = os.read(fd, st.st_size)
        if len(data) != st.st_size:  # a short read (never for regular files, but be exact)
            parts = [data]
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
            data = b"".join(parts)
        return data, st.st_ino
    finally:
        os.close(fd)


def read_into(path: str, buffer: memoryview) -> tuple[bytes | memoryview, int]:
    """A file's contents read into ``buffer`` (a fresh ``bytes`` if it does not fit), and its inode.

    The read lands in memory the caller reuses, so a large chunk costs one copy out of the page
    cache and no page faults of a freshly allocated buffer (``read_file`` pays those).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size > len(buffer):
            data = os.read(fd, size)
            return (data if len(data) == size else data + _read_rest(fd)), st.st_ino
        view = buffer[:size]
        got = os.readv(fd, [view])
        while got < size:  # a short read (never for regular files, but be exact)
            n = os.preadv(fd, [view[got:]], got)
            if n == 0:
                break
            got += n
        return view[:got], st.st_ino
    finally:
        os.close(fd)


def _read_rest(fd: int) -> bytes:
    parts = []
    while chunk := os.read(fd, 1 << 20):
        parts.append(chunk)
    return b"".join(parts)


HEADER_PROBE = 64  # at least the fixed prefix and format 2's fixed header


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read ``len(view)`` bytes at ``offset`` into ``view``; fewer only at the end of the file."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class ChunkPieces:
    """A chunk file open for reading in pieces (:meth:`DiskStore.open_into`).

    ``header`` and ``payload_offset`` come from the file's header as read (not verified until
    :meth:`finish`); ``view`` is the part of the caller's buffer the chunk occupies, byte ``i``
    of the file at ``view[i]``. :meth:`read` may be called from several threads at once (the
    same range twice puts the same bytes in the same place).
    """

    def __init__(self, store: _PieceOwner, key: ChunkKey, path: str, fd: int | None,
                 view: memoryview, head: int, parsed: tuple[ChunkHeader, int], *,
                 ino: int = 0) -> None:
        self._store = store
        self.key = key
        self._path = path
        self._fd = fd
        self._ino = ino
        self.view = view
        self.header, self.payload_offset = parsed
        self._lock = threading.Lock()
        # byte ranges read so far (the head; everything when the chunk came from memory)
        self._have: list[tuple[int, int]] = [(0, head if fd is not None else len(view))]
        self.result: memoryview | None = None
        self.finished = False

    @property
    def size(self) -> int:
        return len(self.view)

    def read(self, offset: int, nbytes: int) -> None:
        """Read file bytes ``offset .. offset + nbytes`` into the same place of ``view``."""
        if offset < 0 or nbytes < 0 or offset + nbytes > len(self.view):
            raise ValueError(f"range {offset}+{nbytes} is outside the chunk's {len(self.view)} "
                             "bytes")
        if self._fd is None or nbytes == 0:
            return
        got = pread_full(self._fd, self.view[offset : offset + nbytes], offset)
        if got != nbytes:
            raise OSError(errno.EIO, f"short read of {self._path} at {offset}")
        with self._lock:
            self._have.append((offset, offset + got))

    def _missing(self) -> list[tuple[int, int]]:
        with self._lock:
            spans = sorted(self._have)
        out, at = [], 0
        for lo, hi in spans:
            if lo > at:
                out.append((at, lo))
            at = max(at, hi)
        if at < len(self.view):
            out.append((at, len(self.view)))
        return out

    def finish(self) -> memoryview | None:
        """Read what was not read, verify the whole chunk (as ``get_into``) and close the file:
        the verified view of the caller's buffer, or None (a miss; a corrupt file is dropped).
        Once only; later calls return the first answer."""
        if self.finished:
            return self.result
        self.finished = True
        store = self._store
        try:
            if self._fd is None:  # from the write-behind queue: already verified bytes
                self.result = self.view
                return self.result
            try:
                for lo, hi in self._missing():
                    self.read(lo, hi - lo)
            except OSError as exc:
                store._read_failed(self.key, self._path, exc)
                return None
            value = store._accept(self.key, self._path, (self.view, self._ino))
            self.result = None if value is None else memoryview(value)
            return self.result
        finally:
            self.close()

    def close(self) -> None:
        """Close the file without verifying (a reader that gave up on the chunk)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            self.finished = True

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


_HUGE_PAGE = 2 << 20  # x86-64 transparent huge page


def staging_buffer(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` for :meth:`DiskStore.get_into`, reused across reads.

    Anonymous memory the kernel is asked to back with transparent huge pages
    (``MADV_HUGEPAGE``, where the platform has it), touched once so no read pays its page
    faults: a 3 MiB chunk then spans two pages instead of 768, and both the copy out of the page
    cache and the checksum pass over it miss the TLB far less (measured here: 151 against 174 to
    343 us per 3 MiB verified read into a ``bytearray``). Where huge pages are unavailable it is
    ordinary memory, as good as a ``bytearray``. The memory is released with the last view.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE  # whole huge pages
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # THP off or unsupported: 4 KiB pages then
            m.madvise(advice)
    view = memoryview(m)
    for off in range(0, size, mmap.PAGESIZE):  # fault every page in now, not in a read
        view[off] = 0
    return view[:nbytes]


def syncfs(fd: int) -> None:
    """Flush the whole filesystem holding ``fd`` (one journal commit for a batch of files)."""
    if _LIBC is not None:
        if _LIBC.syncfs(fd) == 0:
            return
    os.sync()


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.syncfs.argtypes = [ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def _load_fallocate() -> Any:
    """libc's ``fallocate`` (Linux), or None. Not ``os.posix_fallocate``: where a filesystem
    cannot preallocate, glibc emulates that one by writing zeros over the whole range."""
    fn = getattr(_LIBC, "fallocate", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _load_fallocate()
# errnos saying this filesystem does not preallocate: stop asking (the write works without it)
_NO_PREALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EPERM})


def preallocation_available() -> bool:
    """Whether this platform has libc's ``fallocate`` (a filesystem may still refuse it)."""
    return _FALLOCATE is not None


def preallocate(fd: int, size: int) -> str | None:
    """Allocate a new file's blocks in one call: None when done (or worth asking again next
    time), else why this filesystem does not preallocate (stop asking: a write works without
    it); ``OSError`` when the disk is full."""
    if _FALLOCATE(fd, 0, 0, size) == 0:
        return None
    err = ctypes.get_errno()
    if err == errno.ENOSPC:
        raise OSError(err, os.strerror(err))
    if err in _NO_PREALLOCATE:
        return os.strerror(err)
    return None  # anything else (EINTR, ...): the write allocates as it goes


def sync_filesystem(path: str | os.PathLike[str]) -> None:
    """Flush the whole filesystem holding ``path`` (``fsync`` put_many: once per batch)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        syncfs(fd)
    finally:
        os.close(fd)


def advise_willneed(paths: list[str]) -> None:
    """``posix_fadvise(WILLNEED)`` of each file that exists (``DiskStore.prefetch``)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def same_file(path: str, ino: int) -> bool:
    """True when ``path`` still names the file whose inode is ``ino``."""
    try:
        return os.stat(path).st_ino == ino
    except OSError:
        return False
