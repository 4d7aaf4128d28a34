"""The prefix-probing timing attack harness (``semcomm security probe``).

It starts a real ``semcomm serve`` process (a config-built Qwen2 model, KV prefix cache on, the
semantic cache off so that only the KV timing channel is measured) and plays two tenants:

* the **victim** sends a prompt built from a template the attacker knows (PromptPeek's
  "input extraction given a known template"): ``"Intake form <id>. Diagnosis: <secret>. <long
  known text>"``, the secret being one of ``K`` candidate words of equal length;
* the **attacker** calibrates hit and miss latency on prompts of its own (each sent twice: a
  miss, then a hit), then sends one probe per candidate (random order, ``max_tokens=1``, so the
  latency is the time to first token). A probe is a cache hit, i.e. the victim's prompt, when it
  is faster than ``hit_ratio`` x the median of the trial's probes (self-calibrating under machine
  load; the calibrated threshold when fewer than three probes got through). The attacker guesses
  the fastest probe if it is a hit; with no hit, uniformly among the candidates it could not
  measure (throttled with 429) or, failing that, among all. ``success`` is the attacker's expected
  accuracy given what it observed (1/K when it observed nothing), averaged over trials.

Two configurations, served by one ``semcomm serve`` process (one startup; see ``server_toml``):

* **defenses off**: the attacker's API key belongs to the victim's tenant, i.e. one shared cache
  without salts (what a server without ``cache_salt`` does), and no probe detection for it;
* **defenses on**: separate tenants (server-derived salts isolate their KV namespaces) and the
  probe detector (429 + Retry-After for bursts of near-identical prompts).

Each trial uses a fresh form id, so probes stored by earlier trials never hit later ones. A benign
workload (two tenants sharing a system prompt with distinct questions) measures the throughput
each configuration sustains: the cost of the defenses.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...errors import BackendUnavailableError, SemcommError

__all__ = [
    "AttackOutcome",
    "ModeReport",
    "ProbeHarnessConfig",
    "ServeProcess",
    "build_target_model",
    "run_attack",
    "run_probe_harness",
]

log = logging.getLogger(__name__)

CANDIDATES = ("asthma", "anemia", "angina", "sepsis", "rabies", "typhus", "otitis", "uremia")
"""Equal-length secrets, so that every probe has the same token count (and miss cost)."""

_FILLER = (
    "the patient reports intermittent symptoms since early spring with no prior history of "
    "similar episodes and no known allergies to medication or food items recorded on file "
    "vital signs were within normal limits at admission and the attending physician ordered "
    "routine laboratory work including a complete blood count and metabolic panel results "
    "are pending review by the specialist team who will contact the family after rounds "
)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class ProbeHarnessConfig:
    """Parameters of one harness run. The defaults are the short configuration (< 60 s)."""

    candidates: tuple[str, ...] = CANDIDATES  # K candidate secrets (equal length)
    trials: int = 8  # victim prompts to attack, per configuration
    suffix_chars: int = 1400  # known text after the secret (bytes = tokens for the byte model)
    calibration_pairs: int = 3  # attacker's own miss/hit pairs for the threshold
    hidden_size: int = 96  # config-built target model: big enough that prefill shows
    layers: int = 3
    chunk_size: int = 32  # KV chunk size of the target model
    hit_ratio: float = 0.6  # a probe faster than this x the trial's median latency is a hit
    workload_requests: int = 12  # benign requests per user for the throughput figure
    per_defense: bool = False  # also attack with salts alone (no probe detection)
    seed: int = 0
    startup_timeout_s: float = 90.0
    request_timeout_s: float = 30.0


@dataclass(slots=True)
class AttackOutcome:
    """What the attacker achieved against one server configuration."""

    success: float  # mean expected accuracy over trials (0..1)
    trials: int
    threshold_ms: float  # calibrated hit/miss threshold
    calib_miss_ms: float  # median latency of the attacker's own misses
    calib_hit_ms: float  # median latency of the attacker's own hits
    probe_correct_ms: float  # median latency of probes with the right candidate (nan if none)
    probe_wrong_ms: float  # median latency of probes with a wrong candidate (nan if none)
    probes_sent: int
    probes_throttled: int  # probes answered 429
    per_trial: list[float] = field(default_factory=list)


@dataclass(slots=True)
class ModeReport:
    """One server configuration: the attack and the benign throughput."""

    mode: str  # "defenses_off" or "defenses_on"
    attack: AttackOutcome
    throughput_rps: float  # benign workload requests per second
    workload_s: float
    server_start_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_target_model(path: Path, *, hidden_size: int, layers: int, seed: int = 0) -> Path:
    """Save a config-built Qwen2 with a byte-level tokenizer to ``path`` (an HF model folder)."""
    from ...server import build_tiny_model  # the server's offline model recipe, larger here

    if (path / "config.json").exists():
        return path
    model, tokenizer = build_tiny_model(seed=seed, hidden_size=hidden_size, layers=layers,
                                        heads=4, kv_heads=2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def server_toml(*, port: int, model_dir: Path, state_dir: Path, secret: str,
                chunk_size: int) -> str:
    """The ``semcomm serve`` configuration of the harness: both configurations in one server.

    * defenses off: the attacker's ``attacker-shared-key`` belongs to the victim's tenant (one
      cache namespace, no salt between them, as on a server without ``cache_salt``) and that
      tenant is exempt from probe detection; the benign pair ``bench-s1``/``bench-s2`` likewise
      share one exempt tenant;
    * defenses on: ``attacker-key`` and ``bench-a``/``bench-b`` are tenants of their own
      (server-derived salts) under probe detection;
    * salts only (``per_defense``): ``attacker-solo-key`` is a tenant of its own, exempt from
      probe detection, so the salts' effect is measured alone.
    """
    tenants = {
        "victim": ("victim-key", ["attacker-shared-key"]),
        "bench-shared": ("bench-s1-key", ["bench-s2-key"]),
        "attacker": ("attacker-key", []),
        "attacker-solo": ("attacker-solo-key", []),
        "bench-a": ("bench-a-key", []),
        "bench-b": ("bench-b-key", []),
    }
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        f"secret = {_toml_str(secret)}",
        f"state_dir = {_toml_str(str(state_dir))}",
        "",
        "[models.target]",
        'kind = "hf"',
        f"path = {_toml_str(str(model_dir))}",
        f"chunk_size = {chunk_size}",
        "",
        "[kv]",
        "enabled = true",
        'tiers = ["memory"]',
        f"chunk_size = {chunk_size}",
        "",
        "[semantic]",
        "enabled = false",
        "",
        "[routing]",  # one model: no model router (the embedded default's routes other models)
        'default_model = "target"',
        'model_router = ""',
        "",
    ]
    for name, (key, extra) in tenants.items():
        lines += [f"[tenants.{name}]", f"api_key = {_toml_str(key)}",
                  "api_keys = [" + ", ".join(_toml_str(k) for k in extra) + "]", ""]
    lines += ["[security]", "probe_detection = true", "", "[security.probe]",
              'exempt_tenants = ["victim", "bench-shared", "attacker-solo"]', ""]
    return "\n".join(lines)


# (attacker key, victim key, benign pair) of each configuration
_KEYS = {
    "defenses_off": ("attacker-shared-key", "victim-key", ("bench-s1-key", "bench-s2-key")),
    "defenses_on": ("attacker-key", "victim-key", ("bench-a-key", "bench-b-key")),
    "salts_only": ("attacker-solo-key", "victim-key", ("bench-a-key", "bench-b-key")),
}


class ServeProcess:
    """A ``semcomm serve`` subprocess on a free loopback port; ``stop()`` terminates it."""

    def __init__(self, config_path: Path, port: int, *, log_path: Path) -> None:
        self.config_path = config_path
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        """Start the process (returns at once; :meth:`wait_ready` waits for ``/health``)."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-c", "from semcomm.cli import main; main()", "serve",
               "--config", str(self.config_path), "--port", str(self.port),
               "--log-level", "warning"]
        self._t0 = time.perf_counter()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until ``/health`` answers 200; returns the seconds since :meth:`launch`."""
        import httpx

        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BackendUnavailableError(
                    f"semcomm serve exited with code {self.proc.returncode}: {self.log_tail()}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=1.0)
                if r.status_code == 200:
                    return time.perf_counter() - self._t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise BackendUnavailableError(f"semcomm serve did not become ready in {timeout_s:.0f}s: "
                                      f"{self.log_tail()}")

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:  # pragma: no cover - a hung server
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.proc = None
            self._log.close()


MODES = ("defenses_off", "defenses_on")  # the contract's two configurations
EXTRA_MODES = ("salts_only",)  # one defense alone (``per_defense``)


@contextmanager
def _server(work: Path, model_dir: Path, cfg: ProbeHarnessConfig) -> Iterator[tuple[ServeProcess, float]]:
    port = _free_port()
    state = work / "state"
    state.mkdir(parents=True, exist_ok=True)
    conf = work / "serve.toml"
    conf.write_text(server_toml(port=port, model_dir=model_dir, state_dir=state,
                                secret=secrets.token_hex(32), chunk_size=cfg.chunk_size))
    proc = ServeProcess(conf, port, log_path=work / "serve.log")
    try:
        proc.launch()
        started = proc.wait_ready(cfg.startup_timeout_s)
        yield proc, started
    finally:
        proc.stop()


class _Client:
    """Times one chat request (``max_tokens`` small: the latency is the time to first token)."""

    def __init__(self, base_url: str, key: str, timeout_s: float) -> None:
        import httpx

        self._c = httpx.Client(base_url=base_url, timeout=timeout_s,
                               headers={"Authorization": f"Bearer {key}"})

    def close(self) -> None:
        self._c.close()

    def ask(self, text: str, *, max_tokens: int = 1) -> float | None:
        """Seconds the request took, or None when it was refused with 429."""
        body = {"model": "target", "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        r = self._c.post("/v1/chat/completions", json=body)
        dt = time.perf_counter() - t0
        if r.status_code == 429:
            return None
        if r.status_code != 200:
            raise SemcommError(f"harness request failed with HTTP {r.status_code}: {r.text[:300]}")
        return dt


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _filler(n: int) -> str:
    return (_FILLER * (n // len(_FILLER) + 1))[:n]


def run_attack(victim: _Client, attacker: _Client, cfg: ProbeHarnessConfig,
               rng: random.Random, progress: Progress | None = None) -> AttackOutcome:
    """Play the victim and the attacker against one live server (see the module docstring)."""
    k = len(cfg.candidates)
    if k < 2 or len({len(c) for c in cfg.candidates}) != 1:
        raise ValueError("need at least two candidates, all of the same length")
    suffix = ". " + _filler(cfg.suffix_chars)
    probe_len = len(f"Intake form {0:06d}-{'x' * 8}. Diagnosis: ") + len(cfg.candidates[0]) + len(suffix)
    # calibration: the attacker's own prompts of the same length, sent twice (miss then hit)
    misses: list[float] = []
    hits: list[float] = []
    attacker.ask("warm up " + "z" * 64)
    for _ in range(cfg.calibration_pairs):
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(probe_len))
        m, h = attacker.ask(text), attacker.ask(text)
        if m is not None and h is not None:
            misses.append(m)
            hits.append(h)
    miss_ms, hit_ms = _median(misses) * 1000, _median(hits) * 1000
    threshold = math.sqrt(miss_ms * hit_ms) / 1000 if misses else 0.0
    per_trial: list[float] = []
    right: list[float] = []
    wrong: list[float] = []
    sent = throttled = 0
    for trial in range(cfg.trials):
        form = f"Intake form {trial:06d}-{rng.getrandbits(32):08x}. Diagnosis: "
        secret = rng.choice(cfg.candidates)
        if victim.ask(form + secret + suffix, max_tokens=4) is None:
            raise SemcommError("the victim itself was throttled; the harness is misconfigured")
        order = list(cfg.candidates)
        rng.shuffle(order)
        measured: dict[str, float] = {}
        for cand in order:
            sent += 1
            dt = attacker.ask(form + cand + suffix)
            if dt is None:
                throttled += 1
                continue
            measured[cand] = dt
            (right if cand == secret else wrong).append(dt)
        cutoff = _cutoff(measured, threshold, cfg)
        fastest = min(measured, key=measured.__getitem__) if measured else None
        if fastest is not None and measured[fastest] < cutoff:
            pool = [fastest]  # the hit
        else:  # no hit seen: the secret is among the unmeasured, or anywhere
            pool = [c for c in cfg.candidates if c not in measured] or list(cfg.candidates)
        per_trial.append(1.0 / len(pool) if secret in pool else 0.0)
        if progress is not None:
            progress("attack", trial + 1, cfg.trials)
    return AttackOutcome(
        success=sum(per_trial) / len(per_trial) if per_trial else 0.0,
        trials=len(per_trial), threshold_ms=threshold * 1000, calib_miss_ms=miss_ms,
        calib_hit_ms=hit_ms, probe_correct_ms=_median(right) * 1000,
        probe_wrong_ms=_median(wrong) * 1000, probes_sent=sent, probes_throttled=throttled,
        per_trial=per_trial,
    )


def _cutoff(measured: dict[str, float], calibrated: float, cfg: ProbeHarnessConfig) -> float:
    """Latency below which a probe counts as a hit. With three or more probes measured in the
    trial, ``hit_ratio`` x their median (self-calibrating: machine load shifts every probe of a
    trial alike, and the wrong candidates are all misses); with fewer, the calibrated threshold."""
    if len(measured) >= 3:
        return cfg.hit_ratio * statistics.median(measured.values())
    return calibrated


def _workloads(proc: ServeProcess, cfg: ProbeHarnessConfig, rng: random.Random) -> dict[str, tuple[float, float]]:
    """Benign traffic in both configurations: two users sharing a system prompt with distinct
    questions (``max_tokens=4``). The configurations alternate every round so that drifting
    machine load hits both alike. Returns ``{mode: (requests per second, seconds)}``."""
    system = "You are the clinic's scheduling assistant. " + _filler(600) + " Question: "
    clients = {m: [_Client(proc.base_url, k, cfg.request_timeout_s) for k in _KEYS[m][2]]
               for m in MODES}
    spent = dict.fromkeys(MODES, 0.0)
    n = dict.fromkeys(MODES, 0)
    try:
        for i in range(cfg.workload_requests):
            for mode in MODES:
                for who, c in enumerate(clients[mode]):
                    q = (f"{who}{i}: could you move my appointment number {rng.getrandbits(40)} "
                         f"to the {rng.choice(['first', 'second', 'third'])} free slot after "
                         f"{rng.randint(1, 28)} {rng.choice(['May', 'June', 'July'])} please?")
                    dt = c.ask(system + q, max_tokens=4)
                    if dt is None:
                        raise SemcommError("a benign request was throttled: probe detection "
                                           "thresholds too strict for ordinary traffic")
                    spent[mode] += dt
                    n[mode] += 1
    finally:
        for cs in clients.values():
            for c in cs:
                c.close()
    return {m: (n[m] / spent[m] if spent[m] else math.nan, spent[m]) for m in MODES}


def _attack_mode(mode: str, proc: ServeProcess, cfg: ProbeHarnessConfig,
                 progress: Progress | None) -> AttackOutcome:
    rng = random.Random(f"{cfg.seed}/{mode}")
    attacker_key, victim_key, _ = _KEYS[mode]
    victim = _Client(proc.base_url, victim_key, cfg.request_timeout_s)
    attacker = _Client(proc.base_url, attacker_key, cfg.request_timeout_s)
    try:
        return run_attack(victim, attacker, cfg, rng, progress)
    finally:
        victim.close()
        attacker.close()


def run_probe_harness(cfg: ProbeHarnessConfig | None = None, *, workdir: Path | None = None,
                      progress: Progress | None = None) -> dict[str, Any]:
    """Run the attack with defenses off, then on; return the report (JSON-ready)."""
    cfg = cfg or ProbeHarnessConfig()
    t0 = time.perf_counter()
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="semcomm-probe-")) if own else Path(workdir)  # type: ignore[arg-type]
    try:
        model_dir = build_target_model(work / "model", hidden_size=cfg.hidden_size,
                                       layers=cfg.layers, seed=cfg.seed)
        with _server(work, model_dir, cfg) as (proc, started):
            # off first: its victim prompts live in the victim's namespace, out of the
            # separate attacker tenant's reach; every trial uses a fresh form id anyway
            order = ("defenses_off", *(EXTRA_MODES if cfg.per_defense else ()), "defenses_on")
            attacks = {m: _attack_mode(m, proc, cfg, progress) for m in order}
            tput = _workloads(proc, cfg, random.Random(f"{cfg.seed}/workload"))
        off, on = (ModeReport(mode=m, attack=attacks[m], throughput_rps=tput[m][0],
                              workload_s=tput[m][1], server_start_s=started) for m in MODES)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    chance = 1.0 / len(cfg.candidates)
    return {
        "success_defenses_off": off.attack.success,
        "success_defenses_on": on.attack.success,
        "chance": chance,
        "attack_succeeds_without_defenses": off.attack.success > chance + 0.25,
        "defended": on.attack.success <= chance + 0.05,
        "throughput_rps_defenses_off": off.throughput_rps,
        "throughput_rps_defenses_on": on.throughput_rps,
        "throughput_cost": 1.0 - on.throughput_rps / off.throughput_rps if off.throughput_rps else math.nan,
        **({"success_salts_only": attacks["salts_only"].success} if cfg.per_defense else {}),
        "modes": {m.mode: asdict(m) for m in (off, on)},
        "attacks_per_defense": {m: asdict(a) for m, a in attacks.items() if m not in MODES},
        "config": asdict(cfg),
        "elapsed_s": time.perf_counter() - t0,
    }
