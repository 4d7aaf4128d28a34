"""The transformers engine: prefill with exact KV prefix reuse, decode, streaming, snapshots.

Public names: :class:`HFEngine`, :class:`GenerationResult`, :class:`GenerationStats`,
:class:`PrefillResult`, :class:`TokenStream`, :class:`KVSnapshot`, :data:`DEFAULT_CHUNK_SIZE`,
and the decode loop's parts for callers that batch their own forwards: :class:`SamplingParams`,
:class:`Sampler`, :class:`StopText` (incremental detokenization with stop strings held back).
``_cache_adapter`` is the only module that touches the transformers Cache API.
"""

from ._decode import Sampler, SamplingParams, StopText
from ._engine import DEFAULT_CHUNK_SIZE, HFEngine
from ._snapshot import KVSnapshot
from ._types import GenerationResult, GenerationStats, PrefillResult, TokenStream

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "GenerationResult",
    "GenerationStats",
    "HFEngine",
    "KVSnapshot",
    "PrefillResult",
    "Sampler",
    "SamplingParams",
    "StopText",
    "TokenStream",
]
