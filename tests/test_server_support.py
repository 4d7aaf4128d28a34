"""Live-server helpers for the server tests (no tests here): uvicorn on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from semcomm.server import ServerConfig, create_app, load_config

__all__ = ["ADMIN_KEY", "TENANTS", "LiveServer", "live_server", "server_config"]

ADMIN_KEY = "admin-secret-key"
TENANTS = {"acme": "k-acme", "beta": "k-beta"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_config(tmp: Path, *, models: dict[str, Any] | None = None,
                  pipelines: dict[str, Any] | None = None, tenants: bool = True,
                  semantic: bool = True, **server: Any) -> ServerConfig:
    """A small, fast config: the tiny config-built model, memory stores, state under ``tmp``."""
    overrides: dict[str, Any] = {
        "server": {"state_dir": str(tmp), "admin_key": ADMIN_KEY, "max_tokens_limit": 64,
                   "default_max_tokens": 8, **server},
        "models": models if models is not None else {
            "tiny": {"path": "tiny"},
            "tiny-q1": {"path": "tiny", "max_batch": 1, "max_queue": 1},
        },
        "pipelines": pipelines if pipelines is not None else {
            "chain": {"stages": [{"model": "tiny", "system": "Route the request.", "role": "router",
                                  "max_tokens": 4},
                                 {"model": "tiny", "system": "Answer it.", "role": "specialist"}]},
        },
        "kv": {"tiers": ["memory"]},
        "semantic": {"enabled": semantic, "backend": "memory"},
    }
    if tenants:
        overrides["tenants"] = {name: {"api_key": key} for name, key in TENANTS.items()}
    return load_config(None, overrides=overrides, defaults=False, environ={})


class LiveServer:
    """A uvicorn server running ``create_app(config)`` in a thread."""

    def __init__(self, config: ServerConfig) -> None:
        import uvicorn

        self.port = free_port()
        self.app = create_app(config)
        self.gateway = self.app.state.gateway
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.server.started:
                return
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died during startup")
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, key: str | None = None, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)


@contextmanager
def live_server(config: ServerConfig) -> Iterator[LiveServer]:
    srv = LiveServer(config)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
