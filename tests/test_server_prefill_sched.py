"""The process-wide prefill scheduler: long prefills bounded by slots, short ones never wait,
outputs identical with and without it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from semcomm.engine import HFEngine
from semcomm.kv import MemoryStore
from semcomm.runtime import PrefillScheduler, prefill_scheduler

from ._engine_models import FAMILIES, SLIDING, prompt_ids, tiny_model
from .test_server_support import live_server

CHUNK = 16  # the scheduler pieces of these tests are one chunk each


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    """The engine cuts long prefills only with one intra-op thread (where a cut prefill is
    bit-identical to one forward); the tests here run as a server with torch_threads = 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Overlap:
    """Forward hooks on a model: the most forwards of ``min_len``+ tokens running at once.

    Each such forward sleeps ``hold_s`` inside (so two that could overlap do)."""

    def __init__(self, min_len: int, hold_s: float = 0.03) -> None:
        self.min_len, self.hold_s = min_len, hold_s
        self.now = self.peak = self.count = 0
        self.short_peak = 0
        self._short_now = 0
        self._lock = threading.Lock()
        self._mine = threading.local()

    def attach(self, model: Any) -> None:
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, with_kwargs=True)

    def _len(self, kwargs: dict[str, Any]) -> int:
        ids = kwargs.get("input_ids")
        return int(ids.shape[1]) if ids is not None else 0

    def _pre(self, _m: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        n = self._len(kwargs)
        long = n >= self.min_len
        self._mine.long = long
        with self._lock:
            if long:
                self.now += 1
                self.count += 1
                self.peak = max(self.peak, self.now)
            elif n > 1:
                self._short_now += 1
                self.short_peak = max(self.short_peak, self._short_now)
        if long or n > 1:
            time.sleep(self.hold_s)

    def _post(self, _m: Any, _args: Any, kwargs: dict[str, Any], _out: Any) -> None:
        n = self._len(kwargs)
        with self._lock:
            if self._mine.long:
                self.now -= 1
            elif n > 1:
                self._short_now -= 1


def _engine(model: Any, sched: PrefillScheduler | None) -> HFEngine:
    if sched is not None:
        sched.attach(model)  # what the runtime's EngineRunner does for the model it serves
    return HFEngine(model, None, store=MemoryStore(), chunk_size=CHUNK, device="cpu",
                    prefill_scheduler=sched)


def test_pieces_end_at_kv_chunk_boundaries() -> None:
    s = PrefillScheduler(slots=1, long_tokens=4, piece_tokens=20)
    # step rounds 20 up to 24 (three chunks of 8); a cache holding 8 positions cuts at 24, 48
    assert s.cuts(8, 50, 8) == [(0, 16), (16, 40), (40, 50)]
    assert s.cuts(0, 24, 8) == [(0, 24)]
    assert all((8 + b) % 24 == 0 for _, b in s.cuts(8, 50, 8)[:-1])


@pytest.mark.parametrize(("family", "nice"), [("qwen2", 0), ("qwen2", 10), ("gemma3", 10)])
def test_outputs_are_identical_with_and_without_the_scheduler(family: str, nice: int) -> None:
    model = tiny_model(family)
    ids = prompt_ids(120, seed=3)
    plain = _engine(model, None)
    sched = PrefillScheduler(slots=1, long_tokens=16, piece_tokens=16, nice=nice)
    cut = _engine(model, sched)
    for prompt in (ids, ids[:40] + prompt_ids(60, seed=4)):  # a miss, then a partial hit
        a = plain.generate(prompt, max_new_tokens=12)
        b = cut.generate(prompt, max_new_tokens=12)
        assert b.token_ids == a.token_ids
        assert b.stats.hit_tokens == a.stats.hit_tokens
    pa, pb = plain.prefill(prompt_ids(90, seed=5)), cut.prefill(prompt_ids(90, seed=5))
    assert torch.equal(pa.last_logits, pb.last_logits)
    assert sched.long_prefills >= 3
    assert sched.nice_applied == (nice > 0)  # pieces ran on the scheduler's niced thread
    assert sched.pieces > sched.long_prefills  # sliding layers too: the engine cuts anyway


def test_long_prefills_never_exceed_the_slots_and_short_ones_never_wait() -> None:
    models = [tiny_model("qwen2", seed=0), tiny_model("llama", seed=1)]
    probe = _Overlap(min_len=9)
    for m in models:
        probe.attach(m)
    sched = PrefillScheduler(slots=1, long_tokens=12, piece_tokens=16, cores=64)
    engines = [_engine(m, sched) for m in models for _ in range(2)]
    errors: list[BaseException] = []

    def run(eng: HFEngine, prompt: list[int]) -> None:
        try:
            eng.generate(prompt, max_new_tokens=2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    # four long ones: 105 tokens, pieces of 16 and a last one of 9 (all seen by the probe)
    jobs = [(engines[i], prompt_ids(105, seed=10 + i)) for i in range(4)]
    jobs += [(engines[i % 4], prompt_ids(6, seed=30 + i)) for i in range(6)]  # six short ones
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert probe.count == 4 * 7  # every long prompt ran in 7 pieces
    assert probe.peak == 1  # measured at the model, not inferred from the scheduler
    assert sched.peak_running == 1
    assert sched.waits > 0  # the long prefills did contend
    assert probe.short_peak >= 2  # short prefills ran together, unlimited
    assert sched.short_prefills >= 6


def test_without_the_scheduler_long_prefills_overlap() -> None:
    """The instrument can see overlap: the same long prompts, no scheduler."""
    model = tiny_model("qwen2")
    probe = _Overlap(min_len=9, hold_s=0.1)
    probe.attach(model)
    engines = [_engine(model, None) for _ in range(3)]
    threads = [threading.Thread(target=e.generate, args=(prompt_ids(100, seed=10 + i),),
                                kwargs={"max_new_tokens": 1}) for i, e in enumerate(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert probe.peak >= 2


def _config(tmp: Path, **server: Any):  # type: ignore[no-untyped-def]
    from semcomm.server import load_config

    return load_config(None, overrides={
        "server": {"state_dir": str(tmp), "max_tokens_limit": 64, **server},
        "models": {"tiny": {"path": "tiny", "workers": 2, "max_batch": 1}},
        "kv": {"tiers": ["memory"], "memory_bytes": 8 * 2**20, "chunk_size": 8},
        "semantic": {"enabled": False}}, defaults=False, environ={})


def _chat(text: str) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}


LONG = "the long session reads a very long document, page after page. " * 6


def test_the_server_schedules_long_prefills_and_shows_it(tmp_path: Path) -> None:
    answers = {}
    for slots in (1, 0):
        cfg = _config(tmp_path / str(slots), long_prefill_slots=slots, long_prefill_tokens=32,
                      long_prefill_piece_tokens=16)
        with live_server(cfg) as srv, srv.client() as c:
            got = [c.post("/v1/chat/completions", json=_chat(t)).json()
                   for t in (LONG, "hi there", LONG + " and one more page.")]
            answers[slots] = [g["choices"][0]["message"]["content"] for g in got]
            health = c.get("/health").json()
            metrics = c.get("/metrics").text
        if slots == 1:
            pre = health["prefill"]
            assert (pre["slots"], pre["long_tokens"], pre["piece_tokens"]) == (1, 32, 16)
            assert (pre["nice"], pre["nice_applied"]) == (10, True)  # the default
            assert pre["long_prefills"] >= 1 and pre["pieces"] > pre["long_prefills"]
            assert pre["short_prefills"] >= 1
            # the defaults
            assert (pre["yield"], pre["yield_max_ms"], pre["yield_run_ms"]) == (True, 500, 100)
            # the short request was in flight from submit to its first token, then let go
            assert pre["short_requests"] == 1 and pre["short_in_flight"] == 0
            assert "semcomm_prefill_short_in_flight 0.0" in metrics
            assert "semcomm_long_prefill_yield_seconds_total" in metrics
            assert "semcomm_prefill_yield_forced_total" in metrics
            assert "semcomm_prefill_waits_total" in metrics
            assert f"semcomm_prefill_pieces_total {float(pre['pieces'])}" in metrics
        else:
            assert health["prefill"] is None  # 0 turns it off
    assert answers[1] == answers[0]


def test_the_default_slots_leave_a_core_and_bad_settings_are_refused(tmp_path: Path) -> None:
    import os

    from semcomm.errors import ConfigError

    cores = len(os.sched_getaffinity(0))
    sched = prefill_scheduler(None, 512, 256, 10)
    assert sched is not None and sched.slots == max(1, cores - 1)
    assert prefill_scheduler(None, 512, 256, 10) is sched  # one per process and setting
    assert prefill_scheduler(0, 512, 256) is None
    with pytest.raises(ConfigError, match="long_prefill_slots"):
        _config(tmp_path, long_prefill_slots=-1)
    with pytest.raises(ConfigError, match="long_prefill_tokens"):
        _config(tmp_path, long_prefill_tokens="many")
    with pytest.raises(ConfigError, match="long_prefill_nice"):
        _config(tmp_path, long_prefill_nice=20)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(SLIDING))
def test_the_scheduler_changes_nothing_computed_in_every_family(family: str,
                                                               threads: int) -> None:
    """The engine prefills one KV chunk at a time with or without the scheduler (which only
    decides when each piece runs), so the logits are the same bits on any CPU, at any thread
    count, and the greedy tokens the same."""
    model = tiny_model(family)
    sched = PrefillScheduler(slots=1, long_tokens=16, piece_tokens=16)
    plain, cut = _engine(model, None), _engine(model, sched)
    ids = prompt_ids(90, seed=6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pa, pb = plain.prefill(ids), cut.prefill(ids)
        ga = plain.generate(ids, max_new_tokens=6).token_ids
        gb = cut.generate(ids, max_new_tokens=6).token_ids
    finally:
        torch.set_num_threads(before)
    assert sched.pieces == 6  # cut at 16, 32, 48, 64, 80
    assert torch.equal(pa.last_logits, pb.last_logits)
    assert ga == gb


# --- yielding to short requests -------------------------------------------------------------
class _LayerCalls:
    """Forward hooks on a model's decoder layers: the calls each layer finished on one thread,
    and an optional action run once after a given layer's first call there."""

    def __init__(self, model: Any) -> None:
        from semcomm.runtime._prefill import _decoder_layers

        self.thread: int | None = None  # the long prefill's thread (set before it starts)
        self.done = [0] * len(_decoder_layers(model))
        self.after: tuple[int, Any] | None = None  # (layer index, action)
        for i, layer in enumerate(_decoder_layers(model)):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def post(_m: Any, _args: Any, _out: Any) -> None:
            if threading.get_ident() != self.thread:
                return
            self.done[i] += 1
            if self.after is not None and self.after[0] == i:
                action, self.after = self.after[1], None
                action()
        return post


def _wait_for(cond: Any, what: str, timeout: float = 30.0) -> None:
    t_end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t_end, f"timed out waiting for {what}"
        time.sleep(0.002)


def _long_prefill_thread(eng: HFEngine, ids: list[int], out: dict[str, Any]
                         ) -> threading.Thread:
    def work() -> None:
        out["pre"] = eng.prefill(ids)
    return threading.Thread(target=work, daemon=True)


def test_a_long_prefill_waits_for_a_short_request_in_flight_and_resumes_after() -> None:
    model = tiny_model("qwen2")
    calls = _LayerCalls(model)
    sched = PrefillScheduler(slots=1, long_tokens=16, piece_tokens=16, yield_max_s=60)
    plain, eng = _engine(tiny_model("qwen2"), None), _engine(model, sched)
    ids = prompt_ids(90, seed=6)
    ticket = sched.short_request(owner=-1)  # a short request on another worker, queued
    out: dict[str, Any] = {}
    t = _long_prefill_thread(eng, ids, out)
    t.start()
    calls.thread = t.ident
    _wait_for(lambda: sched.stats()["yields"] == 1, "the first piece to yield")
    assert sched.stats()["short_in_flight"] == 1
    assert calls.done == [0, 0]  # nothing of the long prefill computed while it waits
    assert sched.pieces == 0
    ticket.close()
    t.join(30)
    assert torch.equal(out["pre"].last_logits, plain.prefill(ids).last_logits)
    assert calls.done == [6, 6] and sched.pieces == 6
    st = sched.stats()
    assert (st["yields"], st["forced"], st["short_in_flight"]) == (1, 0, 0)
    assert st["yield_s"] > 0 and st["wait_s"] >= st["yield_s"]


def test_a_running_piece_pauses_between_layers_for_a_short_request_arriving() -> None:
    model = tiny_model("llama")
    calls = _LayerCalls(model)
    sched = PrefillScheduler(slots=1, long_tokens=16, piece_tokens=16, yield_max_s=60, nice=10)
    plain, eng = _engine(tiny_model("llama"), None), _engine(model, sched)
    ids = prompt_ids(90, seed=7)
    tickets: list[Any] = []
    out: dict[str, Any] = {}
    t = _long_prefill_thread(eng, ids, out)
    # with nice > 0 the pieces compute on the scheduler's thread: watch that one
    sched._executor()
    assert sched._pool is not None
    calls.thread = sched._pool.submit(threading.get_ident).result()

    def arrive() -> None:  # the short request arrives after layer 0 of the third piece
        if calls.done[0] == 3:
            tickets.append(sched.short_request(owner=-1))
        else:
            calls.after = (0, arrive)
    calls.after = (0, arrive)
    t.start()
    _wait_for(lambda: sched.stats()["yields"] == 1, "the running piece to pause")
    assert calls.done == [3, 2]  # paused after layer 0 of the third piece, before layer 1
    tickets[0].close()
    t.join(30)
    assert calls.done == [6, 6]
    assert torch.equal(out["pre"].last_logits, plain.prefill(ids).last_logits)
    assert sched.stats()["gated_models"] == 1 and sched.forced == 0


@pytest.mark.parametrize(("run_s", "pauses"), [(60.0, 1), (1e-9, 6 + 6 * 2)])
def test_the_starvation_bound_ends_every_pause_and_lets_the_prefill_compute(
        run_s: float, pauses: int) -> None:
    """A short request in flight for the whole prefill: each pause ends after the bound; then
    the prefill computes for ``run_s`` (all of it at 60 s; at 1 ns it pauses again at the next
    point: before each of the 6 pieces and before each of its 2 layers)."""
    bound = 0.04
    sched = PrefillScheduler(slots=1, long_tokens=16, piece_tokens=16, yield_max_s=bound,
                             yield_run_s=run_s)
    plain, eng = _engine(tiny_model("qwen2"), None), _engine(tiny_model("qwen2"), sched)
    ids = prompt_ids(90, seed=8)
    ticket = sched.short_request(owner=-1)  # never ends while the prefill runs
    try:
        pre = eng.prefill(ids)
    finally:
        ticket.close()
    assert torch.equal(pre.last_logits, plain.prefill(ids).last_logits)
    st = sched.stats()
    assert st["pieces"] == 6
    assert st["yields"] == st["forced"] == pauses  # every pause ran out of the bound
    assert st["yield_s"] >= pauses * bound  # and none ended before it


@pytest.mark.parametrize("case", ["own worker", "a worker in a long prefill", "yield off"])
def test_short_requests_that_cannot_go_first_do_not_hold_a_long_prefill(case: str) -> None:
    """A request queued behind this long prefill (same worker), or behind another worker's
    long prefill, cannot start before it; with yield off only running short prefills count."""
    sched = PrefillScheduler(slots=2, long_tokens=16, piece_tokens=16, yield_max_s=60,
                             yield_to_short=case != "yield off")
    eng = _engine(tiny_model("qwen2"), sched)
    ready = threading.Event()
    out: dict[str, Any] = {}

    def work() -> None:
        ready.wait(30)
        out["pre"] = eng.prefill(prompt_ids(90, seed=9))
    t = threading.Thread(target=work, daemon=True)
    t.start()
    other: threading.Thread | None = None
    inside, release = threading.Event(), threading.Event()
    if case == "a worker in a long prefill":
        # another worker's long prefill, held inside its first piece until this one is done
        model2 = tiny_model("llama")

        def hold(_m: Any, _args: Any) -> None:
            if other is not None and threading.get_ident() == other.ident:
                inside.set()
                release.wait(30)
        model2.register_forward_pre_hook(hold)
        other = threading.Thread(target=_engine(model2, sched).prefill,
                                 args=(prompt_ids(90, seed=10),), daemon=True)
        other.start()
        _wait_for(inside.is_set, "the other long prefill to start")
        ticket = sched.short_request(owner=other.ident or 0)  # queued behind it
    else:
        ticket = sched.short_request(owner=t.ident if case == "own worker" else -1)
    try:
        ready.set()
        t.join(30)
        assert not t.is_alive() and "pre" in out
    finally:
        release.set()
        ticket.close()
        if other is not None:
            other.join(30)
    assert (sched.yields, sched.forced, sched.yield_s) == (0, 0, 0.0)


def test_bad_yield_settings_are_refused(tmp_path: Path) -> None:
    from semcomm.errors import ConfigError

    for bad in (-1, "soon", float("inf"), 10**6):
        with pytest.raises(ConfigError, match="long_prefill_yield_max_ms"):
            _config(tmp_path, long_prefill_yield_max_ms=bad)
    for bad in (0, -5, float("nan")):
        with pytest.raises(ConfigError, match="long_prefill_yield_run_ms"):
            _config(tmp_path, long_prefill_yield_run_ms=bad)
    with pytest.raises(ConfigError, match="long_prefill_yield"):
        _config(tmp_path, long_prefill_yield="sometimes")
    with pytest.raises(ValueError, match="yield_max_s"):
        PrefillScheduler(slots=1, long_tokens=4, piece_tokens=4, yield_max_s=-0.5)
    with pytest.raises(ValueError, match="yield_run_s"):
        PrefillScheduler(slots=1, long_tokens=4, piece_tokens=4, yield_run_s=0)
    sv = _config(tmp_path, long_prefill_yield=False, long_prefill_yield_max_ms=250,
                 long_prefill_yield_run_ms=20).server
    from semcomm.server._wiring import scheduler_for

    sched = scheduler_for(sv)
    assert sched is not None
    assert (sched.yield_to_short, sched.yield_max_s, sched.yield_run_s) == (False, 0.25, 0.02)
