"""The transformers engine: prefill with exact KV prefix reuse, decode, streaming, snapshots.

Public names: :class:`HFEngine`, :class:`GenerationResult`, :class:`GenerationStats`,
:class:`PrefillResult`, :class:`TokenStream`, :class:`KVSnapshot`, :data:`DEFAULT_CHUNK_SIZE`;
:class:`BatchDecoder` with :class:`BatchRequest` / :class:`BatchResult` (queued requests
decoded together, with or without KV reuse); and the decode loop's parts:
:class:`SamplingParams`, :class:`Sampler`, :class:`StopText` (incremental detokenization with
stop strings held back), :class:`DecodeState` (one sequence's decode) and
:func:`decode_steps`, the decode loop every one of these runs (with a caller's forward);
:data:`DTYPE_CHOICES` and :data:`QUANTIZE_CHOICES`, the names ``HFEngine(dtype=...,
quantize=...)`` takes (engine/_options.py), and :func:`resolve_dtype` (what ``"auto"`` means
on this machine).
``BatchDecoder.continue_greedy`` decodes from KV a caller built (fusion's fused cache).

``_cache_adapter`` is the only module that touches the transformers Cache API; callers that
move KV tensors themselves (fusion) use its four exported functions: :func:`cache_layers`,
:func:`cache_from_layers`, :func:`output_cache` and :func:`cache_kwargs`.
"""

from ._batch import BatchDecoder, BatchRequest, BatchResult
from ._cache_adapter import cache_from_layers, cache_kwargs, cache_layers, output_cache
from ._decode import DecodeState, FinishReason, Sampler, SamplingParams, StopText, decode_steps
from ._engine import DEFAULT_CHUNK_SIZE, HFEngine
from ._options import DTYPE_CHOICES, QUANTIZE_CHOICES, resolve_dtype
from ._snapshot import KVSnapshot
from ._types import GenerationResult, GenerationStats, PrefillResult, TokenStream

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DTYPE_CHOICES",
    "QUANTIZE_CHOICES",
    "BatchDecoder",
    "BatchRequest",
    "BatchResult",
    "DecodeState",
    "FinishReason",
    "GenerationResult",
    "GenerationStats",
    "HFEngine",
    "KVSnapshot",
    "PrefillResult",
    "Sampler",
    "SamplingParams",
    "StopText",
    "TokenStream",
    "cache_from_layers",
    "cache_kwargs",
    "cache_layers",
    "decode_steps",
    "output_cache",
    "resolve_dtype",
]
