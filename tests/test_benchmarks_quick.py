"""Every benchmark still runs: ``python -m benchmarks.<area>.<name> --quick`` (a smoke run of
seconds on small inputs and the tiny or smallest catalog models), writing its results into a
temporary directory instead of ``benchmarks/results/``.

A benchmark that needs what CI does not have (the shared data sets beside the checkout, a peer's
own venv) is skipped with the reason; the ones that cannot be made small are listed in
``NOT_SMOKED`` with theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
VLLM_PY = os.environ.get("SEMCOMM_VLLM_PYTHON")


def _needs(path: Path) -> str | None:
    return None if path.exists() else f"needs {path} (the shared data sets)"


#: module -> (arguments after --quick; {out} is a temporary directory, and the file that must
#: exist afterwards, relative to it; why it cannot run here, or None)
SMOKE: dict[str, tuple[list[str], str, str | None]] = {
    "benchmarks.kv.ttft": (["--json", "{out}/r.json"], "r.json", None),
    "benchmarks.engine.decode": (["--no-peers", "--json", "{out}/r.json", "--png", "{out}/r.png"],
                                 "r.json", None),
    "benchmarks.kv.codecs": (["--json", "{out}/r.json"], "r.json", None),
    "benchmarks.kv.stores": (["--json", "{out}/r.json", "--dir", "{out}/kv"], "r.json", None),
    "benchmarks.kv.real_models": (["--json", "{out}/r.json", "--png", "{out}/r.png"], "r.json",
                                  _needs(DATA / "semantic")),
    "benchmarks.semantic.quality": (["--out", "{out}", "--emb-cache", "{out}/emb"],
                                    "semantic_quality.json", _needs(DATA / "semantic")),
    "benchmarks.semantic.fresh": (["--out", "{out}"], "semantic_fresh.json",
                                  _needs(DATA / "semantic")),
    "benchmarks.semantic.traffic": (["--out", "{out}"], "semantic_traffic.json",
                                    _needs(DATA / "semantic")),
    "benchmarks.semantic.speed": (["--out", "{out}"], "semantic_speed.json",
                                  _needs(DATA / "semantic")),
    "benchmarks.routing.sim": (["--out", "{out}"], "routing_sim.json", _needs(DATA / "traces")),
    "benchmarks.routing.model": (["--out", "{out}"], "routing_model.json", None),
    "benchmarks.routing.memory": (["--json", "{out}/r.json", "--png", "{out}/r.png"], "r.json",
                                  _needs(DATA / "traces")),
    "benchmarks.fusion.reference": (["--json", "{out}/r.json", "--png", "{out}/r.png"],
                                    "r.json", None),
    "benchmarks.server.gateway": (["--json", "{out}/r.json"], "r.json", None),
    "benchmarks.server.batching": (["--json", "{out}/r.json"], "r.json", None),
    "benchmarks.server.agent_chain": (["--json", "{out}/r.json"], "r.json", None),
    "benchmarks.server.security": (["--json", "{out}/r.json"], "r.json", None),
    "benchmarks.server.hardening": (["--json", "{out}/r.json"], "r.json", None),
    "benchmarks.agents.bench": (["--json", "{out}/r.json", "--png", "{out}/r.png"], "r.json",
                                _needs(DATA / "sft" / "gsm8k_train.jsonl")),
    "benchmarks.agents.offsets": (["--json", "{out}/r.json", "--png", "{out}/r.png"], "r.json",
                                  _needs(DATA / "sft" / "gsm8k_train.jsonl")),
    "benchmarks.rag.bench": (["--json", "{out}/r.json", "--png", "{out}/r.png"], "r.json",
                             _needs(DATA / "rag")),
    "benchmarks.vllm.compare": (["--json", "{out}/r.json", "--png", "{out}/r.png"], "r.json",
                                None),
    "benchmarks.vllm.check": (["--vllm-python", str(VLLM_PY), "--out", "{out}/r.json",
                               "--quiet"], "r.json",
                              None if VLLM_PY else "set SEMCOMM_VLLM_PYTHON (make vllm-test)"),
}

#: benchmarks with no smoke run yet, and why (each still has --quick for a shorter real run)
NOT_SMOKED = {
    "benchmarks.server.memory": "both real models in five child processes (minutes even with "
                                "--quick); tests/test_server_memplan.py covers the plan",
    "benchmarks.fusion.real": "runs `semcomm fusion eval` on both real models or merges its "
                              "outputs; tests/test_fusion_eval.py covers the evaluation",
    "benchmarks.fusion.larger_sharer": "loads Qwen2.5-Coder-1.5B and two receivers (GBs of "
                                       "weights) even for its 3-item --quick run",
    "benchmarks.rag.data": "writes evaluation sets, no measurement; the benchmarks.rag.bench "
                           "smoke run builds its sets with it",
}
AREAS = {"kv", "engine", "semantic", "routing", "fusion", "server", "vllm", "agents", "rag"}


def test_every_benchmark_is_listed() -> None:
    """A new benchmark module gets a smoke run here (or a reason in NOT_SMOKED)."""
    found = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "benchmarks").glob("*/*.py")
        if not p.name.startswith("_") and p.name != "common.py"
        and p.parent.name in AREAS
    }
    missing = sorted(found - set(SMOKE) - set(NOT_SMOKED))
    assert not missing, f"benchmarks without a smoke run or a reason: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(SMOKE))
def test_quick_run(module: str, tmp_path: Path) -> None:
    args, produced, why_not = SMOKE[module]
    if why_not:
        pytest.skip(why_not)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", module, "--quick", *(a.format(out=tmp_path) for a in args)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (tmp_path / produced).exists(), f"{module} did not write {produced}"
