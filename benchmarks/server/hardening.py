"""The gateway measured from outside, as an operator and an attacker see it (issue 32's goals).

Starts ``semcomm serve`` as a subprocess (two tenants and an admin key; the config-built tiny
model with ``--quick``, the embedded real models otherwise; Redis for the semantic store and a
KV tier when Debian's ``redis-server`` is installed) and measures:

* a 20 MB body from an authenticated tenant: status, seconds to the answer, the server's RSS
  growth, and the slowest ``/health`` answer while it was being refused; then 10 at once;
* the slowest ``/health`` answer while a generation request is served;
* hand-written bad requests (wrong types, encodings, sizes, fields): responses with a 5xx and
  responses with a traceback;
* a Redis outage, three times: seconds until ``/health`` says ``degraded``, whether it stayed
  so while Redis was down (flips counted), seconds until ``ok`` after Redis is back.

    python -m benchmarks.server.hardening --quick --json hardening.json
    PYTHONPATH=/path/to/older/src python -m benchmarks.server.hardening --quick --one-body
                                                    # a baseline: an older semcomm serves

Timings are wall-clock on whatever machine runs it (a shared box: rerun before quoting).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import RedisServer, free_port

ADMIN = "bench-admin-key"
TENANT = "bench-tenant-key"
BIG = 20 * 10**6  # bytes of prompt text in the oversized body


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _watch_health(url: str, stop: Any, worst: Any, polls: Any) -> None:
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(f"{url}/health")
            worst.value = max(worst.value, time.perf_counter() - t0)
            polls.value += 1
            time.sleep(0.02)


class _HealthWatch:
    """Polls /health every 20 ms from a process of its own (the senders' threads must not
    delay it in this one); the slowest answer while it ran."""

    def __init__(self, url: str) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._stop, self._worst, self._polls = ctx.Event(), ctx.Value("d", 0.0), ctx.Value("i", 0)
        self._p = ctx.Process(target=_watch_health,
                              args=(url, self._stop, self._worst, self._polls), daemon=True)
        self.worst, self.n = 0.0, 0

    def __enter__(self) -> _HealthWatch:
        self._p.start()
        while self._polls.value == 0 and self._p.is_alive():  # polling before the work starts
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._p.join()
        self.worst, self.n = self._worst.value, self._polls.value


def _config(tmp: Path, quick: bool, redis: RedisServer | None) -> Path:
    lines = ["[server]", f'admin_key = "{ADMIN}"', f'state_dir = "{tmp / "state"}"',
             "max_tokens_limit = 64", "", "[tenants.bench]", f'api_key = "{TENANT}"', ""]
    if quick:
        lines += ["[models.tiny]", 'path = "tiny"', "", "[routing]", 'default_model = "tiny"', ""]
    if redis is not None:
        lines += ["[kv]", 'tiers = ["memory", "redis"]', f'redis_url = "{redis.url}"', "",
                  "[semantic]", 'backend = "redis"', f'redis_url = "{redis.url}"', ""]
    p = tmp / "semcomm.toml"
    p.write_text("\n".join(lines))
    return p


def _wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"semcomm serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise RuntimeError("semcomm serve did not come up")


def _big_body() -> bytes:
    return (b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "'
            + b"x" * BIG + b'"}]}')


def _post(url: str, body: bytes, out: list[tuple[int, float]]) -> None:
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=300,
                       headers={"Authorization": f"Bearer {TENANT}",
                                "content-type": "application/json"})
        out.append((r.status_code, time.perf_counter() - t0))
    except httpx.HTTPError as exc:
        out.append((-1, time.perf_counter() - t0))
        print(f"  transport error: {type(exc).__name__}: {exc}", file=sys.stderr)


def oversized(url: str, pid: int, n: int) -> dict[str, Any]:
    body = _big_body()
    rss0 = _rss(pid)
    results: list[tuple[int, float]] = []
    with _HealthWatch(url) as watch:
        threads = [threading.Thread(target=_post, args=(url, body, results)) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    time.sleep(1.0)
    return {"bodies": n, "body_bytes": len(body), "statuses": sorted(s for s, _ in results),
            "seconds_max": round(max(t for _, t in results), 3),
            "rss_growth_mb": round((_rss(pid) - rss0) / 1e6, 1),
            "health_worst_ms": round(watch.worst * 1000, 1), "health_polls": watch.n}


def health_while_served(url: str) -> dict[str, Any]:
    out: list[tuple[int, float]] = []
    body = json.dumps({"model": "default", "max_tokens": 32, "messages": [
        {"role": "user", "content": "Tell me a long story about a lighthouse. " * 20}]}).encode()
    with _HealthWatch(url) as watch:
        _post(url, body, out)
    return {"status": out[0][0], "request_s": round(out[0][1], 3),
            "health_worst_ms": round(watch.worst * 1000, 1), "health_polls": watch.n}


def _bad_requests() -> list[tuple[str, str, bytes]]:
    """(name, endpoint, raw body): the probe's kinds of malformed input."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    msg = '[{"role": "user", "content": "hi"}]'
    rows = [
        ("empty body", chat, b""), ("not JSON", chat, b"{nope"), ("JSON array", chat, b"[]"),
        ("JSON string", chat, b'"x"'), ("null", chat, b"null"),
        ("no model", chat, f'{{"messages": {msg}}}'.encode()),
        ("no messages", chat, b'{"model": "tiny"}'),
        ("messages not a list", chat, b'{"model": "tiny", "messages": "hi"}'),
        ("empty messages", chat, b'{"model": "tiny", "messages": []}'),
        ("bad role", chat, b'{"model": "tiny", "messages": [{"role": "x", "content": "y"}]}'),
        ("content a number", chat, b'{"model": "tiny", "messages": [{"role": "user", '
                                   b'"content": 5}]}'),
        ("lone surrogate", chat, b'{"model": "tiny", "messages": [{"role": "user", '
                                 b'"content": "a\\ud800b"}]}'),
        ("invalid UTF-8", chat, b'{"model": "tiny", "messages": [{"role": "user", '
                                b'"content": "\xff\xfe"}]}'),
        ("100k-deep JSON", chat, b'{"model": "tiny", "messages": ' + b"[" * 100_000
         + b"]" * 100_000 + b"}"),
        ("NaN temperature", chat, f'{{"model": "tiny", "messages": {msg}, '
                                  f'"temperature": NaN}}'.encode()),
        ("temperature 3", chat, f'{{"model": "tiny", "messages": {msg}, "temperature": 3}}'
         .encode()),
        ("top_p 0", chat, f'{{"model": "tiny", "messages": {msg}, "top_p": 0}}'.encode()),
        ("max_tokens -1", chat, f'{{"model": "tiny", "messages": {msg}, "max_tokens": -1}}'
         .encode()),
        ("max_tokens huge", chat, f'{{"model": "tiny", "messages": {msg}, '
                                  f'"max_tokens": 99999999999999999999}}'.encode()),
        ("max_tokens a string", chat, f'{{"model": "tiny", "messages": {msg}, '
                                      f'"max_tokens": "8"}}'.encode()),
        ("n 2", chat, f'{{"model": "tiny", "messages": {msg}, "n": 2}}'.encode()),
        ("stream yes", chat, f'{{"model": "tiny", "messages": {msg}, "stream": "yes"}}'
         .encode()),
        ("stop five", chat, f'{{"model": "tiny", "messages": {msg}, '
                            f'"stop": ["a","b","c","d","e"]}}'.encode()),
        ("stop a number", chat, f'{{"model": "tiny", "messages": {msg}, "stop": 5}}'.encode()),
        ("seed 2^70", chat, f'{{"model": "tiny", "messages": {msg}, "seed": {2**70}}}'.encode()),
        ("seed a float", chat, f'{{"model": "tiny", "messages": {msg}, "seed": 1.5}}'.encode()),
        ("logprobs", chat, f'{{"model": "tiny", "messages": {msg}, "logprobs": true}}'.encode()),
        ("top_logprobs", chat, f'{{"model": "tiny", "messages": {msg}, "top_logprobs": 3}}'
         .encode()),
        ("logit_bias", chat, f'{{"model": "tiny", "messages": {msg}, "logit_bias": {{"1": 9}}}}'
         .encode()),
        ("response_format json", chat, f'{{"model": "tiny", "messages": {msg}, '
                                       f'"response_format": {{"type": "json_object"}}}}'.encode()),
        ("tools", chat, f'{{"model": "tiny", "messages": {msg}, "tools": [{{"type": "f"}}]}}'
         .encode()),
        ("cache_salt", chat, f'{{"model": "tiny", "messages": {msg}, "cache_salt": "x"}}'
         .encode()),
        ("unknown model", chat, f'{{"model": "nope", "messages": {msg}}}'.encode()),
        ("model a list", chat, f'{{"model": ["tiny"], "messages": {msg}}}'.encode()),
        ("stream_options a string", chat, f'{{"model": "tiny", "messages": {msg}, '
                                          f'"stream_options": "x"}}'.encode()),
        ("prompt list of two", comp, b'{"model": "tiny", "prompt": ["a", "b"]}'),
        ("prompt a number", comp, b'{"model": "tiny", "prompt": 5}'),
        ("empty prompt", comp, b'{"model": "tiny", "prompt": ""}'),
        ("echo", comp, b'{"model": "tiny", "prompt": "a", "echo": true}'),
        ("best_of 3", comp, b'{"model": "tiny", "prompt": "a", "best_of": 3}'),
        ("prompt surrogate", comp, b'{"model": "tiny", "prompt": "\\udfff"}'),
    ]
    return rows


def bad_requests(url: str, model: str) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    tracebacks = 0
    with httpx.Client(base_url=url, timeout=120,
                      headers={"Authorization": f"Bearer {TENANT}",
                               "content-type": "application/json"}) as c:
        for name, endpoint, raw in _bad_requests():
            raw = raw.replace(b'"tiny"', f'"{model}"'.encode())
            try:
                r = c.post(endpoint, content=raw)
                statuses[name] = r.status_code
                tracebacks += "Traceback" in r.text
            except httpx.HTTPError:
                statuses[name] = -1  # connection reset
    return {"requests": len(statuses), "server_errors": sum(s >= 500 for s in statuses.values()),
            "resets": sum(s < 0 for s in statuses.values()), "tracebacks": tracebacks,
            "statuses": statuses}


def _until(cond: Callable[[], bool], limit: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if cond():
            return round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    return None


def outage(url: str, redis: RedisServer, rounds: int, down_s: float) -> list[dict[str, Any]]:
    def status() -> str:
        try:
            return str(httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {ADMIN}"},
                                 timeout=10).json().get("status"))
        except httpx.HTTPError:
            return "error"

    out = []
    for _ in range(rounds):
        redis.stop()
        to_degraded = _until(lambda: status() == "degraded", 30)
        flips, last, end = 0, status(), time.monotonic() + down_s
        while time.monotonic() < end:
            now = status()
            flips += now != last
            last = now
            time.sleep(0.1)
        redis.start()
        to_ok = _until(lambda: status() == "ok", 30)
        out.append({"seconds_to_degraded": to_degraded, "flips_while_down": flips,
                    "seconds_to_ok_after_recovery": to_ok})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, fewer rounds")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--one-body", action="store_true", help="skip the 10 oversized bodies at "
                    "once (a baseline without the body limit takes minutes per body)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="semcomm-hardening-"))
    exe = shutil.which("redis-server")
    redis = RedisServer() if exe else None
    if redis is not None:
        redis.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, SEMCOMM_HOME=str(tmp / "home"), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-c", "from semcomm.cli import main; main()",
                             "serve", "--config", str(_config(tmp, args.quick, redis)),
                             "--port", str(port), "--log-level", "error"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, Any] = {"quick": args.quick}
    try:
        _wait_up(url, proc)
        model = "tiny" if args.quick else "smollm2-135m-instruct"
        out["oversized_one"] = oversized(url, proc.pid, 1)
        print("20 MB body:", out["oversized_one"])
        if not args.one_body:
            out["oversized_ten"] = oversized(url, proc.pid, 10)
            print("10 x 20 MB at once:", out["oversized_ten"])
        out["health_while_served"] = health_while_served(url)
        print("health while a request is served:", out["health_while_served"])
        out["bad_requests"] = bad_requests(url, model)
        print("bad requests:", {k: v for k, v in out["bad_requests"].items() if k != "statuses"})
        if redis is not None:
            out["redis_outage"] = outage(url, redis, 2 if args.quick else 3,
                                         4.0 if args.quick else 10.0)
            print("redis outage:", out["redis_outage"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if redis is not None:
            redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
