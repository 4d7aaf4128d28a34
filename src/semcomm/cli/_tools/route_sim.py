"""Discrete-event simulation of N replicas behind a :class:`ReplicaRouter`.

Each replica has a KV prefix cache of ``capacity_blocks`` blocks with LRU eviction (a prompt's
blocks are touched last-to-first so prefixes outlive their extensions), a FCFS prefill queue
served one prompt at a time, and a continuous decode batch. Costs come from a
:class:`CostModel`. A request's TTFT is its prefill end minus its arrival; its hit tokens are the
consecutive cached blocks found when its prefill starts (at least one token is recomputed).
When the router uses a precise index, every store/evict of a replica's cache is published to it
as a numbered event, exactly like an engine's ``ChunkStore.subscribe`` stream.

Events live in one heap ordered by (time, sequence); arrivals are merged in from the sorted
trace, so the heap only holds in-flight work. Every request completes exactly once.
"""

from __future__ import annotations

import gc
import heapq
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError
from ...routing import CostModel, IndexEvent, PreciseIndex, ReplicaRouter, RouteDecision
from .route_trace import MOONCAKE_BLOCK_SIZE, TraceRequest

__all__ = ["SimConfig", "SimResult", "capacity_at_slo", "simulate"]

logger = logging.getLogger(__name__)

_PREFILL_DONE = 0
_DECODE_DONE = 1


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Parameters of one simulation run."""

    replicas: int = 8  # number of replicas
    policy: str = "default"  # replica policy registry name
    index: str = "precise"  # "precise" (fed by simulated store events) or "approximate"
    capacity_blocks: int = 1000  # KV capacity per replica in blocks (~512k tokens at 512/block)
    block_size: int = MOONCAKE_BLOCK_SIZE  # tokens per block (trace hash_ids granularity)
    rate_scale: float = 1.0  # multiplies the arrival rate (divides inter-arrival times)
    slo_ttft_s: float = 2.0  # TTFT objective, used by SLO-aware policies and capacity search
    cost: CostModel = field(default_factory=CostModel)
    policy_options: tuple[tuple[str, Any], ...] = ()  # extra policy kwargs as (name, value) pairs
    # live KV per replica, in tokens (0: unlimited). A request holds prompt + output tokens of
    # KV from its prefill to its last token and starts only when they fit (it waits otherwise).
    kv_tokens: int = 0
    kv_aware: bool = True  # the router is told each replica's KV headroom (token-aware balancing)


@dataclass(slots=True)
class SimResult:
    """Outcome of one simulation (``to_json`` gives the CLI contract fields and more)."""

    policy: str
    replicas: int
    rate_scale: float
    requests: int  # requests in the trace
    completed: int  # requests that completed (must equal ``requests``)
    hit_rate: float  # cached prompt tokens / prompt tokens (0..1)
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    queue_p50_s: float  # wait before prefill starts
    queue_p99_s: float
    e2e_p50_s: float  # arrival to last token
    load_imbalance: float  # max / mean prefill busy time across replicas (1 = perfectly even)
    routed_imbalance: float  # max / mean requests routed per replica
    makespan_s: float  # simulated time from first arrival to last completion
    decision_p50_us: float  # router decision wall time
    decision_p99_us: float
    decision_cpu_p99_us: float  # router decision thread CPU time (excludes preemption by other processes)
    wall_s: float  # wall time of the simulation
    memory_waits: int = 0  # requests that waited at their replica for KV room (kv_tokens > 0)
    memory_wait_p99_s: float = 0.0  # p99 of those waits
    kv_peak_fraction: float = 0.0  # highest live KV on any replica / kv_tokens
    ttft_s: list[float] = field(default_factory=list, repr=False)  # per request, trace order

    def to_json(self, *, with_samples: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_samples:
            d.pop("ttft_s")
        return d


def _q(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else 0.0


def simulate(
    trace: Sequence[TraceRequest],
    config: SimConfig,
    *,
    on_event: Callable[[float, str, int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Replay ``trace`` through a router and ``config.replicas`` simulated replicas.

    ``on_event(time, kind, request_index)`` (optional) sees every event in processing order
    (kinds: ``arrival``, ``prefill_start``, ``first_token``, ``complete``). ``progress(n)`` is
    called every 1000 arrivals.
    """
    if config.replicas <= 0:
        raise ConfigError(f"replicas must be positive, got {config.replicas}")
    if config.rate_scale <= 0 or not math.isfinite(config.rate_scale):
        raise ConfigError(f"rate_scale must be a positive number, got {config.rate_scale}")
    if config.capacity_blocks <= 0:
        raise ConfigError(f"capacity_blocks must be positive, got {config.capacity_blocks}")
    if config.kv_tokens < 0:
        raise ConfigError(f"kv_tokens must be 0 (unlimited) or positive, got {config.kv_tokens}")
    n_rep = config.replicas
    cost = config.cost
    bs = config.block_size
    cap = config.capacity_blocks
    router = ReplicaRouter(
        n_rep,
        policy=config.policy,
        index=config.index,
        chunk_size=bs,
        capacity_chunks=cap,
        cost=cost,
        slo_ttft_s=config.slo_ttft_s,
        policy_options=dict(config.policy_options),
    )
    precise = router.index if isinstance(router.index, PreciseIndex) else None
    seq = [0] * n_rep  # per-replica event sequence numbers
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_rep)]
    queues: list[deque[int]] = [deque() for _ in range(n_rep)]
    busy = [False] * n_rep
    decoding = [0] * n_rep
    busy_s = [0.0] * n_rep
    slowdown = cost.prefill_slowdown_per_decode
    kv_cap = config.kv_tokens
    kv_used = [0] * n_rep  # live KV (tokens) of prefilling and decoding requests
    kv_queued = [0] * n_rep  # KV the queued requests will need
    kv_peak = 0
    mem_wait: dict[int, float] = {}  # request -> when it first waited for KV room
    mem_waited: list[float] = []

    n = len(trace)
    t0 = trace[0].arrival_s if n else 0.0
    scale = config.rate_scale
    arrivals = [(r.arrival_s - t0) / scale for r in trace]
    decisions: list[RouteDecision | None] = [None] * n
    ttft = np.full(n, np.nan)
    queue_wait = np.full(n, np.nan)
    e2e = np.full(n, np.nan)
    cached_tokens = np.zeros(n, dtype=np.int64)
    done = np.zeros(n, dtype=np.int8)
    dec_ns = np.zeros(n, dtype=np.int64)
    dec_cpu_ns = np.zeros(n, dtype=np.int64)
    heap: list[tuple[float, int, int, int, int]] = []  # (time, tiebreak, kind, replica, request)
    tie = 0
    now = 0.0

    def emit(kind: str, i: int) -> None:
        if on_event is not None:
            on_event(now, kind, i)

    def need(i: int) -> int:  # KV a request holds (at most the whole replica's)
        return min(trace[i].input_length + trace[i].output_length, kv_cap)

    def try_start(r: int) -> None:
        """Start the next queued prefill on an idle replica if its KV fits (else it waits)."""
        if busy[r] or not queues[r]:
            return
        i = queues[r][0]
        if kv_cap and kv_used[r] + need(i) > kv_cap:
            mem_wait.setdefault(i, now)
            return
        if i in mem_wait:
            mem_waited.append(now - mem_wait.pop(i))
        start_prefill(r)

    def start_prefill(r: int) -> None:
        nonlocal tie, kv_peak
        i = queues[r].popleft()
        req = trace[i]
        if kv_cap:
            kv_used[r] += need(i)
            kv_queued[r] -= need(i)
            kv_peak = max(kv_peak, kv_used[r])
        cache = caches[r]
        hit = 0
        for k in req.hash_ids:
            if k in cache:
                hit += 1
            else:
                break
        c = min(hit * bs, req.input_length - 1)
        cached_tokens[i] = c
        service = cost.prefill_s(req.input_length - c, c) * (1.0 + slowdown * decoding[r])
        busy[r] = True
        busy_s[r] += service
        queue_wait[i] = now - arrivals[i]
        emit("prefill_start", i)
        tie += 1
        heapq.heappush(heap, (now + service, tie, _PREFILL_DONE, r, i))

    def store_blocks(r: int, keys: tuple[int, ...]) -> None:
        cache = caches[r]
        for k in reversed(keys):
            if k in cache:
                cache.move_to_end(k)
            else:
                cache[k] = None
                if precise is not None:
                    seq[r] += 1
                    precise.apply(r, IndexEvent("store", k, "memory", seq[r]))
        while len(cache) > cap:
            old, _ = cache.popitem(last=False)
            if precise is not None:
                seq[r] += 1
                precise.apply(r, IndexEvent("evict", old, "memory", seq[r]))

    def process(kind: int, r: int, i: int) -> None:
        nonlocal tie
        d = decisions[i]
        assert d is not None
        if kind == _PREFILL_DONE:
            ttft[i] = now - arrivals[i]
            emit("first_token", i)
            router.prefill_done(d)
            store_blocks(r, trace[i].hash_ids)
            busy[r] = False
            decoding[r] += 1
            dur = trace[i].output_length * cost.decode_step(decoding[r])
            tie += 1
            heapq.heappush(heap, (now + dur, tie, _DECODE_DONE, r, i))
            try_start(r)
        else:
            decoding[r] -= 1
            if kv_cap:
                kv_used[r] -= need(i)
                try_start(r)  # its KV is free: a request waiting for room may start
            router.complete(d)
            assert done[i] == 0, f"request {i} completed twice"
            done[i] = 1
            e2e[i] = now - arrivals[i]
            emit("complete", i)

    wall0 = time.perf_counter()
    perf = time.perf_counter_ns
    cpu = time.thread_time_ns
    # The loop allocates millions of small acyclic objects; cyclic GC passes over them only
    # add pauses (seen as 10 ms decision outliers at 1000 replicas), so it is off meanwhile.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(n):
            t_arr = arrivals[i]
            while heap and heap[0][0] <= t_arr:
                t, _, kind, r, j = heapq.heappop(heap)
                assert t >= now, "simulated time went backwards"
                now = t
                process(kind, r, j)
            assert t_arr >= now, "simulated time went backwards"
            now = t_arr
            req = trace[i]
            emit("arrival", i)
            s, c = perf(), cpu()
            kv = None
            if kv_cap and config.kv_aware:
                router.set_kv_free([kv_cap - kv_used[r] - kv_queued[r] for r in range(n_rep)])
                kv = need(i)
            d = router.route(keys=req.hash_ids, num_tokens=req.input_length, kv_bytes=kv)
            dec_cpu_ns[i] = cpu() - c
            dec_ns[i] = perf() - s
            decisions[i] = d
            queues[d.slot].append(i)
            if kv_cap:
                kv_queued[d.slot] += need(i)
            try_start(d.slot)
            if progress is not None and (i + 1) % 1000 == 0:
                progress(i + 1)
        while heap:
            t, _, kind, r, j = heapq.heappop(heap)
            assert t >= now, "simulated time went backwards"
            now = t
            process(kind, r, j)
    finally:
        if gc_was_enabled:
            gc.enable()
    wall = time.perf_counter() - wall0

    completed = int(done.sum())
    total_tokens = float(sum(r.input_length for r in trace)) or 1.0
    busy_arr = np.asarray(busy_s)
    routed = router.routed.astype(np.float64)
    dec_us = dec_ns / 1000.0
    return SimResult(
        policy=config.policy,
        replicas=n_rep,
        rate_scale=scale,
        requests=n,
        completed=completed,
        hit_rate=float(cached_tokens.sum()) / total_tokens,
        ttft_p50_s=_q(ttft, 0.5),
        ttft_p90_s=_q(ttft, 0.9),
        ttft_p99_s=_q(ttft, 0.99),
        ttft_mean_s=float(np.mean(ttft)) if n else 0.0,
        queue_p50_s=_q(queue_wait, 0.5),
        queue_p99_s=_q(queue_wait, 0.99),
        e2e_p50_s=_q(e2e, 0.5),
        load_imbalance=float(busy_arr.max() / busy_arr.mean()) if busy_arr.mean() > 0 else 1.0,
        routed_imbalance=float(routed.max() / routed.mean()) if routed.mean() > 0 else 1.0,
        makespan_s=now,
        decision_p50_us=_q(dec_us, 0.5),
        decision_p99_us=_q(dec_us, 0.99),
        decision_cpu_p99_us=_q(dec_cpu_ns / 1000.0, 0.99),
        wall_s=wall,
        memory_waits=len(mem_waited),
        memory_wait_p99_s=_q(np.asarray(mem_waited), 0.99),
        kv_peak_fraction=kv_peak / kv_cap if kv_cap else 0.0,
        ttft_s=ttft.tolist(),
    )


def capacity_at_slo(
    trace: Sequence[TraceRequest],
    config: SimConfig,
    *,
    slo_ttft_s: float | None = None,
    quantile: float = 0.9,
    iterations: int = 7,
    max_scale: float = 1024.0,
) -> tuple[float, list[tuple[float, float]]]:
    """Largest ``rate_scale`` whose TTFT ``quantile`` stays within the SLO (DualMap's capacity).

    Doubles the scale until the SLO breaks, then bisects ``iterations`` times. Returns the
    scale and the probes ``[(scale, ttft_quantile_s), ...]``. 0.0 if even scale 1/32 fails.
    """
    slo = slo_ttft_s if slo_ttft_s is not None else config.slo_ttft_s
    probes: list[tuple[float, float]] = []

    def ok(scale: float) -> bool:
        cfg = SimConfig(**{**_cfg_dict(config), "rate_scale": scale})
        res = simulate(trace, cfg)
        q = _q(np.asarray(res.ttft_s), quantile)
        probes.append((scale, q))
        return q <= slo

    lo, hi = 0.0, 1.0
    if ok(1.0):
        lo = 1.0
        hi = 2.0
        while hi <= max_scale and ok(hi):
            lo, hi = hi, hi * 2
        if hi > max_scale:
            return lo, probes
    else:
        hi, lo = 1.0, 0.5
        while not ok(lo):
            hi, lo = lo, lo / 2
            if lo < 1.0 / 64:
                return 0.0, probes
    for _ in range(iterations):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def _cfg_dict(c: SimConfig) -> dict[str, Any]:
    return {f: getattr(c, f) for f in c.__dataclass_fields__}
