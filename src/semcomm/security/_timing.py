"""Timing defenses: the registry of public prefixes, and TTFT padding of shared-prefix hits.

Per-tenant salts make cross-tenant hits impossible, which removes the timing channel between
tenants entirely. Some prefixes are worth sharing anyway (a vetted system prompt every tenant
sends): the operator registers them in :class:`PublicPrefixRegistry`, and only those may be keyed
under the public namespace (``NO_TENANT_DIGEST``). A hit on a public prefix tells a prober only
that the public prefix is cached, which is public knowledge; but an operator who shares more can
also let :class:`TimingGuard` pad the time to first token of requests that reused *shared* KV up to
what a miss would have cost, so that hit and miss look alike on the wire (defense in depth: costs
the latency the cache saved on those requests).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["PublicMatch", "PublicPrefixRegistry", "TimingGuard"]


def _h(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(b"semcomm/public-prefix/v1" + tokens.tobytes(), digest_size=20).digest()


@dataclass(frozen=True, slots=True)
class PublicMatch:
    """Longest registered public prefix a prompt starts with (``length`` 0 and ``name`` "" for none)."""

    name: str
    length: int


class PublicPrefixRegistry:
    """Operator-registered token prefixes that every tenant may share. Thread-safe, bounded.

    Only hashes are kept (by length), so the registry itself reveals nothing if dumped.
    """

    def __init__(self, *, max_entries: int = 1024) -> None:
        self._by_len: dict[int, dict[bytes, str]] = {}
        self._names: dict[str, tuple[int, bytes]] = {}
        self._max = max_entries
        self._lock = threading.Lock()

    def register(self, tokens: Sequence[int] | np.ndarray, *, name: str) -> None:
        """Mark ``tokens`` (a prefix, e.g. a system prompt's token ids) public under ``name``."""
        arr = np.asarray(tokens, dtype="<u4")
        if arr.ndim != 1 or len(arr) == 0:
            raise ValueError("a public prefix must be a non-empty 1-D token sequence")
        if not name:
            raise ValueError("a public prefix needs a name")
        with self._lock:
            if name not in self._names and len(self._names) >= self._max:
                raise ValueError(f"public prefix registry is full ({self._max} entries)")
            self._unregister_locked(name)
            digest = _h(arr)
            self._by_len.setdefault(len(arr), {})[digest] = name
            self._names[name] = (len(arr), digest)

    def _unregister_locked(self, name: str) -> bool:
        old = self._names.pop(name, None)
        if old is None:
            return False
        n, digest = old
        bucket = self._by_len.get(n, {})
        bucket.pop(digest, None)
        if not bucket:
            self._by_len.pop(n, None)
        return True

    def unregister(self, name: str) -> bool:
        with self._lock:
            return self._unregister_locked(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._names)

    def match(self, tokens: Sequence[int] | np.ndarray) -> PublicMatch:
        """The longest registered prefix that ``tokens`` starts with."""
        arr = np.asarray(tokens, dtype="<u4")
        with self._lock:
            lengths = sorted((n for n in self._by_len if n <= len(arr)), reverse=True)
            for n in lengths:
                name = self._by_len[n].get(_h(arr[:n]))
                if name is not None:
                    return PublicMatch(name, n)
        return PublicMatch("", 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._names)


class TimingGuard:
    """Pads the time to first token of hits on shared KV to the cost of a miss.

    ``mode``: ``"off"``; ``"shared"`` pads only requests that reused KV they did not write
    themselves (public or cross-tenant prefixes); ``"all"`` pads every hit (no timing benefit at
    all; for paranoid deployments). The miss cost is learned online: an EWMA of prefill seconds
    per token over misses (``observe_prefill``), seeded with ``initial_s_per_token``.
    """

    def __init__(
        self,
        mode: Literal["off", "shared", "all"] = "shared",
        *,
        initial_s_per_token: float = 0.0,
        alpha: float = 0.2,
    ) -> None:
        if mode not in ("off", "shared", "all"):
            raise ValueError(f"unknown timing guard mode {mode!r}")
        self.mode = mode
        self._s_per_token = initial_s_per_token
        self._alpha = alpha
        self._lock = threading.Lock()
        self.padded = 0  # requests padded
        self.padded_s = 0.0  # total seconds added

    @property
    def s_per_token(self) -> float:
        return self._s_per_token

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Learn from a miss: ``tokens`` prefilled in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        with self._lock:
            if self._s_per_token <= 0:
                self._s_per_token = rate
            else:
                self._s_per_token += self._alpha * (rate - self._s_per_token)

    def pad_seconds(self, prompt_tokens: int, elapsed_s: float, *, reused_tokens: int, shared: bool) -> float:
        """Seconds to wait before the first token so that this request looks like a miss."""
        if self.mode == "off" or reused_tokens <= 0 or (self.mode == "shared" and not shared):
            return 0.0
        return max(0.0, self._s_per_token * prompt_tokens - elapsed_s)

    def _count(self, delay: float) -> None:
        if delay > 0:
            with self._lock:
                self.padded += 1
                self.padded_s += delay

    def pad(self, start: float, prompt_tokens: int, *, reused_tokens: int, shared: bool) -> float:
        """Sleep as needed (``start`` from ``time.perf_counter()``); returns the delay applied."""
        delay = self.pad_seconds(
            prompt_tokens, time.perf_counter() - start, reused_tokens=reused_tokens, shared=shared
        )
        self._count(delay)
        if delay > 0:
            time.sleep(delay)
        return delay

    async def apad(self, start: float, prompt_tokens: int, *, reused_tokens: int, shared: bool) -> float:
        """Async twin of :meth:`pad`."""
        delay = self.pad_seconds(
            prompt_tokens, time.perf_counter() - start, reused_tokens=reused_tokens, shared=shared
        )
        self._count(delay)
        if delay > 0:
            await asyncio.sleep(delay)
        return delay
