"""Failure injection for tests: a backend wrapper that fails on purpose.

The model option ``fail_mode`` (test-only, see docs/server.md) wraps a model's backend in a
:class:`FaultyBackend`; the app answers its :class:`InjectedFault` with the fault's status.
It is the shipped test double for failures: tests of retries, 5xx handling and dropped
streams run against a real server with it instead of mocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..runtime import Delta, StreamItem
from ._backends import BackendStatus, GenRequest, ModelBackend, PreparedPrompt

__all__ = ["FaultyBackend", "InjectedFault"]


class InjectedFault(Exception):
    """Raised by :class:`FaultyBackend`; the app answers with ``status`` (test-only)."""

    def __init__(self, message: str, status: int, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class FaultyBackend:
    """Wraps a backend and fails on purpose, as configured by the test-only ``fail_mode``.

    Modes: ``http_500`` and ``http_503`` answer with that status for the first ``fail_count``
    requests (0 = always); ``slow`` waits ``fail_delay_s`` before serving; ``drop`` sends the
    first event of a stream and then aborts the connection.
    """

    def __init__(self, inner: ModelBackend, mode: str, *, delay_s: float = 0.0,
                 count: int = 0) -> None:
        self.inner = inner
        self.name = inner.name
        self.kind = inner.kind
        self.kv_reuse = inner.kv_reuse
        self.max_positions = inner.max_positions
        self.mode = mode
        self.delay_s = delay_s
        self.count = count
        self.calls = 0

    def status(self) -> BackendStatus:
        return self.inner.status()

    def prepare(self, req: GenRequest) -> PreparedPrompt | None:
        return self.inner.prepare(req)

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        self.calls += 1
        failing = self.count == 0 or self.calls <= self.count
        if self.mode in ("http_500", "http_503") and failing:
            status = int(self.mode[5:])
            raise InjectedFault(f"injected failure ({self.mode})", status,
                                retry_after_s=1 if status == 503 else None)
        if self.mode == "slow":
            await asyncio.sleep(self.delay_s)
        sent = 0
        async for item in self.inner.stream(req):
            if self.mode == "drop" and failing and isinstance(item, Delta) and sent >= 1:
                raise ConnectionAbortedError("injected failure (drop)")
            if isinstance(item, Delta):
                sent += 1
            yield item
        if self.mode == "drop" and failing and sent <= 1:
            raise ConnectionAbortedError("injected failure (drop)")

    async def aclose(self) -> None:
        await self.inner.aclose()

