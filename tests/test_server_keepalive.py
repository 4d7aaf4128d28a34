"""Keep-alive: idle weights unloaded (and freed), reloaded on demand with identical outputs."""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from semcomm.errors import ConfigError

from .test_server_support import live_server

CHAT = {"model": "tiny", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": "You are terse. " * 8},
                     {"role": "user", "content": "say something"}]}


def _config(tmp: Path, **model: Any):  # type: ignore[no-untyped-def]
    from semcomm.server import load_config

    return load_config(None, overrides={
        "server": {"state_dir": str(tmp)},
        "models": {"tiny": {"path": "tiny", **model}},
        "kv": {"tiers": ["memory"], "memory_bytes": 8 * 2**20},
        "semantic": {"enabled": False}}, defaults=False, environ={})


def _wait(pred: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_an_idle_model_is_unloaded_freed_and_reloaded_with_identical_output(
    tmp_path: Path,
) -> None:
    with live_server(_config(tmp_path, keep_alive_s=0.3)) as srv, srv.client() as c:
        backend = srv.gateway.backends["tiny"]
        first = c.post("/v1/chat/completions", json=CHAT)
        assert first.status_code == 200, first.text
        res = backend.residency  # the timer runs from start-up: it may have reloaded once
        u0, r0 = res.unloads, res.reloads
        old_model = weakref.ref(backend.loaded_runner.model)
        assert _wait(lambda: not backend.loaded), "the idle model was not unloaded"
        gc.collect()
        assert old_model() is None, "the unloaded model is still referenced somewhere"
        mem = c.get("/health").json()["memory"]
        m = mem["models"]["tiny"]
        assert (m["state"], m["loaded"], m["unloads"], m["reloads"]) == (
            "unloaded", False, u0 + 1, r0)
        assert mem["planned_now_bytes"] == mem["planned_bytes"] - m["weight_bytes"] - m[
            "kv_budget_bytes"]
        assert m["kv_cached_bytes"] > 0  # its prefix chunks stay in the shared store
        assert 'semcomm_memory_weight_bytes{model="tiny"} 0.0' in c.get("/metrics").text

        again = c.post("/v1/chat/completions", json=CHAT)  # waits for the reload
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"] == \
            first.json()["choices"][0]["message"]["content"]
        assert "kv:" in again.headers.get("x-semcomm-hits", "")  # the stored KV was reused
        m = c.get("/health").json()["memory"]["models"]["tiny"]
        assert (m["loaded"], m["reloads"]) == (True, r0 + 1) and m["last_reload_s"] > 0
        text = c.get("/metrics").text
        assert f'semcomm_memory_reloads_total{{model="tiny"}} {float(r0 + 1)}' in text
        assert 'semcomm_memory_reload_seconds_total{model="tiny"}' in text
        assert 'semcomm_memory_loaded{model="tiny"} 1.0' in text
        board = c.get("/dashboard/data").json()["memory"]["models"]["tiny"]
        assert (board["state"], board["reloads"]) == ("loaded", r0 + 1)
        assert board["weight_resident_bytes"] == m["weight_bytes"] > 0


def test_a_busy_model_is_not_unloaded_and_pin_wins_over_keep_alive(tmp_path: Path) -> None:
    with live_server(_config(tmp_path, keep_alive_s=0.2, pin=True)) as srv, srv.client() as c:
        backend = srv.gateway.backends["tiny"]
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        time.sleep(0.6)
        assert backend.loaded and backend.keep_alive_s is None
        assert "pin wins" in srv.gateway.notes["keep_alive:tiny"]
    with live_server(_config(tmp_path, keep_alive_s=0.2)) as srv:
        backend = srv.gateway.backends["tiny"]
        backend._acquire()  # a request in flight
        time.sleep(0.5)
        assert not backend.unload_if_idle() and backend.loaded
        backend._release()
        assert _wait(lambda: not backend.loaded)


@pytest.mark.parametrize(("model", "message"), [
    ({"workers": 2}, "keep_alive_s needs workers = 1"),
    ({"kind": "upstream", "base_url": "http://127.0.0.1:9/v1", "path": None},
     "keep_alive_s is for in-process models"),
])
def test_keep_alive_that_cannot_work_is_refused(tmp_path: Path, model: dict[str, Any],
                                                message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        _config(tmp_path, keep_alive_s=5, **model)
