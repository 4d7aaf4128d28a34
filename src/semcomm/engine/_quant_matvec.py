"""float32 matrix-vector products with MKL's bits, from the GGUF's quantized codes.

The catalog's models (``semcomm.models``) are GGUF files dequantized by transformers with
gguf-py's numpy ``gguf.quants.dequantize``, so every loaded float32 weight element is
``fl(fl(A * q) + B)`` for a small integer code ``q`` and a float32 scale ``A`` and offset ``B``
per block of 16 or 32 elements along a row (``B`` absent for the types without one):

* Q8_0, Q5_0: ``d * q`` (blocks of 32, ``d`` a float16 read as float32);
* Q4_1: ``d * q + m`` (blocks of 32);
* Q4_K: ``(d * sc) * q - (dmin * m)`` (sub-blocks of 32; ``x - y`` is ``x + (-y)`` in IEEE
  arithmetic, signed zeros included, so ``B = -(dmin * m)``);
* Q6_K: ``(d * sc) * q`` (sub-blocks of 16).

A float32 decode step reads every weight once a token (Qwen2.5-0.5B: 1.43 GB of its layers),
and :class:`~semcomm.engine._exact_matvec.ExactMatVec` is bound by those bytes. This kernel
reads the codes as int8 with the per-block ``A`` (and ``B``) instead, about 1.1-1.3 bytes a
weight, rebuilds each weight in registers with exactly those float32 operations (a multiply,
then an add; compiled with ``-ffp-contract=off``, so never one fused multiply-add) and sums the
products in the same MKL order as the float32 kernel does for the float32 row's alignment (see
that module: ``peel`` leading products summed in order, four lanes of chunks of 4, the lanes'
reduction, the last ``4 - peel`` products after it). The products are computed from
block-aligned 16-column loads; lane ``l`` of MKL's order is then the lane of the columns
``k = peel + l (mod 4)``, and the first and last steps add only the lanes that are MKL's.

Nothing is assumed: a weight's codes are used only where (1) their reconstruction equals the
loaded float32 weight bit for bit, every element (the rows of the GGUF tensor are matched to
the loaded rows by content, so a permutation transformers applied, as for Llama's q/k rows, is
found, not presumed), and (2) the kernel's products equal ``F.linear``'s bits on random rows,
checked at one thread before use. Any weight failing either keeps the float32 kernel or
``F.linear``. The codes are built once from the GGUF beside a catalog model's directory and
cached under ``$SEMCOMM_HOME/quant`` by the GGUF's digest and the tensor; ``SEMCOMM_QUANT_MATVEC=0``
turns the path off.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import struct
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .._native import OncePerProcess, open_built
from ._exact_matvec import build_library, cpu_has_avx512

__all__ = [
    "GGUF_LAYER_NAMES",
    "QuantMatVec",
    "QuantWeight",
    "codes_from_blocks",
    "codes_nbytes",
    "find_gguf",
    "gguf_beside",
    "gguf_codes_nbytes",
    "layer_weight_names",
    "load_codes",
    "peel_of",
    "quant_enabled",
]

logger = logging.getLogger("semcomm.engine")

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

/* Layout. A "quad" is 4 rows; chunk c of a quad is its 16 codes of columns 4c..4c+3, row by
   row, so that one 16-lane vector holds chunk c of 4 rows, lane 4i + m being MKL's lane of
   column 4c + m of row i: products are added to the accumulator as they are, no transpose.
   The rows come in groups of 16 (4 quads) read as one stream: chunk c of the group's 4 quads
   is 64 bytes (one cache line), quad after quad; the scales (offsets) of block b of the
   group's 16 rows are 16 floats, quad after quad. Quads left after the last whole group
   follow, each on its own: its chunks in order, its scales 4 floats a block. */

/* 16 products from 16 codes at p: w = fl(fl(A q) + B) (av / bv: the rows' scales spread over
   their lanes), then fl(w x) */
#define SQ_P(p, av, bv, xv) ({                                                      \
    __m512 w_ = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p)))); \
    w_ = _mm512_mul_ps(w_, av);                                                    \
    if (hasb) w_ = _mm512_add_ps(w_, bv);                                          \
    _mm512_mul_ps(w_, xv); })

/* 4 rows' scales at s, each on its row's 4 lanes */
#define SQ_SPREAD(s) _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(s)))

#define SQ_X(c) _mm512_broadcast_f32x4(_mm_loadu_ps(x + 4 * (c)))

/* chunk 0: the first `peel` products of each row summed in order into MKL's lane a[0]
   (lane peel % 4 of the row), the chunk's other lanes added after it */
#define SQ_FIRST(acc, p) {                                                         \
    float p_[16], s_[16] = {0};                                                    \
    _mm512_storeu_ps(p_, p);                                                       \
    for (int i_ = 0; i_ < 4; i_++) {                                               \
        float v_ = p_[4 * i_];                                                     \
        for (int64_t j_ = 1; j_ < peel; j_++) v_ = v_ + p_[4 * i_ + j_];           \
        s_[4 * i_ + (peel & 3)] = v_;                                              \
    }                                                                              \
    acc = _mm512_mask_add_ps(_mm512_loadu_ps(s_), first, _mm512_loadu_ps(s_), p); }

/* the last chunk: its lanes before the rows' last 16-byte boundary into the lanes, then the
   lanes' reduction, then the 4 - peel last products in order */
#define SQ_LAST(acc, p, yq) {                                                      \
    acc = _mm512_mask_add_ps(acc, last, acc, p);                                   \
    float p_[16], l_[16];                                                          \
    _mm512_storeu_ps(p_, p);                                                       \
    _mm512_storeu_ps(l_, acc);                                                     \
    for (int i_ = 0; i_ < 4; i_++) {                                               \
        const float* a4 = l_ + 4 * i_;                                             \
        float v_ = (a4[peel & 3] + a4[(peel + 2) & 3]) + (a4[(peel + 1) & 3] + a4[(peel + 3) & 3]); \
        for (int64_t j_ = peel; j_ < 4; j_++) v_ = v_ + p_[4 * i_ + j_];           \
        (yq)[i_] = v_;                                                             \
    }                                                                              \
}

static inline __attribute__((always_inline)) void sq_body(
        const int8_t* Q, const float* A, const float* B, const float* x, float* y,
        int64_t N, int64_t K, int64_t gshift, int64_t peel, const int hasb) {
    const int64_t nb = K >> gshift, cpb = ((int64_t)1 << gshift) / 4, C = K / 4;
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __mmask16 first = 0, last = 0;  /* MKL's lanes of the first chunk / of the last chunk */
    for (int i = 0; i < 4; i++)
        for (int m = 0; m < 4; m++) {
            if (m >= peel) first |= (__mmask16)(1u << (4 * i + m));
            if (m < peel) last |= (__mmask16)(1u << (4 * i + m));
        }
    const int64_t groups = N / 16;
    for (int64_t g = 0; g < groups; g++) {  /* 16 rows: 4 independent sums */
        const int8_t* qg = Q + g * 16 * K;
        const float* ag = A + g * 16 * nb;
        const float* bg = B + g * 16 * nb;
        __m512 A0 = SQ_SPREAD(ag), A1 = SQ_SPREAD(ag + 4), A2 = SQ_SPREAD(ag + 8), A3 = SQ_SPREAD(ag + 12);
        __m512 B0 = A0, B1 = A1, B2 = A2, B3 = A3;
        if (hasb) { B0 = SQ_SPREAD(bg); B1 = SQ_SPREAD(bg + 4); B2 = SQ_SPREAD(bg + 8); B3 = SQ_SPREAD(bg + 12); }
        __m512 s0, s1, s2, s3, xv = SQ_X(0);
        SQ_FIRST(s0, SQ_P(qg, A0, B0, xv));
        SQ_FIRST(s1, SQ_P(qg + 16, A1, B1, xv));
        SQ_FIRST(s2, SQ_P(qg + 32, A2, B2, xv));
        SQ_FIRST(s3, SQ_P(qg + 48, A3, B3, xv));
        for (int64_t b = 0; b < nb; b++) {
            if (b) {
                const float* ab = ag + 16 * b;
                A0 = SQ_SPREAD(ab); A1 = SQ_SPREAD(ab + 4); A2 = SQ_SPREAD(ab + 8); A3 = SQ_SPREAD(ab + 12);
                if (hasb) {
                    const float* bb = bg + 16 * b;
                    B0 = SQ_SPREAD(bb); B1 = SQ_SPREAD(bb + 4); B2 = SQ_SPREAD(bb + 8); B3 = SQ_SPREAD(bb + 12);
                }
            }
            int64_t cs = b ? b * cpb : 1, ce = b + 1 < nb ? (b + 1) * cpb : C - 1;
            for (int64_t c = cs; c < ce; c++) {
                const int8_t* p = qg + 64 * c;
                xv = SQ_X(c);
                s0 = _mm512_add_ps(s0, SQ_P(p, A0, B0, xv));
                s1 = _mm512_add_ps(s1, SQ_P(p + 16, A1, B1, xv));
                s2 = _mm512_add_ps(s2, SQ_P(p + 32, A2, B2, xv));
                s3 = _mm512_add_ps(s3, SQ_P(p + 48, A3, B3, xv));
            }
        }
        const int8_t* p = qg + 64 * (C - 1);
        xv = SQ_X(C - 1);
        SQ_LAST(s0, SQ_P(p, A0, B0, xv), y + 16 * g);
        SQ_LAST(s1, SQ_P(p + 16, A1, B1, xv), y + 16 * g + 4);
        SQ_LAST(s2, SQ_P(p + 32, A2, B2, xv), y + 16 * g + 8);
        SQ_LAST(s3, SQ_P(p + 48, A3, B3, xv), y + 16 * g + 12);
    }
    for (int64_t r = groups * 4; r < N / 4; r++) {  /* the quads after the last group */
        const int8_t* qq = Q + r * 4 * K;
        const float *aq = A + r * 4 * nb, *bq = B + r * 4 * nb;
        __m512 A0 = SQ_SPREAD(aq), B0 = hasb ? SQ_SPREAD(bq) : A0, s0, xv = SQ_X(0);
        SQ_FIRST(s0, SQ_P(qq, A0, B0, xv));
        for (int64_t b = 0; b < nb; b++) {
            if (b) { A0 = SQ_SPREAD(aq + 4 * b); if (hasb) B0 = SQ_SPREAD(bq + 4 * b); }
            int64_t cs = b ? b * cpb : 1, ce = b + 1 < nb ? (b + 1) * cpb : C - 1;
            for (int64_t c = cs; c < ce; c++) {
                xv = SQ_X(c);
                s0 = _mm512_add_ps(s0, SQ_P(qq + 16 * c, A0, B0, xv));
            }
        }
        xv = SQ_X(C - 1);
        SQ_LAST(s0, SQ_P(qq + 16 * (C - 1), A0, B0, xv), y + 4 * r);
    }
}

/* y[N] = W[N, K] x[K] in MKL's order for float32 rows starting `peel` floats before a 16-byte
   boundary (1-4; 4: aligned), W[n, k] = fl(fl(A[n, k >> gshift] Q[n, k]) + B[n, k >> gshift])
   (no add where B is NULL), codes and scales laid out as above; N % 4 == 0, K % 4 == 0,
   K >= 32, gshift 4 or 5 (blocks of 16 or 32 columns, K a multiple of the block) */
void semcomm_qmatvec(const int8_t* Q, const float* A, const float* B, const float* x, float* y,
                     int64_t N, int64_t K, int64_t gshift, int64_t peel) {
    if (B) sq_body(Q, A, B, x, y, N, K, gshift, peel, 1);
    else sq_body(Q, A, A, x, y, N, K, gshift, peel, 0);
}
"""

_FLAGS = ["-O2", "-mavx512f", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]


QK_K = 256


def quant_enabled() -> bool:
    """False where ``SEMCOMM_QUANT_MATVEC=0`` turns the quantized-code path off."""
    return os.environ.get("SEMCOMM_QUANT_MATVEC", "1") != "0"


@dataclass(slots=True)
class QuantWeight:
    """One weight's codes: ``weight[n, k] == fl(fl(A[n, k // group] * Q[n, k]) + B[...])``
    (no add where there is no ``B``), for a float32 weight whose rows start ``peel`` floats
    before a 16-byte boundary (4: aligned; the summation order depends on it).

    ``q``, ``a`` and ``b`` are flat, laid out as the kernel reads them (groups of 16 rows,
    4-column chunks of 4 rows at a time; the kernel's source describes it):
    :meth:`from_rows` makes one from the row-major arrays, :meth:`rows` gives them back.
    """

    q: torch.Tensor  # int8 [N * K]
    a: torch.Tensor  # float32 [N * K // group]
    b: torch.Tensor | None  # float32 [N * K // group] or None
    n: int
    k: int
    group: int  # 16 or 32
    kind: str  # the GGUF type (Q5_0, Q4_K, ...)
    peel: int = 4

    @classmethod
    def from_rows(cls, q: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, group: int,
                  kind: str) -> QuantWeight:
        """From row-major ``q`` ``[N, K]``, ``a`` and ``b`` ``[N, K // group]`` (``N`` a
        multiple of 4, ``K`` of ``group`` and of 4)."""
        n, k = int(q.shape[0]), int(q.shape[1])
        if n % 4 or k % 4 or k % group or tuple(a.shape) != (n, k // group):
            raise ValueError(f"{kind}: {n}x{k} codes do not come in quads of whole blocks")
        g, c = n // 16, k // 4

        def lay(t: torch.Tensor, cols: int, inner: int) -> torch.Tensor:
            head = t[:16 * g].reshape(g, 4, 4, cols, inner).permute(0, 3, 1, 2, 4)
            tail = t[16 * g:].reshape(-1, 4, cols, inner).permute(0, 2, 1, 3)
            return torch.cat([head.reshape(-1), tail.reshape(-1)])

        return cls(lay(q, c, 4), lay(a, k // group, 1), None if b is None else lay(b, k // group, 1),
                   n, k, group, kind)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row-major ``(q [N, K], a [N, K // group], b or None)``."""
        k, g = self.k, self.n // 16

        def unlay(t: torch.Tensor, cols: int, inner: int) -> torch.Tensor:
            cut = 16 * g * cols * inner
            head = t[:cut].reshape(g, cols, 4, 4, inner).permute(0, 2, 3, 1, 4)
            tail = t[cut:].reshape(-1, cols, 4, inner).permute(0, 2, 1, 3)
            return torch.cat([head.reshape(16 * g, cols * inner),
                              tail.reshape(-1, cols * inner)])

        nb = k // self.group
        return (unlay(self.q, k // 4, 4), unlay(self.a, nb, 1),
                None if self.b is None else unlay(self.b, nb, 1))

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        return (self.q.numel() + self.a.numel() * 4
                + (0 if self.b is None else self.b.numel() * 4))

    def reconstruct(self) -> torch.Tensor:
        """The float32 weight as the codes give it, with gguf-py's float32 operations."""
        q, a, b = self.rows()
        n, k = self.n, self.k
        w = q.reshape(n, k // self.group, self.group).to(torch.float32) * a[..., None]
        if b is not None:
            w = w + b[..., None]
        return w.reshape(n, k)

    def equals(self, weight: torch.Tensor, step: int = 4096) -> bool:
        """Whether the reconstruction equals ``weight`` bit for bit (signed zeros and NaN
        payloads included), rebuilt ``step`` rows at a time (bounded temporary memory: a
        whole float32 LM head rebuilt at once is two more copies of it at load)."""
        if tuple(weight.shape) != self.shape or weight.dtype != torch.float32:
            return False
        q, a, b = self.rows()
        nb = self.k // self.group
        for r in range(0, self.n, step):
            qs = q[r:r + step].reshape(-1, nb, self.group)
            w = qs.to(torch.float32) * a[r:r + step, :, None]
            if b is not None:
                w = w + b[r:r + step, :, None]
            if not torch.equal(w.reshape(-1, self.k).view(torch.int32),
                               weight[r:r + step].contiguous().view(torch.int32)):
                return False
        return True


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def codes_from_blocks(kind: str, blocks: np.ndarray, rows: int, cols: int,
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """``(q int8 [rows, cols], a float32 [rows, cols // g], b float32 or None, g)`` from a
    GGUF tensor's raw blocks (uint8, ``rows * cols / block_size`` blocks in row order), such
    that gguf-py's dequantized value of element ``[n, k]`` is ``fl(fl(a * q) + b)`` of its block
    (per gguf-py's formulas; the caller checks the reconstruction). Raises ValueError for a
    type this module does not take."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    if kind == "Q8_0":
        blocks = blocks.reshape(-1, 34)
        a = _f16(blocks[:, :2])
        q = blocks[:, 2:].view(np.int8)
        b = None
        g = 32
    elif kind == "Q5_0":
        blocks = blocks.reshape(-1, 22)
        a = _f16(blocks[:, :2])
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32).reshape(-1, 1)
        qh = ((qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)
        qs = blocks[:, 6:22]
        ql = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        q = (ql | (qh << 4)).astype(np.int8) - np.int8(16)
        b = None
        g = 32
    elif kind == "Q4_1":
        blocks = blocks.reshape(-1, 20)
        a = _f16(blocks[:, :2])
        b = _f16(blocks[:, 2:4])
        qs = blocks[:, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8)
        g = 32
    elif kind == "Q4_K":
        blocks = blocks.reshape(-1, 144)
        n = blocks.shape[0]
        d = _f16(blocks[:, 0:2])
        dmin = _f16(blocks[:, 2:4])
        sc3 = blocks[:, 4:16].reshape(n, 3, 4)
        dd, mm, md = sc3[:, 0], sc3[:, 1], sc3[:, 2]
        sc = np.concatenate([dd & 0x3F, (md & 0x0F) | ((dd >> 2) & 0x30)], axis=1)
        mn = np.concatenate([mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30)], axis=1)
        a = (d * sc.astype(np.float32)).reshape(n, 8)  # [n, 8] float32, as gguf-py
        b = -(dmin * mn.astype(np.float32)).reshape(n, 8)
        qs = blocks[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, QK_K).astype(np.int8)
        g = 32
    elif kind == "Q6_K":
        blocks = blocks.reshape(-1, 210)
        n = blocks.shape[0]
        scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        a = (d * scales).reshape(n, 16)
        b = None
        sh2 = np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        sh4 = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        lo: np.ndarray = ((blocks[:, :128].reshape(n, -1, 1, 64) >> sh2) & 0x0F).reshape(n, -1, 32)
        hi: np.ndarray = ((blocks[:, 128:192].reshape(n, -1, 1, 32) >> sh4) & 0x03).reshape(
            n, -1, 32)
        q = ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).reshape(n, QK_K)
        g = 16
    else:
        raise ValueError(f"quantized-code matvec: GGUF type {kind} is not supported")
    if cols % g or (rows * cols) % q.shape[1]:
        raise ValueError(f"{kind}: a {rows}x{cols} tensor does not hold whole blocks")
    q = np.ascontiguousarray(q).reshape(rows, cols)
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(rows, cols // g)
    if b is not None:
        b = np.ascontiguousarray(b, dtype=np.float32).reshape(rows, cols // g)
    return q, a, b, g


# the GGUF types the codes take: (columns a scale covers, whether a block has an offset)
_GROUPS = {"Q8_0": (32, False), "Q5_0": (32, False), "Q4_1": (32, True), "Q4_K": (32, True),
           "Q6_K": (16, False)}


def codes_nbytes(kind: str, rows: int, cols: int) -> int:
    """Bytes the :class:`QuantWeight` of a ``[rows, cols]`` GGUF tensor of type ``kind`` keeps
    (int8 codes, a float32 scale a group, an offset where the type has one), what
    :attr:`QuantWeight.nbytes` gives once built; 0 for a type or shape the codes do not take."""
    g, offset = _GROUPS.get(kind, (0, False))
    if not g or rows <= 0 or rows % 4 or cols <= 0 or cols % 4 or cols % g:
        return 0
    return rows * cols + rows * (cols // g) * 4 * (2 if offset else 1)


def gguf_codes_nbytes(path: Path, names: Iterable[str]) -> dict[str, int]:
    """Bytes of the codes :func:`load_codes` keeps for the tensors ``names`` of the GGUF file
    ``path`` (those of a type and shape the kernel takes; the others are left out), read from
    its tensor table without decoding a block: what a memory plan prices before the model is
    loaded. Empty where the gguf package is missing or the file cannot be read (no codes are
    built then either)."""
    try:
        import gguf
    except ImportError:
        return {}
    try:
        tensors = read_gguf_tensors(path, gguf)
    except (OSError, ValueError, KeyError, struct.error):
        return {}
    out: dict[str, int] = {}
    for name in names:
        t = tensors.get(name)
        if t is None or len(t.dims) != 2:
            continue
        n = codes_nbytes(t.kind, t.dims[1], t.dims[0])  # GGUF lists the dims reversed
        if n:
            out[name] = n
    return out


class QuantMatVec:
    """``linear(x, qw, bias)`` for one float32 row ``x`` ``[1, 1, K]`` from a
    :class:`QuantWeight`, bit for bit as ``F.linear`` on the weight it stands for, for the
    weights :meth:`matches` accepted. Load it with :meth:`shared`."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        fn = lib.semcomm_qmatvec
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
        fn.restype = None
        self._lib = lib
        self._fn = fn
        self.path = path

    @classmethod
    def shared(cls) -> QuantMatVec | None:
        """The process's kernel (compiled once, cached by source digest); None where
        ``SEMCOMM_QUANT_MATVEC=0``, without AVX-512 or a C compiler."""
        return _kernel.get()

    @classmethod
    def _load(cls) -> QuantMatVec | None:
        if not quant_enabled() or not cpu_has_avx512():
            return None
        return open_built(cls, build_library("qmatvec", _SOURCE, _FLAGS, ("cc", "gcc")),
                          "quantized-code matvec", log=logger)

    @staticmethod
    def supports(qw: QuantWeight) -> bool:
        n, k = qw.shape
        nb = k // qw.group if qw.group in (16, 32) else 0
        return (n > 0 and n % 4 == 0 and k >= 32 and k % 4 == 0 and nb * qw.group == k
                and 1 <= qw.peel <= 4 and qw.q.dtype == torch.int8 and qw.q.is_contiguous()
                and qw.q.numel() == n * k and qw.a.dtype == torch.float32
                and qw.a.is_contiguous() and qw.a.numel() == n * nb
                and (qw.b is None or (qw.b.dtype == torch.float32 and qw.b.is_contiguous()
                                      and qw.b.numel() == n * nb)))

    def linear(self, x: torch.Tensor, qw: QuantWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        n, k = qw.shape
        assert x.numel() == k and x.dtype == torch.float32
        y = torch.empty((1, 1, n), dtype=torch.float32)
        self._fn(qw.q.data_ptr(), qw.a.data_ptr(), 0 if qw.b is None else qw.b.data_ptr(),
                 x.data_ptr(), y.data_ptr(), n, k, 4 if qw.group == 16 else 5, qw.peel)
        return y if bias is None else y + bias

    def matches(self, qw: QuantWeight, weight: torch.Tensor, bias: torch.Tensor | None = None,
                samples: int = 2, seed: int = 0, xs: list[torch.Tensor] | None = None) -> bool:
        """Whether :meth:`linear` gives ``F.linear(x, weight, bias)``'s bits on ``samples``
        random rows (of growing scale) and on the rows ``xs``, at the current thread count.
        ``qw.peel`` must be the weight's (:func:`peel_of`)."""
        if not self.supports(qw) or tuple(weight.shape) != qw.shape or qw.peel != peel_of(weight):
            return False
        gen = torch.Generator().manual_seed(seed)
        rows = [torch.randn((1, 1, qw.shape[1]), generator=gen) * (1.0 + 8 * i)
                for i in range(samples)] + list(xs or ())
        with torch.inference_mode():
            for x in rows:
                x = x.reshape(1, 1, -1).to(torch.float32)
                if not torch.equal(self.linear(x, qw, bias).view(torch.int32),
                                   F.linear(x, weight, bias).view(torch.int32)):
                    return False
        return True


def peel_of(weight: torch.Tensor) -> int:
    """The leading products MKL sums in order for a row of ``weight`` (up to its first 16-byte
    boundary: 4 where the rows are aligned)."""
    return 4 - (weight.data_ptr() % 16) // 4


# ------------------------------------------------------------------ GGUF codes for a model

GGUF_LAYER_NAMES = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                "wg": "ffn_gate", "wu": "ffn_up", "wd": "ffn_down"}


def find_gguf(model: Any) -> tuple[Path, str] | None:
    """``(GGUF path, its SHA-256)`` for a catalog model loaded from its converted directory
    (``semcomm-model.json`` names the GGUF, kept in ``../gguf``), else None."""
    cfg = getattr(model, "config", None)
    src = getattr(cfg, "_name_or_path", None) or getattr(model, "name_or_path", None)
    return gguf_beside(src) if src else None


def gguf_beside(src: str | Path) -> tuple[Path, str] | None:
    """``(GGUF path, its SHA-256)`` for a catalog model's converted directory ``src``
    (:func:`find_gguf` before the model is loaded), else None."""
    try:
        man = json.loads((Path(src) / "semcomm-model.json").read_text())
    except (OSError, ValueError):
        return None
    name, digest = man.get("gguf_file"), man.get("gguf_sha256")
    if not isinstance(name, str) or not isinstance(digest, str):
        return None
    path = Path(src).parent / "gguf" / name
    return (path, digest) if path.is_file() else None


def _cache_dir(digest: str) -> Path:
    from ..security import semcomm_home

    return semcomm_home() / "quant" / digest[:32]


def _row_keys(w: torch.Tensor) -> list[bytes]:
    rows = w.contiguous().view(torch.int32).numpy()
    return [hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in rows]


def _match_rows(qw: QuantWeight, weight: torch.Tensor) -> QuantWeight | None:
    """``qw`` with its rows in ``weight``'s order, matched by content (bit-equal rows); None
    where some row of ``weight`` is no row of the reconstruction."""
    have: dict[bytes, int] = {}
    for i, key in enumerate(_row_keys(qw.reconstruct())):
        have.setdefault(key, i)
    try:
        perm = torch.tensor([have[k] for k in _row_keys(weight)], dtype=torch.long)
    except KeyError:
        return None
    q, a, b = qw.rows()
    out = QuantWeight.from_rows(q[perm], a[perm], None if b is None else b[perm], qw.group,
                                qw.kind)
    return out if out.equals(weight) else None


def _save(path: Path, qw: QuantWeight) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    arrays = {"q": qw.q.numpy(), "a": qw.a.numpy(), "group": np.array(qw.group),
              "shape": np.array([qw.n, qw.k]), "kind": np.array(qw.kind)}
    if qw.b is not None:
        arrays["b"] = qw.b.numpy()
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


def _load(path: Path) -> QuantWeight | None:
    try:
        with np.load(path) as z:
            # each array is read into its own new buffer (no copy needed)
            b = torch.from_numpy(z["b"]) if "b" in z.files else None
            n, k = (int(v) for v in z["shape"])
            qw = QuantWeight(torch.from_numpy(z["q"]), torch.from_numpy(z["a"]),
                             b, n, k, int(z["group"]), str(z["kind"]))
    except (OSError, ValueError, KeyError):
        return None
    return qw if QuantMatVec.supports(qw) else None


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file: its type's name, its dims (GGUF order: the row length
    first) and its raw bytes (a read-only memory map)."""

    kind: str
    dims: tuple[int, ...]
    data: np.ndarray  # uint8


def _gguf_skip_value(buf: memoryview, pos: int, vtype: int) -> int:
    """The position after a metadata value of type ``vtype`` at ``pos``."""
    fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    if vtype in fixed:
        return pos + fixed[vtype]
    if vtype == 8:  # string: u64 length, bytes
        return pos + 8 + int(struct.unpack_from("<Q", buf, pos)[0])
    if vtype == 9:  # array: u32 element type, u64 count, elements
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in fixed:
            return pos + fixed[etype] * int(count)
        for _ in range(int(count)):
            pos = _gguf_skip_value(buf, pos, int(etype))
        return pos
    raise ValueError(f"unknown GGUF metadata type {vtype}")


def read_gguf_tensors(path: Path, gguf: Any) -> dict[str, GGUFTensor]:
    """The tensors of the GGUF file ``path`` by name: the header and tensor table read
    directly (gguf-py's reader also decodes every metadata value, the tokenizer's 150k strings
    included: 10+ s for Qwen2.5 here), type names and sizes from ``gguf.constants``."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)  # type: ignore[arg-type]
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    pos, alignment = 24, 32
    for _ in range(int(n_kv)):
        (klen,) = struct.unpack_from("<Q", buf, pos)
        key = bytes(buf[pos + 8:pos + 8 + klen]).decode("utf-8", "replace")
        pos += 8 + int(klen)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.alignment" and vtype == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos)
        pos = _gguf_skip_value(buf, pos, int(vtype))
    infos = []
    for _ in range(int(n_tensors)):
        (nlen,) = struct.unpack_from("<Q", buf, pos)
        name = bytes(buf[pos + 8:pos + 8 + nlen]).decode("utf-8")
        pos += 8 + int(nlen)
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        pos += 4 + 8 * int(ndim)
        ttype, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append((name, tuple(int(d) for d in dims), int(ttype), int(offset)))
    start = -(-pos // alignment) * alignment
    out: dict[str, GGUFTensor] = {}
    for name, dims, ttype, offset in infos:
        qtype = gguf.GGMLQuantizationType(ttype)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        nbytes = count // block * size
        lo = start + offset
        if lo + nbytes > data.shape[0]:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        out[name] = GGUFTensor(qtype.name, dims, data[lo:lo + nbytes])
    return out


def _from_gguf(tensor: GGUFTensor, weight: torch.Tensor) -> QuantWeight | None:
    kind = tensor.kind
    if len(tensor.dims) != 2:
        return None
    rows, cols = tensor.dims[1], tensor.dims[0]  # GGUF lists the dims reversed
    if (rows, cols) != tuple(weight.shape):
        return None
    try:
        q, a, b, g = codes_from_blocks(kind, tensor.data, rows, cols)
        qw = QuantWeight.from_rows(torch.from_numpy(q), torch.from_numpy(a),
                                   None if b is None else torch.from_numpy(b), g, kind)
    except ValueError:
        return None
    if qw.equals(weight):
        return qw
    return _match_rows(qw, weight)  # e.g. Llama's q/k rows, permuted by transformers


def load_codes(gguf_file: tuple[Path, str] | None, weights: dict[str, torch.Tensor],
               ) -> dict[str, QuantWeight]:
    """The codes of the ``weights`` (by their GGUF names: ``blk.3.attn_q.weight``,
    ``output.weight``) from ``gguf_file`` (``(path, SHA-256)``, :func:`find_gguf`): each one's
    reconstruction equals the loaded weight bit for bit (checked here, every load); the others
    are left out. Built from the GGUF once, then read from ``$SEMCOMM_HOME/quant``. Empty
    where the path is off or there is no GGUF."""
    if not quant_enabled() or gguf_file is None:
        return {}
    path, digest = gguf_file
    t0 = time.perf_counter()
    cache = _cache_dir(digest)
    out: dict[str, QuantWeight] = {}
    todo: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
            continue
        w = w.detach()
        file = cache / f"{name}.{w.shape[0]}x{w.shape[1]}.g16.npz"
        qw = _load(file) if file.exists() else None
        if qw is not None and qw.equals(w):
            out[name] = qw
        else:
            todo[name] = w
    if todo:
        try:
            import gguf
        except ImportError:
            logger.info("quantized-code matvec off: the gguf package is not installed")
            return out
        try:
            tensors = read_gguf_tensors(path, gguf)
        except (OSError, ValueError, KeyError, struct.error) as exc:
            logger.info("quantized-code matvec off: cannot read %s: %s", path, exc)
            return out
        for name, w in todo.items():
            t = tensors.get(name)
            qw = _from_gguf(t, w) if t is not None else None
            if qw is None:
                continue
            out[name] = qw
            try:
                _save(cache / f"{name}.{w.shape[0]}x{w.shape[1]}.g16.npz", qw)
            except OSError as exc:
                logger.info("quantized codes not cached: %s", exc)
    for name, qw in out.items():
        qw.peel = peel_of(weights[name])
    _trim_heap()
    logger.info("quantized codes for %d of %d weights (%s) in %.1f s", len(out), len(weights),
                ", ".join(f"{k} {n}" for k, n in sorted(Counter(q.kind for q in out.values())
                                                      .items())), time.perf_counter() - t0)
    return out


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``): reading and
    checking the codes frees many temporaries of a few MB each, which glibc otherwise keeps
    (measured: 355 MiB for SmolLM2's codes read from the cache), resident beyond the memory
    plan. Nothing where the C library has no ``malloc_trim``."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def layer_weight_names(layers: Any) -> dict[str, torch.Tensor]:
    """GGUF names of a lean decoder's layer weights: ``{"blk.0.attn_q.weight": wq, ...}``."""
    return {f"blk.{p.index}.{g}.weight": getattr(p, attr) for p in layers
            for attr, g in GGUF_LAYER_NAMES.items()}


_kernel = OncePerProcess(QuantMatVec._load)  # the process's kernel, loaded on first use
