"""The transformers engine: prefill with exact KV prefix reuse, decode, streaming, snapshots.

Public names: :class:`HFEngine`, :class:`GenerationResult`, :class:`GenerationStats`,
:class:`PrefillResult`, :class:`TokenStream`, :class:`KVSnapshot`, :data:`DEFAULT_CHUNK_SIZE`;
:class:`BatchDecoder` with :class:`BatchRequest` / :class:`BatchResult` (queued requests
decoded together, with or without KV reuse); and the decode loop's parts:
:class:`SamplingParams`, :class:`Sampler`, :class:`StopText` (incremental detokenization with
stop strings held back), :class:`DecodeState` (one sequence's decode) and
:func:`decode_steps`, the decode loop every one of these runs (with a caller's forward);
:data:`DTYPE_CHOICES`, the names ``HFEngine(dtype=...)`` takes (engine/_options.py), and
:func:`resolve_dtype` (what ``"auto"`` means
on this machine); :func:`load_model`, a model loaded with those options (what
``HFEngine("catalog-name", ...)`` and the server use).
``BatchDecoder.continue_greedy`` decodes from KV a caller built (fusion's fused cache).
Documents reused at any position (engine/_documents.py, docs/rag.md): the prompt segments
:class:`System`, :class:`User`, :class:`Assistant`, :class:`Text`, :class:`Document`
(:class:`Segment` their base; :func:`build_prompt` their token ids and document spans, a
:class:`SegmentedPrompt`), :class:`DocumentReuse` (precompute a document's KV once; prefill and
generate with it re-rotated into place and a share recomputed by a selector in
:data:`SELECTORS`), :class:`BlendResult` and :class:`BlendStats`; :class:`AnchorPool`
(engine/_anchors.py: documents' in-context KV captured from other prompts and answers, bounded
in bytes; ``HFEngine(anchors=...)``).
Agents sharing text (engine/_agents.py, docs/agents.md): :class:`AgentPipeline` (solver agents
and a judge of one model; shared segments reused across agents, anchors first, with a
confidence fallback to full prefill), :class:`Agent`, :class:`AgentTurn`, :class:`PipelineRun`,
:func:`default_agents`, :func:`extract_number`, :func:`extract_choice`, :data:`GATES`.

``_cache_adapter`` is the only module that touches the transformers Cache API; callers that
move KV tensors themselves (fusion) use its four exported functions: :func:`cache_layers`,
:func:`cache_from_layers`, :func:`output_cache` and :func:`cache_kwargs`.
"""

from ._agents import (
    DEFAULT_JUDGE_GATE,
    DEFAULT_WATCH,
    GATES,
    Agent,
    AgentPipeline,
    AgentTurn,
    PipelineRun,
    default_agents,
    extract_choice,
    extract_number,
)
from ._anchors import AnchorPool
from ._batch import BatchDecoder, BatchRequest, BatchResult
from ._cache_adapter import cache_from_layers, cache_kwargs, cache_layers, output_cache
from ._decode import DecodeState, FinishReason, Sampler, SamplingParams, StopText, decode_steps
from ._documents import (
    DEFAULT_RECOMPUTE,
    DEFAULT_SELECTOR,
    SELECTORS,
    Assistant,
    BlendResult,
    BlendStats,
    Document,
    DocumentReuse,
    Segment,
    SegmentedPrompt,
    System,
    Text,
    User,
    build_prompt,
)
from ._engine import DEFAULT_CHUNK_SIZE, HFEngine
from ._options import DTYPE_CHOICES, load_model, resolve_dtype
from ._snapshot import KVSnapshot
from ._types import (
    GenerationResult,
    GenerationStats,
    PrefillResult,
    PrefillRunner,
    TokenStream,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_JUDGE_GATE",
    "DEFAULT_RECOMPUTE",
    "DEFAULT_SELECTOR",
    "DEFAULT_WATCH",
    "DTYPE_CHOICES",
    "GATES",
    "SELECTORS",
    "Agent",
    "AgentPipeline",
    "AgentTurn",
    "AnchorPool",
    "Assistant",
    "BatchDecoder",
    "BatchRequest",
    "BatchResult",
    "BlendResult",
    "BlendStats",
    "DecodeState",
    "Document",
    "DocumentReuse",
    "FinishReason",
    "GenerationResult",
    "GenerationStats",
    "HFEngine",
    "KVSnapshot",
    "PipelineRun",
    "PrefillResult",
    "PrefillRunner",
    "Sampler",
    "SamplingParams",
    "Segment",
    "SegmentedPrompt",
    "StopText",
    "System",
    "Text",
    "TokenStream",
    "User",
    "build_prompt",
    "cache_from_layers",
    "cache_kwargs",
    "cache_layers",
    "decode_steps",
    "default_agents",
    "extract_choice",
    "extract_number",
    "load_model",
    "output_cache",
    "resolve_dtype",
]
