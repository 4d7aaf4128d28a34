"""A compiled copy of keys into vLLM's CPU ``vec`` block layout (keys transposed per block).

With the ``vec`` attention ISA each block and head of vLLM's CPU cache holds its keys as
``[head_size, block_size]``, while a semcomm chunk holds them as ``[tokens, head_dim]`` per layer
and head: a load transposes every 2-byte key. numpy's strided copy does that one element at a
time and was most of a load's copy time (keys 10x the values' time for the same bytes, measured
here). :func:`keys_kernel` is one small C function (8x8 tile transposes with SSE2 where the CPU
has it, a plain loop otherwise), compiled once per machine with the system's C compiler into
``$SEMCOMM_HOME/kernels`` (the source's digest in the file name) and called through ``ctypes``
(which releases the GIL). Where there is no compiler, the build fails, the element is not 2
bytes or ``SEMCOMM_VLLM_KERNEL=0``, the connector keeps numpy's copy; both write the same bytes
(tests compare them).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

from .._native import build_library

__all__ = ["KERNEL_ENV", "KeysKernel", "keys_kernel"]

logger = logging.getLogger("semcomm.integrations.vllm")

KERNEL_ENV = "SEMCOMM_VLLM_KERNEL"
"""``0`` turns the compiled key copy off (numpy's copy is used)."""

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Keys of na x nb x nc tiles of 2-byte elements, at any alignment (byte pointers, unaligned
   loads and stores). Tile (a, b, c): bs source rows of d contiguous elements at element offset
   a*sa + b*sb + c*sc of src, row t at + t*st; written transposed as [d][bs] contiguous at
   element offset a*da + b*db + c*dc of dst. */
void semcomm_keys_d_bs(const unsigned char *src, unsigned char *dst,
                       int64_t na, int64_t nb, int64_t nc,
                       int64_t sa, int64_t sb, int64_t sc, int64_t st,
                       int64_t da, int64_t db, int64_t dc, int64_t bs, int64_t d)
{
    for (int64_t a = 0; a < na; a++)
    for (int64_t b = 0; b < nb; b++)
    for (int64_t c = 0; c < nc; c++) {
        const unsigned char *S = src + 2 * (a * sa + b * sb + c * sc);
        unsigned char *D = dst + 2 * (a * da + b * db + c * dc);
#if defined(__SSE2__)
        if (bs % 8 == 0 && d % 8 == 0) {
            for (int64_t t0 = 0; t0 < bs; t0 += 8)
            for (int64_t k0 = 0; k0 < d; k0 += 8) {
                const unsigned char *p = S + 2 * (t0 * st + k0);
                const int64_t r = 2 * st;
                __m128i r0 = _mm_loadu_si128((const __m128i *)(p));
                __m128i r1 = _mm_loadu_si128((const __m128i *)(p + r));
                __m128i r2 = _mm_loadu_si128((const __m128i *)(p + 2 * r));
                __m128i r3 = _mm_loadu_si128((const __m128i *)(p + 3 * r));
                __m128i r4 = _mm_loadu_si128((const __m128i *)(p + 4 * r));
                __m128i r5 = _mm_loadu_si128((const __m128i *)(p + 5 * r));
                __m128i r6 = _mm_loadu_si128((const __m128i *)(p + 6 * r));
                __m128i r7 = _mm_loadu_si128((const __m128i *)(p + 7 * r));
                __m128i t0l = _mm_unpacklo_epi16(r0, r1), t0h = _mm_unpackhi_epi16(r0, r1);
                __m128i t1l = _mm_unpacklo_epi16(r2, r3), t1h = _mm_unpackhi_epi16(r2, r3);
                __m128i t2l = _mm_unpacklo_epi16(r4, r5), t2h = _mm_unpackhi_epi16(r4, r5);
                __m128i t3l = _mm_unpacklo_epi16(r6, r7), t3h = _mm_unpackhi_epi16(r6, r7);
                __m128i u0 = _mm_unpacklo_epi32(t0l, t1l), u1 = _mm_unpackhi_epi32(t0l, t1l);
                __m128i u2 = _mm_unpacklo_epi32(t0h, t1h), u3 = _mm_unpackhi_epi32(t0h, t1h);
                __m128i u4 = _mm_unpacklo_epi32(t2l, t3l), u5 = _mm_unpackhi_epi32(t2l, t3l);
                __m128i u6 = _mm_unpacklo_epi32(t2h, t3h), u7 = _mm_unpackhi_epi32(t2h, t3h);
                unsigned char *q = D + 2 * (k0 * bs + t0);
                const int64_t w = 2 * bs;
                _mm_storeu_si128((__m128i *)(q), _mm_unpacklo_epi64(u0, u4));
                _mm_storeu_si128((__m128i *)(q + w), _mm_unpackhi_epi64(u0, u4));
                _mm_storeu_si128((__m128i *)(q + 2 * w), _mm_unpacklo_epi64(u1, u5));
                _mm_storeu_si128((__m128i *)(q + 3 * w), _mm_unpackhi_epi64(u1, u5));
                _mm_storeu_si128((__m128i *)(q + 4 * w), _mm_unpacklo_epi64(u2, u6));
                _mm_storeu_si128((__m128i *)(q + 5 * w), _mm_unpackhi_epi64(u2, u6));
                _mm_storeu_si128((__m128i *)(q + 6 * w), _mm_unpacklo_epi64(u3, u7));
                _mm_storeu_si128((__m128i *)(q + 7 * w), _mm_unpackhi_epi64(u3, u7));
            }
            continue;
        }
#endif
        for (int64_t t = 0; t < bs; t++)
            for (int64_t k = 0; k < d; k++)
                memcpy(D + 2 * (k * bs + t), S + 2 * (t * st + k), 2);
    }
}
"""
_FLAGS = ["-O2", "-shared", "-fPIC"]

_lock = threading.Lock()
_shared: KeysKernel | bool | None = None  # the process's kernel once tried (False: none)


class KeysKernel:
    """``copy(src, dst, ...)``: tiles of keys from token rows into ``[d, bs]`` tiles (2-byte
    elements, strides in elements; see the C source)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        fn = lib.semcomm_keys_d_bs
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 12
        fn.restype = None
        self._lib = lib  # keeps the library loaded
        self._fn = fn
        self.path = path

    def copy(self, src: int, dst: int, counts: tuple[int, int, int],
             src_strides: tuple[int, int, int, int], dst_strides: tuple[int, int, int],
             bs: int, d: int) -> None:
        """Addresses ``src``/``dst`` (any alignment) of tile (0, 0, 0); ``counts`` tiles
        along three axes, their source strides and row stride, their destination strides."""
        self._fn(src, dst, *counts, *src_strides, *dst_strides, bs, d)


def _build() -> Path | None:
    return build_library("vllm-keys", _SOURCE, _FLAGS, ("cc", "gcc"), log=logger)


def keys_kernel() -> KeysKernel | None:
    """The process's compiled key copy (built on first use, cached on disk by source digest);
    None where it cannot be built or loaded, or with ``SEMCOMM_VLLM_KERNEL=0``."""
    global _shared
    with _lock:
        if _shared is None:
            kernel: KeysKernel | None = None
            if os.environ.get(KERNEL_ENV, "1").strip() != "0":
                try:
                    path = _build()
                    kernel = KeysKernel(path) if path is not None else None
                except OSError as exc:
                    logger.info("compiled key copy off: %s", exc)
            _shared = kernel or False
        return _shared if isinstance(_shared, KeysKernel) else None
