"""Package boundaries (docs/architecture.md, "Packages"): another package is imported only
through its ``__init__``.

Walks every module under ``src/semcomm`` with :mod:`ast` and fails on an import of a private
module (``_x``) of a different top-level subpackage: ``from ..kv._format import ...``,
``import semcomm.kv._format``, ``from semcomm.engine import _cache_adapter``. Imports inside one
package (``from ._x import``, ``from ..server._x`` within ``server``) are fine, and so are the
root package's own modules (``semcomm.errors``, ``semcomm._query``), which every package shares.
Also: the engine's cache adapter is the one module that imports the transformers Cache API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str, src: Path) -> bool:
    base = src.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imported_modules(path: Path, src: Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` for every module an import in ``path`` names."""
    name = _module_name(path, src)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            # ``from pkg import _mod`` names a module too
            found += [(node.lineno, f"{mod}.{a.name}") for a in node.names
                      if _is_module(f"{mod}.{a.name}", src)]
    return found


def violations(src: Path = SRC) -> list[str]:
    """Every import under ``src/semcomm`` of another top-level package's private module."""
    bad = []
    for path in sorted((src / "semcomm").rglob("*.py")):
        here = _module_name(path, src).split(".")
        is_pkg = path.name == "__init__.py"
        # the top-level package this file belongs to (None: a root module such as errors.py)
        own = here[1] if len(here) > 2 or (is_pkg and len(here) > 1) else None
        for line, mod in _imported_modules(path, src):
            parts = mod.split(".")
            if len(parts) < 3 or parts[0] != "semcomm":
                continue  # another library, the root package or one of its own modules
            if parts[1] == own:
                continue  # inside one package
            if any(p.startswith("_") for p in parts[2:]):
                bad.append(f"{path.relative_to(src)}:{line}: {mod}")
    return bad


CACHE_ADAPTER = "semcomm/engine/_cache_adapter.py"


def cache_api_imports(src: Path = SRC) -> list[str]:
    """Imports of the transformers Cache API (``transformers.cache_utils``, any ``*Cache`` /
    ``*Layer`` name from transformers) outside the engine's cache adapter."""
    bad = []
    for path in sorted((src / "semcomm").rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel == CACHE_ADAPTER:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.split(".")[0] != "transformers":
                continue
            names = [a.name for a in node.names
                     if a.name.endswith(("Cache", "Layer")) or "cache_utils" in node.module]
            if names:
                bad.append(f"{rel}:{node.lineno}: {node.module} {names}")
    return bad


def test_only_the_engine_cache_adapter_imports_the_transformers_cache_api(tmp_path: Path) -> None:
    bad = cache_api_imports()
    assert not bad, "go through semcomm.engine instead:\n" + "\n".join(bad)
    probe = tmp_path / "semcomm" / "server" / "_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from transformers import DynamicCache\n")
    assert cache_api_imports(tmp_path) == ["semcomm/server/_probe.py:1: transformers ['DynamicCache']"]


def test_no_package_imports_another_packages_private_module() -> None:
    bad = violations()
    assert not bad, "import these through the package's __init__:\n" + "\n".join(bad)


@pytest.mark.parametrize(("source", "caught"), [
    ("from ..kv._format import read_header\n", True),
    ("from ..engine import _cache_adapter as ca\n", True),
    ("import semcomm.kv._keys\n", True),
    ("from semcomm.fusion._reference import x\n", True),
    ("from ._x import y\nfrom ..server._app import z\n", False),
    ("from ..kv import ChunkKey\nfrom .._query import split_query\n", False),
])
def test_the_check_sees_each_kind_of_import(tmp_path: Path, source: str, caught: bool) -> None:
    """The walker on a fake tree, the import in ``semcomm/server/_probe.py`` (a check that
    sees nothing cannot pass)."""
    for pkg in ("server", "kv", "engine", "fusion"):
        (tmp_path / "semcomm" / pkg).mkdir(parents=True)
        (tmp_path / "semcomm" / pkg / "__init__.py").write_text("")
    (tmp_path / "semcomm" / "__init__.py").write_text("")
    (tmp_path / "semcomm" / "engine" / "_cache_adapter.py").write_text("")
    (tmp_path / "semcomm" / "server" / "_probe.py").write_text(source)
    assert bool(violations(tmp_path)) is caught


# -------------------------------------------- no other library's private names (portability)

_LIBRARIES = ("torch", "transformers", "numpy", "safetensors", "tokenizers")


def private_library_names(src: Path = SRC) -> list[str]:
    """``path:line: name`` for every private name of a library in ``_LIBRARIES`` that code
    under ``src`` imports or reads (``torch._foo``, ``from torch._x import``, ``from torch
    import _y``): such names change without notice between releases and CPUs."""
    bad: list[str] = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        aliases = {lib: lib for lib in _LIBRARIES}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in _LIBRARIES:
                        aliases[a.asname or a.name.split(".")[0]] = a.name.split(".")[0]
        rel = path.relative_to(src)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                parts = [node.attr]
                base: ast.expr = node.value
                while isinstance(base, ast.Attribute):
                    parts.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in aliases:
                    names = [".".join([aliases[base.id], *reversed(parts)])]
            for name in names:
                segs = name.split(".")
                if segs[0] in _LIBRARIES and any(
                        s.startswith("_") and not s.startswith("__") for s in segs[1:]):
                    bad.append(f"{rel}:{node.lineno}: {name}")
    return sorted(set(bad))


def test_no_private_name_of_torch_or_another_library_is_used(tmp_path: Path) -> None:
    bad = private_library_names()
    assert not bad, "use the library's public API instead:\n" + "\n".join(bad)
    probe = tmp_path / "semcomm" / "_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("import torch as T\nfrom transformers import _x\n"
                     "y = T._weight_int8pack_mm\nz = T.nn.functional.linear\n")
    assert private_library_names(tmp_path) == [
        "semcomm/_probe.py:2: transformers._x", "semcomm/_probe.py:3: torch._weight_int8pack_mm"]
