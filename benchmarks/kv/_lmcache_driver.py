"""LMCache's storage backends driven directly, for benchmarks.kv.stores --lmcache-python.

Runs inside a separate virtual environment that has ``lmcache`` (it pins numpy and other
packages that semcomm's environment does not want); it does not import semcomm. It receives
the chunk shape and the measurement plan as JSON on the command line and prints one JSON
object on stdout:

* ``disk``: LMCache's ``LocalDiskBackend`` (the ``local_disk`` backend a vLLM user enables,
  default settings): put throughput (submit every chunk, then wait until every write has
  landed: LMCache writes from a worker thread), get throughput (``get_blocking``: allocate from
  LMCache's CPU pool and ``readinto``; the memory object is released after each get) and
  batched get (``batched_get_blocking`` of ``batch`` keys: its read thread pool), in a fresh
  directory per put round; then a restart (a new backend on the same directory: chunks found) and a tamper test
  (one byte flipped in a chunk file: is the damaged chunk still returned?).
* ``cpu``: ``LocalCPUBackend`` put (allocate from its pool, copy the tensor in,
  ``submit_put_task``) and get (``get_blocking`` then a copy
  of the tensor, as a consumer that keeps the data would), for reference.

``--serve`` instead answers one operation per JSON line on stdin (``_Server``): what
``benchmarks.kv.stores`` uses, to run each LMCache pass back to back with semcomm's.

The chunks have LMCache's KV_2LTD layout ``[2, layers, tokens, kv_heads * head_dim]`` in fp16,
the same bytes as semcomm's 24-layer K/V chunks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import torch


def _quiet() -> None:
    logging.disable(logging.WARNING)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.ERROR)


def main() -> int:
    plan: dict[str, Any] = json.loads(sys.argv[1])
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    _quiet()
    torch.set_num_threads(1)
    layers, heads, head_dim = plan["layers"], plan["heads"], plan["head_dim"]
    repeat = plan["repeat"]
    work = plan.get("dir") or tempfile.mkdtemp(prefix="lmcache-bench-")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    out: dict[str, Any] = {"lmcache_version": _version(), "results": []}

    def config(path: str | None) -> Any:
        return LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=path is None, max_local_cpu_size=2.0,
            local_disk=path, max_local_disk_size=8.0 if path else 0.0,
        )

    pool = torch.empty(3 << 30, dtype=torch.uint8)  # LMCache's CPU staging pool

    def cpu_backend(cfg: Any) -> Any:
        return LocalCPUBackend(cfg, memory_allocator=TensorMemoryAllocator(pool))

    for tokens in plan["tokens"]:
        shape = torch.Size([2, layers, tokens, heads * head_dim])
        one = shape.numel() * 2
        n = max(4, plan["mib"] * (1 << 20) // one)
        gen = torch.Generator().manual_seed(0)
        base = torch.randn(shape, generator=gen).to(torch.float16)

        def keys(round_: int, tokens: int = tokens, n: int = n) -> list[Any]:
            return [CacheEngineKey("bench", 1, 0, (round_ << 32) + (tokens << 20) + i,
                                   torch.float16) for i in range(n)]

        # ---- disk --------------------------------------------------------------------
        puts: list[float] = []
        gets: list[float] = []
        bgets: list[float] = []
        batch = plan["batch"]
        last_dir = ""
        for r in range(repeat):
            d = os.path.join(work, f"disk-{tokens}-{r}")
            os.makedirs(d, exist_ok=True)
            cfg = config(d)
            cpu = cpu_backend(cfg)
            disk = LocalDiskBackend(cfg, loop, cpu)
            ks = keys(r)
            objs = []
            for i in range(n):
                m = cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
                m.tensor.copy_(base + i)
                objs.append(m)
            t0 = time.perf_counter()
            for k, m in zip(ks, objs):
                disk.submit_put_task(k, m)
            while not all(disk.contains(k) for k in (ks[-1], ks[0])) or any(
                    disk.exists_in_put_tasks(k) for k in ks):
                time.sleep(0.0002)
            puts.append(time.perf_counter() - t0)
            for m in objs:
                m.ref_count_down()
            assert all(disk.contains(k) for k in ks)
            for _ in range(repeat):
                t0 = time.perf_counter()
                for k in ks:
                    m = disk.get_blocking(k)
                    assert m is not None
                    m.ref_count_down()
                gets.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in range(0, n, batch):
                    got = disk.batched_get_blocking(ks[i : i + batch])
                    assert all(m is not None for m in got)
                    for m in got:
                        m.ref_count_down()
                bgets.append(time.perf_counter() - t0)
            last_dir = d
            last_keys = ks
            disk.close()
        nbytes = n * one
        # restart: a fresh backend on the last directory
        cfg = config(last_dir)
        disk2 = LocalDiskBackend(cfg, loop, cpu_backend(cfg))
        found = sum(disk2.contains(k) for k in last_keys)
        disk2.close()
        # tamper: flip one byte of a chunk file in a live backend, then get it
        cfg = config(last_dir + "-t")
        cpu = cpu_backend(cfg)
        disk3 = LocalDiskBackend(cfg, loop, cpu)
        k0 = keys(99)[0]
        m = cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
        m.tensor.copy_(base)
        disk3.submit_put_task(k0, m)
        while not disk3.contains(k0) or disk3.exists_in_put_tasks(k0):
            time.sleep(0.001)
        m.ref_count_down()
        path = disk3._key_to_path(k0)
        with open(path, "r+b") as f:
            f.seek(one // 2)
            b = f.read(1)
            f.seek(one // 2)
            f.write(bytes([b[0] ^ 0x40]))
        got = disk3.get_blocking(k0)
        tampered_served = got is not None
        if got is not None:
            got.ref_count_down()
        disk3.close()
        out["results"].append({
            "backend": "lmcache-disk", "tokens": tokens, "chunk_bytes": one, "chunks": n,
            "put_GBps": nbytes / min(puts) / 1e9, "get_GBps": nbytes / min(gets) / 1e9,
            "put_us_per_chunk": min(puts) / n * 1e6, "get_us_per_chunk": min(gets) / n * 1e6,
            "batched_get_GBps": nbytes / min(bgets) / 1e9,
            "batched_get_us_per_chunk": min(bgets) / n * 1e6,
            "found_after_restart": found, "tampered_chunk_served": tampered_served,
            # every timing in microseconds per chunk, for medians across interleaved rounds
            "samples_us": {"put": [t / n * 1e6 for t in puts], "get": [t / n * 1e6 for t in gets],
                           "batched_get": [t / n * 1e6 for t in bgets]},
        })
        # ---- cpu ---------------------------------------------------------------------
        cputimes: list[float] = []
        cgets: list[float] = []
        for r in range(repeat):
            cfg = config(None)
            cpu = cpu_backend(cfg)
            ks = keys(100 + r)
            srcs = [base + i for i in range(n)]
            objs = []
            t0 = time.perf_counter()
            for k, src in zip(ks, srcs):  # a put from data in hand: allocate, copy, insert
                m = cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
                m.tensor.copy_(src)
                cpu.submit_put_task(k, m)
                objs.append(m)
            cputimes.append(time.perf_counter() - t0)
            for m in objs:
                m.ref_count_down()
            t0 = time.perf_counter()
            for k in ks:
                m = cpu.get_blocking(k)
                assert m is not None
                _ = m.tensor.clone()
                m.ref_count_down()
            cgets.append(time.perf_counter() - t0)
            cpu.clear() if hasattr(cpu, "clear") else None
        out["results"].append({
            "backend": "lmcache-cpu", "tokens": tokens, "chunk_bytes": one, "chunks": n,
            "put_GBps": nbytes / min(cputimes) / 1e9, "get_GBps": nbytes / min(cgets) / 1e9,
            "put_us_per_chunk": min(cputimes) / n * 1e6,
            "get_us_per_chunk": min(cgets) / n * 1e6,
            "samples_us": {"put": [t / n * 1e6 for t in cputimes],
                           "get": [t / n * 1e6 for t in cgets]},
        })
    loop.call_soon_threadsafe(loop.stop)
    if not plan.get("dir"):
        shutil.rmtree(work, ignore_errors=True)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


class _Server:
    """``--serve``: one operation per JSON line on stdin, one reply per line on stdout.

    The parent alternates these with semcomm's own operations on the same chunks a few
    milliseconds apart, so both sides see the same machine (it is shared and loaded).
    Operations: ``open`` (chunk shape and count), ``clear`` (the previous round's backend and
    files removed), ``put`` (a fresh directory and backend, every chunk written and waited for;
    also the time until every ``submit_put_task`` returned and the CPU seconds of all of this
    process's threads), ``get`` / ``batched_get`` (one pass over the chunks),
    ``cpu`` (one LocalCPUBackend put and get pass), ``checks`` (restart and tamper), ``exit``.
    """

    def __init__(self) -> None:
        from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.work = tempfile.mkdtemp(prefix="lmcache-bench-")
        self.pool = torch.empty(3 << 30, dtype=torch.uint8)  # LMCache's CPU staging pool
        self.allocator = TensorMemoryAllocator(self.pool)
        self.disk: Any = None
        self.cpu: Any = None
        self.round = 0

    def config(self, path: str | None) -> Any:
        from lmcache.v1.config import LMCacheEngineConfig

        return LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=path is None, max_local_cpu_size=2.0,
            local_disk=path, max_local_disk_size=8.0 if path else 0.0)

    def cpu_backend(self, cfg: Any) -> Any:
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        return LocalCPUBackend(cfg, memory_allocator=self.allocator)

    def keys(self, round_: int) -> list[Any]:
        from lmcache.utils import CacheEngineKey

        return [CacheEngineKey("bench", 1, 0, (round_ << 32) + (self.tokens << 20) + i,
                               torch.float16) for i in range(self.n)]

    def op_open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.tokens, self.n = cmd["tokens"], cmd["chunks"]
        self.shape = torch.Size([2, cmd["layers"], self.tokens, cmd["heads"] * cmd["head_dim"]])
        gen = torch.Generator().manual_seed(0)
        self.base = torch.randn(self.shape, generator=gen).to(torch.float16)
        return {"chunk_bytes": self.shape.numel() * 2}

    def _close_disk(self) -> None:
        if self.disk is not None:
            self.disk.close()
            shutil.rmtree(self.disk_dir, ignore_errors=True)  # as the parent does for its own
            self.disk = None

    def op_clear(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self._close_disk()  # the previous round's backend and files
        return {}

    def op_put(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self._close_disk()
        self.round += 1
        self.disk_dir = os.path.join(self.work, f"disk-{self.tokens}-{self.round}")
        os.makedirs(self.disk_dir, exist_ok=True)
        cfg = self.config(self.disk_dir)
        self.cpu = self.cpu_backend(cfg)
        self.disk = LocalDiskBackend(cfg, self.loop, self.cpu)
        self.ks = self.keys(self.round)
        objs = []
        for i in range(self.n):
            m = self.cpu.allocate(self.shape, torch.float16, MemoryFormat.KV_2LTD)
            m.tensor.copy_(self.base + i)
            objs.append(m)
        c0 = time.process_time()  # CPU seconds of every thread of this process
        t0 = time.perf_counter()
        for k, m in zip(self.ks, objs):
            self.disk.submit_put_task(k, m)
        submitted = time.perf_counter() - t0  # every submit_put_task returned
        while not all(self.disk.contains(k) for k in (self.ks[-1], self.ks[0])) or any(
                self.disk.exists_in_put_tasks(k) for k in self.ks):
            time.sleep(0.0002)
        dt = time.perf_counter() - t0  # every file written and in the index
        cpu = time.process_time() - c0  # (its 0.2 ms polling sleeps cost next to nothing)
        for m in objs:
            m.ref_count_down()
        assert all(self.disk.contains(k) for k in self.ks)
        return {"s": dt, "submit_s": submitted, "cpu_s": cpu}

    def op_get(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        for k in self.ks:
            m = self.disk.get_blocking(k)
            assert m is not None
            m.ref_count_down()
        return {"s": time.perf_counter() - t0}

    def op_batched_get(self, cmd: dict[str, Any]) -> dict[str, Any]:
        batch = cmd["batch"]
        t0 = time.perf_counter()
        for i in range(0, self.n, batch):
            got = self.disk.batched_get_blocking(self.ks[i : i + batch])
            assert all(m is not None for m in got)
            for m in got:
                m.ref_count_down()
        return {"s": time.perf_counter() - t0}

    def op_cpu(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from lmcache.v1.memory_management import MemoryFormat

        cpu = self.cpu_backend(self.config(None))
        self.round += 1
        ks = self.keys(self.round)
        srcs = [self.base + i for i in range(self.n)]
        objs = []
        t0 = time.perf_counter()
        for k, src in zip(ks, srcs):  # a put from data in hand: allocate, copy, insert
            m = cpu.allocate(self.shape, torch.float16, MemoryFormat.KV_2LTD)
            m.tensor.copy_(src)
            cpu.submit_put_task(k, m)
            objs.append(m)
        put = time.perf_counter() - t0
        for m in objs:
            m.ref_count_down()
        t0 = time.perf_counter()
        for k in ks:
            m = cpu.get_blocking(k)
            assert m is not None
            _ = m.tensor.clone()  # a consumer that keeps the data copies it
            m.ref_count_down()
        get = time.perf_counter() - t0
        if hasattr(cpu, "clear"):
            cpu.clear()
        return {"put_s": put, "get_s": get}

    def op_checks(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.disk.close()
        cfg = self.config(self.disk_dir)  # restart: a fresh backend on the same directory
        again = LocalDiskBackend(cfg, self.loop, self.cpu_backend(cfg))
        found = sum(again.contains(k) for k in self.ks)
        again.close()
        self.disk = None
        d = self.disk_dir + "-t"  # tamper: one byte flipped in a chunk file of a live backend
        os.makedirs(d, exist_ok=True)
        cfg = self.config(d)
        cpu = self.cpu_backend(cfg)
        disk = LocalDiskBackend(cfg, self.loop, cpu)
        k0 = self.keys(99)[0]
        m = cpu.allocate(self.shape, torch.float16, MemoryFormat.KV_2LTD)
        m.tensor.copy_(self.base)
        disk.submit_put_task(k0, m)
        while not disk.contains(k0) or disk.exists_in_put_tasks(k0):
            time.sleep(0.001)
        m.ref_count_down()
        one = self.shape.numel() * 2
        with open(disk._key_to_path(k0), "r+b") as f:
            f.seek(one // 2)
            b = f.read(1)
            f.seek(one // 2)
            f.write(bytes([b[0] ^ 0x40]))
        got = disk.get_blocking(k0)
        served = got is not None
        if got is not None:
            got.ref_count_down()
        disk.close()
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(self.disk_dir, ignore_errors=True)
        return {"found_after_restart": found, "chunks": self.n, "tampered_chunk_served": served}

    def serve(self) -> int:
        print("@@" + json.dumps({"lmcache_version": _version()}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            out = getattr(self, f"op_{cmd['op']}")(cmd)
            print("@@" + json.dumps(out), flush=True)
        self._close_disk()
        self.loop.call_soon_threadsafe(self.loop.stop)
        shutil.rmtree(self.work, ignore_errors=True)
        return 0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:  # pragma: no cover - metadata missing
        return "unknown"


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _quiet()
        torch.set_num_threads(1)
        raise SystemExit(_Server().serve())
    raise SystemExit(main())
