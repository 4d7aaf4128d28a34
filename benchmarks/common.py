"""What the benchmarks share: where results and data live, the JSON results file, saved charts."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["DATA", "RESULTS", "ROOT", "agg_figure", "write_json"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (benchmarks run from here: ``python -m benchmarks.<area>.<name>``)."""
RESULTS = ROOT / "benchmarks" / "results"
"""One JSON and one PNG per benchmark, overwritten by its next run."""
DATA = ROOT.parent / "shared" / "data"
"""The shared data sets (CLINC150, Quora, MCQA, traces) beside the checkout."""


def write_json(path: Path, results: Any, console: Console) -> None:
    """Write ``results`` to ``path`` as indented JSON and say so."""
    path.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {path}")


@contextmanager
def agg_figure(path: Path, figsize: tuple[float, float]) -> Iterator[Any]:
    """The axes of one matplotlib figure (Agg backend), saved to ``path`` at 110 dpi.

    The caller draws inside the ``with`` block; the layout is tightened and the PNG written when
    the block ends, and the figure is closed either way.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


# --- a real redis-server on a free loopback port (benchmarks and tests) -------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Owns one redis-server process on a free loopback port; ``stop()``/``start()`` simulate an
    outage on the same port."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: install Debian's redis-server (make test does)")
        self.exe = exe
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="semcomm-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
            s.sendall(b"FLUSHALL\r\n")
            s.recv(16)
