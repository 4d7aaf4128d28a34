"""Non-streaming upstream calls: one JSON request and reply, no SSE parsing.

Used by :class:`~semcomm.server.UpstreamBackend` when the client did not ask for a stream: the
gateway then adds only what it must (auth, admission, cache lookup, one proxied call).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import UpstreamError

__all__ = ["parse_completion"]


def parse_completion(name: str, data: bytes) -> tuple[str, str, dict[str, Any]]:
    """``(text, finish_reason, usage)`` from an OpenAI chat or text completion body."""
    try:
        body = json.loads(data)
        choice = body["choices"][0]
        if "message" in choice:
            text = choice["message"].get("content") or ""
        else:
            text = choice.get("text") or ""
        finish = choice.get("finish_reason") or "stop"
        usage = body.get("usage") or {}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise UpstreamError(f"upstream model {name!r} sent a malformed reply ({exc})",
                            status=502) from exc
    return str(text), str(finish), usage
