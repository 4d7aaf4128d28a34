"""Throughput of one engine: 8 concurrent clients (batched) against one request at a time.

The server is semcomm's app, in-process over ASGI (the whole request path: auth, admission,
engine queue, batching worker, KV-reusing engine). Each request asks a different question with
``max_tokens`` new tokens (greedy, ``ignore`` of EOS is not available, so the model's own stops
count: generated tokens are what the server reports in ``usage``). Semantic cache off; KV on.

    python -m benchmarks.server.batching --json batching.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

console = Console()


async def drive(app: Any, clients: int, per_client: int, max_tokens: int, tag: str
                ) -> dict[str, float]:
    transport = httpx.ASGITransport(app=app)
    tokens = 0
    lat: list[float] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600,
                                 headers={"Authorization": "Bearer bench"}) as c:
        async def one(cid: int) -> None:
            nonlocal tokens
            for j in range(per_client):
                body = {"model": "m", "max_tokens": max_tokens, "messages": [
                    {"role": "system", "content": "You are the support desk."},
                    {"role": "user", "content": f"{tag}: client {cid} question {j} about "
                                                f"invoice {cid * 1000 + j}"}]}
                t = time.perf_counter()
                r = await c.post("/v1/chat/completions", json=body)
                lat.append(time.perf_counter() - t)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*[one(k) for k in range(clients)])
        wall = time.perf_counter() - t0
    lat.sort()
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "requests": len(lat), "median_latency_s": lat[len(lat) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/server_batching.json"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from semcomm.kv import MemoryStore
    from semcomm.reference import build_tiny_model
    from semcomm.runtime import engine_runner
    from semcomm.security import TenantSalter
    from semcomm.server import BatchingWorker, LocalBackend, create_app, load_config
    from semcomm.server._wiring import build_gateway

    per = 2 if args.quick else 4
    model, tok = build_tiny_model(hidden_size=args.hidden, layers=args.layers,
                                  heads=max(2, args.hidden // 64),
                                  kv_heads=max(1, args.hidden // 128))
    # the random model may stop early; make EOS unreachable so every request decodes max_tokens
    model.generation_config.eos_token_id = None
    results: dict[str, Any] = {"model": {"hidden": args.hidden, "layers": args.layers},
                               "max_tokens": args.max_tokens}
    for label, clients, max_batch in (("sequential", 1, 1), ("concurrent-8", 8, 8)):
        tmp = Path(tempfile.mkdtemp(prefix="semcomm-bench-batch-"))
        cfg = load_config(None, environ={}, defaults=False, overrides={
            "server": {"state_dir": str(tmp), "max_tokens_limit": 4096},
            "models": {"m": {"path": "tiny"}},
            "kv": {"tiers": ["memory"]}, "semantic": {"enabled": False},
            "tenants": {"bench": {"api_key": "bench"}}})
        store = MemoryStore(capacity_bytes=2**30)
        runner, note = engine_runner(model, tok, model_id="bench", store=store,
                                     salter=TenantSalter(cfg.server.secret), chunk_size=64,
                                     codec=None)
        assert runner is not None, note
        runner.decoder.eos_ids = frozenset()  # decode the full length every time
        gw = build_gateway(cfg, backends={"m": LocalBackend(
            "m", BatchingWorker(runner, max_batch=max_batch, name="m"), kv_reuse=True)})
        gw.kv_store = store
        app = create_app(gateway=gw)
        asyncio.run(gw.startup())
        asyncio.run(drive(app, 1, 1, 4, "warm-up"))
        n_req = 8 * per  # same number of requests either way
        res = asyncio.run(drive(app, clients, n_req // clients, args.max_tokens, label))
        res["mean_batch"] = gw.backends["m"].worker.stats()["mean_batch"]
        results[label] = res
        asyncio.run(gw.shutdown())
        console.print(f"{label}: {res['tokens_per_s']:.1f} tokens/s")
    ratio = results["concurrent-8"]["tokens_per_s"] / results["sequential"]["tokens_per_s"]
    results["throughput_ratio"] = ratio
    table = Table(title=f"one engine, Qwen2 h{args.hidden} x{args.layers}, "
                        f"{args.max_tokens} new tokens per request")
    for col in ("mode", "requests", "tokens", "wall s", "tokens/s", "mean batch"):
        table.add_column(col, justify="right")
    for label in ("sequential", "concurrent-8"):
        r = results[label]
        table.add_row(label, str(r["requests"]), str(r["tokens"]), f"{r['wall_s']:.2f}",
                      f"{r['tokens_per_s']:.1f}", f"{r['mean_batch']:.2f}")
    console.print(table)
    console.print(f"8 concurrent clients vs one at a time: {ratio:.2f}x generated tokens/s")
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
