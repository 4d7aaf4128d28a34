"""The transformers engine: prefill with exact KV prefix reuse, decode, streaming, snapshots.

Public names: :class:`HFEngine`, :class:`GenerationResult`, :class:`GenerationStats`,
:class:`PrefillResult`, :class:`TokenStream`, :class:`KVSnapshot`, :data:`DEFAULT_CHUNK_SIZE`;
:class:`BatchDecoder` with :class:`BatchRequest` / :class:`BatchResult` (queued requests
decoded together, with or without KV reuse); and the decode loop's parts:
:class:`SamplingParams`, :class:`Sampler`, :class:`StopText` (incremental detokenization with
stop strings held back), :class:`DecodeState` (one sequence's decode) and
:func:`decode_steps`, the decode loop every one of these runs (with a caller's forward);
:func:`greedy_head_nbytes`, what the greedy head keeps beside a float32 head (for a memory plan);
:func:`planned_codes_nbytes` and :func:`codes_nbytes_on`, the GGUF's quantized codes a
one-thread float32 lean decoder keeps beside the weights, before and after load.
``BatchDecoder.continue_greedy`` decodes from KV a caller built (fusion's fused cache).

``_cache_adapter`` is the only module that touches the transformers Cache API; callers that
move KV tensors themselves (fusion) use its four exported functions: :func:`cache_layers`,
:func:`cache_from_layers`, :func:`output_cache` and :func:`cache_kwargs`.
"""

from ._batch import BatchDecoder, BatchRequest, BatchResult
from ._cache_adapter import cache_from_layers, cache_kwargs, cache_layers, output_cache
from ._decode import DecodeState, FinishReason, Sampler, SamplingParams, StopText, decode_steps
from ._engine import DEFAULT_CHUNK_SIZE, HFEngine
from ._greedy_head import greedy_head_nbytes
from ._lean_decode import codes_nbytes_on, planned_codes_nbytes
from ._snapshot import KVSnapshot
from ._types import GenerationResult, GenerationStats, PrefillResult, TokenStream

__all__ = [
    "DEFAULT_CHUNK_SIZE",
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
    "codes_nbytes_on",
    "decode_steps",
    "greedy_head_nbytes",
    "output_cache",
    "planned_codes_nbytes",
]
