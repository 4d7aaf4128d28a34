"""The dashboard in headless Chromium: the page fetches live figures and renders them."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .test_server_support import TENANTS, LiveServer, live_server, server_config

ACME_KEY_ALIAS = TENANTS["acme"]

pytestmark = pytest.mark.chromium

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(server_config(tmp_path_factory.mktemp("dash"))) as srv:
        yield srv


def _chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM, "Debian's chromium is required (make system-deps installs it)"
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}",
         *args],
        capture_output=True, text=True, timeout=90)


def test_dashboard_shows_live_figures(server: LiveServer, tmp_path: Path) -> None:
    with server.client(ACME_KEY_ALIAS) as c:
        body = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Where is my invoice for March?"}]}
        for _ in range(3):  # one miss, then semantic hits
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        data = c.get("/dashboard/data").json()
        html = c.get("/dashboard")
    assert data["requests"] == 3 and data["layers"]["semantic"]["hits"] == 2
    assert "<script src" not in html.text and "http://" not in html.text.replace(
        "http://www.w3.org", "")  # self-contained: no external scripts, fonts or styles
    out = _chromium(tmp_path, "--virtual-time-budget=8000", "--dump-dom",
                    f"{server.url}/dashboard")
    dom = out.stdout
    assert 'data-loaded="true"' in dom, out.stderr[-2000:]
    assert re.search(r'id="requests">3<', dom)
    row = re.search(r"<tr><td>semantic</td><td>2</td><td>([0-9.]+)%</td>", dom)
    assert row and float(row.group(1)) == pytest.approx(66.7, abs=0.1)
    assert "kv-memory" in dom  # the memory tier table is filled in
    assert "invoice" not in dom  # prefixes appear as fingerprints, never as text


def test_dashboard_screenshot(server: LiveServer, tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "dash.png"
    out = _chromium(tmp_path, "--virtual-time-budget=6000", f"--screenshot={png}",
                    "--window-size=1200,800", f"{server.url}/dashboard")
    assert png.exists(), out.stderr[-2000:]
    img = Image.open(png).convert("RGB")
    assert img.size == (1200, 800)
    colors = img.getcolors(maxcolors=1_000_000) or []
    assert len(colors) > 50  # text and tables were drawn, not a blank page
    # the live-data JSON the page polls
    data = httpx.get(f"{server.url}/dashboard/data").json()
    assert {"layers", "tiers", "routing", "top_prefixes", "history"} <= set(data)
