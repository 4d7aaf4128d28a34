"""Request traces: Mooncake JSONL replay and synthetic shared-prefix workloads.

The Mooncake format (kvcache-ai/Mooncake FAST25 traces) is one JSON object per line:
``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``.
``hash_ids`` name the prompt's blocks of ``block_size`` (512) tokens; ids are chained, so a
shared id means the whole prefix up to that block is shared. The simulator uses them directly
as chunk keys. Parsing is strict: a malformed line raises :class:`InvalidInputError` naming the
file and the line number, and nothing is returned.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import InvalidInputError

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "TraceRequest",
    "load_trace",
    "parse_trace_lines",
    "shared_prefix_workload",
    "write_trace",
]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace (immutable)."""

    arrival_s: float  # arrival time in seconds from the trace start
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # chained block ids of the prompt, block_size tokens each


def _field_int(obj: dict[str, object], name: str, where: str, minimum: int) -> int:
    if name not in obj:
        raise InvalidInputError(f"{where}: missing field {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise InvalidInputError(f"{where}: field {name!r} must be an integer, got {v!r}")
    iv = int(v)
    if iv < minimum:
        raise InvalidInputError(f"{where}: field {name!r} must be >= {minimum}, got {iv}")
    return iv


def parse_trace_lines(
    lines: Iterable[str], *, source: str = "<trace>", block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[TraceRequest]:
    """Parse Mooncake JSONL lines (blank lines skipped); returns requests sorted by arrival."""
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise InvalidInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if "timestamp" not in obj:
            raise InvalidInputError(f"{where}: missing field 'timestamp'")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise InvalidInputError(f"{where}: field 'timestamp' must be a non-negative number (ms), got {ts!r}")
        inp = _field_int(obj, "input_length", where, 1)
        outl = _field_int(obj, "output_length", where, 0)
        hids = obj.get("hash_ids")
        if not isinstance(hids, list) or not hids:
            raise InvalidInputError(f"{where}: field 'hash_ids' must be a non-empty list of integers")
        if any(isinstance(h, bool) or not isinstance(h, int) for h in hids):
            raise InvalidInputError(f"{where}: field 'hash_ids' must hold integers only")
        expected = math.ceil(inp / block_size)
        if len(hids) != expected:
            raise InvalidInputError(
                f"{where}: {len(hids)} hash_ids for input_length {inp}; expected {expected} "
                f"blocks of {block_size} tokens"
            )
        out.append(TraceRequest(float(ts) / 1000.0, inp, outl, tuple(hids)))
    if not out:
        raise InvalidInputError(f"{source}: the trace holds no requests")
    out.sort(key=lambda r: r.arrival_s)
    return out


def load_trace(path: str | Path, *, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace file."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"trace file {p} does not exist")
    with p.open("r", encoding="utf-8") as fh:
        return parse_trace_lines(fh, source=str(p), block_size=block_size)


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write requests as Mooncake JSONL (timestamps in integer milliseconds)."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for r in requests:
            fh.write(
                json.dumps(
                    {
                        "timestamp": round(r.arrival_s * 1000),
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )
    tmp.replace(p)


class _BlockIds:
    """Hash-consing of block contents into chained integer ids (Mooncake style)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def ids(self, segments: list[tuple[int, int]], block_size: int) -> tuple[int, ...]:
        """Block ids of a prompt made of ``(segment_id, length)`` pieces, in order."""
        out: list[int] = []
        parent = -1
        pieces: list[tuple[int, int, int]] = []
        filled = 0
        for seg_id, length in segments:
            pos = 0
            while pos < length:
                take = min(length - pos, block_size - filled)
                pieces.append((seg_id, pos, pos + take))
                pos += take
                filled += take
                if filled == block_size:
                    parent = self._intern(parent, pieces)
                    out.append(parent)
                    pieces, filled = [], 0
        if pieces:
            out.append(self._intern(parent, pieces))
        return tuple(out)

    def _intern(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        key = (parent, tuple(pieces))
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def shared_prefix_workload(
    *,
    groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 4096,
    question_len: int = 256,
    output_len: int = 128,
    turns: int = 1,
    zipf_s: float = 0.0,
    rate: float = 8.0,
    num_requests: int | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    seed: int = 0,
) -> list[TraceRequest]:
    """Synthetic shared-prefix workload (SGLang ``generated-shared-prefix`` shape, with skew).

    ``groups`` system prompts of ``system_len`` tokens; ``prompts_per_group`` sets the default
    size (``groups x prompts_per_group`` conversations); each conversation has ``turns`` turns (turn k's prompt = system + earlier
    questions and answers + question k). Conversations are drawn with Zipf(``zipf_s``)
    popularity over groups (0 = uniform; ~1.2 makes a hotspot); arrivals are Poisson at
    ``rate`` requests/s. Turns of one conversation arrive in order. ``num_requests`` defaults
    to every conversation once.
    """
    if groups <= 0 or prompts_per_group <= 0 or turns <= 0:
        raise InvalidInputError("groups, prompts_per_group and turns must be positive")
    if rate <= 0:
        raise InvalidInputError(f"rate must be positive, got {rate}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, groups + 1, dtype=np.float64) ** zipf_s
    weights /= weights.sum()
    total = num_requests if num_requests is not None else groups * prompts_per_group * turns
    convs = max(1, math.ceil(total / turns))
    conv_group = rng.choice(groups, size=convs, p=weights)
    blocks = _BlockIds()
    # segment ids: system prompt g -> g; question/answer segments get fresh ids per conversation
    next_seg = groups
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=total))
    # interleave conversations: turn t of conversation c is request index t*convs + c, so turns
    # of one conversation arrive in order with other traffic in between
    out: list[TraceRequest] = []
    conv_segments: list[list[tuple[int, int]]] = [[] for _ in range(convs)]
    order: list[tuple[int, int]] = [(t, c) for t in range(turns) for c in range(convs)][:total]
    for i, (t, c) in enumerate(order):
        segs = conv_segments[c]
        if t == 0:
            segs.append((int(conv_group[c]), system_len))
        else:
            segs.append((next_seg, output_len))  # the previous turn's answer
            next_seg += 1
        segs.append((next_seg, question_len))
        next_seg += 1
        n_tokens = sum(length for _, length in segs)
        out.append(TraceRequest(float(arrivals[i]), n_tokens, output_len, blocks.ids(segs, block_size)))
    return out
