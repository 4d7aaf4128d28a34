"""semcomm.runtime: serving in-process models to many requests at once.

* :class:`BatchingWorker`: a bounded FIFO queue of :class:`Job` s in front of one runner,
  drained in batches by one thread (429 with Retry-After when full).
* :class:`EngineRunner` (per-tenant ``semcomm.engine.HFEngine`` s over one model and one KV
  store) and :class:`DirectRunner` (a model the engine does not support): one batch, one
  ``BatchDecoder`` call.
* :class:`PrefillScheduler`: long prefills in pieces, bounded, yielding to short requests.
* The memory plan (:class:`MemoryPlan`, :class:`KVAccountant`, :class:`MemoryMonitor`): what
  the process's models, live KV and cached KV may take, and KV admission per request.
* The one result type: :class:`Started`, :class:`Delta` pieces, one :class:`Completion`.

Every collaborator is a constructor argument; the server (``semcomm.server``) wires them from
its config. See docs/architecture.md, "The request path".
"""

from typing import TYPE_CHECKING, Any

from ._batching import BatchingWorker, Job, Runner
from ._events import Completion, Delta, Event, Failed, Started, StreamItem
from ._memplan import (
    DEFAULT_BASELINE_BYTES,
    KVAccountant,
    KVReservation,
    KVShape,
    MemoryMonitor,
    MemoryPlan,
    ModelFacts,
    ModelPlan,
    build_plan,
    current_rss_bytes,
    kv_shape_from_config,
    peak_rss_bytes,
    weight_bytes,
    weight_bytes_from_dir,
)
from ._prefill import PrefillScheduler, ShortTicket, prefill_scheduler

if TYPE_CHECKING:  # pragma: no cover
    from ._runners import DirectRunner, EngineRunner, engine_runner

# the runners load semcomm.engine (torch, transformers): imported on first use, so a gateway
# serving upstreams only starts without them
_LAZY = {"DirectRunner", "EngineRunner", "engine_runner"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'semcomm.runtime' has no attribute {name!r}")
    from . import _runners

    value = getattr(_runners, name)
    globals()[name] = value
    return value

__all__ = [
    "DEFAULT_BASELINE_BYTES",
    "BatchingWorker",
    "Completion",
    "Delta",
    "DirectRunner",
    "EngineRunner",
    "Event",
    "Failed",
    "Job",
    "KVAccountant",
    "KVReservation",
    "KVShape",
    "MemoryMonitor",
    "MemoryPlan",
    "ModelFacts",
    "ModelPlan",
    "PrefillScheduler",
    "Runner",
    "ShortTicket",
    "Started",
    "StreamItem",
    "build_plan",
    "current_rss_bytes",
    "engine_runner",
    "kv_shape_from_config",
    "peak_rss_bytes",
    "prefill_scheduler",
    "weight_bytes",
    "weight_bytes_from_dir",
]
