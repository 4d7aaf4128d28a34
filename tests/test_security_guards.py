"""Client salts refused, probe detection, rate limiting, public prefixes, TTFT padding."""

from __future__ import annotations

import pytest

from semcomm.errors import OverloadedError, TenantError
from semcomm.security import (
    ClientSaltError,
    ProbeConfig,
    ProbeDetector,
    ProbeThrottledError,
    PublicPrefixRegistry,
    RateLimiter,
    RequestGuard,
    TenantSalter,
    TimingGuard,
    reject_client_salt,
)


class FakeClock:
    """Deterministic time for window/expiry tests (time itself is the only thing faked)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(
    "body, headers, field",
    [
        ({"model": "m", "cache_salt": "victim"}, None, "cache_salt"),
        ({"model": "m", "Salt": "x"}, None, "Salt"),
        ({"model": "m", "extra_body": {"cache_salt": "x"}}, None, "extra_body.cache_salt"),
        ({"model": "m", "metadata": {"salt_regions": []}}, None, "metadata.salt_regions"),
        ({"model": "m"}, {"X-Cache-Salt": "x"}, "header X-Cache-Salt"),
    ],
)
def test_client_supplied_salts_are_refused(body: dict, headers: dict | None, field: str) -> None:
    with pytest.raises(ClientSaltError) as info:
        reject_client_salt(body, headers)
    assert info.value.field == field and info.value.status_code == 400
    assert isinstance(info.value, TenantError)
    assert field.split(".")[-1].split()[-1] in str(info.value)


def test_ordinary_requests_pass_the_salt_check() -> None:
    """Words like "salt" in content, ordinary metadata and headers are not salts: the guard
    admits the request under the tenant's own digest; the same request with a salt is refused."""
    body = {"model": "m", "messages": [{"role": "user", "content": "salt? cache_salt?"}],
            "metadata": {"user": "u1", "note": "season with salt"}, "temperature": 0}
    headers = {"Authorization": "Bearer k", "X-Request-Id": "salt-123"}
    reject_client_salt(body, headers)  # no ClientSaltError
    salter = TenantSalter("ab" * 32)
    guard = RequestGuard(salter)
    admission = guard.admit("acme", [1, 2, 3], max_tokens=4, body=body, headers=headers)
    assert admission.salt_digest == salter.digest("acme") and not admission.isolate
    assert guard.refused == 0
    with pytest.raises(ClientSaltError):
        guard.admit("acme", [1, 2, 3], max_tokens=4, body={**body, "cache_salt": "x"},
                    headers=headers)


SYSTEM = list(range(1000, 1200))  # a 200-token shared prefix


def _probe(cand: int, tail: list[int] | None = None) -> list[int]:
    return SYSTEM + [cand] + (tail or [])


@pytest.mark.parametrize("tail", [[], list(range(5000, 5100))], ids=["candidate-last", "known-suffix"])
def test_probe_burst_is_flagged_then_throttled_and_expires(tail: list[int]) -> None:
    clock = FakeClock()
    det = ProbeDetector(ProbeConfig(near_dup_threshold=6, window_s=30, block_s=20), clock=clock)
    verdicts = []
    for cand in range(10):
        clock.t += 0.1
        verdicts.append(det.observe("mallory", _probe(cand, tail), max_tokens=1))
    # TTFT-only probes weigh 1.5: the 4th distinct near-duplicate reaches 6
    assert [v.allowed for v in verdicts[:3]] == [True] * 3
    assert not verdicts[3].allowed and verdicts[3].retry_after_s == pytest.approx(20)
    assert all(not v.allowed for v in verdicts[3:])
    assert det.is_flagged("mallory") and det.flags("mallory") == 1
    # another tenant is unaffected
    assert det.observe("alice", _probe(1, tail)).allowed
    clock.t += 21
    # still remembered near-duplicates keep the tenant flagged while it probes on
    assert not det.observe("mallory", _probe(99, tail), max_tokens=1).allowed
    clock.t += 100  # window and block expired
    assert det.observe("mallory", _probe(100, tail), max_tokens=1).allowed


def test_normal_traffic_is_not_flagged() -> None:
    clock = FakeClock()
    det = ProbeDetector(ProbeConfig(near_dup_threshold=6), clock=clock)
    # a shared system prompt with distinct, reasonably long questions; and exact retries
    for q in range(40):
        clock.t += 0.5
        question = [2000 + q * 50 + i for i in range(40)]
        assert det.observe("alice", SYSTEM + question, max_tokens=64).allowed
    for _ in range(20):
        assert det.observe("alice", SYSTEM + [7], max_tokens=64).allowed  # retries: identical
    assert det.flags("alice") == 0


def test_isolate_action_serves_but_isolates() -> None:
    clock = FakeClock()
    det = ProbeDetector(ProbeConfig(near_dup_threshold=4, action="isolate"), clock=clock)
    vs = [det.observe("m", _probe(c), max_tokens=1) for c in range(5)]
    assert all(v.allowed for v in vs)
    assert [v.isolate for v in vs] == [False, False, True, True, True]


def test_detector_memory_is_bounded() -> None:
    det = ProbeDetector(ProbeConfig(max_history=8, max_tenants=3))
    for t in range(10):
        for c in range(20):
            det.observe(f"t{t}", [c] * 20)
    assert len(det._tenants) == 3
    assert all(len(s.history) <= 8 for s in det._tenants.values())


def test_rate_limiter_token_bucket() -> None:
    clock = FakeClock()
    rl = RateLimiter(rate_per_s=2.0, burst=3, clock=clock)
    assert [rl.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rl.acquire("a") == pytest.approx(0.5)
    assert rl.acquire("b") == 0.0
    clock.t += 0.5
    assert rl.acquire("a") == 0.0


def test_request_guard_maps_to_errors_with_retry_after() -> None:
    clock = FakeClock()
    guard = RequestGuard(
        TenantSalter("s" * 32),
        detector=ProbeDetector(ProbeConfig(near_dup_threshold=3), clock=clock),
        limiter=RateLimiter(rate_per_s=100, burst=100, clock=clock),
    )
    adm = guard.admit("acme", SYSTEM + [1], max_tokens=8)
    assert adm.salt_digest == TenantSalter("s" * 32).digest("acme") and not adm.isolate
    with pytest.raises(ClientSaltError):
        guard.admit("acme", SYSTEM, body={"cache_salt": "x"})
    guard.admit("acme", SYSTEM + [2], max_tokens=8)
    with pytest.raises(ProbeThrottledError) as info:
        guard.admit("acme", SYSTEM + [3], max_tokens=8)
    assert isinstance(info.value, OverloadedError) and info.value.retry_after_s > 0
    assert info.value.status_code == 429 and guard.refused == 1


def test_public_prefix_registry() -> None:
    reg = PublicPrefixRegistry(max_entries=2)
    reg.register(SYSTEM[:50], name="short")
    reg.register(SYSTEM, name="long")
    assert reg.match(SYSTEM + [1, 2]).name == "long" and reg.match(SYSTEM + [1]).length == 200
    assert reg.match(SYSTEM[:60]).name == "short"
    assert reg.match([1, 2, 3]).length == 0
    with pytest.raises(ValueError, match="full"):
        reg.register([1, 2], name="third")
    assert reg.unregister("long") and reg.match(SYSTEM).name == "short"


def test_timing_guard_pads_shared_hits_only() -> None:
    g = TimingGuard("shared")
    g.observe_prefill(100, 0.2)  # 2 ms/token learned from a miss
    assert g.s_per_token == pytest.approx(0.002)
    assert g.pad_seconds(100, 0.05, reused_tokens=90, shared=True) == pytest.approx(0.15)
    assert g.pad_seconds(100, 0.05, reused_tokens=90, shared=False) == 0.0  # own prefix: no pad
    assert g.pad_seconds(100, 0.05, reused_tokens=0, shared=True) == 0.0  # a miss
    assert TimingGuard("all", initial_s_per_token=0.002).pad_seconds(
        100, 0.05, reused_tokens=90, shared=False) == pytest.approx(0.15)
    assert TimingGuard("off", initial_s_per_token=1).pad_seconds(
        100, 0, reused_tokens=90, shared=True) == 0.0


def test_security_cli_help_and_salt_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from semcomm.cli import app

    runner = CliRunner()
    for args in (["security", "--help"], ["security", "probe", "--help"],
                 ["security", "salt-digest", "--help"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0 and "Usage" in r.output, args
    assert "--json" in runner.invoke(app, ["security", "probe", "--help"]).output
    monkeypatch.setenv("SEMCOMM_SECRET", "cli-test-secret-0123456789abcdef")
    r = runner.invoke(app, ["security", "salt-digest", "acme"])
    assert r.exit_code == 0
    assert r.output.strip() == TenantSalter("cli-test-secret-0123456789abcdef").digest("acme")
    assert r.output.strip() != TenantSalter("cli-test-secret-0123456789abcdef").digest("globex")
