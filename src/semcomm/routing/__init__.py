"""Routing: which model (capability and cost) and which replica (prefix affinity and load).

* :class:`ReplicaRouter` chooses a replica of one model from the prompt's KV chunk keys, a
  :class:`PrefixIndex` (:class:`ApproximateIndex` from its own decisions, :class:`PreciseIndex`
  from engine store/evict events) and a policy from :data:`POLICIES`.
* The replica-routing simulator (traces, synthetic workloads, discrete-event replay) is CLI
  tooling: ``semcomm route simulate`` / ``route synth`` (``semcomm.cli._tools.route_sim``).
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

__all__ = [
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
    "load_labelled",
    "make_policy",
    "policy_names",
    "predicted_ttft",
    "render_conversation",
    "shipped_router_path",
]
