"""Gateway overhead: semcomm vs LiteLLM's proxy over the same dummy upstream, in one run.

Every process runs on loopback: a dummy OpenAI-compatible upstream (aiohttp, fixed replies),
``semcomm serve`` with that upstream as a model, and LiteLLM's proxy (``litellm --config``) in
front of the same upstream. For each path: median and p99 latency of sequential requests
(unique prompts, after warm-up) and throughput with 16 concurrent clients; the added latency is
the path's median minus the direct-to-upstream median measured in the same run. Caches off,
then on (semcomm: semantic cache, miss and hit; LiteLLM: its in-memory exact cache).

LiteLLM is found as ``--litellm PATH`` or ``litellm`` on PATH (install it in its own virtual
environment: ``python -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install
'litellm[proxy]'``); without it, only semcomm is measured and the JSON says so.

    python -m benchmarks.server.gateway --json gateway.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.common import free_port

console = Console()
MASTER_KEY = "sk-bench-7f3a9c21e5d84b06"  # LiteLLM refuses well-known weak keys
SEMCOMM_KEY = "bench-key"


# --- the dummy upstream ---------------------------------------------------------------------------


def run_dummy(port: int) -> None:
    """An OpenAI-compatible upstream with fixed replies (JSON and SSE), no model at all."""
    from aiohttp import web

    reply = "The dummy upstream says hello."

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            base = {"id": "d1", "object": "chat.completion.chunk", "created": 1,
                    "model": body.get("model", "dummy")}
            for piece in ("The dummy ", "upstream says ", "hello."):
                chunk = {**base, "choices": [{"index": 0, "delta": {"content": piece},
                                              "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            end = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "usage": usage}
            await resp.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({
            "id": "d1", "object": "chat.completion", "created": 1,
            "model": body.get("model", "dummy"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                         "finish_reason": "stop"}],
            "usage": usage,
        })

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "dummy", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- processes ---------------------------------------------------------------------------------------


class Proc:
    def __init__(self, name: str, args: list[str], url: str, ready: str, env: dict[str, str],
                 headers: dict[str, str] | None = None) -> None:
        self.name, self.url = name, url
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited early; log: {self.log.name}")
            try:
                if httpx.get(url + ready, headers=headers, timeout=2).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{name} did not come up; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_semcomm(upstream: str, tmp: Path, env: dict[str, str], *, cache: bool) -> Proc:
    port = free_port()
    cfg = tmp / f"semcomm-{'cache' if cache else 'nocache'}.toml"
    cfg.write_text(f"""
[server]
state_dir = "{tmp / ('state-c' if cache else 'state-n')}"
max_queue = 4096
max_tokens_limit = 4096
torch_threads = 1
[models.dummy]
kind = "upstream"
base_url = "{upstream}/v1"
upstream_model = "dummy"
[kv]
enabled = false
[semantic]
enabled = {'true' if cache else 'false'}
backend = "memory"
[tenants.bench]
api_key = "{SEMCOMM_KEY}"
""")
    return Proc(f"semcomm-{'cache' if cache else 'nocache'}",
                [sys.executable, "-c", "from semcomm.cli import main; main()", "serve",
                 "--config", str(cfg), "--port", str(port), "--log-level", "warning"],
                f"http://127.0.0.1:{port}", "/health", env)


def start_litellm(exe: str, upstream: str, tmp: Path, env: dict[str, str], *, cache: bool
                  ) -> Proc:
    port = free_port()
    cfg = tmp / f"litellm-{'cache' if cache else 'nocache'}.yaml"
    text = f"""model_list:
  - model_name: dummy
    litellm_params:
      model: openai/dummy
      api_base: {upstream}/v1
      api_key: sk-dummy
general_settings:
  master_key: {MASTER_KEY}
"""
    if cache:
        text += "litellm_settings:\n  cache: true\n  cache_params:\n    type: local\n"
    cfg.write_text(text)
    e = dict(env, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    return Proc(f"litellm-{'cache' if cache else 'nocache'}",
                [exe, "--config", str(cfg), "--port", str(port), "--host", "127.0.0.1"],
                f"http://127.0.0.1:{port}", "/health/liveliness", e)


# --- load ---------------------------------------------------------------------------------------------


def _body(i: int, tag: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "dummy", "max_tokens": 16, "stream": stream,
            "messages": [{"role": "user", "content": f"{tag} request number {i}: what is new?"}]}


async def sequential(url: str, key: str | None, n: int, warm: int, tag: str, *,
                     same_prompt: bool = False) -> list[float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    lat = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as c:
        for i in range(warm + n):
            body = _body(0 if same_prompt else i, tag)
            t = time.perf_counter()
            r = await c.post("/v1/chat/completions", json=body)
            dt = time.perf_counter() - t
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
            if i >= warm:
                lat.append(dt * 1000)
    return lat


async def concurrent(url: str, key: str | None, clients: int, per_client: int, tag: str, *,
                     same_prompt: bool = False) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    lat: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120,
                                 limits=limits) as c:
        async def one(cid: int) -> None:
            nonlocal errors
            for j in range(per_client):
                i = 0 if same_prompt else cid * 100_000 + j
                t = time.perf_counter()
                r = await c.post("/v1/chat/completions", json=_body(i, tag))
                lat.append((time.perf_counter() - t) * 1000)
                errors += r.status_code != 200

        t0 = time.perf_counter()
        await asyncio.gather(*[one(k) for k in range(clients)])
        wall = time.perf_counter() - t0
    lat.sort()
    return {"rps": len(lat) / wall, "median_ms": statistics.median(lat),
            "p99_ms": lat[int(0.99 * (len(lat) - 1))], "errors": errors}


def stats(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    return {"median_ms": statistics.median(s), "p99_ms": s[int(0.99 * (len(s) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/server_gateway.json"))
    ap.add_argument("--litellm", default=None, help="path of the litellm executable")
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument("--dummy-port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dummy_port:
        run_dummy(args.dummy_port)
        return
    n, warm, clients, per = (20, 2, 4, 5) if args.quick else (200, 10, 16, 25)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    tmp = Path(tempfile.mkdtemp(prefix="semcomm-bench-gw-"))
    env["SEMCOMM_HOME"] = str(tmp / "home")
    exe = args.litellm or shutil.which("litellm")
    if exe is None and Path("/tmp/litellm-venv/bin/litellm").exists():
        exe = "/tmp/litellm-venv/bin/litellm"
    procs: list[Proc] = []
    results: dict[str, Any] = {"n_sequential": n, "clients": clients, "per_client": per,
                               "cpus": os.cpu_count(), "paths": {}}
    try:
        dport = free_port()
        dummy = Proc("dummy", [sys.executable, "-m", "benchmarks.server.gateway", "--dummy-port", str(dport)],
                     f"http://127.0.0.1:{dport}", "/v1/models", env)
        procs.append(dummy)
        paths: list[tuple[str, str, str | None, bool]] = [("direct", dummy.url, None, False)]
        with console.status("starting semcomm"):
            for cache in (False, True):
                p = start_semcomm(dummy.url, tmp, env, cache=cache)
                procs.append(p)
                paths.append((p.name, p.url, SEMCOMM_KEY, cache))
        if exe:
            with console.status("starting LiteLLM"):
                for cache in (False, True):
                    try:
                        p = start_litellm(exe, dummy.url, tmp, env, cache=cache)
                    except RuntimeError as exc:
                        results["litellm_error"] = str(exc)
                        console.print(f"[red]LiteLLM did not start:[/] {exc}")
                        break
                    procs.append(p)
                    paths.append((p.name, p.url, MASTER_KEY, cache))
        else:
            results["litellm_error"] = "litellm executable not found (see the module docstring)"
        for name, url, key, cache in paths:
            console.print(f"measuring {name}")
            row: dict[str, Any] = {}
            row["sequential"] = stats(asyncio.run(sequential(url, key, n, warm, f"{name}-seq")))
            row["concurrent"] = asyncio.run(concurrent(url, key, clients, per, f"{name}-conc"))
            if cache:
                row["sequential_hit"] = stats(asyncio.run(
                    sequential(url, key, n, warm, f"{name}-hit", same_prompt=True)))
                row["concurrent_hit"] = asyncio.run(
                    concurrent(url, key, clients, per, f"{name}-hit", same_prompt=True))
            results["paths"][name] = row
    finally:
        for p in reversed(procs):
            p.stop()
    direct = results["paths"]["direct"]["sequential"]["median_ms"]
    for name, row in results["paths"].items():
        row["added_ms"] = row["sequential"]["median_ms"] - direct
        if "sequential_hit" in row:
            row["added_ms_hit"] = row["sequential_hit"]["median_ms"] - direct
    ratios: dict[str, Any] = {}
    P = results["paths"]
    for mode in ("nocache", "cache"):
        s, li = P.get(f"semcomm-{mode}"), P.get(f"litellm-{mode}")
        if s and li:
            ratios[mode] = {
                "added_latency_ratio": s["added_ms"] / li["added_ms"] if li["added_ms"] else None,
                "throughput_ratio": s["concurrent"]["rps"] / li["concurrent"]["rps"],
            }
    results["ratios_semcomm_over_litellm"] = ratios
    table = Table(title="gateway overhead over a dummy upstream (loopback)")
    for col in ("path", "seq median ms", "p99 ms", "added ms", "16-client req/s",
                "16-client median ms", "errors"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, row in P.items():
        table.add_row(name, f"{row['sequential']['median_ms']:.2f}",
                      f"{row['sequential']['p99_ms']:.2f}", f"{row['added_ms']:.2f}",
                      f"{row['concurrent']['rps']:.0f}", f"{row['concurrent']['median_ms']:.1f}",
                      str(row["concurrent"]["errors"]))
        if "sequential_hit" in row:
            table.add_row(f"{name} (hit)", f"{row['sequential_hit']['median_ms']:.2f}",
                          f"{row['sequential_hit']['p99_ms']:.2f}", f"{row['added_ms_hit']:.2f}",
                          f"{row['concurrent_hit']['rps']:.0f}",
                          f"{row['concurrent_hit']['median_ms']:.1f}",
                          str(row["concurrent_hit"]["errors"]))
    console.print(table)
    for mode, r in ratios.items():
        console.print(f"caches {mode}: semcomm/LiteLLM added latency "
                      f"{r['added_latency_ratio']:.2f}, throughput {r['throughput_ratio']:.2f}x")
    args.json.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
