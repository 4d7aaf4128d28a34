"""The one result type of a generation, from the engine thread to the HTTP response.

Every request, whatever serves it (an in-process engine, an upstream, a pipeline, a semantic
hit), is a stream of events: one :class:`Started` (prefill done: how much of the prompt came
from cache), :class:`Delta` pieces of text, then one :class:`Completion`, the final value. The
deltas joined equal the completion's ``text``. A worker that fails a job sends
:class:`Failed` instead of the completion; a backend raises its error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Completion", "Delta", "Event", "Failed", "Started", "StreamItem"]


@dataclass(slots=True)
class Started:
    """Prefill done: how much of the prompt came from cache. Sent before any text."""

    prompt_tokens: int
    hit_tokens: int
    hit_tiers: tuple[str, ...] = ()  # the tier that served each restored chunk
    layers: tuple[str, ...] = ()  # reuse layers other than KV known at the start ("c2c")
    replica: str = ""  # which replica serves the request, when the model has several


@dataclass(slots=True)
class Delta:
    """A piece of the answer's text."""

    text: str


@dataclass(slots=True)
class Completion:
    """The final result of a request, whatever served it."""

    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    hits: list[str] = field(default_factory=list)  # header tokens: "semantic", "kv:512", "c2c"
    hit_tokens: int = 0  # prompt tokens not recomputed (KV prefix or snapshot)
    ttft_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)  # reported as response["semcomm"]


@dataclass(slots=True)
class Failed:
    """A job ended with an error (sent by a worker thread instead of the completion)."""

    error: BaseException


StreamItem = Started | Delta | Completion
"""What a backend yields."""

Event = Started | Delta | Completion | Failed
"""What a worker thread emits for a job."""
