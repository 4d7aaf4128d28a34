"""semcomm.semantic: a semantic answer cache with near-miss safety and a bounded error rate.

>>> from semcomm import SemanticCache
>>> cache = SemanticCache()                       # memory, all-MiniLM-L6-v2, default policy
>>> cache.store("How do I reset my password?", "Settings > Security > Reset.")
>>> cache.lookup("How can I reset my password?")  # -> Hit(answer=..., similarity=0.9...)

See docs/semantic.md.
"""

from ._cache import EVICTION_POLICIES, CacheStats, Hit, SemanticCache, open_store
from ._context import Scope, context_window
from ._cross import CrossEncoderVerifier
from ._embed import (
    CallableEmbedder,
    Embedder,
    SentenceTransformerEmbedder,
    as_embedder,
    default_embedder,
)
from ._entry import ENTRY_FORMAT_VERSION, Entry, Row, decode_entry, encode_entry
from ._guard import GuardResult, LexicalGuard
from ._index import (
    AutoIndex,
    FlatIndex,
    HNSWIndex,
    IVFIndex,
    check_hnsw_options,
    check_ivf_options,
    make_index,
)
from ._intent import IntentMetric, default_intent_metric
from ._judge import JudgeVerifier
from ._policy import (
    DEFAULT_THRESHOLD,
    LEAD_FLOOR,
    POLICIES,
    VERIFIED_MIN_SCORE,
    VERIFIED_THRESHOLD,
    CalibrationResult,
    Candidate,
    ClusterVotePolicy,
    Decision,
    ErrorBoundedPolicy,
    HitPolicy,
    IntentCheck,
    PolicyBase,
    ScoredCut,
    ThresholdPolicy,
    Verifier,
    calibrate_scored_cut,
    calibrate_threshold,
    lead_score,
    make_policy,
)
from ._redis import RedisEntryStore
from ._shadow import (
    ShadowLog,
    ShadowRecord,
    ShadowReport,
    answers_agree,
    plot_shadow_report,
    read_shadow_log,
    shadow_report,
)
from ._stores import EntryStore, MemoryEntryStore, SQLiteEntryStore, Sync
from ._verifier import LexicalVerifier, verifier_features

__all__ = [
    "DEFAULT_THRESHOLD",
    "ENTRY_FORMAT_VERSION",
    "EVICTION_POLICIES",
    "LEAD_FLOOR",
    "POLICIES",
    "VERIFIED_MIN_SCORE",
    "VERIFIED_THRESHOLD",
    "AutoIndex",
    "CacheStats",
    "CalibrationResult",
    "CallableEmbedder",
    "Candidate",
    "ClusterVotePolicy",
    "CrossEncoderVerifier",
    "Decision",
    "Embedder",
    "Entry",
    "EntryStore",
    "ErrorBoundedPolicy",
    "FlatIndex",
    "GuardResult",
    "HNSWIndex",
    "Hit",
    "HitPolicy",
    "IVFIndex",
    "IntentCheck",
    "IntentMetric",
    "JudgeVerifier",
    "LexicalGuard",
    "LexicalVerifier",
    "MemoryEntryStore",
    "PolicyBase",
    "RedisEntryStore",
    "Row",
    "SQLiteEntryStore",
    "Scope",
    "ScoredCut",
    "SemanticCache",
    "SentenceTransformerEmbedder",
    "ShadowLog",
    "ShadowRecord",
    "ShadowReport",
    "Sync",
    "ThresholdPolicy",
    "Verifier",
    "answers_agree",
    "as_embedder",
    "calibrate_scored_cut",
    "calibrate_threshold",
    "check_hnsw_options",
    "check_ivf_options",
    "context_window",
    "decode_entry",
    "default_embedder",
    "default_intent_metric",
    "encode_entry",
    "lead_score",
    "make_index",
    "make_policy",
    "open_store",
    "plot_shadow_report",
    "read_shadow_log",
    "shadow_report",
    "verifier_features",
]
