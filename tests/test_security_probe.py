"""The prefix-probing timing attack against a live `semcomm serve`: it must succeed with the
defenses off (or the harness proves nothing) and be at chance with them on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_probe_harness_contract(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", "from semcomm.cli import main; main()", "security", "probe",
         "--json", str(out), "--trials", "5", "--workload", "3"],
        capture_output=True, text=True, timeout=400, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for k in ("success_defenses_off", "success_defenses_on", "chance"):
        assert 0.0 <= report[k] <= 1.0, k
    chance = report["chance"]
    assert chance == pytest.approx(1 / 8)
    # defenses off: the attacker reads the victim's secret from TTFT well above chance
    assert report["success_defenses_off"] >= chance + 0.3, report["modes"]["defenses_off"]
    # defenses on: no better than chance + 5 points
    assert report["success_defenses_on"] <= chance + 0.05, report["modes"]["defenses_on"]
    on = report["modes"]["defenses_on"]["attack"]
    assert on["probes_throttled"] > 0  # probe detection engaged (429 + Retry-After)
    assert report["throughput_rps_defenses_on"] > 0 and report["throughput_rps_defenses_off"] > 0
