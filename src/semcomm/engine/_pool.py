"""Idle K/V buffers kept for the next request on the CPU.

A fresh ``torch.empty`` of a few hundred MB is not free on the CPU: the kernel maps and zeroes
each 4 KiB page on its first write, so restoring a prompt into new memory costs several times
the copy itself (measured here: 200 MB copied into fresh memory 85-100 ms, into touched memory
15-17 ms). ``generate`` hands its buffer back when it finishes, and the next request's restore
writes into pages that are already mapped, as a serving engine's preallocated KV blocks are.

The pool holds at most ``max_bytes`` of idle buffers (oldest dropped first); a buffer is handed
out to one request at a time, and only buffers nobody references any more are given back.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

__all__ = ["DEFAULT_KV_POOL_BYTES", "KVBufferPool"]

DEFAULT_KV_POOL_BYTES = 256 * 2**20
"""Idle K/V buffer bytes an engine keeps on the CPU (``HFEngine(kv_pool_bytes=...)``; 0: none)."""

Pair = tuple[torch.Tensor, torch.Tensor]


def _shape_key(k: torch.Tensor, v: torch.Tensor) -> tuple[object, ...]:
    return (k.shape[0], k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)


class KVBufferPool:
    """Thread-safe store of idle ``[layers, kv_heads, capacity, head_dim]`` key/value pairs."""

    def __init__(self, max_bytes: int = DEFAULT_KV_POOL_BYTES):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"kv_pool_bytes must be a non-negative integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._idle: OrderedDict[int, Pair] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again instead of allocated

    @property
    def idle_bytes(self) -> int:
        return self._bytes

    def take(self, layers: int, heads: int, width: int, k_dim: int, v_dim: int,
             dtype: torch.dtype, device: torch.device) -> Pair:
        """An idle pair of at least ``width`` positions (the smallest that fits), else new."""
        want = (layers, heads, k_dim, v_dim, dtype, device)
        with self._lock:
            best: int | None = None
            for ident, (k, v) in self._idle.items():
                if _shape_key(k, v) == want and k.shape[2] >= width and (
                        best is None or k.shape[2] < self._idle[best][0].shape[2]):
                    best = ident
            if best is not None:
                k, v = self._idle.pop(best)
                self._bytes -= k.nbytes + v.nbytes
                self.reused += 1
                return k, v
        return (torch.empty((layers, heads, width, k_dim), dtype=dtype, device=device),
                torch.empty((layers, heads, width, v_dim), dtype=dtype, device=device))

    def give(self, pair: Pair) -> None:
        """Keep ``pair`` for a later request (the caller no longer uses it)."""
        k, v = pair
        size = k.nbytes + v.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if id(k) in self._idle:
                return
            while self._idle and self._bytes + size > self.max_bytes:
                _, (ok, ov) = self._idle.popitem(last=False)
                self._bytes -= ok.nbytes + ov.nbytes
            self._idle[id(k)] = pair
            self._bytes += size

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._bytes = 0
