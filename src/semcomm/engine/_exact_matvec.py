"""float32 matrix-vector products with the bits of this machine's BLAS, at twice its speed.

A float32 decode step on the CPU is mostly ``F.linear`` of one token's hidden state by each
weight matrix, and MKL runs that matrix-vector product with a 128-bit kernel that reads weights
at about 15 GB/s on one core here (AMD EPYC, AVX-512), where a plain read of the same bytes runs
at 30 or more. Equal tokens with ``model.generate`` need equal bits, so a faster kernel must
add in MKL's order. That order, found by the accumulation-order probe below (one ``+M``, one
``-M`` and ones elsewhere: the ones that survive tell which terms were summed together) and then
checked on random data, is for a row ``w`` of ``K`` (a multiple of 4) and ``x``, with products
``p[k] = w[k] * x[k]`` rounded to float32 (no fused multiply-add):

* ``s = ((p[0] + p[1]) + p[2]) + p[3]``;
* four lanes ``a[0..3]``, ``a[0] = s`` and the others 0, then ``a[l] += p[4c + l]`` for
  ``c = 1, 2, ...`` in order;
* ``y = (a[0] + a[2]) + (a[1] + a[3])``, and a bias is added to ``y`` afterwards.

That is for a row starting 16-byte aligned; a row that starts ``a`` floats past a 16-byte
boundary (safetensors' memory-mapped weights here start 8 bytes past one) has ``4 - a`` leading
products in ``s`` (up to the first boundary), its chunks from there on, and its last ``a``
products added to ``y`` in order after the lanes' reduction. It holds when the rows come in
whole groups of 4 (a tail row rounds otherwise). :class:`ExactMatVec` runs that order with
512-bit registers (four rows a register, their four-lane chunks brought together by a 4 x 4
transpose of 128-bit lanes, 8 rows at a time, the chunks before a row's first 64-byte boundary
as a partial step so that every whole step loads whole cache lines), in a small C library
compiled once with the system's C compiler and cached under ``$SEMCOMM_HOME/kernels``. Nothing
is assumed: :meth:`matches` checks a weight's products against ``F.linear`` bit for bit on this
machine before it is used, and where there is no C compiler, no AVX-512 or any check fails, the
caller keeps ``F.linear``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import _native
from .._native import OncePerProcess, open_built

__all__ = ["ExactMatVec", "build_library", "cpu_has_avx512"]

logger = logging.getLogger("semcomm.engine")

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

/* 4 x 4 transpose of 128-bit lanes: T_j = [a.c_j, b.c_j, c.c_j, d.c_j] */
#define SC_T4(a, b, c, d, T0, T1, T2, T3) {                                     \
    __m512 t0 = _mm512_shuffle_f32x4(a, b, 0x44), t1 = _mm512_shuffle_f32x4(a, b, 0xEE); \
    __m512 t2 = _mm512_shuffle_f32x4(c, d, 0x44), t3 = _mm512_shuffle_f32x4(c, d, 0xEE); \
    T0 = _mm512_shuffle_f32x4(t0, t2, 0x88); T1 = _mm512_shuffle_f32x4(t0, t2, 0xDD); \
    T2 = _mm512_shuffle_f32x4(t1, t3, 0x88); T3 = _mm512_shuffle_f32x4(t1, t3, 0xDD); }

/* 4 rows (w, w + K, ...) times xv = x[k, k + 16): the 4 chunks of 4 columns of every row,
   chunk j of all 4 rows in T_j; SC_PRODUCTS_M loads only the lanes in the mask m (the rest 0) */
#define SC_PRODUCTS(w, K, k, xv, T0, T1, T2, T3) {                              \
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(w + k), xv);                       \
    __m512 b = _mm512_mul_ps(_mm512_loadu_ps(w + K + k), xv);                   \
    __m512 c = _mm512_mul_ps(_mm512_loadu_ps(w + 2 * K + k), xv);               \
    __m512 d = _mm512_mul_ps(_mm512_loadu_ps(w + 3 * K + k), xv);               \
    SC_T4(a, b, c, d, T0, T1, T2, T3); }
#define SC_PRODUCTS_M(w, K, k, xv, m, T0, T1, T2, T3) {                         \
    __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + k), xv);              \
    __m512 b = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + K + k), xv);          \
    __m512 c = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + 2 * K + k), xv);      \
    __m512 d = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + 3 * K + k), xv);      \
    SC_T4(a, b, c, d, T0, T1, T2, T3); }

#define SC_STEP(acc, w, K, k, xv) {                                             \
    __m512 T0, T1, T2, T3;                                                      \
    SC_PRODUCTS(w, K, k, xv, T0, T1, T2, T3);                                   \
    acc = _mm512_add_ps(acc, T0); acc = _mm512_add_ps(acc, T1);                 \
    acc = _mm512_add_ps(acc, T2); acc = _mm512_add_ps(acc, T3); }

/* 4 rows: lane 0 of each starts with the sum of its first `peel` products (in order) */
static inline __m512 sc_start(const float* w, int64_t K, const float* x, int64_t peel) {
    float s[4];
    for (int r = 0; r < 4; r++) {
        const float* wr = w + r * K;
        float v = wr[0] * x[0];
        for (int64_t k = 1; k < peel; k++) v = v + wr[k] * x[k];
        s[r] = v;
    }
    return _mm512_set_ps(0, 0, 0, s[3], 0, 0, 0, s[2], 0, 0, 0, s[1], 0, 0, 0, s[0]);
}

/* acc plus `n` (1-3) chunks of 4 columns from column k, in order (a partial step) */
static inline __m512 sc_part(__m512 acc, const float* w, int64_t K, const float* x, int64_t k,
                             int64_t n) {
    __mmask16 m = (__mmask16)((1u << (4 * n)) - 1);
    __m512 xv = _mm512_maskz_loadu_ps(m, x + k), T0, T1, T2, T3;
    SC_PRODUCTS_M(w, K, k, xv, m, T0, T1, T2, T3);
    acc = _mm512_add_ps(acc, T0);
    if (n > 1) acc = _mm512_add_ps(acc, T1);
    if (n > 2) acc = _mm512_add_ps(acc, T2);
    return acc;
}

/* the chunks left after the whole 16-column steps (fewer than 4), then the reduction of the
   lanes and the columns after the last whole chunk */
static inline void sc_finish(__m512 acc, const float* w, int64_t K, const float* x,
                             int64_t k, int64_t rem, float* y) {
    if (rem) acc = sc_part(acc, w, K, x, k, rem);
    float l[16];
    _mm512_storeu_ps(l, acc);
    for (int r = 0; r < 4; r++) {
        const float* wr = w + r * K;
        float v = (l[4 * r] + l[4 * r + 2]) + (l[4 * r + 1] + l[4 * r + 3]);
        for (int64_t j = k + 4 * rem; j < K; j++) v = v + wr[j] * x[j];
        y[r] = v;
    }
}

/* y[N] = W[N, K] x[K] in MKL's order (see the module docstring); N % 4 == 0, K % 4 == 0,
   K >= 8, W float-aligned (every row shares its alignment mod 16 bytes) */
void semcomm_matvec(const float* W, const float* x, float* y, int64_t N, int64_t K) {
    int64_t peel = 4 - (int64_t)(((uintptr_t)W % 16) / 4);  /* up to the first 16-byte boundary */
    int64_t chunks = (K - peel) / 4;
    /* the chunks before the rows' first 64-byte boundary go as a partial step, so that every
       whole step loads whole cache lines (the rows share their alignment when K % 16 == 0) */
    int64_t lead = 0;
    if (K % 16 == 0) {
        int64_t a = (int64_t)(((uintptr_t)(W + peel)) % 64);
        lead = a ? (64 - a) / 16 : 0;
        if (lead > chunks) lead = chunks;
    }
    int64_t k_lead = peel + 4 * lead;
    int64_t steps = (chunks - lead) / 4, rem = (chunks - lead) % 4, k_end = k_lead + 16 * steps;
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
        const float* wa = W + n * K;
        const float* wb = wa + 4 * K;
        __m512 aa = sc_start(wa, K, x, peel), ab = sc_start(wb, K, x, peel);
        if (lead) {
            aa = sc_part(aa, wa, K, x, peel, lead);
            ab = sc_part(ab, wb, K, x, peel, lead);
        }
        for (int64_t k = k_lead; k < k_end; k += 16) {
            __m512 xv = _mm512_loadu_ps(x + k);
            SC_STEP(aa, wa, K, k, xv);
            SC_STEP(ab, wb, K, k, xv);
        }
        sc_finish(aa, wa, K, x, k_end, rem, y + n);
        sc_finish(ab, wb, K, x, k_end, rem, y + n + 4);
    }
    for (; n < N; n += 4) {
        const float* wa = W + n * K;
        __m512 aa = sc_start(wa, K, x, peel);
        if (lead) aa = sc_part(aa, wa, K, x, peel, lead);
        for (int64_t k = k_lead; k < k_end; k += 16) {
            __m512 xv = _mm512_loadu_ps(x + k);
            SC_STEP(aa, wa, K, k, xv);
        }
        sc_finish(aa, wa, K, x, k_end, rem, y + n);
    }
}
"""

# -ffp-contract=off: a product and its sum must stay two roundings (the order above), never one
# fused multiply-add
_FLAGS = ["-O2", "-mavx512f", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]


def cpu_has_avx512() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:  # torch's own dispatch level: AVX512 only where the CPU and the build have it
        return str(torch.backends.cpu.get_cpu_capability()).upper().startswith("AVX512")
    except (AttributeError, RuntimeError):
        return False


def build_library(name: str, source: str, flags: list[str], compilers: tuple[str, ...],
                  suffix: str = ".c") -> Path | None:
    """:func:`semcomm._native.build_library` with torch's version in the digest, so another
    torch build compiles the engine's kernels anew."""
    return _native.build_library(name, source, flags, compilers, suffix,
                                 digest_parts=(torch.__version__,), log=logger)


class ExactMatVec:
    """``linear(x, weight, bias)`` for one float32 row ``x`` ``[1, 1, K]``, bit for bit as
    ``F.linear`` on this machine for the weights :meth:`matches` accepted.

    Load it with :meth:`shared` (None where it cannot run here). :meth:`supports` says which
    weights the kernel takes (float32, contiguous, rows and columns multiples of 4, at least 8
    columns); :meth:`matches` checks one against ``F.linear``.
    """

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        fn = lib.semcomm_matvec
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_int64]
        fn.restype = None
        self._lib = lib  # keeps the library loaded
        self._fn = fn
        self.path = path

    @classmethod
    def shared(cls) -> ExactMatVec | None:
        """The process's kernel, compiled on first use (cached on disk by source digest);
        None without AVX-512, a C compiler, or where it fails to build or load."""
        return _kernel.get()

    @classmethod
    def _load(cls) -> ExactMatVec | None:
        if os.environ.get("SEMCOMM_EXACT_MATVEC", "1") == "0":
            return None
        if not cpu_has_avx512():
            logger.info("exact matvec off: the CPU (or torch's build) has no AVX-512")
            return None
        return open_built(cls, build_library("matvec", _SOURCE, _FLAGS, ("cc", "gcc")),
                          "exact matvec", log=logger)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu"
                or not weight.is_contiguous()):
            return False
        n, k = weight.shape
        return n > 0 and n % 4 == 0 and k >= 8 and k % 4 == 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for ``x`` ``[1, 1, K]`` float32 (the caller checked
        :meth:`supports` and :meth:`matches` for ``weight``): ``[1, 1, N]``."""
        x = x.contiguous()
        n, k = weight.shape
        assert x.numel() == k and x.dtype == torch.float32
        y = torch.empty((1, 1, n), dtype=torch.float32)
        self._fn(weight.data_ptr(), x.data_ptr(), y.data_ptr(), n, k)
        return y if bias is None else y + bias

    def matches(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                samples: int = 2, seed: int = 0) -> bool:
        """Whether :meth:`linear` gives ``F.linear``'s bits for ``weight`` on ``samples``
        random rows (of growing scale) at the current thread count."""
        if not self.supports(weight):
            return False
        gen = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            for i in range(samples):
                x = torch.randn((1, 1, weight.shape[1]), generator=gen) * (1.0 + 8 * i)
                if not torch.equal(self.linear(x, weight, bias), F.linear(x, weight, bias)):
                    return False
        return True


_kernel = OncePerProcess(ExactMatVec._load)  # the process's kernel, loaded on first use
