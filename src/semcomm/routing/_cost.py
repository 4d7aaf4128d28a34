"""Prefill and decode cost model shared by the router (TTFT prediction) and the simulator.

Default constants describe one 8B-parameter decoder on one H100-class GPU, sized from public
arithmetic rather than measured here:

* prefill is compute bound: ~2 x 8e9 FLOP per token at ~40% of 989 TFLOP/s (bf16 dense) gives
  ~25k tokens/s, i.e. ``prefill_s_per_token = 4e-5``; attention adds ~4 x layers x d_model =
  4 x 32 x 4096 FLOP-pairs per (query, key) token pair, ~2.6e-12 s each at that rate
  (``prefill_s_per_token_pair``); ``prefill_overhead_s`` = 15 ms scheduling and launch cost.
* decode is memory bound: a step reads the 16 GB of weights at ~3 TB/s (~6 ms) plus a small
  per-sequence cost (``decode_step_s`` = 8 ms, ``decode_s_per_seq`` = 0.1 ms).
* chunked prefill shares the GPU with running decodes: each running sequence slows a prefill by
  ``prefill_slowdown_per_decode`` (1%).

Engine benchmarks can write a calibration JSON with any subset of these fields
(:meth:`CostModel.from_json`), e.g. measured on the reference tiny models.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..errors import ConfigError

__all__ = ["CostModel"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per unit of work on one replica (see the module docstring for the defaults)."""

    prefill_overhead_s: float = 0.015  # fixed cost of one prefill
    prefill_s_per_token: float = 4e-5  # linear (MLP + projections) cost per new token
    prefill_s_per_token_pair: float = 2.6e-12  # attention cost per (new token, context token)
    decode_step_s: float = 0.008  # one decode step with a batch of one
    decode_s_per_seq: float = 1e-4  # extra step time per running sequence
    prefill_slowdown_per_decode: float = 0.01  # prefill stretch per running decode

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill ``new_tokens`` after ``cached_tokens`` restored from cache."""
        # attention: each new token attends to the cache and to half the new tokens on average
        pairs = new_tokens * (cached_tokens + new_tokens * 0.5)
        return (
            self.prefill_overhead_s
            + new_tokens * self.prefill_s_per_token
            + pairs * self.prefill_s_per_token_pair
        )

    def decode_step(self, batch: int) -> float:
        """Time of one decode step with ``batch`` running sequences."""
        return self.decode_step_s + self.decode_s_per_seq * max(batch, 1)

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        """Load a calibration file: a JSON object with any subset of the fields."""
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"calibration file {p} does not exist") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"calibration file {p} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"calibration file {p} must hold a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"source", "notes"})
        if unknown:
            raise ConfigError(f"calibration file {p}: unknown field(s) {unknown}; known: {sorted(known)}")
        kwargs: dict[str, float] = {}
        for name in known & set(data):
            v = data[name]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"calibration file {p}: {name} must be a non-negative number, got {v!r}")
            kwargs[name] = float(v)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
