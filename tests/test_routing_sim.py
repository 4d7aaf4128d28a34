"""Trace parsing, synthetic workloads and the discrete-event simulator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from semcomm.cli._tools.route_sim import SimConfig, capacity_at_slo, simulate
from semcomm.cli._tools.route_trace import (
    TraceRequest,
    load_trace,
    parse_trace_lines,
    shared_prefix_workload,
    write_trace,
)
from semcomm.errors import ConfigError, InvalidInputError
from semcomm.routing import CostModel


def _line(ts: int = 0, n: int = 1000, out: int = 10, ids: list[int] | None = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out,
                       "hash_ids": ids if ids is not None else [0, 1]})


def test_parse_valid_trace_sorted_and_in_seconds() -> None:
    reqs = parse_trace_lines([_line(2000, ids=[5, 6]), "", _line(500)])
    assert [r.arrival_s for r in reqs] == [0.5, 2.0]
    assert reqs[1].hash_ids == (5, 6)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"input_length": 10, "output_length": 1, "hash_ids": [1]}), "missing field 'timestamp'"),
        (json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": [1]}), "missing field 'input_length'"),
        (_line(n=0), "'input_length' must be >= 1"),
        (_line(out=-1), "'output_length' must be >= 0"),
        (json.dumps({"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}), "timestamp"),
        (json.dumps({"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}), "integer"),
        (_line(ids=[]), "non-empty list"),
        (_line(ids=[1, "x"]), "integers only"),
        (_line(n=1000, ids=[1, 2, 3]), "expected 2 blocks"),
    ],
)
def test_malformed_line_names_its_line_number(bad: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([_line(0), _line(10), bad, _line(20)]) + "\n")
    with pytest.raises(InvalidInputError, match=rf"line 3: .*{message}"):
        load_trace(path)


def test_missing_and_empty_trace_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(InvalidInputError, match="no requests"):
        load_trace(tmp_path / "e.jsonl")


def test_synthetic_workload_roundtrips_and_shares_prefixes(tmp_path: Path) -> None:
    reqs = shared_prefix_workload(groups=4, prompts_per_group=5, system_len=1024, question_len=100,
                                  output_len=20, turns=3, zipf_s=1.0, rate=10.0, seed=3)
    assert len(reqs) == 60
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in reqs)
    firsts = {r.hash_ids[0] for r in reqs}
    assert len(firsts) <= 4  # first block = the group's system prompt
    # a later turn extends its conversation's earlier prompt block for block (full blocks)
    by_prefix = [r for r in reqs if r.input_length > 1024 + 100 + 20 + 100]
    assert by_prefix
    path = tmp_path / "s.jsonl"
    write_trace(reqs, path)
    back = load_trace(path)
    assert [r.hash_ids for r in back] == [r.hash_ids for r in sorted(reqs, key=lambda r: r.arrival_s)]


def _small_trace() -> list[TraceRequest]:
    return shared_prefix_workload(groups=6, prompts_per_group=20, system_len=4096, question_len=512,
                                  output_len=32, turns=2, zipf_s=1.1, rate=30.0, seed=1)


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "affinity", "weighted", "gated",
                                    "two-choice", "default"])
def test_every_request_completes_once_and_time_moves_forward(policy: str) -> None:
    trace = _small_trace()
    seen: dict[str, list[int]] = {"arrival": [], "prefill_start": [], "first_token": [], "complete": []}
    last = [-1.0]

    def on_event(t: float, kind: str, i: int) -> None:
        assert t >= last[0]
        last[0] = t
        seen[kind].append(i)

    res = simulate(trace, SimConfig(replicas=4, policy=policy, capacity_blocks=40), on_event=on_event)
    n = len(trace)
    assert res.requests == res.completed == n
    for kind, indices in seen.items():
        assert sorted(indices) == list(range(n)), kind
    assert 0.0 <= res.hit_rate <= 1.0
    assert 0 < res.ttft_p50_s <= res.ttft_p90_s <= res.ttft_p99_s
    assert res.makespan_s >= trace[-1].arrival_s - trace[0].arrival_s


def test_affinity_beats_round_robin_on_hits_and_rate_scale_raises_load() -> None:
    trace = _small_trace()
    rr = simulate(trace, SimConfig(replicas=4, policy="round-robin", capacity_blocks=40))
    aff = simulate(trace, SimConfig(replicas=4, policy="affinity", capacity_blocks=40))
    assert aff.hit_rate > rr.hit_rate + 0.1
    fast = simulate(trace, SimConfig(replicas=4, policy="round-robin", capacity_blocks=40, rate_scale=8))
    assert fast.ttft_p99_s > rr.ttft_p99_s
    assert fast.makespan_s < rr.makespan_s


def test_precise_and_approximate_indexes_both_find_hits() -> None:
    trace = _small_trace()
    for index in ("precise", "approximate"):
        res = simulate(trace, SimConfig(replicas=4, policy="affinity", index=index, capacity_blocks=40))
        assert res.hit_rate > 0.3, index


def test_capacity_search_brackets_the_slo() -> None:
    trace = _small_trace()
    cfg = SimConfig(replicas=2, policy="least-loaded", capacity_blocks=40)
    cap, probes = capacity_at_slo(trace, cfg, slo_ttft_s=1.0, iterations=4)
    assert cap > 0
    ok = [s for s, q in probes if q <= 1.0]
    bad = [s for s, q in probes if q > 1.0]
    assert cap == max(ok)
    assert bad and min(bad) > cap


def test_bad_config_and_calibration(tmp_path: Path) -> None:
    trace = _small_trace()
    with pytest.raises(ConfigError):
        simulate(trace, SimConfig(replicas=0))
    with pytest.raises(ConfigError):
        simulate(trace, SimConfig(rate_scale=0))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"prefill_s_per_token": 1e-4, "source": "bench"}))
    assert CostModel.from_json(cal).prefill_s_per_token == 1e-4
    cal.write_text(json.dumps({"prefil_s": 1}))
    with pytest.raises(ConfigError, match="unknown field"):
        CostModel.from_json(cal)
    cal.write_text(json.dumps({"decode_step_s": -1}))
    with pytest.raises(ConfigError, match="non-negative"):
        CostModel.from_json(cal)


def _long_and_short(n: int = 240) -> list[TraceRequest]:
    """A short request every 0.25 s and, every 2.5 s, a long-context one (6k tokens of KV held
    through 1,000 output tokens); no shared prefixes."""
    out = []
    for i in range(n):
        if i % 10 == 0:
            out.append(TraceRequest(0.25 * i, 5_000, 1_000, tuple(range(10_000 * i, 10_000 * i + 10))))
        out.append(TraceRequest(0.25 * i + 0.01, 300, 50,
                                tuple(range(10_000 * i + 5_000, 10_000 * i + 5_001))))
    return out


def test_kv_headroom_routing_avoids_waiting_for_memory() -> None:
    """Each replica holds 8k tokens of live KV, room for one long request. Told the headroom,
    the router sends each long request to a replica with room and nothing waits; blind, a long
    request sometimes lands behind another's KV and waits, and so do the shorts behind it."""
    trace = _long_and_short()
    base = {"replicas": 4, "policy": "least-loaded", "block_size": 512, "kv_tokens": 8_000}
    aware = simulate(trace, SimConfig(**base, kv_aware=True))
    blind = simulate(trace, SimConfig(**base, kv_aware=False))
    unlimited = simulate(trace, SimConfig(**{**base, "kv_tokens": 0}))
    for res in (aware, blind, unlimited):
        assert res.completed == len(trace)
    assert 0 < aware.kv_peak_fraction <= 1.0 and blind.kv_peak_fraction <= 1.0
    assert unlimited.memory_waits == 0 and unlimited.kv_peak_fraction == 0.0
    assert aware.memory_waits == 0 < blind.memory_waits
    assert aware.ttft_p99_s < blind.ttft_p99_s / 5
    with pytest.raises(ConfigError, match="kv_tokens"):
        simulate(trace, SimConfig(kv_tokens=-1))
