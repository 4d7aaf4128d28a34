"""The engine's speed options: weight dtype and weight-only quantization, from maintained kernels.

Every option here changes only how the model computes, through public APIs that are correct on
any CPU: ``dtype`` casts the weights (bfloat16 runs on oneDNN, with AVX-512 BF16 or AMX where
the CPU has them), ``quantize="int8"`` swaps each linear weight for torchao's int8 weight-only
tensor. An option that changes the model's numbers is part of the KV namespace (the dtype as
the cache's dtype, the quantization as its own field), so chunks never cross options.

``dtype="auto"`` is the measured best default (docs/engine.md, benchmarks/engine/decode.py):
bfloat16 on a CPU with native bfloat16 arithmetic (the ``avx512_bf16`` or ``amx_bf16`` flags),
float32 elsewhere and on accelerators' own default.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInputError

__all__ = ["DTYPE_CHOICES", "QUANTIZE_CHOICES", "apply_quantize", "check_quantize", "cpu_flags",
           "load_model", "resolve_dtype", "use_fast_attention"]

logger = logging.getLogger("semcomm.engine")

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""Names ``HFEngine(dtype=...)``, the server config's ``dtype`` and ``--dtype`` take."""

QUANTIZE_CHOICES = ("none", "int8")
"""``none``: the weights as loaded; ``int8``: torchao's int8 weight-only linear layers."""

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


def check_quantize(quantize: Any) -> str:
    """The quantization name (``"none"`` for None); a clear error for anything else."""
    name = "none" if quantize is None else quantize
    if name not in QUANTIZE_CHOICES:
        raise InvalidInputError(
            f"unknown quantize {quantize!r}; use one of {', '.join(QUANTIZE_CHOICES)}")
    return str(name)


def apply_quantize(model: Any, quantize: str) -> None:
    """Quantize ``model``'s linear weights in place (``quantize`` from :func:`check_quantize`).

    The input embedding stays as it is (a lookup, not a product); a tied output head is
    quantized as a linear layer like the others."""
    if quantize == "none":
        return
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise InvalidInputError(
            "quantize='int8' needs torchao: pip install 'semcomm[quant]'") from None
    def plain_linear(module: Any, _fqn: str) -> bool:  # not one quantized already
        return (isinstance(module, torch.nn.Linear)
                and not callable(getattr(module.weight, "__tensor_flatten__", None)))

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=plain_linear)
    logger.info("weights quantized: %s (torchao int8 weight-only)", quantize)


def load_model(path: str | Path, *, dtype: Any = None, quantize: str | None = None,
               device: str | torch.device = "cpu") -> Any:
    """A causal LM from a transformers directory or hub id, with the engine's options applied:
    ``dtype`` (:func:`resolve_dtype`; None: the checkpoint's own), the attention that is fast
    at that dtype (:func:`use_fast_attention`) and ``quantize`` (:func:`apply_quantize`)."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    tdtype = resolve_dtype(dtype, dev)
    name = check_quantize(quantize)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype if tdtype else "auto")
    model = model.to(dev).eval()
    use_fast_attention(model, dev)
    apply_quantize(model, name)
    return model
