"""The greedy token of a float32 LM head, exact, from half the weight bytes.

A decode step on the CPU is bound by reading weights, and a float32 LM head is a large part of
them (Qwen2.5-0.5B: 545 MB of its 2 GB a token, SmolLM2-135M: 113 MB of 540 MB), read by the
BLAS matrix-vector kernel at well under the memory bandwidth. Greedy decoding needs only the
argmax of the logits, so :class:`GreedyHead` finds it in three steps:

1. ``fast = bf16(W) @ bf16(h)``: every logit, approximately, from a bfloat16 copy of the
   weights (half the bytes, oneDNN's bfloat16 kernel);
2. a bound ``|fast[n] - exact[n]| <= bound[n]`` (below), so the exact maximum is at least
   ``max(fast - bound)``, and only the rows whose ``fast + bound`` reach it can hold it (the
   candidates, usually a few);
3. the candidates' exact logits, computed by the same float32 ``F.linear`` on just those rows.

Every other row's exact logit is strictly below the maximum, so the argmax over the candidates'
exact logits is the argmax of the full exact logits, ties included (the first index wins in
both). :meth:`GreedyHead.logits` returns a ``[vocab]`` tensor holding those exact values at the
candidates and ``-inf`` elsewhere: its argmax is the model's own greedy token; nothing else about
it is meaningful (the engine uses it only for greedy decoding).

The bound. With ``u = 2**-8`` (bfloat16's unit roundoff), ``w' = bf16(w)``, ``h' = bf16(h)``:
products of bfloat16 values are exact in float32, so
``|fast - exact| <= (2u + u**2 + 2.1 K 2**-24) S + 2u |fast|`` where
``S = sum_k |w_k h_k|`` (input rounding, both float32 accumulations in any order, the bfloat16
output rounding). ``S`` is bounded per block of ``K``: ``S <= sum_b ||w_b|| ||h_b||``
(Cauchy-Schwarz), from row norms kept per block. The bound used is twice that.

Step 3 relies on the BLAS computing a row's logit the same way in the full product and in a
product over some of the rows. MKL does when every row is in a whole group of 4 rows (its
kernel's unit: a row in a smaller tail group rounds differently) and at the same address
alignment (a copy of the weight at another alignment rounds differently), so the candidate rows
are copied to memory at the weight's alignment (every row shares it when a row is a multiple of
64 bytes) and padded to a multiple of 4. :meth:`GreedyHead.verified` checks both assumptions (the bound holds,
candidate rows reproduce the full product's bits) on this machine and thread count before the
head is used; where they fail, the engine keeps the full float32 head.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

__all__ = ["GreedyHead", "greedy_head_nbytes"]

logger = logging.getLogger("semcomm.engine")

_BLOCKS = 16  # blocks of the hidden size with their own row norms (tighter than one norm)
_ROW_GROUP = 4  # MKL's matrix-vector kernel works in groups of 4 rows
_MAX_CANDIDATES = 4096  # more candidates than this: the full exact head instead


def greedy_head_nbytes(vocab: int, hidden: int) -> int:
    """Bytes a :class:`GreedyHead` keeps for a ``[vocab, hidden]`` float32 head (the int8
    copy, a bfloat16 scale a row, the per-block bounds): what a memory plan prices before the
    model is loaded."""
    return vocab * hidden + vocab * 2 + vocab * max(1, min(_BLOCKS, hidden)) * 4


class GreedyHead:
    """Exact greedy token of ``F.linear(h, weight)`` for a float32 ``[vocab, hidden]`` weight.

    Holds an int8 copy of the weight with one bfloat16 scale a row (a quarter of its bytes) and
    per-block error coefficients ``[vocab, blocks]``. ``logits(h)`` for ``h`` ``[1, 1, hidden]``
    float32 returns ``[vocab]`` float32: the exact logits at the candidate rows, ``-inf``
    elsewhere (argmax only). ``checked`` records the thread counts :meth:`verified` passed at.
    """

    def __init__(self, weight: torch.Tensor, blocks: int = _BLOCKS):
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("GreedyHead takes a float32 [vocab, hidden] CPU weight")
        self.weight = weight
        vocab, hidden = weight.shape
        self.hidden = int(hidden)
        self.blocks = max(1, min(blocks, self.hidden))
        self._bounds = [round(i * self.hidden / self.blocks) for i in range(self.blocks + 1)]
        u = 2.0**-8  # bfloat16's unit roundoff (the hidden state and the output are bfloat16)
        gamma = 1.01 * self.hidden * 2.0**-24  # float32 accumulation over the hidden size
        with torch.no_grad():
            # a bfloat16 scale a row, rounded up to the next bfloat16 so that |w / scale| <= 127
            # stays true: the kernel multiplies by exactly this scale
            scale = (weight.abs().amax(dim=1) / 127 * (1 + 2**-20)).clamp_min(2.0**-100)
            sb = scale.to(torch.bfloat16)
            up = (sb.view(torch.int16) + 1).view(torch.bfloat16)  # the next bfloat16 (> 0)
            sb = torch.where(sb.float() < scale, up, sb)
            self.scales = sb
            self.weight_int8 = torch.empty((vocab, hidden), dtype=torch.int8)
            coef = torch.empty((vocab, self.blocks), dtype=torch.float32)
            step = 8192  # rows at a time (bounded temporary memory)
            for r in range(0, vocab, step):
                w = weight[r : r + step]
                sr = sb[r : r + step].float()[:, None]
                q = torch.round(w / sr).clamp_(-127, 127)
                self.weight_int8[r : r + step] = q.to(torch.int8)
                resid = w - q * sr  # q * sr is exact (8 x 8 significant bits)
                for bi in range(self.blocks):
                    lo, hi = self._bounds[bi], self._bounds[bi + 1]
                    # |fast - exact| <= sum_k |resid_k h_k| (1 + u + 2 gamma)
                    #                 + sum_k |w_k h_k| (u + 3 gamma) + 2u |fast|, and each sum
                    # is at most the sum over blocks of ||row block|| ||h block|| (Cauchy-Schwarz)
                    coef[r : r + step, bi] = (
                        resid[:, lo:hi].norm(dim=1) * (1 + u + 2 * gamma)
                        + w[:, lo:hi].norm(dim=1) * (u + 3 * gamma))
            # x2: a safety margin; (1 + 2**-12) covers the float32 rounding of the norms
            self.coef = coef * (2 * (1 + 2**-12))
        self._out = 2 * (2 * u)
        self._buf: torch.Tensor | None = None  # candidate rows, at the weight's alignment
        self.checked: set[int] = set()  # thread counts the checks passed at
        self._failed: set[int] = set()  # and failed at

    @property
    def nbytes(self) -> int:
        """Bytes this head keeps beside the model (the int8 copy, its scales, the bounds)."""
        return (self.weight_int8.numel() + self.scales.numel() * 2
                + self.coef.numel() * self.coef.element_size())

    def _block_norms(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1).double()
        return torch.stack([x[self._bounds[b]:self._bounds[b + 1]].norm()
                            for b in range(self.blocks)]).float() * (1 + 2**-16)

    def bounds(self, h: torch.Tensor, fast: torch.Tensor) -> torch.Tensor:
        """``[vocab]`` upper bounds of ``|fast - exact|`` for the hidden state ``h``."""
        s = torch.mv(self.coef, self._block_norms(h)) * (1 + 2**-10)  # past mv's rounding
        return s + fast.abs() * self._out + 1e-30

    def approx(self, h: torch.Tensor) -> torch.Tensor:
        """``[vocab]`` float32 approximate logits (int8 weights, bfloat16 hidden state)."""
        x = h.reshape(1, -1).to(torch.bfloat16)
        return torch._weight_int8pack_mm(x, self.weight_int8, self.scales).reshape(-1).float()

    def _rows_buffer(self, n: int) -> torch.Tensor:
        """A ``[n, hidden]`` float32 buffer at the weight's address alignment (mod 64)."""
        if self._buf is None or self._buf.shape[0] < n:
            cap = max(n, 256)
            raw = torch.empty(cap * self.hidden * 4 + 64, dtype=torch.uint8)
            off = (self.weight.data_ptr() - raw.data_ptr()) % 64
            self._buf = raw[off : off + cap * self.hidden * 4].view(torch.float32).view(
                cap, self.hidden)
        return self._buf[:n]

    def exact_rows(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Exact float32 logits of ``rows`` (sorted indices), bit for bit as
        ``F.linear(h, weight)`` gives them: the rows are copied to memory at the weight's
        alignment and padded to whole groups of 4 rows, then multiplied by the same call."""
        n = rows.numel()
        pad = (-n) % _ROW_GROUP
        idx = torch.cat([rows, rows[-1:].expand(pad)]) if pad else rows
        buf = self._rows_buffer(idx.numel())
        torch.index_select(self.weight, 0, idx, out=buf)
        return F.linear(h, buf).reshape(-1)[:n]

    def candidates(self, h: torch.Tensor) -> torch.Tensor | None:
        """Sorted indices of the rows that can hold the exact maximum; None: too many (or
        none, for a hidden state that is not finite)."""
        fast = self.approx(h)
        bound = self.bounds(h, fast)
        floor = (fast - bound).max()  # the exact maximum is at least this
        rows = torch.nonzero(fast + bound >= floor).reshape(-1)
        # none (a NaN hidden state) or too many: the full head decides
        return rows if 0 < rows.numel() <= _MAX_CANDIDATES else None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[vocab]``: exact logits at the candidates, ``-inf`` elsewhere (argmax only)."""
        rows = self.candidates(h)
        if rows is None:
            return F.linear(h, self.weight).reshape(-1)
        out = torch.full((self.weight.shape[0],), float("-inf"), dtype=torch.float32)
        out[rows] = self.exact_rows(h, rows)
        return out

    def verified(self, samples: int = 3, seed: int = 0) -> bool:
        """True when, at the current thread count, the bound holds and candidate rows give the
        full product's bits on ``samples`` random hidden states (checked once per count)."""
        threads = torch.get_num_threads()
        if threads in self.checked:
            return True
        if threads in self._failed:
            return False
        ok = self._check(samples, seed)
        (self.checked if ok else self._failed).add(threads)
        return ok

    def _check(self, samples: int, seed: int) -> bool:
        if not self.weight.is_contiguous() or (self.hidden * 4) % 64:
            return False  # rows at differing alignments: a copy cannot match each of them
        threads = torch.get_num_threads()
        gen = torch.Generator().manual_seed(seed)
        vocab = self.weight.shape[0]
        with torch.no_grad():
            for i in range(samples):
                h = torch.randn((1, 1, self.hidden), generator=gen) * (1.0 + 4 * i)
                exact = F.linear(h, self.weight).reshape(-1)
                fast = self.approx(h)
                if not bool(((fast - exact).abs() <= self.bounds(h, fast)).all()):
                    logger.info("greedy head: the int8 bound does not hold here")
                    return False
                for n in (1, 3, 4, 9, 64, 1000):
                    rows = torch.randperm(vocab, generator=gen)[:n]
                    rows = torch.cat([rows, torch.tensor([0, vocab - 1])]).unique()  # sorted
                    if not torch.equal(self.exact_rows(h, rows), exact[rows]):
                        logger.info("greedy head: rows of the float32 head round differently "
                                    "alone (%d threads)", threads)
                        return False
                if int(self.logits(h).argmax()) != int(exact.argmax()):
                    return False
        return True
