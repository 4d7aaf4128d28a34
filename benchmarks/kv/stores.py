"""KV store throughput against the floors the engine benchmark compares to.

For chunks shaped like a Qwen2.5-0.5B layer stack (24 layers x K,V x 2 KV heads x T tokens
x 64 dims, fp16; T = 256 is 3 MiB per chunk) it measures, in one run:

* the floors: memcpy bandwidth (numpy copy of a 256 MiB buffer) and sequential file read
  bandwidth, both from the page cache ("warm") and after dropping the file's pages with
  ``posix_fadvise(DONTNEED)`` ("cold", the device itself);
* per store (memory, disk, redis, tiered memory+disk): put and get throughput, and the
  ratio of get time to its floor (bytes / memcpy bandwidth for memory and redis, bytes /
  sequential read bandwidth for disk). Every get is a full validated read (disk and redis
  verify the XXH3 checksum; memory returns the stored object without copying).

Run: ``python -m benchmarks.kv.stores [--json out.json] [--tokens 16,64,256]``.
Redis: ``--redis-url`` or, if omitted, a private redis-server on a free port (Debian's
redis-server must be installed; ``--no-redis`` skips it).

``--lmcache-python .venv-lmcache/bin/python`` compares, in the same run, against LMCache's own
storage backends on the same chunks: LMCache runs as a persistent process in the environment
that has ``lmcache`` (``benchmarks/_lmcache_driver.py --serve``), and each of its passes (a pass:
every chunk once) runs back to back with the matching semcomm pass, so both see the same moment
of a shared machine; the figures are medians of the per-pair ratios. Every put round writes new
chunks into a fresh store on both sides (the previous round's files deleted); semcomm's are
encoded right before each put pass (outside the timing: LMCache's likewise start in its memory
objects), so ``put`` gets ``encode_chunk``'s own objects and does not hash them again, as from
the engine and the vLLM connector; in rounds 2-3, 6-7, ... the flush pass puts copies instead
("bytes hashed at put": what a put of bytes from anywhere else costs). Gets read and drop
each chunk; ``get_into`` reads into one reused buffer (LMCache reads into its staging pool): a
``bytearray``, and ``semcomm.kv.staging_buffer`` (huge pages) as ``get_into_staging``; the
DiskStore at its three durabilities (``flush``: one ``put`` per chunk, and one ``put_many`` of
the whole pass, written by the caller and the store's ``writer_threads`` helpers and returning
once every chunk is in its file and the index: the point LMCache's put is timed to, with its 4
writer threads; ``write-behind``: one
``put`` per chunk, then ``flush()``, timed to the point LMCache's put is timed to, every file
written and indexed, with the time until every ``put`` returned beside LMCache's time until every
``submit_put_task`` returned; ``fsync``: ``put_many`` per batch of ``--batch`` chunks, run last
in each round). Every put pass starts from a synced filesystem (``os.sync`` before it: no pass
pays for another's dirty pages, deleted files or new directories); LMCache's goes first in even
rounds and last in odd ones, and semcomm's three passes rotate (each first, second and last
in turn). CPU seconds
of each put pass (all threads of the process) are kept beside the wall times. Then a restart (a
new store on the same directory: chunks found) and a tamper test (one payload byte flipped:
served or rejected).
Writes a table, ``--json`` (every sample kept) and ``--png`` (ratios semcomm / LMCache).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from semcomm.kv import (
    ChunkKey,
    ChunkStore,
    DiskStore,
    MemoryStore,
    Namespace,
    RedisStore,
    TieredStore,
    chunk_keys,
    encode_chunk,
    staging_buffer,
)
from semcomm.kv._disk import DEFAULT_MAX_PENDING_BYTES, DEFAULT_WRITER_THREADS

MiB = 1 << 20


def chunk_set(n: int, tokens: int, layers: int, heads: int, head_dim: int,
              seed: int = 0) -> list[tuple[ChunkKey, bytes]]:
    """``n`` chained chunks of fp16 KV: k.i / v.i of shape [heads, tokens, head_dim] per layer."""
    ns = Namespace(model="bench-qwen2.5-0.5b-shape", tokenizer="", dtype="float16",
                   codec="none", tenant="bench")
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 150_000, size=n * tokens)
    keys = chunk_keys(ns.digest, toks, tokens)
    base = rng.standard_normal((heads, tokens, head_dim)).astype(np.float16)
    out: list[tuple[ChunkKey, bytes]] = []
    parent: bytes | None = None
    for i, key in enumerate(keys):
        arrays = {}
        for layer in range(layers):
            arrays[f"k.{layer}"] = base + np.float16(i + layer)
            arrays[f"v.{layer}"] = base - np.float16(i + layer)
        out.append((key, encode_chunk(namespace=ns.digest, key=key, parent=parent,
                                      num_tokens=tokens, start=i * tokens, dtype="float16",
                                      codec="none", codec_params={}, arrays=arrays)))
        parent = key
    return out


def best_of(fn: Callable[[], None], repeat: int) -> float:
    """Fastest wall time of ``repeat`` runs (the least disturbed by the shared machine)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_bandwidth(nbytes: int = 256 * MiB, repeat: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / best_of(lambda: np.copyto(dst, src), repeat)


def drop_cache(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def seq_read_bandwidth(directory: Path, nbytes: int = 256 * MiB, repeat: int = 3,
                       cold: bool = False) -> float:
    path = directory / "seqread.bin"
    block = os.urandom(8 * MiB)
    with open(path, "wb") as f:
        f.writelines(block for _ in range(nbytes // len(block)))
        f.flush()
        os.fsync(f.fileno())

    def read() -> None:
        if cold:
            drop_cache(path)
        buf = bytearray(8 * MiB)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    read()  # warm the page cache (warm case) / the inode (cold case)
    bw = nbytes / best_of(read, repeat)
    path.unlink()
    return bw


@contextmanager
def private_redis() -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (pass --no-redis or --redis-url)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="semcomm-bench-redis-")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", d],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(d, ignore_errors=True)


def make_store(name: str, tokens: int, work: Path, redis_url: str | None) -> ChunkStore:
    if name == "memory":
        return MemoryStore(capacity_bytes=4 << 30)
    if name == "disk":
        return DiskStore(work / f"disk-{tokens}")
    if name == "redis":
        assert redis_url is not None
        return RedisStore(redis_url, prefix=f"bench:{tokens}:")
    return TieredStore([MemoryStore(capacity_bytes=4 << 30), DiskStore(work / f"tier-{tokens}")])


def measure(make: Callable[[], ChunkStore], items: list[tuple[ChunkKey, bytes]],
            repeat: int, cold_disk: Path | None = None) -> dict[str, float]:
    store = make()
    nbytes = sum(len(v) for _, v in items)

    def put_all() -> None:
        for k, v in items:
            store.put(k, v)

    def get_all() -> None:
        for k, _ in items:
            assert store.get(k) is not None

    def lookup() -> None:
        store.lookup(keys)

    keys = [k for k, _ in items]
    put_s = best_of(put_all, repeat)
    get_s = best_of(get_all, repeat)
    out = {"put_GBps": nbytes / put_s / 1e9, "get_GBps": nbytes / get_s / 1e9,
           "get_ms_per_chunk": get_s / len(items) * 1e3,
           "lookup_us": best_of(lookup, repeat) * 1e6}
    if cold_disk is not None:
        def get_cold() -> None:
            for k, _ in items:
                drop_cache(cold_disk / k.hex()[:2] / f"{k.hex()}.sckv")
            t0 = time.perf_counter()
            get_all()
            timings.append(time.perf_counter() - t0)

        timings: list[float] = []
        for _ in range(repeat):
            get_cold()
        out["get_cold_GBps"] = nbytes / min(timings) / 1e9
    close = getattr(store, "close", None)
    if close is not None:
        close()
    return out


class LMCacheServer:
    """LMCache's backends in their own environment, one operation per call (``--serve``)."""

    def __init__(self, py: str) -> None:
        driver = Path(__file__).with_name("_lmcache_driver.py")
        self.proc = subprocess.Popen([py, str(driver), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.version = self._reply()["lmcache_version"]

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return dict(json.loads(line[2:]))
        raise SystemExit(f"LMCache driver exited (status {self.proc.wait()})")

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def empty_chunk_dir(path: Path) -> None:
    """Delete a DiskStore directory's chunk files, keeping its shard directories."""
    for shard in path.iterdir():
        if shard.is_dir():
            for f in shard.iterdir():
                f.unlink()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds of every thread of this process (writer threads too)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def paired_size(lm: LMCacheServer, tokens: int, args: argparse.Namespace,
                work: Path) -> tuple[list[dict[str, Any]], list[tuple[str, str, str, list[float]]]]:
    """One chunk size: LMCache and semcomm operations alternated, every sample kept.

    Returns the rows (medians of per-chunk times) and the paired samples
    ``(ours, theirs, op, [their time / our time ...])``: each ratio compares two passes over
    the same number of chunks run back to back, so both saw the same moment of the machine.
    """
    # bytes of a chunk with a parent (every chunk but a chain's first, which is 32 bytes shorter)
    one = len(chunk_set(2, tokens, args.layers, args.heads, args.head_dim)[1][1])
    n = max(4, args.mib * MiB // one)
    theirs_bytes = lm("open", tokens=tokens, chunks=n, layers=args.layers, heads=args.heads,
                      head_dim=args.head_dim)["chunk_bytes"]
    samples: dict[tuple[str, str], list[float]] = {}  # (backend, op) -> seconds per pass
    pairs: dict[tuple[str, str, str], list[float]] = {}

    def add(backend: str, op: str, t: float) -> None:
        samples.setdefault((backend, op), []).append(t)

    def pair(ours: str, theirs: str, op: str, t_ours: float, t_theirs: float) -> None:
        pairs.setdefault((ours, theirs, op), []).append(t_theirs / t_ours)

    buf = bytearray(one)  # get_into's, reused (LMCache: its pool); no chunk is larger
    staging = staging_buffer(one)  # the same, from semcomm's staging allocator (huge pages)
    stores: list[DiskStore] = []
    labels = ("semcomm disk flush", "semcomm disk fsync (put_many)", "semcomm disk write-behind",
              "semcomm disk flush (bytes hashed at put)", "semcomm disk flush (put_many)")
    written: dict[str, list[tuple[ChunkKey, bytes]]] = {}  # each store's chunks, last round
    seeds = iter(range(1, 1 << 30))

    def fresh() -> list[tuple[ChunkKey, bytes]]:
        """New chunks, just encoded (outside the timing): what the engine and the vLLM connector
        hand to ``put``, so the store checks them without hashing them a second time (their
        checksum was computed by ``encode_chunk``); LMCache's put likewise starts from chunks
        already in its memory objects."""
        return chunk_set(n, tokens, args.layers, args.heads, args.head_dim, seed=next(seeds))

    def plain() -> list[tuple[ChunkKey, bytes]]:
        """New chunks as bytes from anywhere else (a copy): put verifies their checksum."""
        return [(k, bytes(bytearray(v))) for k, v in fresh()]

    for r in range(args.rounds):
        for st in stores:  # the previous round's chunk files go, and LMCache's
            st.close()
            empty_chunk_dir(st.path)
        lm("clear")
        # each store is new but its directory is not: the 256 shard directories stay, as
        # they do for a store in use (a fresh set of 256 per store and round, deleted the
        # next round, made every file creation scan thousands of recently deleted inodes)
        flush = DiskStore(work / f"p{tokens}-flush", capacity_bytes=8 << 30)
        fsync = DiskStore(work / f"p{tokens}-fsync", capacity_bytes=8 << 30,
                          durability="fsync")
        behind = DiskStore(work / f"p{tokens}-behind", capacity_bytes=8 << 30,
                           durability="write-behind", writer_threads=args.writer_threads,
                           max_pending_bytes=args.max_pending_mib << 20)
        many = DiskStore(work / f"p{tokens}-many", capacity_bytes=8 << 30,
                         writer_threads=args.writer_threads)
        stores = [flush, fsync, behind, many]
        f, g = flush, fsync
        # the flush pass of rounds 2-3, 6-7, ... puts plain bytes (hashed at put) instead of
        # chunks just encoded: both kinds from the same store, each with LMCache first and last
        flush_label = labels[3] if (r // 2) % 2 else labels[0]

        def put_flush(f: DiskStore = flush, label: str = flush_label) -> None:
            for k, v in written[label]:
                f.put(k, v)

        accepted: list[float] = []

        def put_behind(b: DiskStore = behind, acc: list[float] = accepted,
                       label: str = labels[2]) -> None:
            t0 = time.perf_counter()
            for k, v in written[label]:
                b.put(k, v)
            acc.append(time.perf_counter() - t0)  # every put returned (LMCache: submitted)
            b.flush()  # timed to the same point as LMCache's: every file written and indexed

        def put_many(m: DiskStore = many, label: str = labels[4]) -> None:
            m.put_many(written[label])  # returns once every chunk is written and indexed

        ours = [(flush_label, put_flush, plain if flush_label == labels[3] else fresh),
                (labels[2], put_behind, fresh), (labels[4], put_many, fresh)]
        ours = ours[r % 3:] + ours[: r % 3]  # each of ours first, second and last in turn
        timed: dict[str, float] = {}
        cpus: dict[str, float] = {}  # CPU seconds of the pass (all of our threads)
        # every put pass starts from a synced filesystem: no pass pays for another's dirty
        # pages, deleted files or new directories (the journal's work is done before timing)
        first_lm = r % 2 == 0  # alternate whether LMCache goes first or last
        if first_lm:
            os.sync()
            lm_put = lm("put")
        for label, fn, make in ours:
            written[label] = make()
            os.sync()
            timed[label], cpus[label] = _timed_cpu(fn)
        if not first_lm:
            os.sync()
            lm_put = lm("put")
        keys = [k for k, _ in written[flush_label]]  # the gets read the flush store's chunks
        t_lm = lm_put["s"]
        t_lm_put = t_lm
        add("lmcache-disk", "put", t_lm)
        add("lmcache-disk", "put_accept", lm_put["submit_s"])
        add("lmcache-disk", "put_cpu", lm_put["cpu_s"])
        add("semcomm disk write-behind", "put_accept", accepted[0])
        pair("semcomm disk write-behind", "lmcache-disk", "put_accept", accepted[0],
             lm_put["submit_s"])
        for label, t in timed.items():
            add(label, "put", t)
            pair(label, "lmcache-disk", "put", t, t_lm)
            add(label, "put_cpu", cpus[label])
            pair(label, "lmcache-disk", "put_cpu", cpus[label], lm_put["cpu_s"])
        for j in range(args.repeat):
            t_lm = lm("get")["s"]
            gets = {"get": lambda f=f, ks=keys: [f.get(k) for k in ks],
                    "get_into": lambda f=f, ks=keys: [f.get_into(k, buf) for k in ks],
                    "get_into_staging": lambda f=f, ks=keys: [f.get_into(k, staging)
                                                              for k in ks]}
            order = list(gets) if j % 2 == 0 else list(gets)[::-1]
            t_ours = {op: _timed(gets[op]) for op in order}
            t_get, t_into = t_ours["get"], t_ours["get_into"]
            t_lm2 = lm("get")["s"]  # bracket: LMCache before and after ours
            t_lmb = lm("batched_get", batch=args.batch)["s"]
            t_b = _timed(lambda f=f, ks=keys: [f.fetch_many(ks[i : i + args.batch])
                                      for i in range(0, n, args.batch)])
            for t in (t_lm, t_lm2):
                add("lmcache-disk", "get", t)
            add("semcomm disk flush", "get", t_get)
            add("semcomm disk flush", "get_into", t_into)
            add("semcomm disk flush", "get_into_staging", t_ours["get_into_staging"])
            add("lmcache-disk", "batched_get", t_lmb)
            add("semcomm disk flush", "batched_get", t_b)
            mid = (t_lm + t_lm2) / 2
            pair("semcomm disk flush", "lmcache-disk", "get", t_get, mid)
            pair("semcomm disk flush", "lmcache-disk", "get_into", t_into, mid)
            pair("semcomm disk flush", "lmcache-disk", "get_into_staging",
                 t_ours["get_into_staging"], mid)
            pair("semcomm disk flush", "lmcache-disk", "batched_get", t_b, t_lmb)
        # fsync last in the round: its filesystem syncs would slow whatever runs next
        written[labels[1]] = batch_items = fresh()
        t_fsync = _timed(lambda g=g, b=batch_items: [g.put_many(b[i : i + args.batch])
                                      for i in range(0, n, args.batch)])
        add("semcomm disk fsync (put_many)", "put", t_fsync)
        pair("semcomm disk fsync (put_many)", "lmcache-disk", "put", t_fsync, t_lm_put)
        cpu = lm("cpu")
        mem = MemoryStore(capacity_bytes=4 << 30)
        mem_items = fresh()
        t_mput = _timed(lambda mem=mem, m=mem_items: [mem.put(k, v) for k, v in m])
        # a consumer that keeps the data copies it (LMCache side: clone)
        t_mget = _timed(lambda mem=mem, m=mem_items: [bytearray(mem.get(k) or b"")
                                                       for k, _ in m])
        add("lmcache-cpu", "put", cpu["put_s"])
        add("lmcache-cpu", "get", cpu["get_s"])
        add("semcomm memory", "put", t_mput)
        add("semcomm memory", "get", t_mget)
        pair("semcomm memory", "lmcache-cpu", "put", t_mput, cpu["put_s"])
        pair("semcomm memory", "lmcache-cpu", "get", t_mget, cpu["get_s"])
    checks = lm("checks")
    mine = {}
    last_flush = flush_label
    for label, st in zip((*labels[:3], labels[4]), stores):
        st.close()  # write-behind: writes what is still queued (flush() already did)
        reopened = DiskStore(st.path, capacity_bytes=8 << 30)
        found = len(reopened)
        k0 = written[last_flush if label == labels[0] else label][0][0]
        path = st.path / k0.hex()[:2] / f"{k0.hex()}.sckv"
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
        mine[label] = (found, reopened.get(k0) is not None)
        reopened.close()
        shutil.rmtree(st.path, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    for backend in ("lmcache-disk", "lmcache-cpu", "semcomm disk flush",
                    "semcomm disk flush (put_many)",
                    "semcomm disk write-behind", "semcomm disk fsync (put_many)",
                    "semcomm disk flush (bytes hashed at put)", "semcomm memory"):
        cb = theirs_bytes if backend.startswith("lmcache") else one
        row: dict[str, Any] = {"backend": backend, "tokens": tokens, "chunk_bytes": cb,
                               "chunks": n, "samples_us": {}}
        for (b, op), ts in samples.items():
            if b != backend:
                continue
            us = [t / n * 1e6 for t in ts]
            row["samples_us"][op] = us
            row[f"{op}_us_per_chunk"] = statistics.median(us)
            row[f"{op}_GBps"] = cb / statistics.median(us) / 1e3
        if backend == "lmcache-disk":
            row["found_after_restart"] = checks["found_after_restart"]
            row["tampered_chunk_served"] = checks["tampered_chunk_served"]
        elif backend in mine:
            found, served = mine[backend]
            row["found_after_restart"] = found
            row["tampered_chunk_served"] = served
        rows.append(row)
    return rows, [(o, t, op, xs) for (o, t, op), xs in pairs.items()]


def compare_lmcache(args: argparse.Namespace, console: Console, work: Path) -> dict[str, Any]:
    tokens = [int(t) for t in args.tokens.split(",")]
    lm = LMCacheServer(args.lmcache_python)
    rows: list[dict[str, Any]] = []
    paired: dict[tuple[str, str, str, int], list[float]] = {}
    try:
        for t in tokens:
            r, p = paired_size(lm, t, args, work)
            rows += r
            for o, th, op, xs in p:
                paired[(o, th, op, t)] = xs
            console.print(f"T={t}: done")
    finally:
        lm.close()
    lm_info = {"lmcache_version": lm.version}
    by = {(r["backend"], r["tokens"]): r for r in rows}
    ratios: list[dict[str, Any]] = []
    for t in tokens:
        for ours, theirs in (("semcomm disk flush", "lmcache-disk"),
                             ("semcomm disk flush (put_many)", "lmcache-disk"),
                             ("semcomm disk write-behind", "lmcache-disk"),
                             ("semcomm disk flush (bytes hashed at put)", "lmcache-disk"),
                             ("semcomm disk fsync (put_many)", "lmcache-disk"),
                             ("semcomm memory", "lmcache-cpu")):
            q: dict[str, Any] = {"semcomm": ours, "lmcache": theirs, "tokens": t}
            # bytes per chunk differ a little (semcomm's carry a header and a checksum): the
            # ratio of back-to-back pass times, scaled to a ratio of throughputs
            a, b = by[(ours, t)]["chunk_bytes"], by[(theirs, t)]["chunk_bytes"]
            for (o, th, op, tt), xs in paired.items():
                if (o, th, tt) == (ours, theirs, t):
                    q[f"{op}_ratio"] = statistics.median(xs) * a / b
                    q[f"{op}_pairs"] = len(xs)
            ratios.append(q)
    version = lm_info["lmcache_version"]
    table = Table(title=f"semcomm vs LMCache {version} storage backends (one run; medians of "
                        "back-to-back pass ratios; > 1: semcomm faster)")
    for col in ("semcomm store", "LMCache backend", "tokens", "put us/chunk (ours / theirs)",
                "put ratio", "puts returned ratio", "get us/chunk (ours / theirs)", "get ratio",
                "get_into us/chunk",
                "get_into ratio", "staging ratio", "batched get us/chunk", "batched ratio"):
        table.add_column(col, justify="left" if "store" in col or "backend" in col else "right")

    def us(a: dict[str, Any], b: dict[str, Any] | None, op: str) -> str:
        if f"{op}_us_per_chunk" not in a:
            return "-"
        mine = f"{a[f'{op}_us_per_chunk']:.0f}"
        return mine if b is None else f"{mine} / {b[f'{op}_us_per_chunk']:.0f}"

    def ratio(q: dict[str, Any], op: str) -> str:
        return f"{q[f'{op}_ratio']:.2f}x" if f"{op}_ratio" in q else "-"

    for q in ratios:
        a, b = by[(q["semcomm"], q["tokens"])], by[(q["lmcache"], q["tokens"])]
        table.add_row(q["semcomm"], q["lmcache"], str(q["tokens"]), us(a, b, "put"),
                      ratio(q, "put"), ratio(q, "put_accept"), us(a, b, "get"), ratio(q, "get"),
                      us(a, None, "get_into"), ratio(q, "get_into"), ratio(q, "get_into_staging"),
                      us(a, b, "batched_get"),
                      ratio(q, "batched_get"))
    console.print(table)
    for r in rows:
        if "found_after_restart" in r:
            console.print(f"{r['backend']:<32} T={r['tokens']:<4} after restart found "
                          f"{r['found_after_restart']}/{r['chunks']}; tampered chunk "
                          f"{'SERVED' if r['tampered_chunk_served'] else 'rejected'}")
    if args.png:
        draw_ratios(ratios, Path(args.png), version)
        console.print(f"wrote {args.png}")
    return {"lmcache_version": version, "rows": rows, "ratios": ratios,
            "protocol": "paired: LMCache and semcomm passes back to back, medians of ratios"}


def draw_ratios(ratios: list[dict[str, Any]], path: Path, version: str) -> None:
    from benchmarks.common import agg_figure

    labels = sorted({q["semcomm"] for q in ratios})
    tokens = sorted({q["tokens"] for q in ratios})
    ops = ("put", "put_accept", "get", "get_into", "get_into_staging", "batched_get")
    hatch = {"put": "", "put_accept": "--", "get": "//", "get_into": "xx",
             "get_into_staging": "++", "batched_get": ".."}
    series = [(label, op) for label in labels for op in ops
              if any(q.get(f"{op}_ratio") for q in ratios if q["semcomm"] == label)]
    with agg_figure(path, (10, 5.6)) as ax:
        width = 0.84 / len(series)
        for j, (label, op) in enumerate(series):
            xs = [ti + j * width - 0.42 + width / 2 for ti in range(len(tokens))]
            ys = [next((q.get(f"{op}_ratio", 0.0) for q in ratios
                        if q["semcomm"] == label and q["tokens"] == t), 0.0) for t in tokens]
            name = "puts returned" if op == "put_accept" else op.replace("_", " ")
            ax.bar(xs, ys, width, label=f"{label}: {name}", hatch=hatch[op])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(tokens)), [f"{t} tokens" for t in tokens])
        ax.set_yscale("log")
        ax.set_ylabel(f"throughput ratio semcomm / LMCache {version}")
        ax.set_title("> 1: semcomm faster (medians of back-to-back pass ratios, one run)",
                     fontsize=9)
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16,64,256", help="tokens per chunk, comma separated")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--mib", type=int, default=96, help="MiB of chunks per store and size")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--dir", default=None, help="directory for the disk store (default: a tmp dir)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here")
    ap.add_argument("--lmcache-python", default=None,
                    help="python of an environment with lmcache: compare against its backends")
    ap.add_argument("--only-lmcache", action="store_true",
                    help="with --lmcache-python: skip the floors and the per-store table")
    ap.add_argument("--batch", type=int, default=16, help="chunks per put_many (fsync)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved LMCache/semcomm rounds")
    ap.add_argument("--writer-threads", type=int, default=DEFAULT_WRITER_THREADS,
                    help="writer threads of the write-behind DiskStore (its default)")
    ap.add_argument("--max-pending-mib", type=int, default=DEFAULT_MAX_PENDING_BYTES >> 20,
                    help="queue bound of the write-behind DiskStore, MiB (its default)")
    ap.add_argument("--png", default=None, help="with --lmcache-python: ratio chart here")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 MiB per store and size, one repetition, no Redis")
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.repeat, args.no_redis, args.rounds = 2, 1, True, 1
    console = Console(width=150)

    work = Path(args.dir or tempfile.mkdtemp(prefix="semcomm-bench-kv-"))
    work.mkdir(parents=True, exist_ok=True)
    comparison: dict[str, Any] | None = None
    if args.lmcache_python:
        comparison = compare_lmcache(args, console, work)
        if args.only_lmcache:
            if args.json_path:
                payload = {"benchmark": "kv_stores_vs_lmcache", "python": sys.version.split()[0],
                           "shape": {"layers": args.layers, "kv_heads": args.heads,
                                     "head_dim": args.head_dim, "dtype": "float16"},
                           "repeat": args.repeat, "batch": args.batch,
                           "rounds": args.rounds, "mib": args.mib,
                           "writer_threads": args.writer_threads,
                           "max_pending_mib": args.max_pending_mib,
                           # glibc's allocator settings of both processes (fresh memory per
                           # get is page faults unless freed memory is kept: docs/BENCHMARKS.md)
                           "malloc_env": {k: os.environ.get(k) for k in
                                          ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")},
                           "load_average": os.getloadavg(), **comparison}
                Path(args.json_path).write_text(json.dumps(payload, indent=2) + "\n")
                console.print(f"wrote {args.json_path}")
            if args.dir is None:
                shutil.rmtree(work, ignore_errors=True)
            return 0
    console.print(f"[bold]floors[/bold] (work dir {work})")
    floors = {
        "memcpy_GBps": memcpy_bandwidth() / 1e9,
        "seq_read_warm_GBps": seq_read_bandwidth(work) / 1e9,
        "seq_read_cold_GBps": seq_read_bandwidth(work, cold=True) / 1e9,
    }
    console.print({k: round(v, 2) for k, v in floors.items()})

    results: list[dict[str, Any]] = []
    redis_ctx = None
    redis_url = args.redis_url
    if redis_url is None and not args.no_redis:
        redis_ctx = private_redis()
        redis_url = redis_ctx.__enter__()
    try:
        for tokens in [int(t) for t in args.tokens.split(",")]:
            one = len(chunk_set(1, tokens, args.layers, args.heads, args.head_dim)[0][1])
            n = max(4, args.mib * MiB // one)
            items = chunk_set(n, tokens, args.layers, args.heads, args.head_dim)
            console.print(f"tokens/chunk {tokens}: {n} chunks of {one / MiB:.2f} MiB")
            names = ["memory", "disk", "tiered(memory+disk)"]
            if redis_url is not None:
                names.append("redis")
            for name in names:
                make = partial(make_store, name, tokens, work, redis_url)
                cold = work / f"disk-{tokens}" if name == "disk" else None
                r = measure(make, items, args.repeat, cold_disk=cold)
                floor = floors["seq_read_warm_GBps"] if name == "disk" else floors["memcpy_GBps"]
                r["get_vs_floor"] = floor / r["get_GBps"]  # >1: slower than the floor
                if "get_cold_GBps" in r:
                    r["get_cold_vs_floor"] = floors["seq_read_cold_GBps"] / r["get_cold_GBps"]
                results.append({"store": name, "tokens": tokens, "chunk_bytes": one,
                                "chunks": n, **r})
    finally:
        if redis_ctx is not None:
            redis_ctx.__exit__(None, None, None)
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    table = Table(title="KV stores: throughput and distance to the floor (one run)")
    for col in ("store", "tokens", "chunk MiB", "put GB/s", "get GB/s", "get ms/chunk",
                "get / floor", "cold get GB/s", "cold / floor", "lookup us"):
        table.add_column(col, justify="right" if col != "store" else "left")
    for r in results:
        table.add_row(
            str(r["store"]), str(r["tokens"]), f"{r['chunk_bytes'] / MiB:.2f}",
            f"{r['put_GBps']:.2f}", f"{r['get_GBps']:.2f}", f"{r['get_ms_per_chunk']:.3f}",
            f"{r['get_vs_floor']:.2f}x",
            f"{r['get_cold_GBps']:.2f}" if "get_cold_GBps" in r else "-",
            f"{r['get_cold_vs_floor']:.2f}x" if "get_cold_vs_floor" in r else "-",
            f"{r['lookup_us']:.0f}",
        )
    console.print(table)
    console.print(
        f"floors: memcpy {floors['memcpy_GBps']:.2f} GB/s, sequential read "
        f"{floors['seq_read_warm_GBps']:.2f} GB/s (page cache), "
        f"{floors['seq_read_cold_GBps']:.2f} GB/s (cold)")
    if args.json_path:
        payload = {"benchmark": "kv_stores", "python": sys.version.split()[0],
                   "shape": {"layers": args.layers, "kv_heads": args.heads,
                             "head_dim": args.head_dim, "dtype": "float16"},
                   "floors": floors, "results": results}
        if comparison is not None:
            payload["lmcache"] = comparison
        Path(args.json_path).write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
