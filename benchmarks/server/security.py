"""What each security defense costs, measured in one run.

* **Tenant isolation (salts)**: ``T`` tenants send ``R`` requests each that share one system
  prompt (HFEngine, config-built Qwen2, MemoryStore). Shared namespace (no salts: what an
  unsalted server does) vs one namespace per tenant. Reports requests/s, prompt tokens recomputed
  and mean time to first token; the cost is the cross-tenant reuse given up.
* **Sealing at rest**: AES-256-GCM ``ChunkSealer`` seal/open throughput on real chunk sizes, and
  DiskStore put+get per chunk, sealed vs plain; semantic entries in SQLite, sealed vs plain.
* **Probe detection / rate limit**: microseconds per request of ``ProbeDetector.observe`` with a
  full per-tenant history, and of ``RateLimiter.acquire``, next to the request time they guard.
* **TTFT padding** (``TimingGuard("all")``): the latency it adds to a hit equals the TTFT the
  cache saved (miss TTFT - hit TTFT), measured with the engine.

Usage: ``python -m benchmarks.server.security [--quick] [--json FILE]``. The end-to-end attack
figures (success with defenses off/on, benign throughput through ``semcomm serve``) come from
``semcomm security probe --json FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from semcomm.engine import HFEngine
from semcomm.kv import DiskStore, MemoryStore, Namespace, chunk_keys, encode_chunk
from semcomm.security import (
    ChunkSealer,
    EntrySealer,
    ProbeDetector,
    RateLimiter,
    TenantKeyring,
    TenantSalter,
)

console = Console(width=None if sys.stdout.isatty() else 150)
SECRET = "bench-security-secret-0123456789"


def _timeit(fn: Any, n: int) -> float:
    """Median seconds per call over ``n`` calls (after one warm-up)."""
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_isolation(quick: bool) -> dict[str, Any]:
    from semcomm.reference import build_tiny_model

    torch.manual_seed(0)
    model, tok = build_tiny_model(hidden_size=128, layers=4)
    tenants, per = (4, 3) if quick else (8, 4)
    system = ("You are the support assistant of Nimbus Cloud. Policies: " +
              "refunds within 30 days, escalate outages to tier two, never share credentials. " * 8)
    salter = TenantSalter(SECRET)
    out: dict[str, Any] = {"tenants": tenants, "requests_per_tenant": per,
                           "system_prompt_tokens": len(tok(system)["input_ids"])}
    for mode in ("shared", "isolated"):
        store = MemoryStore()
        engines = {t: HFEngine(model, tok, store=store, chunk_size=32, device="cpu",
                               tenant=None if mode == "shared" else f"tenant-{t}", salter=salter)
                   for t in range(tenants)}
        recomputed = 0
        ttfts: list[float] = []
        t0 = time.perf_counter()
        for r in range(per):
            for t in range(tenants):
                q = f" Question {r} from user {t}: where is my invoice number {1000 * t + r}?"
                res = engines[t].generate(system + q, max_new_tokens=4)
                recomputed += res.stats.recomputed_tokens
                ttfts.append(res.stats.ttft_s)
        wall = time.perf_counter() - t0
        out[mode] = {"requests_per_s": tenants * per / wall, "recomputed_tokens": recomputed,
                     "mean_ttft_ms": 1000 * statistics.mean(ttfts)}
    out["throughput_cost"] = 1 - out["isolated"]["requests_per_s"] / out["shared"]["requests_per_s"]
    out["recompute_ratio"] = out["isolated"]["recomputed_tokens"] / out["shared"]["recomputed_tokens"]
    # TTFT padding: a padded hit costs what a miss costs; measure both on one engine
    eng = HFEngine(model, tok, store=MemoryStore(), chunk_size=32, device="cpu")
    miss, hit = [], []
    for i in range(3 if quick else 6):
        p = f"Padding probe {i}. " + system
        miss.append(eng.generate(p, max_new_tokens=1).stats.ttft_s)
        hit.append(eng.generate(p, max_new_tokens=1).stats.ttft_s)
    out["ttft_miss_ms"] = 1000 * statistics.median(miss)
    out["ttft_hit_ms"] = 1000 * statistics.median(hit)
    out["padding_added_ms"] = out["ttft_miss_ms"] - out["ttft_hit_ms"]
    return out


def _chunk(payload_bytes: int, i: int = 0) -> tuple[bytes, bytes]:
    ns = Namespace(model="bench", tokenizer="", dtype="float32", codec="lossless", tenant="t")
    key = chunk_keys(ns.digest, [i, 1, 2, 3], 4)[0]
    arr = np.random.default_rng(i).standard_normal(payload_bytes // 4, dtype=np.float32)
    return key, encode_chunk(namespace=ns.digest, key=key, parent=None, num_tokens=4, start=0,
                             dtype="float32", codec="lossless", codec_params={},
                             arrays={"k.0": arr})


def bench_sealing(quick: bool) -> dict[str, Any]:
    sealer = ChunkSealer(TenantKeyring(SECRET))
    n = 20 if quick else 60
    out: dict[str, Any] = {"chunks": {}}
    for size in (64 << 10, 1 << 20, 4 << 20):
        _, data = _chunk(size)
        sealed = sealer.seal(data)
        s = _timeit(lambda data=data: sealer.seal(data), n)
        o = _timeit(lambda sealed=sealed: sealer.open(sealed), n)
        out["chunks"][str(size)] = {"seal_MBps": len(data) / s / 1e6,
                                    "open_MBps": len(data) / o / 1e6,
                                    "overhead_bytes": len(sealed) - len(data)}
    with tempfile.TemporaryDirectory() as tmp:
        items = [_chunk(1 << 20, i) for i in range(8 if quick else 24)]
        res = {}
        for label, sl in (("plain", None), ("sealed", sealer)):
            store = DiskStore(Path(tmp) / label, sealer=sl, fsync=False)
            t0 = time.perf_counter()
            for k, v in items:
                store.put(k, v)
            put_s = (time.perf_counter() - t0) / len(items)
            t0 = time.perf_counter()
            for k, v in items:
                assert store.get(k) == v
            get_s = (time.perf_counter() - t0) / len(items)
            res[label] = {"put_ms": 1000 * put_s, "get_ms": 1000 * get_s}
            store.close()
        out["disk_1MiB"] = res
        out["disk_get_cost"] = res["sealed"]["get_ms"] / res["plain"]["get_ms"] - 1
        out["disk_put_cost"] = res["sealed"]["put_ms"] / res["plain"]["put_ms"] - 1
        from semcomm.semantic import Entry, SQLiteEntryStore

        vec = np.ones(384, dtype=np.float32) / np.sqrt(384)
        entries = [Entry(id=f"{i:08x}", partition="p" * 32, query=f"question {i} " * 8,
                         answer=f"answer {i} " * 60, vector=vec) for i in range(200 if quick else 600)]
        sem: dict[str, Any] = {}
        for label, es in (("plain", None), ("sealed", EntrySealer(TenantKeyring(SECRET)))):
            st = SQLiteEntryStore(Path(tmp) / f"{label}.sqlite3", sealer=es)
            t0 = time.perf_counter()
            st.put_many(entries)
            put = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = list(st.load_all())
            load = time.perf_counter() - t0
            assert len(got) == len(entries)
            sem[label] = {"put_per_s": len(entries) / put, "load_per_s": len(entries) / load}
            st.close()
        out["semantic_sqlite"] = sem
        out["semantic_load_cost"] = sem["plain"]["load_per_s"] / sem["sealed"]["load_per_s"] - 1
    return out


def bench_detection(quick: bool) -> dict[str, Any]:
    det = ProbeDetector()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50_000, size=1024) for _ in range(256)]
    for i, p in enumerate(prompts):  # fill the tenant's history (max_history = 256)
        det.observe("t", p, max_tokens=64)
    n = 50 if quick else 200
    it = iter(prompts * 4)
    observe = _timeit(lambda: det.observe("t", next(it), max_tokens=64), n)
    rl = RateLimiter(rate_per_s=1e9, burst=10**9)
    acquire = _timeit(lambda: rl.acquire("t"), n)
    return {"observe_us_1k_tokens_full_history": 1e6 * observe, "rate_limit_us": 1e6 * acquire}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, fn in track([("isolation", bench_isolation), ("sealing", bench_sealing),
                           ("detection", bench_detection)], description="security benchmarks",
                          console=console):
        results[name] = fn(args.quick)
    iso, seal, det = results["isolation"], results["sealing"], results["detection"]
    t = Table(title="cost of each security defense (one run)")
    t.add_column("defense")
    t.add_column("measure")
    t.add_column("without", justify="right")
    t.add_column("with", justify="right")
    t.add_column("cost", justify="right")
    t.add_row("tenant salts", f"req/s, {iso['tenants']} tenants x {iso['requests_per_tenant']}",
              f"{iso['shared']['requests_per_s']:.1f}", f"{iso['isolated']['requests_per_s']:.1f}",
              f"{100 * iso['throughput_cost']:.1f}%")
    t.add_row("tenant salts", "prompt tokens recomputed", str(iso["shared"]["recomputed_tokens"]),
              str(iso["isolated"]["recomputed_tokens"]), f"x{iso['recompute_ratio']:.2f}")
    t.add_row("sealing", "DiskStore get, 1 MiB chunk (ms)", f"{seal['disk_1MiB']['plain']['get_ms']:.2f}",
              f"{seal['disk_1MiB']['sealed']['get_ms']:.2f}", f"{100 * seal['disk_get_cost']:.0f}%")
    t.add_row("sealing", "DiskStore put, 1 MiB chunk (ms)", f"{seal['disk_1MiB']['plain']['put_ms']:.2f}",
              f"{seal['disk_1MiB']['sealed']['put_ms']:.2f}", f"{100 * seal['disk_put_cost']:.0f}%")
    c1 = seal["chunks"][str(1 << 20)]
    t.add_row("sealing", "AES-GCM seal / open MB/s (1 MiB)", "-",
              f"{c1['seal_MBps']:.0f} / {c1['open_MBps']:.0f}", f"+{c1['overhead_bytes']} B")
    sq = seal["semantic_sqlite"]
    t.add_row("sealing", "SQLite entries loaded/s", f"{sq['plain']['load_per_s']:.0f}",
              f"{sq['sealed']['load_per_s']:.0f}", f"{100 * seal['semantic_load_cost']:.0f}%")
    t.add_row("probe detection", "us per request (1k tokens)", "0",
              f"{det['observe_us_1k_tokens_full_history']:.0f}",
              f"{det['observe_us_1k_tokens_full_history'] / 1000 / iso['ttft_hit_ms'] * 100:.1f}% of a hit TTFT")
    t.add_row("rate limit", "us per request", "0", f"{det['rate_limit_us']:.1f}", "-")
    t.add_row("TTFT padding (all)", "hit TTFT ms", f"{iso['ttft_hit_ms']:.1f}",
              f"{iso['ttft_miss_ms']:.1f}", f"+{iso['padding_added_ms']:.1f} ms")
    console.print(t)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
