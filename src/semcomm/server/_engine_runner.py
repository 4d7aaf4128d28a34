"""The KV-reusing runner: serves jobs through ``semcomm.engine.HFEngine`` (one engine per tenant).

Filled in when ``semcomm.engine`` provides ``HFEngine``; until then :func:`engine_runner`
returns None and the caller falls back to plain batched decoding.
"""

from __future__ import annotations

from typing import Any

__all__ = ["engine_runner"]


def engine_runner(model: Any, tokenizer: Any, *, model_id: str, store: Any, salter: Any,
                  chunk_size: int | None, codec: str | None) -> tuple[Any, str]:
    """Return ``(runner, note)``; ``runner`` is None when the engine package is not available."""
    try:
        from ..engine import HFEngine  # noqa: F401
    except ImportError as exc:
        return None, f"semcomm.engine.HFEngine unavailable ({exc}); plain batched decoding"
    return None, "HFEngine runner not wired yet; plain batched decoding"
