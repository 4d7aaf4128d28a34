"""semcomm: let language models share what they already understood.

Public entry points (imported lazily so that ``import semcomm`` stays light):

- :class:`semcomm.HFEngine` - a transformers engine with an exact, persistent KV prefix cache.
- :class:`semcomm.SemanticCache` - a semantic answer cache with a bounded error rate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["HFEngine", "SemanticCache", "__version__"]

_LAZY = {
    "HFEngine": "semcomm.engine",
    "SemanticCache": "semcomm.semantic",
}

if TYPE_CHECKING:  # pragma: no cover
    from .engine import HFEngine
    from .semantic import SemanticCache


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'semcomm' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
