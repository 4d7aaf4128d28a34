"""Replica policies on constructed cases, router lifecycle, full-conversation routing."""

from __future__ import annotations

import pytest

from semcomm.errors import ConfigError, InvalidInputError
from semcomm.routing import POLICIES, CostModel, ReplicaRouter, policy_names
from semcomm.routing._policies import TwoChoice

CS = 4  # tokens per chunk in these tests


def _router(policy: str, n: int = 3, **kw: object) -> ReplicaRouter:
    return ReplicaRouter(n, policy=policy, chunk_size=CS, capacity_chunks=1000, **kw)  # type: ignore[arg-type]


def _prompt(tag: int, chunks: int = 8) -> list[int]:
    return [tag * 1000 + i for i in range(chunks * CS)]


def test_registry_names_and_unknown_policy() -> None:
    assert {"round-robin", "least-loaded", "affinity", "weighted", "gated", "two-choice", "default"} <= set(
        policy_names()
    )
    assert set(POLICIES) == set(policy_names())
    with pytest.raises(ConfigError, match="unknown routing policy"):
        ReplicaRouter(2, policy="nope")
    with pytest.raises(ConfigError, match="bad options"):
        ReplicaRouter(2, policy="default", policy_options={"bogus": 1})


def test_round_robin_cycles() -> None:
    r = _router("round-robin")
    assert [r.route(_prompt(1)).slot for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_loaded_picks_fewest_in_flight_and_frees_on_complete() -> None:
    r = _router("least-loaded")
    d0, d1 = r.route(_prompt(1)), r.route(_prompt(1))
    assert (d0.slot, d1.slot) == (0, 1)  # same prompt still spreads
    r.complete(d0)
    assert r.route(_prompt(2)).slot == 0  # replica 0 is free again
    assert r.inflight.tolist() == [1, 1, 0]


def test_affinity_follows_the_longest_prefix_even_under_load() -> None:
    r = _router("affinity")
    first = r.route(_prompt(7))
    for _ in range(5):
        d = r.route(_prompt(7))
        assert d.slot == first.slot
        assert d.matched_chunks == 8
    other = r.route(_prompt(8))  # no match: least loaded
    assert other.slot != first.slot and other.matched_chunks == 0


def test_weighted_trades_prefix_for_load() -> None:
    r = _router("weighted", n=2, policy_options={"prefix_weight": 3.0, "queue_weight": 2.0, "kv_weight": 0.0})
    d = r.route(_prompt(1))
    assert r.route(_prompt(1)).slot == d.slot  # full prefix 3 > queue difference 2
    r2 = _router("weighted", n=2, policy_options={"prefix_weight": 1.0, "queue_weight": 2.0, "kv_weight": 0.0})
    d = r2.route(_prompt(1))
    assert r2.route(_prompt(1)).slot != d.slot  # load wins when prefix weighs less


def test_gated_balanced_uses_prefix_imbalanced_uses_least_loaded() -> None:
    r = _router("gated", n=2, policy_options={"balance_abs_threshold": 2, "balance_rel_threshold": 1.5})
    d = r.route(_prompt(1))
    assert r.route(_prompt(1)).slot == d.slot  # match rate 1 > 0.3, balanced (2-0 not > 2)
    assert r.route(_prompt(1)).slot == d.slot  # 3 vs 0 is now imbalanced after this one
    assert r.route(_prompt(1)).slot != d.slot  # imbalanced: least loaded despite the prefix
    # low match rate: the replica with the smallest cache
    r3 = _router("gated", n=3)
    r3.route(_prompt(1))
    r3.route(_prompt(2))
    assert r3.route(_prompt(3)).slot == 2


def test_two_choice_candidates_are_stable_and_distinct() -> None:
    tc = TwoChoice()
    for n in (2, 3, 64):
        for tag in range(20):
            keys = ReplicaRouter(n, chunk_size=CS).keys_for(_prompt(tag))
            c1, c2 = tc.candidates(keys, n)
            assert c1 != c2 and 0 <= c1 < n and 0 <= c2 < n
            assert tc.candidates(keys, n) == (c1, c2)


def test_two_choice_prefers_affine_until_slo_then_other_candidate() -> None:
    slo = 0.5
    cost = CostModel()
    r = _router("two-choice", n=8, slo_ttft_s=slo, cost=cost)
    p = _prompt(3)
    c1, c2 = TwoChoice().candidates(r.keys_for(p), 8)
    first = r.route(p)
    assert first.slot in (c1, c2)
    other = c2 if first.slot == c1 else c1
    assert r.route(p).slot == first.slot  # affine and within the SLO
    r.set_load(first.slot, backlog_s=10.0)  # affine candidate now breaks the SLO
    assert r.route(p).slot == other
    chosen = {r.route(_prompt(3)).slot for _ in range(10)}
    assert chosen <= {c1, c2}  # never leaves its two candidates


def test_default_keeps_affinity_at_low_load_and_spreads_under_backlog() -> None:
    r = ReplicaRouter(3, policy="default", chunk_size=256, capacity_chunks=1000)
    long_prompt = list(range(8192))
    d = r.route(long_prompt)
    r.prefill_done(d)
    again = r.route(long_prompt)
    assert again.slot == d.slot and again.cached_tokens == 8191
    r.prefill_done(again)
    r.set_load(d.slot, backlog_s=30.0)  # a long queue on the cached replica
    moved = r.route(long_prompt)
    assert moved.slot != d.slot
    assert moved.predicted_ttft_s < 30.0


def test_routing_uses_the_full_conversation() -> None:
    """Turn 2 shares turn 1's whole prompt; it follows it although its last message is new."""
    r = _router("affinity", n=4)
    system = _prompt(1, chunks=4)
    conv_a = system + _prompt(2, chunks=2)
    conv_b = system + _prompt(3, chunks=2)
    da, db = r.route(conv_a), r.route(conv_b)
    assert da.slot == db.slot  # shared system prompt, more chunks on the first replica
    r.set_load(da.slot, inflight=0)
    turn2 = conv_b + _prompt(4, chunks=1) + _prompt(5, chunks=1)
    d = r.route(turn2)
    assert d.slot == db.slot and d.matched_chunks == 6


def test_router_lifecycle_and_bad_input() -> None:
    r = _router("least-loaded", n=2)
    d = r.route(_prompt(1))
    r.prefill_done(d)
    with pytest.raises(RuntimeError):
        r.prefill_done(d)
    r.complete(d)
    with pytest.raises(RuntimeError):
        r.complete(d)
    assert r.inflight.tolist() == [0, 0] and r.backlog_s.tolist() == [0.0, 0.0]
    with pytest.raises(InvalidInputError):
        r.route([])
    with pytest.raises(InvalidInputError):
        r.route()
    with pytest.raises(ConfigError):
        ReplicaRouter(["a", "a"])


def test_set_replicas_keeps_state_of_survivors() -> None:
    r = ReplicaRouter(["a", "b"], policy="affinity", chunk_size=CS)
    d = r.route(_prompt(1))
    r.set_replicas(["c", d.replica])
    again = r.route(_prompt(1))
    assert again.replica == d.replica and again.slot == 1 and again.matched_chunks == 8
    r.complete(d)  # a decision made before the change still releases its load
    assert r.inflight.tolist() == [0, 1]


def test_plan_records_nothing_until_record_and_reassign_moves_load() -> None:
    r = _router("least-loaded", n=2)
    plan = r.plan(_prompt(1))
    assert r.inflight.tolist() == [0, 0] and r.index.match(plan.keys) == {}
    d = r.record(plan)
    assert r.inflight.tolist() == [1, 0] and r.index.match(plan.keys) == {0: 8}
    with pytest.raises(RuntimeError):
        r.record(plan)
    moved = r.reassign(d, 1)  # the request actually went to replica 1
    assert moved.replica == "1" and r.inflight.tolist() == [0, 1]
    assert r.reassign(moved, "1") is moved
    r.complete(moved)
    assert r.inflight.tolist() == [0, 0]
    with pytest.raises(RuntimeError, match="never recorded"):
        r.complete(r.plan(_prompt(2)))
