"""Routing: which model (capability and cost) and which replica (prefix affinity and load).

* :class:`ReplicaRouter` chooses a replica of one model from the prompt's KV chunk keys, a
  :class:`PrefixIndex` (:class:`ApproximateIndex` from its own decisions, :class:`PreciseIndex`
  from engine store/evict events) and a policy from :data:`POLICIES`.
* :func:`simulate` replays Mooncake-format traces (:func:`load_trace`) or synthetic
  shared-prefix workloads (:func:`shared_prefix_workload`) through simulated replicas.
* :class:`ModelRouter` chooses among N models by predicted quality against cost.
"""

from ._cost import CostModel
from ._index import ApproximateIndex, IndexEvent, PreciseIndex, PreciseIndexStats, PrefixIndex
from ._model import (
    SHIPPED_ROUTERS,
    LabelledSet,
    ModelChoice,
    ModelRouter,
    ModelSpec,
    QualityPredictor,
    RouterEval,
    load_labelled,
    render_conversation,
    shipped_router_path,
)
from ._policies import POLICIES, Policy, RouteView, make_policy, policy_names, predicted_ttft
from ._replica import DecisionState, ReplicaRouter, RouteDecision
from ._sim import SimConfig, SimResult, capacity_at_slo, simulate
from ._trace import (
    MOONCAKE_BLOCK_SIZE,
    TraceRequest,
    load_trace,
    parse_trace_lines,
    shared_prefix_workload,
    write_trace,
)

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "POLICIES",
    "SHIPPED_ROUTERS",
    "ApproximateIndex",
    "CostModel",
    "DecisionState",
    "IndexEvent",
    "LabelledSet",
    "ModelChoice",
    "ModelRouter",
    "ModelSpec",
    "Policy",
    "PreciseIndex",
    "PreciseIndexStats",
    "PrefixIndex",
    "QualityPredictor",
    "ReplicaRouter",
    "RouteDecision",
    "RouteView",
    "RouterEval",
    "SimConfig",
    "SimResult",
    "TraceRequest",
    "capacity_at_slo",
    "load_labelled",
    "load_trace",
    "make_policy",
    "parse_trace_lines",
    "policy_names",
    "predicted_ttft",
    "render_conversation",
    "shared_prefix_workload",
    "shipped_router_path",
    "simulate",
    "write_trace",
]
