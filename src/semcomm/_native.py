"""Small C libraries compiled on the user's machine and cached under ``$SEMCOMM_HOME/kernels``.

The engine's exact CPU kernels and the vLLM connector's key copy are each one C source built
once with the system's compiler; every caller keeps its pure-PyTorch (or numpy) path where
there is no compiler or the build fails, so nothing here is required to run semcomm.
:func:`open_built` opens what a build made and :class:`OncePerProcess` keeps one loaded kernel
per process (the engine's kernels load through both).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

__all__ = ["OncePerProcess", "build_library", "kernels_dir", "open_built"]

T = TypeVar("T")

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


def open_built(open_: Callable[[Path], T], path: Path | None, what: str,
               errors: tuple[type[BaseException], ...] = (OSError,),
               log: logging.Logger = logger) -> T | None:
    """``open_(path)`` for a library :func:`build_library` made; None (logged as "``what``
    off") where it made none or opening it raised one of ``errors``."""
    if path is None:
        return None
    try:
        return open_(path)
    except errors as exc:
        log.info("%s off: %s", what, exc)
        return None


class OncePerProcess(Generic[T]):
    """What ``make`` returns, made on the first :meth:`get` and kept for the process; a
    ``make`` that returned None (the kernel cannot run here) is not tried again."""

    def __init__(self, make: Callable[[], T | None]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._tried = False
        self._value: T | None = None

    def get(self) -> T | None:
        with self._lock:
            if not self._tried:
                self._value = self._make()
                self._tried = True
            return self._value
