"""DiskStore: one file per chunk in a directory, shared safely by several processes.

Layout::

    <root>/.semcomm-kv                 marker (JSON: kind and layout version)
    <root>/.lock                       fcntl lock taken by eviction sweeps
    <root>/<hh>/<64 hex>.sckv          one encoded chunk; <hh> = first two hex digits of the key
    <root>/<hh>/.<64 hex>.<pid>.<rand>.tmp   a write in progress (renamed into place when done)

What a returned ``put`` promises is the store's ``durability`` (:data:`DURABILITY`); every
setting writes a temporary file and renames it into place, so none can leave a torn chunk
under a chunk's name, and every read verifies the checksum whatever the setting.

This module is the store: its index, admission, eviction and the write and read paths. The file
I/O it calls is in ``_disk_io`` (reads into buffers, chunks read in pieces, syncs,
preallocation), the threads that write besides the caller in ``_writeback`` (the write-behind
queue, ``put_many``'s helpers) and the process's directory re-lister in ``_refresher``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, CorruptEntryError
from ._disk_io import (
    HEADER_PROBE,
    ChunkPieces,
    advise_willneed,
    fsync_dir,
    pid_alive,
    pread_full,
    preallocate,
    preallocation_available,
    read_file,
    read_into,
    same_file,
    staging_buffer,
    sync_filesystem,
)
from ._format import ChunkHeader, header_from_prefix, prefix_length
from ._keys import ChunkKey
from ._lru import ChainLru, LruPinning
from ._refresher import ACTIVITY, QUIET_S, REFRESH_S, REFRESHER
from ._store import (
    KEY_SIZE,
    ChunkSealer,
    ChunkStoreBase,
    StoreStats,
    byte_view,
    check_key,
    open_stored,
    parent_of,
    validate_chunk,
)
from ._writeback import HELPERS, WriteBatch, WriteQueue

__all__ = ["DEFAULT_DISK_CAPACITY", "DEFAULT_MAX_PENDING_BYTES", "DURABILITY", "ChunkPieces",
           "DiskStore", "staging_buffer"]

logger = logging.getLogger("semcomm.kv")

DEFAULT_DISK_CAPACITY = 10 << 30  # 10 GiB
DURABILITY = frozenset({"flush", "fsync", "write-behind"})
"""What a returned ``DiskStore.put`` promises (see :class:`DiskStore`): ``"flush"`` the chunk is
written (it survives the process crashing), ``"fsync"`` also synced (it survives power loss),
``"write-behind"`` only accepted (validated and queued; written within the queue's bound, and
by ``flush()``/``close()``)."""
DEFAULT_MAX_PENDING_BYTES = 256 << 20  # write-behind: bytes queued before put waits
DEFAULT_WRITER_THREADS = 2  # write-behind: threads writing the queue
_SUFFIX = ".sckv"
_TMP_SUFFIX = ".tmp"
_MARKER = ".semcomm-kv"
_LOCK = ".lock"
_HEX = frozenset("0123456789abcdef")
_STALE_TMP_S = 900.0  # a tmp file this old is abandoned even if its pid looks alive (pid reuse)
# a shard directory whose mtime is this close to the clock when it was listed is listed again
# next time: a change later in the same filesystem timestamp tick (a coarse clock: 1 to 10 ms)
# would leave its mtime as it was
_RACY_NS = 20_000_000
# a chunk file at least this large gets its blocks allocated in one fallocate before the write:
# ext4's delayed allocation otherwise reserves and tracks every 4 KiB block as the bytes are
# copied in (measured alone here: 3 MiB written in 450 instead of 650 us, 0.75 MiB 180 instead
# of 215 us; below 256 KiB no difference)
_PREALLOCATE_MIN = 256 << 10


def _key_from_name(name: str) -> ChunkKey | None:
    if not name.endswith(_SUFFIX):
        return None
    stem = name[: -len(_SUFFIX)]
    if len(stem) != 2 * KEY_SIZE or not set(stem) <= _HEX:
        return None
    return ChunkKey(bytes.fromhex(stem))


@dataclass(slots=True)
class _Job:
    """One admitted write: room is reserved for ``value`` until ``_finish``."""

    key: ChunkKey
    value: bytes  # the bytes to store (sealed when the store has a sealer)
    parent: ChunkKey | None
    existed: bool  # the key was indexed before (a replacement)
    pins: int  # pins of the replaced entry, carried over


class DiskStore(ChunkStoreBase, LruPinning):
    """Chunks as files under ``path``, bounded by ``capacity_bytes`` of file bytes.

    Guarantees:

    * **Atomic writes.** A chunk is written to a temporary file and renamed into place with
      ``os.replace``; readers see the old file or the new one, never a partial write.
      A writer killed mid-write leaves only a ``.tmp`` file, which is never served and is
      removed by the next open once its process is gone.
    * **Durability** says what a returned ``put`` promises (:data:`DURABILITY`):
      ``"flush"`` (default): the bytes are in the operating system's hands, so they survive the
      writing process crashing; an OS crash or power loss can lose the newest chunks (a file
      that comes back torn fails its checksum and is a miss, never served).
      ``"fsync"``: the chunk survives power loss too (file data synced before the rename, the
      directory after it); :meth:`put_many` syncs once per batch instead of once per chunk.
      ``"write-behind"``: the chunk is validated (a bad one raises in ``put``), room is made
      for it and it is queued; ``writer_threads`` threads write the queue (temporary file and
      rename, as ``"flush"``). This store serves a queued chunk from memory at once (``get``,
      ``contains``, ``lookup``, ``scan``); other processes see it once it is written, which
      :meth:`flush` and :meth:`close` wait for (and an ``atexit`` hook, for stores still open
      at a normal interpreter exit). A process killed before that loses the queued chunks
      (misses later, never a wrong or torn chunk). At most ``max_pending_bytes`` are queued:
      beyond it ``put`` waits for the writers (backpressure). A caller that waits (``flush``,
      ``close``, a held-back ``put``) writes queued chunks itself meanwhile (``WriteQueue``). A write that fails is counted in
      ``stats().errors`` and the chunk is absent.
    * **Batched writes.** :meth:`put_many` with ``"flush"`` or ``"fsync"`` writes its chunks
      concurrently (the caller and up to ``writer_threads`` helper threads of the process) and
      returns with the same promise as ``put``, every chunk of the batch indexed.
    * **Preallocated files.** A chunk of ``_PREALLOCATE_MIN`` bytes or more has its blocks
      allocated in one ``fallocate`` before it is written (off for good where the filesystem
      cannot; a full disk fails the write).
    * **Verified reads.** Every ``get`` checks header, key and XXH3 checksum. A truncated,
      bit-flipped or swapped file (content naming another key) is counted in
      ``stats().corrupt``, deleted and reported as a miss.
    * **Rebuilt index.** Opening scans the directory, reads each header (dropping and deleting
      files that fail), removes stale temporary files and orders entries by mtime for LRU.
    * **Budget.** LRU in this process's view, with chain tails evicted before their prefixes
      and pinned entries kept (:class:`ChainLru`). Room is made *before* a write, so in one
      process the directory never exceeds the budget. With several writers, a background
      thread re-lists the directory every ``refresh_s`` seconds (waiting while the store is
      busy, at most one period more; only shard directories whose mtime moved since their last
      listing are read again), indexes other processes' files and deletions, and evicts down
      to the budget holding ``.lock`` (fcntl), tolerating files that appear or vanish, so the
      total converges to the budget at every re-listing (:meth:`sweep` forces a full one).
      ``put`` never lists the directory. ``refresh_s=None``: no thread; other processes'
      files are then indexed only by reads, sweeps and a reopen.
    * Recency lives in memory (``get`` does not rewrite files); after a reopen it is the
      file mtimes, i.e. write order.
    """

    name = "disk"
    verified_reads = True  # every read checks the checksum and key of what it read
    reads_into = True  # get_into reads the file straight into the caller's buffer

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int = DEFAULT_DISK_CAPACITY,
        *,
        name: str = "disk",
        durability: str = "flush",
        fsync: bool | None = None,
        sealer: ChunkSealer | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        writer_threads: int = DEFAULT_WRITER_THREADS,
        refresh_s: float | None = REFRESH_S,
    ):
        super().__init__()
        if refresh_s is not None:
            if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)):
                raise TypeError(f"refresh_s must be a number or None, got "
                                f"{type(refresh_s).__name__}")
            if not refresh_s > 0:
                raise ValueError(f"refresh_s must be > 0 (or None: no re-listing), got "
                                 f"{refresh_s}")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if fsync is not None:  # the older switch: fsync=True is durability="fsync"
            durability = "fsync" if fsync else "flush"
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {sorted(DURABILITY)}, got {durability!r}")
        # raises ValueError for bad values before anything touches the directory
        if isinstance(writer_threads, bool) or not isinstance(writer_threads, int) or (
                writer_threads < 1):
            raise ValueError(f"writer threads must be an int >= 1, got {writer_threads!r}")
        queue: WriteQueue[_Job] | None = None
        if durability == "write-behind":
            queue = WriteQueue(self._write_queued, max_bytes=max_pending_bytes,
                               threads=writer_threads)
        root = Path(path).expanduser()
        if root.exists() and not root.is_dir():
            raise ConfigError(f"DiskStore path {str(root)!r} exists and is not a directory")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create DiskStore directory {str(root)!r}: {exc}") from exc
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError(f"DiskStore directory {str(root)!r} is not writable")
        self.name = name
        self.path = root
        self.capacity_bytes = capacity_bytes
        self.durability = durability
        self._fsync = durability == "fsync"
        self._behind = durability == "write-behind"
        self._queue = queue  # write-behind: the threads writing accepted chunks
        # write-behind: threads writing the queue; "flush"/"fsync": helpers of a put_many
        self._writer_threads = writer_threads
        # the newest accepted job of each key not yet written (write-behind's queue, and a
        # "flush"/"fsync" put_many's batch while it is written); an entry leaves
        # in _finish in the same hold of _lock that indexes the file (or drops the chunk),
        # so a key is always in one of the two, and its bytes are reserved while it is here
        self._queued: dict[ChunkKey, _Job] = {}
        self._root_s = str(root) + os.sep
        self._shard_dirs: set[str] = set()  # shard directories known to exist (skips mkdir)
        # preallocate large chunk files (see _PREALLOCATE_MIN); turned off for good the first
        # time the filesystem says it cannot (only the writer threads and put change it)
        self._preallocate = preallocation_available()
        self._tmp_seq = itertools.count(secrets.randbelow(1 << 30))
        self.sealer = sealer
        self._lock = threading.RLock()
        self._lru = ChainLru()
        self._hits = self._misses = self._puts = self._rejected = 0
        self._evictions = self._corrupt = self._errors = 0
        self._last_refresh = 0.0  # monotonic time of the last re-listing
        self.refresh_s = refresh_s
        # shard name -> its directory's st_mtime_ns when last listed (-1: list it again), so a
        # re-listing reads only shards that changed; used under _refresh_lock (or in __init__)
        self._shard_mtimes: dict[str, int] = {}
        self._refresh_lock = threading.Lock()  # one re-listing at a time (refresher, sweep)
        self._closing = False  # set once by close()
        self._reserved = 0  # bytes of writes in flight in this process (room already made)
        marker = root / _MARKER
        if not marker.exists():
            # a new store: its 256 shard directories at once (a store of any size has them
            # all after a few hundred chunks; made lazily, the first writes each paid a mkdir)
            for i in range(256):
                shard = f"{self._root_s}{i:02x}"
                with contextlib.suppress(OSError):  # a write makes it later if this fails
                    os.makedirs(shard, exist_ok=True)
                    self._shard_dirs.add(shard)
            marker.write_text(json.dumps({"kind": "semcomm-kv-disk", "layout": 1}) + "\n")
        self._lock_fd = os.open(root / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        with self._lock, self._flock():
            self._rebuild()
            self._evict_to(0, None)
        if queue is not None:
            queue.start()  # the writer threads, here rather than in the first put
        else:
            HELPERS.warm(writer_threads)  # put_many's helpers, here rather than in a put_many
        if refresh_s is not None:
            REFRESHER.add(self)  # the process's refresher thread re-lists it from now on

    # ---- paths and locking -------------------------------------------------------------
    def _path(self, key: ChunkKey) -> str:
        h = key.hex()
        return f"{self._root_s}{h[:2]}/{h}{_SUFFIX}"

    class _FLock:
        __slots__ = ("fd",)

        def __init__(self, fd: int) -> None:
            self.fd = fd

        def __enter__(self) -> None:
            fcntl.flock(self.fd, fcntl.LOCK_EX)

        def __exit__(self, *exc: object) -> None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _flock(self) -> DiskStore._FLock:
        if self._lock_fd < 0:
            raise RuntimeError("DiskStore is closed")
        return DiskStore._FLock(self._lock_fd)

    def flush(self) -> None:
        """Wait until every accepted chunk is written (write-behind; else nothing to wait for).

        After it returns, every chunk this store accepted before the call is a file that other
        processes and a reopened store find."""
        if self._queue is not None:
            self._queue.flush()

    @property
    def queue_depth(self) -> tuple[int, int]:
        """(chunks, bytes) accepted but not yet written (write-behind; else always (0, 0))."""
        return (0, 0) if self._queue is None else self._queue.queued

    def close(self) -> None:
        """Write what is queued, leave the refresher, then release the lock file; the directory
        stays as it is."""
        if self._queue is not None:
            self._queue.close()
        REFRESHER.remove(self)
        self._closing = True  # a re-listing waiting for a quiet moment gives up
        with self._refresh_lock:  # a re-listing in progress ends first
            pass
        with self._lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def __del__(self) -> None:
        fd = getattr(self, "_lock_fd", -1)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- scanning ----------------------------------------------------------------------
    def _shards(self) -> Iterator[os.DirEntry[str]]:
        try:
            with os.scandir(self.path) as it:
                for d in it:
                    if len(d.name) == 2 and set(d.name) <= _HEX and d.is_dir(follow_symlinks=False):
                        yield d
        except FileNotFoundError:
            return

    def _read_header(self, path: str, key: ChunkKey) -> tuple[ChunkHeader, int, int, int]:
        """Header, size, mtime_ns and inode of a chunk file; CorruptEntryError if not valid."""
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            n = prefix_length(head)
            head += f.read(n - len(head))
        header, _ = header_from_prefix(head, st.st_size)
        if header.key != key.hex():
            raise CorruptEntryError(f"file for key {key.hex()[:16]} holds chunk {header.key[:16]}")
        return header, st.st_size, st.st_mtime_ns, st.st_ino

    def _rebuild(self) -> None:
        """Scan the directory into a fresh index (caller holds both locks)."""
        found: list[tuple[int, ChunkKey, int, ChunkKey | None]] = []
        now = time.time()
        start = time.time_ns()
        self._shard_mtimes.clear()
        for shard in self._shards():
            try:
                mtime = shard.stat(follow_symlinks=False).st_mtime_ns
                entries = list(os.scandir(shard.path))
            except OSError:
                continue
            # the removals of stale files below move the mtime: those shards are listed again
            self._shard_mtimes[shard.name] = mtime if abs(start - mtime) > _RACY_NS else -1
            self._shard_dirs.add(shard.path)  # exists: a write there needs no makedirs
            for ent in entries:
                if ent.name.endswith(_TMP_SUFFIX):
                    self._maybe_remove_tmp(ent, now)
                    continue
                key = _key_from_name(ent.name)
                if key is None:
                    continue
                try:
                    header, size, mtime, _ = self._read_header(ent.path, key)
                except FileNotFoundError:
                    continue
                except (CorruptEntryError, OSError) as exc:
                    self._drop_corrupt(key, ent.path, str(exc))
                    continue
                found.append((mtime, key, size, parent_of(header)))
        found.sort(key=lambda t: t[0])  # oldest first: least recently used
        self._lru = ChainLru()
        for _, key, size, parent in found:
            self._lru.add(key, size, parent)
        self._last_refresh = time.monotonic()
        logger.debug("DiskStore %s: %d chunks, %d bytes", self.path, len(self._lru),
                     self._lru.bytes)

    def _maybe_remove_tmp(self, ent: os.DirEntry[str], now: float) -> None:
        parts = ent.name.split(".")  # ["", hex, pid, rand, "tmp"]
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            pid = -1
        try:
            age = now - ent.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return
        if pid <= 0 or not pid_alive(pid) or age > _STALE_TMP_S:
            try:
                os.unlink(ent.path)
                logger.info("removed stale temporary chunk file %s", ent.path)
            except FileNotFoundError:
                pass

    def _refresh(self, *, full: bool = False, background: bool = False) -> list[ChunkKey]:
        """Bring the index in line with the directory (other processes' writes and deletes),
        then evict down to the budget; returns the keys evicted (events not yet emitted).

        Lists without holding ``_lock``; with ``full`` every shard, else only the shard
        directories whose mtime moved since they were last listed (a file created, renamed in
        or deleted moves it; one listed within ``_RACY_NS`` of its mtime is listed again next
        time). What the listing found is applied under ``_lock`` and ``.lock``: a key is
        dropped only if its file is still gone then, a new file indexed only if it is still
        the file whose header was read and no write of this process is queued for its key.
        ``background`` (the refresher): the listing pauses while a store of the process is in
        use, for at most one period.
        """
        with self._refresh_lock:
            start = time.time_ns()
            give_up = time.monotonic() + (self.refresh_s or REFRESH_S)
            mtimes = self._shard_mtimes
            if full:
                mtimes.clear()
            listed: set[int] = set()  # first key byte of each shard listed
            on_disk: set[ChunkKey] = set()  # chunk files in the shards listed
            present: set[str] = set()
            for i, shard in enumerate(self._shards()):
                if background and i % 16 == 0:
                    while ACTIVITY.busy(now := time.monotonic()) and now < give_up:
                        if self._closing:
                            return []
                        time.sleep(QUIET_S)
                present.add(shard.name)
                try:
                    mtime = shard.stat(follow_symlinks=False).st_mtime_ns
                    if mtimes.get(shard.name) == mtime:
                        continue
                    names = os.listdir(shard.path)
                except OSError:
                    continue
                mtimes[shard.name] = mtime if abs(start - mtime) > _RACY_NS else -1
                listed.add(int(shard.name, 16))
                for name in names:
                    key = _key_from_name(name)
                    if key is not None:
                        on_disk.add(key)
            for name in [n for n in mtimes if n not in present]:  # a shard directory removed
                del mtimes[name]
                listed.add(int(name, 16))
                self._shard_dirs.discard(self._root_s + name)
            if not listed:  # no shard changed since it was last listed: nothing to apply
                self._last_refresh = time.monotonic()
                return []
            with self._lock:
                known = set(self._lru.entries)
            gone = [k for k in known if k[0] in listed and k not in on_disk]
            found: list[tuple[ChunkKey, str, int, int, ChunkKey | None]] = []
            for key in on_disk - known:
                if key in self._queued:  # indexed when its queued write lands
                    continue
                path = self._path(key)
                try:
                    header, size, _, ino = self._read_header(path, key)
                except FileNotFoundError:
                    continue
                except (CorruptEntryError, OSError) as exc:
                    self._drop_corrupt(key, path, str(exc))
                    continue
                found.append((key, path, ino, size, parent_of(header)))
            evicted: list[ChunkKey] = []
            with self._lock:
                if self._lock_fd < 0:  # closed meanwhile
                    return []
                with self._flock():
                    for key in gone:
                        if key in self._lru and key not in self._queued and not os.path.exists(
                                self._path(key)):
                            self._lru.remove(key)
                    for key, path, ino, size, parent in found:
                        if key not in self._lru and key not in self._queued and same_file(
                                path, ino):
                            self._lru.add(key, size, parent)
                    _, evicted = self._evict_to(0, None)
                self._last_refresh = time.monotonic()
            return evicted

    def _refresh_and_evict(self) -> None:
        """One re-listing (the refresher's round), with the events of what it evicted."""
        for k in self._refresh(background=True):
            self._emit("evict", k, "evict")

    def _drop_corrupt(self, key: ChunkKey, path: str, why: str, ino: int | None = None) -> None:
        """Delete a bad file (only if it is still the file we read) and count it."""
        logger.warning("DiskStore: dropping corrupt chunk file %s: %s", path, why)
        try:
            if ino is None or os.stat(path).st_ino == ino:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("DiskStore: could not delete %s: %s", path, exc)
        with self._lock:
            self._corrupt += 1
            had = self._lru.remove(key) is not None
        if had:
            self._emit("evict", key, "corrupt")

    # ---- eviction ----------------------------------------------------------------------
    def _evict_to(self, incoming: int, protect: ChunkKey | None) -> tuple[bool, list[ChunkKey]]:
        """Evict until ``incoming`` more bytes fit (caller holds both locks)."""
        evicted: list[ChunkKey] = []
        while self._lru.bytes + self._reserved + incoming > self.capacity_bytes:
            victim = self._lru.victim(protect=protect)
            if victim is None:
                return False, evicted
            self._lru.remove(victim)
            with contextlib.suppress(FileNotFoundError):  # another process evicted it already
                os.unlink(self._path(victim))
            self._evictions += 1
            evicted.append(victim)
        return True, evicted

    def sweep(self) -> int:
        """Re-list the whole directory and evict down to the budget; returns the number evicted."""
        if self._lock_fd < 0:
            raise RuntimeError("DiskStore is closed")
        evicted = self._refresh(full=True)
        for k in evicted:
            self._emit("evict", k, "evict")
        return len(evicted)

    # ---- primitives --------------------------------------------------------------------
    def get(self, key: ChunkKey) -> bytes | None:
        key = check_key(key)
        if self._behind:
            queued = self._queued_value(key)
            if queued is not None:
                return queued
        path = self._path(key)
        value = self._accept(key, path, self._load(key, path))
        assert value is None or isinstance(value, bytes)  # read into new memory, not a view
        return value

    def get_into(self, key: ChunkKey, buffer: bytearray | memoryview) -> memoryview | None:
        """``get`` that reads into ``buffer`` (memory the caller reuses, like a staging pool).

        Returns a view of the verified chunk bytes: of ``buffer`` when the chunk fits in it and
        the store is not sealed, else of new memory (a chunk larger than ``buffer``; the opened
        plaintext of a sealed chunk). The same checks as ``get`` (checksum, header, key) and the
        same misses. The view is only valid until ``buffer`` is reused: copy what you keep.
        """
        key = check_key(key)
        out = byte_view(buffer, "get_into")
        if self._behind:
            queued = self._queued_value(key)
            if queued is not None:
                if self.sealer is not None or len(queued) > len(out):
                    return memoryview(queued)
                out[: len(queued)] = queued
                return out[: len(queued)]
        path = self._path(key)
        value = self._accept(key, path, self._load(key, path, out))
        return None if value is None else memoryview(value)

    def open_into(self, key: ChunkKey, buffer: bytearray | memoryview, *,
                  head: int = 4096) -> ChunkPieces | None:
        """Open a chunk for reading in pieces, in any order, into ``buffer``; verify at the end.

        For a reader that wants to use parts of a chunk before all of it has arrived (the vLLM
        connector copies layer ``l`` of every chunk into vLLM's blocks while the forward pass
        runs, then reads layer ``l + 1``). The chunk's first ``head`` bytes, or its whole header
        where that is longer (``head=0``: the header alone), are read now and its header parsed
        (not yet trusted: the checksum covers it); :meth:`ChunkPieces.read` reads any range
        into the same place of ``buffer`` as in the file, and :meth:`ChunkPieces.finish` reads
        every byte not read yet and verifies the whole chunk exactly as :meth:`get_into` does
        (checksum, header, key; a corrupt file is dropped and counted): the verified view, or
        None. Until ``finish`` returns a view,
        nothing read may be served as this chunk: a caller that used pieces early must undo
        what it did with them when ``finish`` says None.

        Returns None for a miss (absent, unreadable, a header that does not parse: that file
        is dropped as corrupt, larger than ``buffer``). A chunk still in the write-behind queue
        is copied into ``buffer`` whole (every piece already read). A sealed store cannot be
        read in pieces (the plaintext exists only once the whole ciphertext is opened):
        ``ConfigError``; use :meth:`get_into`.
        """
        key = check_key(key)
        if self.sealer is not None:
            raise ConfigError("a sealed DiskStore cannot be read in pieces: use get_into")
        out = byte_view(buffer, "open_into")
        if self._behind:
            queued = self._queued_value(key)
            if queued is not None:
                if len(queued) > len(out):
                    return None
                out[: len(queued)] = queued
                return ChunkPieces(self, key, "", None, out[: len(queued)], 0,
                                   header_from_prefix(queued, len(queued)))
        path = self._path(key)
        ACTIVITY.at = time.monotonic()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._read_failed(key, path, exc)
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size > len(out):
                os.close(fd)
                with self._lock:
                    self._misses += 1
                return None
            view = out[:size]
            got = pread_full(fd, view[: min(max(head, HEADER_PROBE), size)], 0)
            try:
                need = prefix_length(view[:got])
                if need > got:
                    got += pread_full(fd, view[got:need], got)
                parsed = header_from_prefix(view[:got], size)
            except CorruptEntryError as exc:
                os.close(fd)
                self._drop_corrupt(key, path, str(exc), ino=st.st_ino)
                with self._lock:
                    self._misses += 1
                return None
        except OSError as exc:
            os.close(fd)
            self._read_failed(key, path, exc)
            return None
        return ChunkPieces(self, key, path, fd, view, got, parsed, ino=st.st_ino)

    def _queued_value(self, key: ChunkKey) -> bytes | None:
        """A chunk accepted but not yet written: served from the write queue (a hit)."""
        job = self._queued.get(key)  # one dict read: no lock needed
        if job is None:
            return None
        stored = job.value
        if self.sealer is not None:
            try:  # queued bytes are sealed like the file will be: open (and verify) them
                stored, _ = open_stored(key, stored, self.sealer)
            except CorruptEntryError as exc:  # pragma: no cover - sealed by this process
                logger.warning("DiskStore: queued chunk %s does not open: %s", key.hex()[:16],
                               exc)
                return None
        with self._lock:
            self._hits += 1
        return stored

    def _load(self, key: ChunkKey, path: str,
              into: memoryview | None = None) -> tuple[bytes | memoryview, int] | None:
        """The file's bytes and inode, or None (absent or unreadable; counted as a miss)."""
        ACTIVITY.at = time.monotonic()
        try:
            return read_file(path) if into is None else read_into(path, into)
        except OSError as exc:
            self._read_failed(key, path, exc)
            return None

    def _read_failed(self, key: ChunkKey, path: str, exc: OSError) -> None:
        """Count a read that found no file (forgetting the key) or could not read it."""
        if isinstance(exc, FileNotFoundError):
            with self._lock:
                self._misses += 1
                # a write of the key may have renamed its file into place (and indexed it) since
                # the read failed: forget the key only while its file is still gone
                gone = not os.path.exists(path) and self._lru.remove(key) is not None
            if gone:
                self._emit("evict", key, "delete")
            return
        logger.warning("DiskStore: cannot read %s: %s", path, exc)
        with self._lock:
            self._misses += 1
            self._errors += 1

    def _accept(self, key: ChunkKey, path: str,
                loaded: tuple[bytes | memoryview, int] | None) -> bytes | memoryview | None:
        """Verify (and unseal) what ``_load`` read; index a file another process wrote."""
        if loaded is None:
            return None
        data, ino = loaded
        try:
            value, parent = open_stored(key, data, self.sealer)
        except CorruptEntryError as exc:
            self._drop_corrupt(key, path, str(exc), ino=ino)
            with self._lock:
                self._misses += 1
            return None
        added = False
        evicted: list[ChunkKey] = []
        with self._lock:
            self._hits += 1
            if key in self._lru:
                self._lru.touch(key)
            elif key not in self._queued and same_file(path, ino):
                # written by another process, and still there (a key with a queued write is
                # indexed when that write lands: its old file must not be counted beside it)
                # (evictions unlink under this lock: a file evicted while we read it is not
                # re-indexed, which would put the budget over its cap)
                self._lru.add(key, len(data), parent)
                added = True
                evicted = self._enforce_budget(key)
        if added:  # stored, then what the budget evicted (the chunk itself may be one)
            self._emit("store", key, "found")
            for k in evicted:
                self._emit("evict", k, "evict")
        return value

    def put(self, key: ChunkKey, value: bytes) -> None:
        key = check_key(key)
        value, parent = validate_chunk(key, value)
        if self._behind:
            self._put_behind(key, value, parent)
            return
        job = self._admit(key, value, parent)
        if job is None:
            return
        self._finish(job, self._write(job, sync=self._fsync))

    def _put_behind(self, key: ChunkKey, value: bytes, parent: ChunkKey | None) -> None:
        """Queue a validated chunk (write-behind); readable from ``_queued`` until written."""
        assert self._queue is not None
        queued = self._queued.get(key)
        if queued is not None and self.sealer is None and (
                queued.value is value or queued.value == value):
            return  # the same chunk is already on its way
        job = self._admit(key, value, parent, queue=True)
        if job is None:
            return
        try:
            self._queue.submit(job)
        except BaseException:  # closed: the chunk is not stored after all
            self._finish(job, False)
            raise

    def _write_queued(self, job: _Job) -> None:
        """A writer thread's work for one queued chunk (``WriteQueue`` calls it)."""
        self._finish(job, self._write(job, sync=False))

    def put_many(self, items: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """``put`` of each (key, value), with the store's durability for the whole batch.

        Every value is validated before anything is written: a malformed one raises
        ``InvalidInputError`` and none of the batch is stored. ``"write-behind"``: queued, as
        ``put``. ``"flush"`` and ``"fsync"``: room is made for the whole batch, then its chunks
        are written concurrently, by the caller and up to ``writer_threads`` helper threads
        (the process's, shared by its stores; the caller waits only for chunks a helper has
        taken), each to a temporary file; ``"flush"`` renames each into place as soon as it
        is written, ``"fsync"`` syncs the filesystem once, then renames them all and syncs
        each directory once. When it returns every chunk of the batch is in its final file
        and in the index (or counted in ``stats().errors`` and absent), with the promise of
        ``put`` for the store's durability; events come in the batch's order. A key given
        twice is written once, with its last value (the last ``put`` wins).
        """
        checked: dict[ChunkKey, tuple[bytes, ChunkKey | None]] = {}
        for k, v in items:
            k = check_key(k)
            value, parent = validate_chunk(k, v)
            checked.pop(k, None)  # a repeated key: its last value, at its last place
            checked[k] = (value, parent)
        if self._behind:
            for k, (v, parent) in checked.items():
                self._put_behind(k, v, parent)
            return
        if len(checked) == 1:  # nothing to share out: put's own path
            for k, (v, parent) in checked.items():
                job = self._admit(k, v, parent)
                if job is not None:
                    self._finish(job, self._write(job, sync=self._fsync))
            return
        # in _queued while being written: no reader or re-listing of this process indexes a
        # renamed file before _finish does (it would count its bytes beside the reservation)
        jobs = [j for j in (self._admit(k, v, p, queue=True) for k, (v, p) in checked.items())
                if j is not None]
        if not jobs:
            return
        batch = WriteBatch(self._stage if self._fsync else self._stage_and_rename, jobs)
        try:
            HELPERS.run(batch, min(self._writer_threads, len(jobs) - 1))
        finally:
            if self._fsync:
                self._rename_synced(jobs, batch.results)
            else:
                for job, path in zip(jobs, batch.results):
                    self._finish(job, path is not None)

    def _stage_and_rename(self, job: _Job) -> str | None:
        """Write one chunk to its final file ("flush"): its path, None on failure."""
        tmp = self._stage(job)
        if tmp is None or not self._rename(job, tmp):
            return None
        return tmp

    def _rename_synced(self, jobs: list[_Job], staged: list[str | None]) -> None:
        """"fsync" put_many's second half: one filesystem sync, the renames, a sync per
        directory renamed into; every job finished (indexed, or released if it failed)."""
        if any(tmp is not None for tmp in staged):
            self._sync_root()
        dirs: set[str] = set()
        for job, tmp in zip(jobs, staged):
            ok = False
            if tmp is not None and self._rename(job, tmp):
                dirs.add(os.path.dirname(tmp))
                ok = True
            self._finish(job, ok)
        for d in dirs:
            fsync_dir(d)

    def _admit(self, key: ChunkKey, value: bytes, parent: ChunkKey | None, *,
               queue: bool = False) -> _Job | None:
        """Seal a validated chunk and make room for its write; None if it is not to be written.

        ``queue`` (write-behind): the job enters ``_queued`` in the same hold of ``_lock`` that
        reserves its room, so no reader ever finds the key neither indexed nor queued (it would
        re-index the replaced file on top of the reservation)."""
        if self.sealer is not None:
            value = self.sealer.seal(value)
        size = len(value)
        if size > self.capacity_bytes:
            with self._lock:
                self._rejected += 1
            return None
        with self._lock:
            old = self._lru.remove(key)  # replacing: its bytes are freed first
            existed = old is not None
            pins = old.pins if old is not None else 0
            evicted: list[ChunkKey] = []
            ACTIVITY.at = time.monotonic()
            # no re-listing here: the refresher indexes other processes' files meanwhile
            if self._lru.bytes + self._reserved + size > self.capacity_bytes:
                with self._flock():
                    ok, evicted = self._evict_to(size, parent)
            else:
                ok = True
            job = None
            if ok:
                self._reserved += size
                job = _Job(key, value, parent, existed, pins)
                if queue:
                    self._queued[key] = job
            else:
                self._rejected += 1
        for k in evicted:
            self._emit("evict", k, "evict")
        if job is None and existed:
            self._forget_or_keep(key)
        return job

    def _finish(self, job: _Job, written: bool) -> None:
        if not written:
            with self._lock:
                self._reserved -= len(job.value)
                if self._queued.get(job.key) is job:
                    del self._queued[job.key]
            if job.existed:  # the old file was not replaced
                self._forget_or_keep(job.key)
            return
        path = self._path(job.key)
        with self._lock:  # reservation to index in one step: the bytes are never uncounted
            self._reserved -= len(job.value)
            if self._queued.get(job.key) is job:  # the newest write of the key: readable now
                del self._queued[job.key]
            if not os.path.exists(path):
                # renamed into place, then unlinked before this hold of the lock: another write
                # of the key was indexed meanwhile and evicted (evictions unlink under _lock),
                # taking this file with it. Indexing it now would list a chunk with no file.
                self._puts += 1
                return
            self._lru.add(job.key, len(job.value), job.parent)
            for _ in range(job.pins):
                self._lru.pin(job.key)
            self._puts += 1
            evicted = self._enforce_budget(job.key)
        if not job.existed:  # before the evictions: the chunk itself may be one of them
            self._emit("store", job.key, "put")
        for k in evicted:
            self._emit("evict", k, "evict")

    def _enforce_budget(self, protect: ChunkKey | None) -> list[ChunkKey]:
        """Evict until the index is within the budget again (caller holds ``_lock``).

        Admission reserves room before a write, but concurrent writers, readers indexing a
        file another writer just renamed into place, and re-listings can still leave the index
        a chunk over: this restores the bound whatever the interleaving was. ``protect`` is
        spared while anything else can go; when nothing else can (the rest is queued or
        pinned), it is evicted too rather than leave the budget exceeded."""
        if self._lru.bytes + self._reserved <= self.capacity_bytes:
            return []
        with self._flock():
            ok, evicted = self._evict_to(0, protect)
            if not ok and protect is not None:
                _, more = self._evict_to(0, None)
                evicted += more
        return evicted

    def _forget_or_keep(self, key: ChunkKey) -> None:
        # the old file is still on disk: re-index it so the budget stays truthful (other writes
        # may have taken the room its removal freed meanwhile: enforce the budget again)
        try:
            header, size, _, _ = self._read_header(self._path(key), key)
        except (OSError, CorruptEntryError):
            return
        with self._lock:
            self._lru.add(key, size, parent_of(header))
            evicted = self._enforce_budget(key)
        for k in evicted:
            self._emit("evict", k, "evict")

    def _write(self, job: _Job, *, sync: bool) -> bool:
        tmp = self._stage(job, sync=sync)
        if tmp is None:
            return False
        if not self._rename(job, tmp):
            return False
        if sync:
            fsync_dir(os.path.dirname(tmp))
        return True

    def _stage(self, job: _Job, *, sync: bool = False) -> str | None:
        """Write a chunk to a fresh temporary file next to its final name; None on failure."""
        h = job.key.hex()
        shard = f"{self._root_s}{h[:2]}"
        tmp = f"{shard}/.{h}.{os.getpid()}.{next(self._tmp_seq)}{_TMP_SUFFIX}"
        fd = -1
        try:
            if shard not in self._shard_dirs:
                os.makedirs(shard, exist_ok=True)
                self._shard_dirs.add(shard)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # the shard directory was removed under us
                self._shard_dirs.discard(shard)
                os.makedirs(shard, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            size = len(job.value)
            if self._preallocate and size >= _PREALLOCATE_MIN:
                self._allocate(fd, size)
            view = memoryview(job.value)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if sync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            return tmp
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            self._write_failed(job.key, tmp, exc)
            return None

    def _allocate(self, fd: int, size: int) -> None:
        """Allocate a new file's blocks in one call; ``OSError`` when the disk is full."""
        why = preallocate(fd, size)
        if why is not None:  # this filesystem does not preallocate: stop asking
            self._preallocate = False
            logger.debug("DiskStore %s: the filesystem does not preallocate (%s)", self.path,
                         why)

    def _rename(self, job: _Job, tmp: str) -> bool:
        try:
            os.replace(tmp, self._path(job.key))
            return True
        except OSError as exc:
            self._write_failed(job.key, tmp, exc)
            return False

    def _write_failed(self, key: ChunkKey, tmp: str, exc: OSError) -> None:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        level = logging.WARNING if exc.errno != errno.ENOENT else logging.DEBUG
        logger.log(level, "DiskStore: could not write chunk %s: %s", key.hex()[:16], exc)
        with self._lock:
            self._errors += 1

    def _sync_root(self) -> None:
        sync_filesystem(self.path)

    def prefetch(self, keys: Sequence[ChunkKey]) -> None:
        """Ask the operating system to start reading these chunks' files into memory, on one of
        the process's helper threads, and return at once (``posix_fadvise(WILLNEED)``: the whole
        of every file is requested at once instead of a read-ahead window at a time per file
        as ``get`` reads it). A later ``get`` / ``get_into`` (still verified as always) then
        finds the bytes in memory sooner when they were not (measured here, 16 chunks of 3 MiB
        dropped from the page cache: a load of 70.6 ms, 48 ms with the prefetch first). Keys
        without a file are skipped; a failure is ignored (it only means no head start)."""
        paths = [self._path(check_key(k)) for k in keys]
        if not paths or not hasattr(os, "posix_fadvise"):
            return
        try:
            HELPERS.submit(advise_willneed, paths)
        except RuntimeError:  # interpreter shutting down
            pass

    def contains(self, key: ChunkKey) -> bool:
        key = check_key(key)
        return key in self._queued or os.path.exists(self._path(key))

    def delete(self, key: ChunkKey) -> bool:
        key = check_key(key)
        if key in self._queued:
            self.flush()  # its queued write lands first, then it is deleted
        try:
            os.unlink(self._path(key))
            existed = True
        except FileNotFoundError:
            existed = False
        with self._lock:
            known = self._lru.remove(key) is not None
        if existed or known:
            self._emit("evict", key, "delete")
        return existed

    def scan(self) -> Iterator[ChunkKey]:
        """Keys of every chunk file in the directory (all processes' writes)."""
        # queued keys first: a write that lands during the listing is in one list or the other
        with self._lock:
            queued = list(self._queued)
        keys: list[ChunkKey] = []
        for shard in self._shards():
            try:
                names = os.listdir(shard.path)
            except OSError:
                continue
            for name in names:
                key = _key_from_name(name)
                if key is not None:
                    keys.append(key)
        if queued:  # accepted, not yet written
            on_disk = set(keys)
            keys += [k for k in queued if k not in on_disk]
        return iter(keys)

    def clear(self) -> None:
        """Delete every chunk file (pinned ones included; queued writes land first)."""
        self.flush()
        for key in list(self.scan()):
            self.delete(key)

    def stats(self) -> StoreStats:
        """Counters; ``entries`` and ``bytes`` include accepted chunks still queued, ``puts``
        counts chunks written."""
        with self._lock:
            queued = [len(j.value) for k, j in self._queued.items() if k not in self._lru]
            return StoreStats(
                name=self.name, entries=len(self._lru) + len(queued),
                bytes=self._lru.bytes + sum(queued),
                capacity_bytes=self.capacity_bytes, hits=self._hits, misses=self._misses,
                puts=self._puts, rejected=self._rejected, evictions=self._evictions,
                corrupt=self._corrupt, errors=self._errors, pinned=self._lru.pinned,
            )

    # pinning (this process's view): pin / unpin / eviction_order come from LruPinning

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru) + sum(k not in self._lru for k in self._queued)

    def __repr__(self) -> str:
        return (f"DiskStore({str(self.path)!r}, entries={len(self._lru)}, "
                f"bytes={self._lru.bytes}, capacity_bytes={self.capacity_bytes})")
