"""What a cache key means: scope (with the tenant's salt digest), model and context window.

The query is matched semantically; everything else is matched exactly through the
*partition*: ``sha256(canonical JSON of [scope name, tenant salt digest, model, window])``,
where the window is every system message plus the last ``turns`` other messages before the
query (whitespace-normalised). Entries from another model, tenant, scope or conversation
context live in another partition and are never candidates.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError

__all__ = ["ContextLike", "Scope", "context_window", "entry_id", "partition_key"]

ContextLike = str | Sequence[Mapping[str, Any]] | Sequence[str] | None
"""A system prompt (str), a list of chat messages ({"role", "content"}), or a list of turns."""


@dataclass(frozen=True, slots=True)
class Scope:
    """Where an entry is visible. ``tenant`` is the tenant id; only its salt digest is stored."""

    name: str = "default"
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidInputError(f"scope name must be a non-empty string, got {self.name!r}")


_WS = re.compile(r"\s+")


def _norm(text: str) -> str:
    return _WS.sub(" ", text).strip()


def _content(msg: Any) -> str:
    if isinstance(msg, str):
        return msg
    if isinstance(msg, Mapping):
        c = msg.get("content", "")
    else:
        c = getattr(msg, "content", "")
    if isinstance(c, list):  # OpenAI content parts
        c = " ".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in c)
    return str(c)


def _role(msg: Any) -> str:
    if isinstance(msg, str):
        return "user"
    if isinstance(msg, Mapping):
        return str(msg.get("role", "user"))
    return str(getattr(msg, "role", getattr(msg, "type", "user")))


def context_window(context: ContextLike, turns: int) -> list[tuple[str, str]]:
    """The (role, text) pairs of ``context`` that are part of the key."""
    if context is None:
        return []
    if isinstance(context, str):
        return [("system", _norm(context))] if context.strip() else []
    if not isinstance(context, Sequence):
        raise InvalidInputError(f"context must be a string or a list of messages, got "
                                f"{type(context).__name__}")
    system = [("system", _norm(_content(m))) for m in context if _role(m) == "system"]
    others = [(_role(m), _norm(_content(m))) for m in context if _role(m) != "system"]
    return system + (others[-turns:] if turns > 0 else [])


def partition_key(scope: str, tenant_digest: str, model: str,
                  window: Sequence[tuple[str, str]]) -> str:
    payload = json.dumps([scope, tenant_digest, model, [list(w) for w in window]],
                         separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(b"semcomm/semantic/partition/v1\x00" + payload.encode()).hexdigest()


def entry_id(partition: str, query: str) -> str:
    h = hashlib.sha256(b"semcomm/semantic/entry/v1\x00" + partition.encode() + b"\x00"
                       + _norm(query).encode())
    return h.hexdigest()[:32]
