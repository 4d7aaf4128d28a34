"""A real redis-server for tests: started on a free loopback port, stopped by the fixture."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.common import RedisServer, free_port

__all__ = ["RedisServer", "free_port", "running_redis"]


@contextmanager
def running_redis() -> Iterator[RedisServer]:
    """A started redis-server, stopped on exit (for fixtures of any scope)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
