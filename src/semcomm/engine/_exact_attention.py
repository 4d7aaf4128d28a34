"""One-query attention with the bits of PyTorch's CPU flash attention, reading the cache once.

A float32 decode step's ``scaled_dot_product_attention`` on the CPU runs PyTorch's flash kernel
with one query: per query head and block of 512 keys, MKL's matrix-vector product for the
scores, the scale and the block maximum, ``exp`` and the sum, and MKL's product with the values
(online softmax across blocks). With grouped KV heads each query head reads its KV head again,
through MKL's 128-bit kernels: at a 2k context on SmolLM2 about 0.37 ms a layer, a third of a
step. :class:`ExactAttention` computes the same values in the same order, one KV head's query
heads together (each key and value row read once), in a small C++ library:

* scores: the exact matvec order (engine/_exact_matvec.py) for whole groups of 4 keys, and MKL's
  own ``sgemm_`` (the one PyTorch links) for a block's last 1-3 keys, whose tail kernel rounds
  otherwise;
* the block maximum and ``exp``: PyTorch's own vector code (its ``Vectorized<float>`` headers,
  ``exp_u20`` on whole vectors of 16), and for the block's last ``len % 16`` scores ``exp`` in
  double rounded to float, added in order after the vector sum's reduction;
* across blocks: the running sum ``fma(exp(m_old - m_new), sum, block_sum)`` with the float
  ``exp``, the accumulator scaled by that factor;
* values: MKL's order for one column, ``acc += p_j v_j`` in key order (product and sum rounded
  apart), except the outputs MKL handles before its output pointer reaches a 16-byte boundary
  (PyTorch's accumulator starts ``min(512, L) + 2`` floats into its buffer), which add their
  products in blocks of 8 as ``((((acc + p0) + p1) + p2) + p3) + (((p4 + p5) + p6) + p7)``;
* the output: the accumulator times ``1 / sum``.

Each of these was found by probing the kernels (one ``+M``, one ``-M`` and ones elsewhere tell
which terms were summed together) and checked on random data. Nothing is assumed at run time:
:meth:`ExactAttention.matches` compares it with ``scaled_dot_product_attention`` bit for bit on
random queries, keys and values of a model's head shapes at many context lengths (one and more
blocks, every tail) before it is used, one thread only (PyTorch's buffer layout differs per
thread), float32, and the caller keeps SDPA otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from .._native import OncePerProcess, open_built
from ._exact_matvec import build_library, cpu_has_avx512

__all__ = ["ExactAttention"]

logger = logging.getLogger("semcomm.engine")

_SPLIT = 512  # PyTorch's key block for short queries (q_split 32, kv_split 512)

_SOURCE = r"""
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using Vec = at::vec::Vectorized<float>;
typedef void (*sgemm_t)(const char*, const char*, const int*, const int*, const int*,
                        const float*, const float*, const int*, const float*, const int*,
                        const float*, float*, const int*);
static sgemm_t g_sgemm = nullptr;

#define SC_T4(a, b, c, d, T0, T1, T2, T3) {                                     \
    __m512 t0 = _mm512_shuffle_f32x4(a, b, 0x44), t1 = _mm512_shuffle_f32x4(a, b, 0xEE); \
    __m512 t2 = _mm512_shuffle_f32x4(c, d, 0x44), t3 = _mm512_shuffle_f32x4(c, d, 0xEE); \
    T0 = _mm512_shuffle_f32x4(t0, t2, 0x88); T1 = _mm512_shuffle_f32x4(t0, t2, 0xDD); \
    T2 = _mm512_shuffle_f32x4(t1, t3, 0x88); T3 = _mm512_shuffle_f32x4(t1, t3, 0xDD); }

/* dot products of 4 rows of K (stride D) with each of G queries, in MKL's sgemv order;
   out[g * ld + r] */
static inline void dots4(const float* w, int64_t D, const float* q, int64_t G, float* out,
                         int64_t ld) {
    int64_t peel = 4 - (int64_t)(((uintptr_t)w % 16) / 4);
    int64_t chunks = (D - peel) / 4, steps = chunks / 4, rem = chunks % 4;
    int64_t k_end = peel + 16 * steps;
    for (int64_t g = 0; g < G; g++) {
        const float* x = q + g * D;
        float s[4];
        for (int r = 0; r < 4; r++) {
            const float* wr = w + r * D;
            float v = wr[0] * x[0];
            for (int64_t k = 1; k < peel; k++) v = v + wr[k] * x[k];
            s[r] = v;
        }
        __m512 acc = _mm512_set_ps(0, 0, 0, s[3], 0, 0, 0, s[2], 0, 0, 0, s[1], 0, 0, 0, s[0]);
        for (int64_t k = peel; k < k_end; k += 16) {
            __m512 xv = _mm512_loadu_ps(x + k), T0, T1, T2, T3;
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(w + k), xv);
            __m512 b = _mm512_mul_ps(_mm512_loadu_ps(w + D + k), xv);
            __m512 c = _mm512_mul_ps(_mm512_loadu_ps(w + 2 * D + k), xv);
            __m512 d = _mm512_mul_ps(_mm512_loadu_ps(w + 3 * D + k), xv);
            SC_T4(a, b, c, d, T0, T1, T2, T3);
            acc = _mm512_add_ps(acc, T0); acc = _mm512_add_ps(acc, T1);
            acc = _mm512_add_ps(acc, T2); acc = _mm512_add_ps(acc, T3);
        }
        if (rem) {
            __mmask16 m = (__mmask16)((1u << (4 * rem)) - 1);
            __m512 xv = _mm512_maskz_loadu_ps(m, x + k_end), T0, T1, T2, T3;
            __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + k_end), xv);
            __m512 b = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + D + k_end), xv);
            __m512 c = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + 2 * D + k_end), xv);
            __m512 d = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + 3 * D + k_end), xv);
            SC_T4(a, b, c, d, T0, T1, T2, T3);
            acc = _mm512_add_ps(acc, T0);
            if (rem > 1) acc = _mm512_add_ps(acc, T1);
            if (rem > 2) acc = _mm512_add_ps(acc, T2);
        }
        float l[16];
        _mm512_storeu_ps(l, acc);
        for (int r = 0; r < 4; r++) {
            const float* wr = w + r * D;
            float v = (l[4 * r] + l[4 * r + 2]) + (l[4 * r + 1] + l[4 * r + 3]);
            for (int64_t j = k_end + 4 * rem; j < D; j++) v = v + wr[j] * x[j];
            out[g * ld + r] = v;
        }
    }
}


/* lane 0 of each 128-bit lane of x: ((x0 + x1) + x2) + x3, the other lanes 0 */
static inline __m512 sc_lane_seq(__m512 x) {
    __m512 s = _mm512_add_ps(x, _mm512_permute_ps(x, 0x55));          /* x0 + x1 */
    s = _mm512_add_ps(s, _mm512_permute_ps(x, 0xAA));                   /* + x2 */
    s = _mm512_add_ps(s, _mm512_permute_ps(x, 0xFF));                   /* + x3 */
    return _mm512_maskz_mov_ps(0x1111, s);
}

/* dots4 for rows of 64 floats starting 16-byte aligned (peel 4, no tail): every load is one
   whole 64-byte line when the rows are 64-byte aligned */
static inline void dots4_64(const float* w, const float* q, int64_t G, float* out, int64_t ld) {
    __m512 w0[4], w1[4], w2[4], w3[4];
    for (int s = 0; s < 4; s++) {
        w0[s] = _mm512_loadu_ps(w + 16 * s);
        w1[s] = _mm512_loadu_ps(w + 64 + 16 * s);
        w2[s] = _mm512_loadu_ps(w + 128 + 16 * s);
        w3[s] = _mm512_loadu_ps(w + 192 + 16 * s);
    }
    for (int64_t g = 0; g < G; g++) {
        const float* x = q + g * 64;
        __m512 acc = _mm512_setzero_ps();
        for (int s = 0; s < 4; s++) {
            __m512 xv = _mm512_loadu_ps(x + 16 * s), T0, T1, T2, T3;
            __m512 a = _mm512_mul_ps(w0[s], xv), b = _mm512_mul_ps(w1[s], xv);
            __m512 c = _mm512_mul_ps(w2[s], xv), d = _mm512_mul_ps(w3[s], xv);
            SC_T4(a, b, c, d, T0, T1, T2, T3);
            acc = s == 0 ? sc_lane_seq(T0) : _mm512_add_ps(acc, T0);
            acc = _mm512_add_ps(acc, T1);
            acc = _mm512_add_ps(acc, T2);
            acc = _mm512_add_ps(acc, T3);
        }
        /* (l0 + l2) + (l1 + l3) in lane 0 of each 128-bit lane */
        __m512 h = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0x4E));   /* l0+l2, l1+l3 */
        h = _mm512_add_ps(h, _mm512_permute_ps(h, 0xB1));               /* (l0+l2)+(l1+l3) */
        _mm512_mask_compressstoreu_ps(out + g * ld, 0x1111, h);
    }
}


/* dst[g] += p[g][j] V[j] for j in [0, b) in order, G heads of 64 outputs held in registers */
template <int G>
static inline void pv_64(const float* V, const float* qk, int64_t split, int64_t b, float* dst) {
    __m512 acc[G][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_loadu_ps(dst + g * 64 + 16 * c);
    for (int64_t j = 0; j < b; j++) {
        const float* vr = V + j * 64;
        __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
        __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
        for (int g = 0; g < G; g++) {
            __m512 p = _mm512_set1_ps(qk[g * split + j]);
            acc[g][0] = _mm512_add_ps(acc[g][0], _mm512_mul_ps(v0, p));
            acc[g][1] = _mm512_add_ps(acc[g][1], _mm512_mul_ps(v1, p));
            acc[g][2] = _mm512_add_ps(acc[g][2], _mm512_mul_ps(v2, p));
            acc[g][3] = _mm512_add_ps(acc[g][3], _mm512_mul_ps(v3, p));
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(dst + g * 64 + 16 * c, acc[g][c]);
}

static bool pv_64_any(int64_t G, const float* V, const float* qk, int64_t split, int64_t b,
                      float* dst) {
    switch (G) {
        case 1: pv_64<1>(V, qk, split, b, dst); return true;
        case 2: pv_64<2>(V, qk, split, b, dst); return true;
        case 3: pv_64<3>(V, qk, split, b, dst); return true;
        case 4: pv_64<4>(V, qk, split, b, dst); return true;
        case 5: pv_64<5>(V, qk, split, b, dst); return true;
        case 6: pv_64<6>(V, qk, split, b, dst); return true;
        case 7: pv_64<7>(V, qk, split, b, dst); return true;
        default: return false;
    }
}

extern "C" void semcomm_attention_set_sgemm(void* f) { g_sgemm = (sgemm_t)f; }

/* one query per head: out[h] = softmax(scale q[h] K[h / G]^T) V[h / G], as PyTorch's CPU flash
   attention computes it for one query (blocks of `split` keys) */
extern "C" int semcomm_attention(const float* q, const float* k, const float* v, int64_t H,
                                 int64_t Hkv, int64_t L, int64_t D, int64_t kh, int64_t vh,
                                 int64_t split, float scale, float* out) {
    if (!g_sgemm || H % Hkv || H / Hkv > 64 || D % 16 || D > 256 || L < 1 || split < 16) return 1;
    const int64_t G = H / Hkv;
    std::vector<float> qk_buf(G * split + 16), dst(G * D), mx(G), sm(G);
    float* qk = qk_buf.data();
    const float ninf = -std::numeric_limits<float>::infinity();
    /* PyTorch's per-thread buffer holds the block's scores, the row maximum and sum, then the
       output accumulator: that accumulator starts (min(split, L) + 2) floats past a 64-byte
       boundary, and MKL's gemv handles the outputs before the next 16-byte boundary apart */
    const int64_t peel = (4 - (std::min(split, L) + 2) % 4) % 4;
    for (int64_t kvh = 0; kvh < Hkv; kvh++) {
        const float* K = k + kvh * kh;
        const float* V = v + kvh * vh;
        const float* qg = q + kvh * G * D;
        for (int64_t g = 0; g < G; g++) { mx[g] = ninf; sm[g] = 0.f; }
        for (int64_t n = 0; n < L; n += split) {
            int64_t b = std::min(split, L - n);
            int64_t full = b - b % 4;
            if (D == 64 && (uintptr_t)K % 16 == 0) {
                for (int64_t j = 0; j < full; j += 4) dots4_64(K + (n + j) * D, qg, G, qk + j, split);
            } else {
                for (int64_t j = 0; j < full; j += 4) dots4(K + (n + j) * D, D, qg, G, qk + j, split);
            }
            if (full < b) {  /* a tail of 1-3 keys: MKL's own kernel for a tail group */
                int m = (int)(b - full), one = 1, dd = (int)D;
                float alpha = 1.f, beta = 0.f;
                for (int64_t g = 0; g < G; g++)
                    g_sgemm("T", "N", &m, &one, &dd, &alpha, K + (n + full) * D, &dd, qg + g * D,
                            &dd, &beta, qk + g * split + full, &m);
            }
            for (int64_t g = 0; g < G; g++) {
                float* s = qk + g * split;
                /* scores *= scale, block maximum */
                Vec vs(scale), vmax(ninf);
                int64_t i = 0;
                float tmax = ninf;
                for (; i < Vec::size() * (b / Vec::size()); i += Vec::size()) {
                    Vec t = Vec::loadu(s + i) * vs;
                    vmax = at::vec::maximum(vmax, t);
                    t.store(s + i);
                }
                for (; i < b; i++) { float t = s[i] * scale; tmax = std::max(tmax, t); s[i] = t; }
                float bmax = std::max(tmax, at::vec::vec_reduce_all<float>(
                    [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax));
                float newmax = mx[g] > bmax ? mx[g] : bmax;
                float* d = dst.data() + g * D;
                if (newmax == ninf) {
                    for (int64_t t = 0; t < b; t++) s[t] = 0.f;
                } else {
                    Vec vm(newmax), vsum(0.f);
                    int64_t t = 0;
                    for (; t < Vec::size() * (b / Vec::size()); t += Vec::size()) {
                        Vec e = (Vec::loadu(s + t) - vm).exp_u20();
                        vsum += e;
                        e.store(s + t);
                    }
                    float tsum = at::vec::vec_reduce_all<float>(
                        [](Vec& x, Vec& y) { return x + y; }, vsum);
                    for (; t < b; t++) {  /* the scalar tail: exp in double, rounded */
                        float e = (float)::exp((double)(s[t] - newmax));
                        tsum += e;
                        s[t] = e;
                    }
                    float et = std::exp(mx[g] - newmax);  /* float exp here */
                    sm[g] = std::fma(et, sm[g], tsum);  /* one fused rounding, as compiled there */
                    mx[g] = newmax;
                    if (n > 0) for (int64_t c = 0; c < D; c++) d[c] = d[c] * et;
                }
                if (n == 0) for (int64_t c = 0; c < D; c++) d[c] = 0.f;
            }
            /* dst[g] += sum_j p[g][j] V[n + j] in order (MKL's gemv, beta 1 after the first
               block); the first `peel` outputs, which MKL computes before its output pointer
               reaches a 16-byte boundary, add their products in blocks of 8 as
               ((((acc + p0) + p1) + p2) + p3) + (((p4 + p5) + p6) + p7) */
            float keep[4 * 64];
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < peel; c++) keep[g * 4 + c] = dst[g * D + c];
            if (!(D == 64 && pv_64_any(G, V + n * D, qk, split, b, dst.data())))
            for (int64_t j = 0; j < b; j++) {
                const float* vr = V + (n + j) * D;
                for (int64_t g = 0; g < G; g++) {
                    __m512 pv = _mm512_set1_ps(qk[g * split + j]);
                    float* d = dst.data() + g * D;
                    for (int64_t c = 0; c < D; c += 16)
                        _mm512_storeu_ps(d + c, _mm512_add_ps(_mm512_loadu_ps(d + c),
                                         _mm512_mul_ps(_mm512_loadu_ps(vr + c), pv)));
                }
            }
            for (int64_t g = 0; g < G; g++) {
                const float* p = qk + g * split;
                for (int64_t c = 0; c < peel; c++) {
                    float acc = keep[g * 4 + c];
                    int64_t j = 0;
                    for (; j + 8 <= b; j += 8) {
                        const float* vr = V + (n + j) * D + c;
                        acc = acc + vr[0] * p[j];
                        acc = acc + vr[D] * p[j + 1];
                        acc = acc + vr[2 * D] * p[j + 2];
                        acc = acc + vr[3 * D] * p[j + 3];
                        float grp = vr[4 * D] * p[j + 4];
                        grp = grp + vr[5 * D] * p[j + 5];
                        grp = grp + vr[6 * D] * p[j + 6];
                        grp = grp + vr[7 * D] * p[j + 7];
                        acc = acc + grp;
                    }
                    for (; j < b; j++) acc = acc + V[(n + j) * D + c] * p[j];
                    dst[g * D + c] = acc;
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float sum = sm[g] == 0.f ? 1.f : sm[g];
            float rcp = 1.f / sum;
            const float* d = dst.data() + g * D;
            float* o = out + (kvh * G + g) * D;
            for (int64_t c = 0; c < D; c++) o[c] = d[c] * rcp;
        }
    }
    return 0;
}
"""

# -ffp-contract=off: every product and sum rounds apart unless written as one fma
_FLAGS = ["-std=c++17", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
          "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]

# context lengths the check runs: one block, its tails, several blocks and their tails
_CHECK_LENGTHS = (1, 3, 4, 7, 13, 16, 31, 64, 130, 511, 512, 513, 1029, 1538)


class ExactAttention:
    """``attend(q, k, v, scale)``: ``scaled_dot_product_attention(q, k, v, scale=scale,
    enable_gqa=...)`` for one query, bit for bit, where :meth:`supports` and :meth:`matches`
    say so. Load it with :meth:`shared` (None where it cannot run here)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        lib.semcomm_attention_set_sgemm(ctypes.cast(torch_cpu.sgemm_, ctypes.c_void_p))
        fn = lib.semcomm_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
        fn.restype = ctypes.c_int
        self._libs = (lib, torch_cpu)  # keep both loaded
        self._fn = fn
        self.path = path
        self._checked: dict[tuple[int, int, int, float], bool] = {}

    @classmethod
    def shared(cls) -> ExactAttention | None:
        """The process's kernel, compiled on first use (cached on disk); None without AVX-512,
        a C++ compiler, torch's headers and MKL's ``sgemm_`` in torch, or where it fails."""
        return _kernel.get()

    @classmethod
    def _load(cls) -> ExactAttention | None:
        if os.environ.get("SEMCOMM_EXACT_ATTENTION", "1") == "0":
            return None
        if not cpu_has_avx512():
            logger.info("exact attention off: the CPU (or torch's build) has no AVX-512")
            return None
        include = Path(torch.__file__).parent / "include"
        if not (include / "ATen" / "cpu" / "vec" / "vec.h").exists():
            logger.info("exact attention off: torch's C++ headers are not installed")
            return None
        path = build_library("attention", _SOURCE, [*_FLAGS, f"-I{include}"],
                             ("c++", "g++"), suffix=".cpp")
        # AttributeError: torch has no sgemm_ for the library to call
        return open_built(cls, path, "exact attention", (OSError, AttributeError), log=logger)

    @staticmethod
    def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """One float32 CPU query ``[1, H, 1, D]`` over cache views ``[1, Hkv, L, D]`` whose
        rows are contiguous and whose heads start 64-byte aligned (the engine's buffers), at
        one thread."""
        if torch.get_num_threads() != 1:
            return False
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4
               for t in (q, k, v)):
            return False
        _, h, lq, d = q.shape
        _, hkv, n, dk = k.shape
        if (q.shape[0] != 1 or k.shape[0] != 1 or lq != 1 or v.shape != k.shape or dk != d
                or hkv < 1 or h % hkv or h // hkv > 64 or d % 16 or d > 256 or n < 1):
            return False
        return all(t.stride(-1) == 1 and t.stride(-2) == d and t.stride(1) % 16 == 0
                   and t.data_ptr() % 64 == 0 for t in (k, v))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``[1, H, 1, D]``: the attention of one query per head (``supports`` holds)."""
        q = q.contiguous()
        _, h, _, d = q.shape
        out = torch.empty((1, h, 1, d), dtype=torch.float32)
        rc = self._fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), h, k.shape[1], k.shape[2], d,
                      k.stride(1), v.stride(1), _SPLIT, float(scale), out.data_ptr())
        if rc:
            raise RuntimeError(f"exact attention refused the shapes {tuple(q.shape)}, "
                               f"{tuple(k.shape)}")
        return out

    def matches(self, heads: int, kv_heads: int, head_dim: int, scale: float) -> bool:
        """Whether :meth:`attend` gives SDPA's bits for these head shapes and scale on random
        data at every length of ``_CHECK_LENGTHS`` (checked once a shape, at one thread)."""
        key = (heads, kv_heads, head_dim, float(scale))
        if key not in self._checked:
            self._checked[key] = self._check(*key)
        return self._checked[key]

    def _check(self, heads: int, kv_heads: int, head_dim: int, scale: float) -> bool:
        if torch.get_num_threads() != 1:
            return False
        gen = torch.Generator().manual_seed(0)
        cap = max(_CHECK_LENGTHS) + 16
        bk = torch.randn((1, kv_heads, cap, head_dim), generator=gen) * 2
        bv = torch.randn((1, kv_heads, cap, head_dim), generator=gen)
        with torch.inference_mode():
            for n in _CHECK_LENGTHS:
                q = torch.randn((1, heads, 1, head_dim), generator=gen) * (1 + n % 5)
                k, v = bk[:, :, :n], bv[:, :, :n]
                if not self.supports(q, k, v):
                    return False
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                                     scale=scale, is_causal=False,
                                                     enable_gqa=heads != kv_heads)
                if not torch.equal(self.attend(q, k, v, scale), ref):
                    logger.info("exact attention off: it differs from SDPA at %d keys", n)
                    return False
        return True


_kernel = OncePerProcess(ExactAttention._load)  # the process's kernel, loaded on first use
