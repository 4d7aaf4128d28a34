"""The one rule that splits a chat into the semantic cache's query and its context.

The gateway (``semcomm.server``) and the three integrations (OpenAI client wrapper, LangChain,
LlamaIndex) key semantic entries with :func:`split_query`, so an entry written through one is
found through the others: the query is the last user message that has text, the context is
every other message, in order (earlier turns, system prompts, and anything after the query,
such as an assistant prefill, all of which change the answer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["message_role", "message_text", "split_query"]

M = TypeVar("M")


def message_role(msg: Any) -> str:
    """A message's role as a plain string (dicts, objects, enum roles)."""
    role = msg.get("role") if isinstance(msg, Mapping) else getattr(msg, "role", None)
    return str(getattr(role, "value", role) or "")


def message_text(msg: Any) -> str:
    """A message's text; OpenAI content parts are joined, a missing content is ''."""
    content = msg.get("content") if isinstance(msg, Mapping) else getattr(msg, "content", None)
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return " ".join(str(p.get("text", "")) if isinstance(p, Mapping) else
                        str(getattr(p, "text", p)) for p in content)
    return str(content)


def split_query(messages: Sequence[M]) -> tuple[str | None, list[M]]:
    """``(query, context)``: the last user message with text, and every other message in order.

    ``query`` is None (nothing to key on: do not cache) when no user message has text.
    """
    msgs = list(messages)
    for i in range(len(msgs) - 1, -1, -1):
        if message_role(msgs[i]) == "user":
            text = message_text(msgs[i])
            if text.strip():
                return text, msgs[:i] + msgs[i + 1:]
    return None, msgs
