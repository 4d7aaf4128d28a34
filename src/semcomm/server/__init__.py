"""semcomm.server: an OpenAI-compatible gateway running the whole semcomm request path.

``create_app(config)`` builds the FastAPI app; ``load_config(path)`` reads and validates the TOML
configuration (embedded default + file + ``SEMCOMM__SECTION__KEY`` environment overrides);
``Gateway`` is the request path without HTTP; ``ModelBackend`` is the protocol every model is
served through (in-process HF engines, OpenAI-compatible upstreams, pipelines). See
``docs/server.md``.
"""

from ..reference import build_tiny_model
from ..runtime import BatchingWorker, Job, KVAccountant, MemoryMonitor, MemoryPlan, ModelPlan
from ..runtime import Runner as EngineRunner
from ._app import create_app
from ._backends import (
    BackendStatus,
    Completion,
    GenRequest,
    LocalBackend,
    ModelBackend,
)
from ._config import DEFAULT_TOML, ServerConfig, load_config
from ._faults import FaultyBackend
from ._gateway import Gateway
from ._pipeline import PipelineBackend
from ._preflight import preflight
from ._ray import serve_ray
from ._upstream import UpstreamBackend
from ._wiring import build_gateway, plan_config

__all__ = [
    "DEFAULT_TOML",
    "BackendStatus",
    "BatchingWorker",
    "Completion",
    "EngineRunner",
    "FaultyBackend",
    "Gateway",
    "GenRequest",
    "Job",
    "KVAccountant",
    "LocalBackend",
    "MemoryMonitor",
    "MemoryPlan",
    "ModelBackend",
    "ModelPlan",
    "PipelineBackend",
    "ServerConfig",
    "UpstreamBackend",
    "build_gateway",
    "build_tiny_model",
    "create_app",
    "load_config",
    "plan_config",
    "preflight",
    "serve_ray",
]
