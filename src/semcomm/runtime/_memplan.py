"""The memory plan of one server process: weights plus KV per model, checked against a limit.

What limits several models in one place (docs/architecture.md, invariant 6): weights are fixed
once loaded; the KV cache grows with tokens, batch and concurrency; the process must fit the
sum of the weights, the peak KV of the running requests and the prefix cache it keeps in
memory. The plan holds, per configured model:

* ``weight_bytes``: measured after load (parameters and buffers, tied tensors counted once),
  or before load from the safetensors headers of
  the model directory (``serve --check``); the engine keeps nothing beside the weights;
* ``kv_bytes_per_token``: layers x KV heads x (key dim + value dim) x dtype bytes, from the
  model config; a sliding-window layer holds at most ``window - 1`` positions, so
  :meth:`KVShape.bytes_for` caps those layers;
* ``kv_budget_bytes``: the live KV this model's running requests may hold (``[models.X]
  kv_bytes``; default: its share of what the limit leaves);
* ``anchor_budget_bytes``: documents' in-context KV its engines keep as anchors
  (``[models.X] anchor_bytes``, engine/_anchors.py; 0 without a pool), held between requests;

and for the process: a baseline (the interpreter, torch, the embedder: measured, or a
documented default before start-up) and the in-memory prefix-cache tier's budget.
``planned_bytes`` is their sum: what the process should peak at.

:class:`KVAccountant` admits a request only when its prompt plus ``max_tokens`` fits its
model's KV headroom; otherwise it waits (bounded) or raises
:class:`~semcomm.errors.OverloadedError` with a retry delay, never an out-of-memory crash.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InvalidInputError, OverloadedError

__all__ = [
    "DEFAULT_BASELINE_BYTES",
    "KVAccountant",
    "KVReservation",
    "KVShape",
    "MemoryMonitor",
    "MemoryPlan",
    "ModelFacts",
    "ModelPlan",
    "build_plan",
    "current_rss_bytes",
    "kv_shape_from_config",
    "peak_rss_bytes",
    "weight_bytes",
    "weight_bytes_from_dir",
]

DEFAULT_BASELINE_BYTES = 900 * 2**20
"""Resident bytes of a server process before any model is loaded (Python, torch, transformers,
FastAPI, the MiniLM embedder and its index), used by ``serve --check`` before start-up. Measured
on CPU with the embedded default (docs/server.md); a running server measures its own."""

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1,
                "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _dtype_bytes(dtype: Any) -> int:
    if hasattr(dtype, "itemsize"):
        return int(dtype.itemsize)
    name = str(dtype).removeprefix("torch.")
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise InvalidInputError(f"unknown dtype {dtype!r} for a memory plan") from None


@dataclass(frozen=True, slots=True)
class KVShape:
    """The KV cache of one model: what one token costs in each kind of layer."""

    full_layers: int  # layers that keep every position
    sliding_layers: int  # layers that keep at most ``window`` positions
    window: int | None  # sliding window (positions), None without sliding layers
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype_bytes: int

    @property
    def layers(self) -> int:
        return self.full_layers + self.sliding_layers

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token adds to every layer (the cost while below the window)."""
        return self.layers * self.kv_heads * (self.key_dim + self.value_dim) * self.dtype_bytes

    def bytes_for(self, tokens: int) -> int:
        """KV bytes a cache of ``tokens`` holds: a sliding layer keeps the last ``window - 1``
        positions (what transformers' sliding layers keep between steps, and all the next
        token attends to besides itself)."""
        per_layer = self.kv_heads * (self.key_dim + self.value_dim) * self.dtype_bytes
        sliding = min(tokens, self.window - 1) if self.window is not None else tokens
        return per_layer * (self.full_layers * tokens + self.sliding_layers * sliding)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def kv_shape_from_config(config: Any, dtype: Any = "float32") -> KVShape:
    """The :class:`KVShape` of a transformers config (``PretrainedConfig`` or its dict)."""
    if isinstance(config, Mapping):
        cfg: Any = type("Cfg", (), dict(config.get("text_config") or config))()
    else:
        cfg = _text_config(config)
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not (layers and heads and hidden):
        raise InvalidInputError("model config lacks num_hidden_layers / num_attention_heads / "
                                "hidden_size: cannot plan its KV memory")
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    window = getattr(cfg, "sliding_window", None)
    if layer_types:
        sliding = sum(1 for t in layer_types if t in ("sliding_attention", "chunked_attention"))
    elif window and getattr(cfg, "use_sliding_window", True):
        sliding = int(layers)
    else:
        sliding = 0
    return KVShape(full_layers=int(layers) - sliding, sliding_layers=sliding,
                   window=int(window) if sliding and window else None, kv_heads=int(kv_heads),
                   key_dim=int(head_dim), value_dim=int(head_dim),
                   dtype_bytes=_dtype_bytes(dtype))


def weight_bytes(model: Any) -> int:
    """Bytes of a loaded model's parameters and buffers, tied tensors counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def weight_bytes_from_dir(path: str | Path, dtype: Any = None) -> int:
    """Bytes the weights of a transformers directory take once loaded (from safetensors
    headers, without reading the tensors); ``dtype`` re-prices floating tensors as a cast would."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise InvalidInputError(f"{path}: no *.safetensors files to plan the weights from")
    target = _dtype_bytes(dtype) if dtype not in (None, "auto") else None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in info["shape"]:
                count *= int(d)
            size = _dtype_bytes(info["dtype"])
            if target is not None and info["dtype"] in ("F32", "F16", "BF16", "F64"):
                size = target
            total += count * size
    return total


def current_rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; ``getrusage`` peak elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``VmHWM``)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass(slots=True)
class ModelPlan:
    """One model's line of the plan."""

    name: str
    weight_bytes: int  # measured after load, or from the safetensors headers before
    kv: KVShape
    max_context: int  # longest prompt + max_tokens one request may hold
    kv_budget_bytes: int  # live KV its running requests may hold together
    pinned: bool = False  # never unloaded by keep-alive
    anchor_budget_bytes: int = 0  # its anchor pool's budget (held between requests)
    keep_alive_s: float | None = None  # unload idle weights after this long (None: never)
    measured: bool = False  # weight_bytes measured on the loaded model

    @property
    def min_kv_bytes(self) -> int:
        """KV of one request at ``max_context``: the least the model needs to serve at all."""
        return self.kv.bytes_for(self.max_context)

    @property
    def planned_bytes(self) -> int:
        return self.weight_bytes + self.kv_budget_bytes + self.anchor_budget_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv.bytes_per_token,
                "kv_budget_bytes": self.kv_budget_bytes,
                "anchor_budget_bytes": self.anchor_budget_bytes, "max_context": self.max_context,
                "min_kv_bytes": self.min_kv_bytes, "pinned": self.pinned,
                "keep_alive_s": self.keep_alive_s, "measured": self.measured,
                "sliding_window": self.kv.window, "layers": self.kv.layers}


@dataclass(slots=True)
class MemoryPlan:
    """The whole process: baseline + every model's weights and KV budget + the memory tier."""

    limit_bytes: int | None  # ``[server] memory_bytes`` (None: no limit)
    baseline_bytes: int
    prefix_cache_bytes: int  # the in-memory KV tier's budget
    models: dict[str, ModelPlan] = field(default_factory=dict)

    @property
    def planned_bytes(self) -> int:
        return (self.baseline_bytes + self.prefix_cache_bytes
                + sum(m.planned_bytes for m in self.models.values()))

    def planned_now_bytes(self, loaded: Mapping[str, bool]) -> int:
        """The plan with the models keep-alive has unloaded taken out (their weights are
        freed, and they hold no live KV until a request reloads them); ``loaded`` maps a model
        to whether its weights are in memory (absent: loaded)."""
        return (self.baseline_bytes + self.prefix_cache_bytes
                + sum(m.planned_bytes for n, m in self.models.items() if loaded.get(n, True)))

    @property
    def pinned_floor_bytes(self) -> int:
        """What must fit no matter what: baseline, pinned weights, one request per model."""
        return (self.baseline_bytes
                + sum(m.weight_bytes for m in self.models.values() if m.pinned)
                + max((m.weight_bytes for m in self.models.values() if not m.pinned), default=0)
                + sum(m.min_kv_bytes for m in self.models.values()))

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the numbers when the plan cannot fit the limit."""
        if self.limit_bytes is None:
            return
        floor = self.pinned_floor_bytes
        if floor > self.limit_bytes:
            parts = [f"baseline {_mib(self.baseline_bytes)}"]
            for m in self.models.values():
                parts.append(f"{m.name}: weights {_mib(m.weight_bytes)}"
                             f"{' (pinned)' if m.pinned else ''} + one {m.max_context}-token "
                             f"request's KV {_mib(m.min_kv_bytes)}")
            raise ConfigError(
                f"server.memory_bytes = {_mib(self.limit_bytes)} cannot hold the configured "
                f"models: at least {_mib(floor)} is needed ({'; '.join(parts)}); raise "
                "memory_bytes, lower [models.X] max_context, or unpin a model")
        if self.planned_bytes > self.limit_bytes:
            raise ConfigError(
                f"server.memory_bytes = {_mib(self.limit_bytes)} is below the plan's "
                f"{_mib(self.planned_bytes)} (baseline {_mib(self.baseline_bytes)}, memory KV "
                f"tier {_mib(self.prefix_cache_bytes)}, "
                + ", ".join(f"{m.name} {_mib(m.weight_bytes)} weights + "
                            f"{_mib(m.kv_budget_bytes)} KV"
                            + (f" + {_mib(m.anchor_budget_bytes)} anchors"
                               if m.anchor_budget_bytes else "")
                            for m in self.models.values())
                + "); lower [models.X] kv_bytes, anchor_bytes or kv.memory_bytes")

    def as_dict(self) -> dict[str, Any]:
        return {"limit_bytes": self.limit_bytes, "baseline_bytes": self.baseline_bytes,
                "prefix_cache_bytes": self.prefix_cache_bytes,
                "planned_bytes": self.planned_bytes,
                "models": {n: m.as_dict() for n, m in self.models.items()}}

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(part, weights, KV/token, KV budget, total) rows for a table (a model's anchor pool
        is added to its KV budget cell)."""
        out = [("baseline (process)", "", "", "", _mib(self.baseline_bytes)),
               ("prefix cache (memory tier)", "", "", "", _mib(self.prefix_cache_bytes))]
        for m in self.models.values():
            tag = (" (pinned)" if m.pinned else f" (keep-alive {m.keep_alive_s:g} s)"
                   if m.keep_alive_s is not None else "")
            kv = _mib(m.kv_budget_bytes) + (f" + {_mib(m.anchor_budget_bytes)} anchors"
                                             if m.anchor_budget_bytes else "")
            out.append((m.name + tag, _mib(m.weight_bytes),
                        f"{m.kv.bytes_per_token / 1024:.1f} KiB", kv, _mib(m.planned_bytes)))
        out.append(("planned", "", "", "", _mib(self.planned_bytes)))
        if self.limit_bytes is not None:
            out.append(("limit (server.memory_bytes)", "", "", "", _mib(self.limit_bytes)))
        return out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@dataclass(slots=True)
class KVReservation:
    """Live KV held by one running request (released when it finishes)."""

    model: str
    nbytes: int
    tokens: int
    released: bool = False
    worker: str | None = None  # the worker whose share it counts against (None: the model's)


class KVAccountant:
    """Per-model live KV budgets: a request reserves its worst case before it runs.

    A reservation is ``KVShape.bytes_for(prompt + max_tokens)``. When it does not fit the
    model's headroom the request waits up to ``max_wait_s`` for running requests to finish, then
    gets :class:`OverloadedError` (HTTP 429 with Retry-After). A request that could never fit
    (larger than the whole budget) is refused at once with a message naming the numbers.
    Thread-safe.
    """

    def __init__(self, plans: Mapping[str, ModelPlan], *, max_wait_s: float = 2.0) -> None:
        self._plans = dict(plans)
        self._live: dict[str, int] = dict.fromkeys(self._plans, 0)
        self._worker_live: dict[tuple[str, str], int] = {}  # (model, worker) -> live bytes
        self._workers: dict[str, int] = dict.fromkeys(self._plans, 1)  # workers per model
        self._cond = threading.Condition()
        self.max_wait_s = max_wait_s
        self.refused: dict[str, int] = dict.fromkeys(self._plans, 0)

    def set_workers(self, model: str, count: int) -> None:
        """``model`` is served by ``count`` workers: each one's fair share of its budget is
        ``budget / count`` (what :meth:`worker_headroom` measures against)."""
        if count < 1:
            raise ValueError(f"a model has at least one worker, got {count}")
        with self._cond:
            self._workers[model] = count

    def need_bytes(self, model: str, tokens: int) -> int | None:
        """KV bytes a request of ``tokens`` reserves on ``model`` (None: not planned here)."""
        plan = self._plans.get(model)
        return None if plan is None else plan.kv.bytes_for(tokens)

    def live_bytes(self, model: str) -> int:
        with self._cond:
            return self._live.get(model, 0)

    def headroom(self, model: str) -> int:
        with self._cond:
            plan = self._plans[model]
            return plan.kv_budget_bytes - self._live[model]

    def worker_headroom(self, model: str, worker: str) -> int:
        """What ``worker`` may still reserve: the model's headroom, at most the worker's share
        of the budget less what its own requests hold (the replica router's KV term)."""
        with self._cond:
            plan = self._plans[model]
            share = plan.kv_budget_bytes // self._workers.get(model, 1)
            own = self._worker_live.get((model, worker), 0)
            return min(plan.kv_budget_bytes - self._live[model], share - own)

    def reserve(self, model: str, tokens: int, *, wait_s: float | None = None,
                worker: str | None = None) -> KVReservation:
        plan = self._plans.get(model)
        if plan is None:  # an upstream model: its memory is not ours
            return KVReservation(model, 0, tokens, released=True)
        if tokens > plan.max_context:
            raise InvalidInputError(
                f"{model}: prompt + max_tokens = {tokens} tokens exceeds its max_context of "
                f"{plan.max_context}")
        need = plan.kv.bytes_for(tokens)
        if need > plan.kv_budget_bytes:
            raise OverloadedError(
                f"{model}: this request needs {_mib(need)} of KV ({tokens} tokens) but the "
                f"model's KV budget is {_mib(plan.kv_budget_bytes)}", retry_after_s=60.0)
        deadline = time.monotonic() + (self.max_wait_s if wait_s is None else wait_s)
        with self._cond:
            while self._live[model] + need > plan.kv_budget_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused[model] += 1
                    raise OverloadedError(
                        f"{model}: KV headroom {_mib(plan.kv_budget_bytes - self._live[model])} "
                        f"< {_mib(need)} needed; retry shortly", retry_after_s=1.0)
                self._cond.wait(left)
            self._live[model] += need
            if worker is not None:
                key = (model, worker)
                self._worker_live[key] = self._worker_live.get(key, 0) + need
        return KVReservation(model, need, tokens, worker=worker)

    def release(self, r: KVReservation) -> None:
        if r.released:
            return
        with self._cond:
            self._live[r.model] -= r.nbytes
            if r.worker is not None:
                self._worker_live[(r.model, r.worker)] -= r.nbytes
            r.released = True
            self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the plan needs to know of one in-process model (loaded or not)."""

    config: Any  # its transformers config (or config.json as a dict)
    weight_bytes: int
    measured: bool  # weight_bytes measured on the loaded model (else from the headers)
    dtype: str = "float32"
    max_context: int | None = None  # ``[models.X] max_context`` (None: the model's positions)
    kv_bytes: int | None = None  # ``[models.X] kv_bytes`` (None: a share of what is left)
    anchor_bytes: int = 0  # ``[models.X] anchor_bytes``: its anchor pool (0: none)
    max_batch: int = 8  # requests decoded together (the default KV budget holds this many)
    pinned: bool = False
    keep_alive_s: float | None = None


def build_plan(models: Mapping[str, ModelFacts], *, limit_bytes: int | None,
               prefix_cache_bytes: int, baseline_bytes: int | None = None) -> MemoryPlan:
    """The plan for ``models``: each model's KV budget is its ``kv_bytes`` when set; otherwise
    an equal share of what the limit leaves after the baseline, the weights, the memory tier,
    the anchor pools and the set budgets, and without a limit ``max_batch`` requests at
    ``max_context``."""
    base = current_rss_bytes() if baseline_bytes is None else baseline_bytes
    plans: dict[str, ModelPlan] = {}
    for name, f in models.items():
        shape = kv_shape_from_config(f.config, f.dtype)
        cfg = f.config if isinstance(f.config, Mapping) else _text_config(f.config).__dict__
        positions = int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 4096)
        ctx = min(f.max_context or positions, positions)
        plans[name] = ModelPlan(name=name, weight_bytes=f.weight_bytes, kv=shape, max_context=ctx,
                                kv_budget_bytes=f.kv_bytes or 0, pinned=f.pinned,
                                anchor_budget_bytes=f.anchor_bytes,
                                keep_alive_s=f.keep_alive_s, measured=f.measured)
    unset = [n for n, f in models.items() if not f.kv_bytes]
    if unset:
        if limit_bytes is not None:
            left = (limit_bytes - base - prefix_cache_bytes
                    - sum(p.weight_bytes + p.anchor_budget_bytes for p in plans.values())
                    - sum(p.kv_budget_bytes for p in plans.values()))
            share = max(0, left // len(unset))
            for n in unset:
                plans[n].kv_budget_bytes = share
        else:
            for n in unset:
                p = plans[n]
                p.kv_budget_bytes = p.min_kv_bytes * max(1, models[n].max_batch)
    return MemoryPlan(limit_bytes=limit_bytes, baseline_bytes=base,
                      prefix_cache_bytes=prefix_cache_bytes, models=plans)


class MemoryMonitor:
    """What ``/health``, ``/metrics`` and the dashboard show of the plan, read live.

    ``namespaces()`` maps each model to the KV namespace digests its engines use (one per tenant
    seen so far); ``tier_bytes()`` maps namespace digests to the bytes the in-memory tier holds
    for them. A model's ``kv_bytes`` is its live KV (reservations of running requests) plus the
    prefix cache it holds in memory.
    """

    def __init__(self, plan: MemoryPlan, accountant: KVAccountant, *,
                 namespaces: Any = None, tier_bytes: Any = None, residency: Any = None) -> None:
        self.plan = plan
        self.accountant = accountant
        self._namespaces = namespaces
        self._tier_bytes = tier_bytes
        # () -> {model: Residency.as_dict()}: keep-alive state (loaded, unloads, reloads)
        self._residency = residency

    def residency(self) -> dict[str, dict[str, Any]]:
        return dict(self._residency()) if self._residency is not None else {}

    def fits(self, model: str, tokens: int) -> bool:
        """Whether a request holding ``tokens`` of KV fits the model's headroom now (True for
        a model the plan does not cover)."""
        p = self.plan.models.get(model)
        if p is None:
            return True
        return tokens <= p.max_context and p.kv.bytes_for(tokens) <= self.accountant.headroom(model)

    def cached_bytes(self) -> dict[str, int]:
        if self._namespaces is None or self._tier_bytes is None:
            return dict.fromkeys(self.plan.models, 0)
        try:
            held = self._tier_bytes()
            spaces = self._namespaces()
        except Exception:  # a scrape must not fail because a store is busy or down
            return dict.fromkeys(self.plan.models, 0)
        return {m: sum(held.get(ns, 0) for ns in spaces.get(m, ())) for m in self.plan.models}

    def snapshot(self) -> dict[str, Any]:
        cached = self.cached_bytes()
        res = self.residency()
        models = {}
        for name, p in self.plan.models.items():
            live = self.accountant.live_bytes(name)
            r = res.get(name) or {"state": "loaded", "loaded": True, "unloads": 0, "reloads": 0,
                                  "reload_s_total": 0.0, "last_reload_s": 0.0}
            models[name] = {
                "weight_bytes": p.weight_bytes,
                "weight_resident_bytes": p.weight_bytes if r["loaded"] else 0,
                "kv_bytes_per_token": p.kv.bytes_per_token,
                "kv_budget_bytes": p.kv_budget_bytes, "kv_live_bytes": live,
                "anchor_budget_bytes": p.anchor_budget_bytes,
                "kv_cached_bytes": cached.get(name, 0), "kv_bytes": live + cached.get(name, 0),
                "kv_headroom_bytes": p.kv_budget_bytes - live,
                "max_context": p.max_context, "pinned": p.pinned,
                "keep_alive_s": p.keep_alive_s,
                "refused": self.accountant.refused.get(name, 0), **r,
            }
        loaded = {n: bool(m["loaded"]) for n, m in models.items()}
        return {"limit_bytes": self.plan.limit_bytes, "planned_bytes": self.plan.planned_bytes,
                "planned_now_bytes": self.plan.planned_now_bytes(loaded),
                "baseline_bytes": self.plan.baseline_bytes,
                "prefix_cache_bytes": self.plan.prefix_cache_bytes,
                "rss_bytes": current_rss_bytes(), "peak_rss_bytes": peak_rss_bytes(),
                "models": models}
