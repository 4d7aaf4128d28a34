"""Small C libraries compiled on the user's machine and cached under ``$SEMCOMM_HOME/kernels``.

The engine's exact CPU kernels and the vLLM connector's key copy are each one C source built
once with the system's compiler; every caller keeps its pure-PyTorch (or numpy) path where
there is no compiler or the build fails, so nothing here is required to run semcomm.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_library", "kernels_dir"]

logger = logging.getLogger("semcomm")


def kernels_dir() -> Path:
    from .security import semcomm_home

    return semcomm_home() / "kernels"


def build_library(name: str, source: str, flags: Sequence[str], compilers: Sequence[str],
                  suffix: str = ".c", digest_parts: Sequence[str] = (),
                  log: logging.Logger = logger) -> Path | None:
    """``kernels_dir()/{name}-{digest}.so`` built from ``source`` with the first of
    ``compilers`` found (``$CC``, or ``$CXX`` for a ``suffix`` other than ``.c``, first) unless
    already there; None (logged to ``log``) where there is no compiler or it fails. The digest
    covers the source, the flags and ``digest_parts`` (the engine adds torch's version), so a
    changed kernel compiles anew. The finished file is moved into place atomically, so processes
    building the same library at once never load a half-written one."""
    digest = hashlib.sha256("\0".join([source, *flags, *digest_parts]).encode()).hexdigest()
    out = kernels_dir() / f"{name}-{digest[:16]}.so"
    if out.exists():
        return out
    env = "CXX" if suffix != ".c" else "CC"
    cc = os.environ.get(env) or next((c for c in map(shutil.which, compilers) if c), None)
    if not cc:
        log.info("%s off: no compiler (%s) found", name, " or ".join(compilers))
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / f"{name}{suffix}"
        src.write_text(source)
        lib = Path(tmp) / out.name
        try:
            cp = subprocess.run([cc, *flags, "-o", str(lib), str(src)], capture_output=True,
                                text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.info("%s off: %s failed: %s", name, cc, exc)
            return None
        if cp.returncode != 0:
            log.info("%s off: %s failed: %s", name, cc, cp.stderr[-400:])
            return None
        os.replace(lib, out)  # atomic: another process may be compiling the same file
    return out
