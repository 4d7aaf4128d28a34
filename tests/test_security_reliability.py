"""Crash safety and degraded service: kill -9 mid-write, Redis restarts, overload and probing.

Writers run in a child process (this module run as a script, see ``_worker``) that prints the
index of every write *after* the store call returned (committed). The test kills it with SIGKILL
mid-stream, reopens the store and checks: every committed entry is intact, nothing corrupt is
served, and the store is usable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from semcomm.errors import BackendDownWarning
from semcomm.kv import DiskStore, Namespace, RedisStore, chunk_keys, encode_chunk
from semcomm.security import ChunkSealer, TenantKeyring

SECRET = "reliability-test-secret-0123456789"
NS = Namespace(model="crash", tokenizer="", dtype="float32", codec="none", tenant="t")


def _chunk(i: int, payload: int) -> tuple[bytes, bytes]:
    """Deterministic chunk number ``i`` (its own one-chunk chain)."""
    key = chunk_keys(NS.digest, [i, i + 1, i + 2], 3)[0]
    arr = np.random.default_rng(i).standard_normal(payload // 4, dtype=np.float32)
    data = encode_chunk(namespace=NS.digest, key=key, parent=None, num_tokens=3, start=0,
                        dtype="float32", codec="none", codec_params={}, arrays={"k.0": arr})
    return key, data


def _entry(i: int) -> Any:
    from semcomm.semantic import Entry

    vec = np.random.default_rng(i).standard_normal(32).astype(np.float32)
    return Entry(id=f"{i:08x}", partition="p" * 32, query=f"question {i}", answer=f"answer {i}" * 50,
                 vector=vec / np.linalg.norm(vec), tenant="t" * 64, created_at=float(i))


def _entry_sealer() -> Any:
    from semcomm.security import EntrySealer

    return EntrySealer(TenantKeyring(SECRET))


def _open_kv(kind: str, where: str) -> Any:
    sealer = ChunkSealer(TenantKeyring(SECRET))
    return DiskStore(where, sealer=sealer) if kind == "disk" else RedisStore(where, sealer=sealer)


def _open_semantic(kind: str, where: str) -> Any:
    from semcomm.semantic import RedisEntryStore, SQLiteEntryStore

    sealer = _entry_sealer()
    if kind == "sqlite":
        return SQLiteEntryStore(where, sealer=sealer)
    return RedisEntryStore(where, sealer=sealer)


def _worker(kind: str, where: str) -> None:
    """Write until killed; print each committed index."""
    if kind in ("disk", "redis"):
        store = _open_kv(kind, where)
        for i in range(1_000_000):
            key, data = _chunk(i, 256 << 10)  # 256 KiB chunks: a kill lands mid-write
            store.put(key, data)
            print(i, flush=True)
    else:
        sem = _open_semantic(kind, where)
        for i in range(1_000_000):
            sem.put(_entry(i))  # sealed by the store
            print(i, flush=True)


@pytest.fixture
def child() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _run_and_kill(procs: list[subprocess.Popen[str]], kind: str, where: str, after: int) -> list[int]:
    """Start a writer, SIGKILL it once ``after`` writes were committed; return committed indexes."""
    p = subprocess.Popen([sys.executable, __file__, kind, where], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    procs.append(p)
    committed: list[int] = []
    assert p.stdout is not None
    deadline = time.monotonic() + 120
    while len(committed) < after:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"writer died: {p.stderr.read() if p.stderr else ''}")
        committed.append(int(line))
        assert time.monotonic() < deadline
    os.kill(p.pid, signal.SIGKILL)  # mid-write: the writer is busy with the next item
    p.wait(timeout=30)
    rest = p.stdout.read()  # lines already printed before the kill are committed too
    committed += [int(x) for x in rest.split()]
    return committed


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_kill_9_during_kv_writes(kind: str, tmp_path: Path, redis_url: str,
                                 child: list[subprocess.Popen[str]]) -> None:
    where = str(tmp_path / "kv") if kind == "disk" else redis_url
    committed = _run_and_kill(child, kind, where, after=12)
    store = _open_kv(kind, where)
    for i in committed:  # committed entries intact (and still authenticated)
        key, data = _chunk(i, 256 << 10)
        assert store.get(key) == data, i
    for key in list(store.scan()):  # nothing corrupt is served
        assert store.get(key) is not None
    assert store.stats().corrupt == 0
    assert len(list(store.scan())) >= len(committed)
    if kind == "disk":
        assert not list((tmp_path / "kv").rglob("*.tmp"))  # the dead writer's partial file is gone
    key, data = _chunk(10**6, 1024)  # and the store is writable again
    store.put(key, data)
    assert store.get(key) == data


@pytest.mark.parametrize("kind", ["sqlite", "redis-sem"])
def test_kill_9_during_semantic_writes(kind: str, tmp_path: Path, redis_url: str,
                                       child: list[subprocess.Popen[str]]) -> None:
    where = str(tmp_path / "sem.sqlite3") if kind == "sqlite" else redis_url
    committed = _run_and_kill(child, kind, where, after=40)
    store = _open_semantic(kind, where)
    for i in committed:
        e = store.get(f"{i:08x}")  # opened by the store: authenticated, not torn or tampered
        assert e is not None, i
        assert e.answer == f"answer {i}" * 50 and e.query == f"question {i}"
    everything = list(store.load_all())
    assert len(everything) >= len(committed)
    assert store.corrupt == 0
    store.close()


def test_tampered_sealed_chunks_are_rejected_counted_and_removed(tmp_path: Path) -> None:
    store = _open_kv("disk", str(tmp_path / "kv"))
    items = [_chunk(i, 4096) for i in range(3)]
    for k, v in items:
        store.put(k, v)
    files = {k: tmp_path / "kv" / k.hex()[:2] / f"{k.hex()}.sckv" for k, _ in items}
    # 1. swap: file of chunk 1 copied over chunk 0 (a valid sealed chunk, wrong key)
    files[items[0][0]].write_bytes(files[items[1][0]].read_bytes())
    # 2. forge: a plain (unsealed) chunk written by someone without the secret
    files[items[2][0]].write_bytes(items[2][1])
    assert store.get(items[0][0]) is None and store.get(items[2][0]) is None
    assert store.get(items[1][0]) == items[1][1]
    assert store.stats().corrupt == 2
    assert not files[items[0][0]].exists() and not files[items[2][0]].exists()


# -- through the server ------------------------------------------------------------------------

def _config(tmp: Path, **sections: Any) -> Any:
    """The server tests' small config (tiny model, tenants acme/beta) with ``sections`` replaced."""
    from semcomm.server import load_config

    from .test_server_support import server_config

    base = server_config(tmp, models={"tiny": {"path": "tiny"}}, pipelines={}, semantic=False)
    return load_config(None, overrides={**base.model_dump(), **sections}, defaults=False,
                       environ={})


def _chat(c: httpx.Client, text: str, **extra: Any) -> httpx.Response:
    return c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": text}],
                                                 **extra})


@pytest.fixture(scope="module")
def redis_for_server() -> Iterator[Any]:
    """A redis-server of this module's own: the outage test stops and restarts it."""
    from ._redis import running_redis

    with running_redis() as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_for_server: Any) -> Iterator[Any]:
    """One live server for the tests below: KV in Redis only, probe detection on."""
    from .test_server_support import live_server

    cfg = _config(tmp_path_factory.mktemp("srv"), security={"probe_detection": True},
                  kv={"tiers": ["redis"], "redis_url": redis_for_server.url})
    with live_server(cfg) as srv:
        yield srv


def test_no_response_field_reveals_another_tenants_cache(server: Any) -> None:
    """(Runs before the probing test, which gets acme flagged.) Counters (usage.cached_tokens, x-semcomm-hits) only ever report the caller's own hits."""
    from .test_server_support import TENANTS

    prompt = "Confidential: merger code name BLUEBIRD, closing on the 14th. Summarise. " * 3
    with server.client(TENANTS["acme"]) as acme, server.client(TENANTS["beta"]) as beta:
        _chat(acme, prompt, max_tokens=2)
        own = _chat(acme, prompt, max_tokens=2)
        assert own.headers["x-semcomm-hits"].startswith("kv:")
        assert own.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        other = _chat(beta, prompt, max_tokens=2)
        assert other.status_code == 200 and other.headers["x-semcomm-hits"] == "none"
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_server_refuses_client_salts_and_throttles_probing(server: Any) -> None:
    from .test_server_support import TENANTS

    with server.client(TENANTS["acme"]) as acme, server.client(TENANTS["beta"]) as beta:
        r = _chat(acme, "hello", cache_salt="victim-salt")
        assert r.status_code == 400 and "derives cache salts on the server" in r.text
        template = "Patient record 0042. Diagnosis: {}. " + "known template text " * 10
        codes = [_chat(acme, template.format(c)).status_code
                 for c in ("asthma", "anemia", "angina", "sepsis", "rabies")]
        assert codes == [200, 200, 200, 429, 429]  # the 4th TTFT-only near-duplicate is refused
        r = _chat(acme, template.format("otitis"))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert _chat(beta, template.format("asthma")).status_code == 200  # others unaffected
        assert _chat(acme, "an unrelated question about invoices", max_tokens=4).status_code == 429


def test_redis_restart_mid_load_service_continues_and_recovers(server: Any,
                                                               redis_for_server: Any) -> None:
    from .test_server_support import TENANTS

    prompt = "A long shared system prompt for the Redis outage test, repeated. " * 5

    def hits(r: httpx.Response) -> str:
        assert r.status_code == 200, r.text
        return r.headers["x-semcomm-hits"]

    with server.client(TENANTS["beta"]) as c:
        hits(_chat(c, prompt, max_tokens=4))
        assert hits(_chat(c, prompt, max_tokens=4)).startswith("kv:")  # Redis serves hits
        redis_for_server.stop()
        t0 = time.monotonic()
        # loud (a BackendDownWarning, from the request path or the server's health probe,
        # whichever meets the outage first; /health says degraded: tests/test_server_outage.py),
        # but not an error: the service continues
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BackendDownWarning)
            # distinct openings, so that this traffic is not a probe pattern for the detector
            down = [hits(_chat(c, t, max_tokens=4))
                    for t in [f"{w} " * 12 + prompt for w in ("alpha", "bravo", "charlie")]
                    + [prompt]]
        assert any(issubclass(w.category, BackendDownWarning) for w in caught)
        assert down == ["none"] * 4  # ... with misses
        assert time.monotonic() - t0 < 30
        redis_for_server.start()  # back, empty
        deadline = time.monotonic() + 20
        recovered = False
        while time.monotonic() < deadline and not recovered:
            hits(_chat(c, prompt + " after", max_tokens=4))
            recovered = hits(_chat(c, prompt + " after", max_tokens=4)).startswith("kv:")
            time.sleep(0.2)
        assert recovered  # writes and hits resume once Redis is back


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
