"""The engine's speed option: the weight dtype, through maintained kernels.

``dtype`` casts the weights through public APIs that are correct on any CPU (bfloat16 runs on
oneDNN, with AVX-512 BF16 or AMX where the CPU has them). It changes the model's numbers, so
it is part of the KV namespace (the cache's dtype): chunks never cross dtypes.

``dtype="auto"`` is the measured best default (docs/engine.md, benchmarks/engine/decode.py):
bfloat16 on a CPU with native bfloat16 arithmetic (the ``avx512_bf16`` or ``amx_bf16`` flags),
float32 elsewhere and on accelerators' own default.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInputError

__all__ = ["DTYPE_CHOICES", "cpu_flags", "load_model", "resolve_dtype", "use_fast_attention"]

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""Names ``HFEngine(dtype=...)``, the server config's ``dtype`` and ``--dtype`` take."""


_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def resolve_dtype(dtype: Any, device: torch.device | None = None) -> torch.dtype | None:
    """A torch dtype for ``dtype`` (None: keep the model's own)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device is not None and device.type != "cpu":
            return None
        return torch.bfloat16 if cpu_flags() & _NATIVE_BF16_FLAGS else torch.float32
    if isinstance(dtype, str) and dtype in DTYPE_CHOICES:
        out = getattr(torch, dtype)
        assert isinstance(out, torch.dtype)
        return out
    raise InvalidInputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")


def use_fast_attention(model: Any, device: torch.device) -> None:
    """Half-precision models on the CPU use transformers' eager attention: torch's SDPA kernel
    for one bfloat16 query over a 2k-token cache took 10.2 ms a layer here against 1.3 ms for
    eager's matmuls and float32 softmax (float32: 2.2 ms SDPA, 2.6 ms eager, so float32 keeps
    SDPA). Prefills run one KV chunk at a time, so eager's score matrix stays chunk-sized."""
    if device.type != "cpu" or next(model.parameters()).dtype not in (torch.bfloat16,
                                                                      torch.float16):
        return
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter("eager")


def load_model(path: str | Path, *, dtype: Any = None,
               device: str | torch.device = "cpu") -> Any:
    """A causal LM from a transformers directory or hub id, with the engine's options applied:
    ``dtype`` (:func:`resolve_dtype`; None: the checkpoint's own) and the attention that is
    fast at that dtype (:func:`use_fast_attention`)."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    tdtype = resolve_dtype(dtype, dev)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype if tdtype else "auto")
    model = model.to(dev).eval()  # type: ignore[arg-type]  # transformers types .to narrowly
    use_fast_attention(model, dev)
    return model
