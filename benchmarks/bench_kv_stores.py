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

Run: ``python benchmarks/bench_kv_stores.py [--json out.json] [--tokens 16,64,256]``.
Redis: ``--redis-url`` or, if omitted, a private redis-server on a free port (Debian's
redis-server must be installed; ``--no-redis`` skips it).

``--lmcache-python .venv-lmcache/bin/python`` adds, in the same run, LMCache's own storage
backends on the same chunks (``benchmarks/_lmcache_driver.py`` drives them in the environment
that has ``lmcache``) next to semcomm's under one protocol: every put round writes new chunks
into a fresh store (LMCache skips keys it holds; semcomm would replace), every get reads and
drops a chunk; the DiskStore at both durabilities (``flush``: one ``put`` per chunk;
``fsync``: ``put_many`` per batch of ``--batch`` chunks). Then a restart (a new store on the same
directory: chunks found) and a tamper test (one payload byte flipped: served or rejected).
Writes a table, ``--json`` and ``--png`` (ratios semcomm / LMCache).
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
)

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


def lmcache_side(py: str, tokens: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """LMCache's backends on the same chunk shapes (a subprocess in LMCache's environment)."""
    plan = {"layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
            "tokens": tokens, "mib": args.mib, "repeat": args.repeat, "batch": args.batch}
    driver = Path(__file__).with_name("_lmcache_driver.py")
    proc = subprocess.run([py, str(driver), json.dumps(plan)], capture_output=True, text=True,
                          check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"LMCache driver failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def semcomm_side(tokens: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """semcomm's stores under the LMCache protocol (fresh store per put round, get and drop)."""
    one = len(chunk_set(1, tokens, args.layers, args.heads, args.head_dim)[0][1])
    n = max(4, args.mib * MiB // one)
    items = chunk_set(n, tokens, args.layers, args.heads, args.head_dim)
    keys = [k for k, _ in items]
    nbytes = sum(len(v) for _, v in items)
    out: list[dict[str, Any]] = []
    for label, durability, batch in (("disk flush", "flush", 0),
                                     ("disk fsync (put_many)", "fsync", args.batch)):
        puts: list[float] = []
        gets: list[float] = []
        igets: list[float] = []
        bgets: list[float] = []
        last = work
        # get_into's buffer: allocated and touched once, reused for every get (LMCache reads
        # into its pre-allocated staging pool the same way)
        buf = bytearray(one)
        for r in range(args.repeat):
            d = work / f"cmp-{tokens}-{durability}-{r}"
            store = DiskStore(d, capacity_bytes=8 << 30, durability=durability)
            t0 = time.perf_counter()
            if batch:
                for i in range(0, n, batch):
                    store.put_many(items[i : i + batch])
            else:
                for k, v in items:
                    store.put(k, v)
            puts.append(time.perf_counter() - t0)
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                for k, _v in items:
                    if store.get(k) is None:
                        raise AssertionError("a chunk just written is missing")
                gets.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for k, _v in items:
                    if store.get_into(k, buf) is None:
                        raise AssertionError("a chunk just written is missing")
                igets.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in range(0, n, args.batch):
                    if any(f is None for f in store.fetch_many(keys[i : i + args.batch])):
                        raise AssertionError("a chunk just written is missing")
                bgets.append(time.perf_counter() - t0)
            store.close()
            last = d
        reopened = DiskStore(last, capacity_bytes=8 << 30)
        found = len(reopened)
        k0 = items[0][0]
        path = last / k0.hex()[:2] / f"{k0.hex()}.sckv"
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
        tampered_served = reopened.get(k0) is not None
        reopened.close()
        out.append({"backend": f"semcomm {label}", "tokens": tokens, "chunk_bytes": one,
                    "chunks": n, "put_GBps": nbytes / min(puts) / 1e9,
                    "get_GBps": nbytes / min(gets) / 1e9,
                    "put_us_per_chunk": min(puts) / n * 1e6,
                    "get_us_per_chunk": min(gets) / n * 1e6,
                    "batched_get_GBps": nbytes / min(bgets) / 1e9,
                    "batched_get_us_per_chunk": min(bgets) / n * 1e6,
                    "get_into_GBps": nbytes / min(igets) / 1e9,
                    "get_into_us_per_chunk": min(igets) / n * 1e6,
                    "found_after_restart": found, "tampered_chunk_served": tampered_served,
                    "samples_us": {"put": [t / n * 1e6 for t in puts],
                                   "get": [t / n * 1e6 for t in gets],
                                   "get_into": [t / n * 1e6 for t in igets],
                                   "batched_get": [t / n * 1e6 for t in bgets]}})
    puts, gets = [], []
    for _ in range(args.repeat):
        mem = MemoryStore(capacity_bytes=4 << 30)
        t0 = time.perf_counter()
        for k, v in items:
            mem.put(k, v)
        puts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k, _v in items:
            got = mem.get(k)
            assert got is not None
            bytearray(got)  # a consumer that keeps the data copies it (LMCache side: clone)
        gets.append(time.perf_counter() - t0)
    out.append({"backend": "semcomm memory", "tokens": tokens, "chunk_bytes": one, "chunks": n,
                "put_GBps": nbytes / min(puts) / 1e9, "get_GBps": nbytes / min(gets) / 1e9,
                "put_us_per_chunk": min(puts) / n * 1e6,
                "get_us_per_chunk": min(gets) / n * 1e6,
                "samples_us": {"put": [t / n * 1e6 for t in puts],
                               "get": [t / n * 1e6 for t in gets]}})
    return out


def compare_lmcache(args: argparse.Namespace, console: Console, work: Path) -> dict[str, Any]:
    tokens = [int(t) for t in args.tokens.split(",")]
    # interleaved: LMCache then semcomm for one chunk size, --rounds times; every timing of
    # every round is kept and the median is reported (the machine's load drifts over minutes,
    # so a side measured only early or late would gain; the median resists the spikes)
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    version = "?"
    for t in tokens:
        for r in range(args.rounds):
            if r % 2 == 0:  # alternate which side goes first
                lm = lmcache_side(args.lmcache_python, [t], args)
                ours = semcomm_side(t, args, work / f"round{r}")
            else:
                ours = semcomm_side(t, args, work / f"round{r}")
                lm = lmcache_side(args.lmcache_python, [t], args)
            version = lm["lmcache_version"]
            for row in [*lm["results"], *ours]:
                key = (row["backend"], row["tokens"])
                if key not in merged:
                    merged[key] = row
                    continue
                for m, xs in row["samples_us"].items():
                    merged[key]["samples_us"][m].extend(xs)
    rows: list[dict[str, Any]] = list(merged.values())
    for row in rows:  # the reported figures: medians over rounds x repeats
        for m, xs in row["samples_us"].items():
            med = statistics.median(xs)
            row[f"{m}_us_per_chunk"] = med
            row[f"{m}_GBps"] = row["chunk_bytes"] / med / 1e3
    lm = {"lmcache_version": version}
    by = {(r["backend"], r["tokens"]): r for r in rows}
    ratios: list[dict[str, Any]] = []
    for t in tokens:
        for ours, theirs in (("semcomm disk flush", "lmcache-disk"),
                             ("semcomm disk fsync (put_many)", "lmcache-disk"),
                             ("semcomm memory", "lmcache-cpu")):
            a, b = by[(ours, t)], by[(theirs, t)]
            q = {"semcomm": ours, "lmcache": theirs, "tokens": t,
                 "put_ratio": a["put_GBps"] / b["put_GBps"],
                 "get_ratio": a["get_GBps"] / b["get_GBps"]}
            if "get_into_GBps" in a:
                q["get_into_ratio"] = a["get_into_GBps"] / b["get_GBps"]
            if "batched_get_GBps" in a and "batched_get_GBps" in b:
                q["batched_get_ratio"] = a["batched_get_GBps"] / b["batched_get_GBps"]
            ratios.append(q)
    table = Table(title=f"semcomm vs LMCache {lm['lmcache_version']} storage backends "
                        "(one run, medians; ratio > 1: semcomm faster)")
    for col in ("semcomm store", "LMCache backend", "tokens", "put us/chunk (ours / theirs)",
                "put ratio", "get us/chunk (ours / theirs)", "get ratio", "get_into us/chunk",
                "get_into ratio", "batched get us/chunk", "batched ratio"):
        table.add_column(col, justify="left" if "store" in col or "backend" in col else "right")
    for q in ratios:
        a, b = by[(q["semcomm"], q["tokens"])], by[(q["lmcache"], q["tokens"])]
        table.add_row(q["semcomm"], q["lmcache"], str(q["tokens"]),
                      f"{a['put_us_per_chunk']:.0f} / {b['put_us_per_chunk']:.0f}",
                      f"{q['put_ratio']:.2f}x",
                      f"{a['get_us_per_chunk']:.0f} / {b['get_us_per_chunk']:.0f}",
                      f"{q['get_ratio']:.2f}x",
                      f"{a['get_into_us_per_chunk']:.0f}" if "get_into_ratio" in q else "-",
                      f"{q['get_into_ratio']:.2f}x" if "get_into_ratio" in q else "-",
                      f"{a['batched_get_us_per_chunk']:.0f} / {b['batched_get_us_per_chunk']:.0f}"
                      if "batched_get_ratio" in q else "-",
                      f"{q['batched_get_ratio']:.2f}x" if "batched_get_ratio" in q else "-")
    console.print(table)
    for r in rows:
        if "found_after_restart" in r:
            console.print(f"{r['backend']:<32} T={r['tokens']:<4} after restart found "
                          f"{r['found_after_restart']}/{r['chunks']}; tampered chunk "
                          f"{'SERVED' if r['tampered_chunk_served'] else 'rejected'}")
    if args.png:
        draw_ratios(ratios, Path(args.png), lm["lmcache_version"])
        console.print(f"wrote {args.png}")
    return {"lmcache_version": lm["lmcache_version"], "rows": rows, "ratios": ratios}


def draw_ratios(ratios: list[dict[str, Any]], path: Path, version: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import agg_figure

    labels = sorted({q["semcomm"] for q in ratios})
    tokens = sorted({q["tokens"] for q in ratios})
    with agg_figure(path, (9, 4.2)) as ax:
        width = 0.8 / (4 * len(labels))
        for i, label in enumerate(labels):
            for j, op in enumerate(("put", "get", "get_into", "batched_get")):
                xs = [ti + (4 * i + j) * width - 0.4 + width / 2 for ti in range(len(tokens))]
                ys = [next((q.get(f"{op}_ratio", 0.0) for q in ratios
                            if q["semcomm"] == label and q["tokens"] == t), 0.0) for t in tokens]
                if not any(ys):
                    continue
                ax.bar(xs, ys, width, label=f"{label}: {op.replace('_', ' ')}",
                       hatch={"put": "", "get": "//", "get_into": "xx", "batched_get": ".."}[op])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(tokens)), [f"{t} tokens" for t in tokens])
        ax.set_yscale("log")
        ax.set_ylabel(f"throughput ratio semcomm / LMCache {version}")
        ax.legend(fontsize=7, ncol=2)


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
    ap.add_argument("--png", default=None, help="with --lmcache-python: ratio chart here")
    args = ap.parse_args(argv)
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
                           "repeat": args.repeat, "batch": args.batch, **comparison}
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
