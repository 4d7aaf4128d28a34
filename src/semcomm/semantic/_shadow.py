"""Shadow mode: measure what the cache would serve on real traffic before it serves anything.

In ``SemanticCache(mode="shadow")`` every lookup returns None (the model answers every
request), and the cache keeps a :class:`ShadowRecord` of what it would have done: the most
similar admissible stored query, its similarity, whether the policy would have served it and
why. When the model's real answer for that query is stored (``store(query, answer)``, which a
gateway does after every miss), the record learns whether the cached answer agrees with the
real one (:func:`answers_agree`: the same text, or answer embeddings at least ``answer_match``
similar, or a caller's judge). Each finished record goes to a bounded in-memory log and, with
``shadow_log=PATH``, one JSON line per record to a file that ``semcomm cache report`` reads.
:class:`ShadowTracker` is the cache's collaborator that keeps the open records.

:func:`shadow_report` turns records into the deployment checklist's numbers: the would-be hit
rate, the estimated precision of would-be hits overall and by similarity band, and the lowest
cosine threshold whose estimated precision meets a target.

The log holds no answers and, for privacy, stores the query text only when asked
(``log_queries``); similarity, decision and agreement are what the report needs.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, InvalidInputError

if TYPE_CHECKING:
    from ._entry import Entry
    from ._policy import Candidate
    from ._stats import CacheStats

__all__ = [
    "DEFAULT_BANDS",
    "MODES",
    "ShadowBand",
    "ShadowLog",
    "ShadowRecord",
    "ShadowReport",
    "ShadowTracker",
    "answers_agree",
    "plot_shadow_report",
    "read_shadow_log",
    "shadow_report",
]

MODES = frozenset({"serve", "shadow"})

# answers shorter than this (in words) agree only when their texts are the same: embeddings of
# short labels ("A1" / "A2", "17" / "18") are close whatever they mean
MIN_EMBED_WORDS = 4

# similarity bands of the report: [lo, hi)
DEFAULT_BANDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0 + 1e-9)


@dataclass(slots=True)
class ShadowRecord:
    """One shadowed lookup. ``agree`` stays None until the real answer is stored."""

    t: float  # when the lookup happened (the cache's clock)
    scope: str
    similarity: float | None  # of the candidate it would serve, else of the best one; None: none
    would_serve: bool  # the policy would have served a stored answer
    reason: str  # the policy's reason ("centroid", "threshold", "below", ...)
    entry_id: str = ""  # the candidate's entry ("" when there was none)
    cluster: str = ""
    agree: bool | None = None  # the candidate's answer agrees with the real one
    query: str = ""  # only with log_queries
    cached_answer: str = field(default="", repr=False)  # kept in memory until compared, not logged

    def as_json(self) -> str:
        d = asdict(self)
        d.pop("cached_answer")
        return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class ShadowLog:
    """Finished shadow records: the last ``maxlen`` in memory, all of them appended to ``path``
    (JSON lines) when one is given."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, maxlen: int = 100_000,
                 log_queries: bool = False) -> None:
        if maxlen < 1:
            raise ConfigError(f"shadow log maxlen must be >= 1, got {maxlen!r}")
        self.path = None if path is None else Path(path)
        if self.path is not None:  # a server's state dir may not exist yet (memory backend)
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log_queries = log_queries
        self.records: deque[ShadowRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, r: ShadowRecord) -> None:
        if not self.log_queries:
            r.query = ""
        with self._lock:
            self.records.append(r)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write(r.as_json() + "\n")

    def __len__(self) -> int:
        return len(self.records)


class ShadowTracker:
    """Shadow mode inside :class:`~semcomm.semantic.SemanticCache`: the lookups whose real
    answer is not stored yet.

    :meth:`record` keeps what a lookup would have served (counted as a miss: the model
    answers); :meth:`finish`, called when the model's answer for the same query and partition
    is stored, compares the two (``agree``), tells the entry's trust (``feedback``) when it
    would have been served, and logs the record to ``log``. At most ``log.records.maxlen``
    lookups wait; the oldest beyond that is logged uncompared (``agree=None``). Reads the
    would-be answer from the store (``entry``); state and ``stats`` change under ``lock``.
    """

    def __init__(self, log: ShadowLog, lock: threading.RLock, stats: CacheStats, *,
                 entry: Callable[[str], Entry | None], agree: Callable[[str, str], bool],
                 feedback: Callable[[str, bool], float]) -> None:
        self.log = log
        self._lock = lock
        self._stats = stats
        self._entry = entry
        self._agree = agree
        self._feedback = feedback
        self._open: OrderedDict[tuple[str, str], ShadowRecord] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def record(self, query: str, partition: str, scope: str, c: Candidate | None,
               would_serve: bool, reason: str, now: float) -> None:
        """Remember what would have been served (``c``) until the real answer is stored."""
        entry = self._entry(c.entry_id) if c is not None else None
        rec = ShadowRecord(t=now, scope=scope, similarity=None if c is None else c.similarity,
                           would_serve=would_serve and entry is not None,
                           reason=reason if entry is not None or c is None else "gone",
                           entry_id="" if c is None else c.entry_id,
                           cluster="" if c is None else c.cluster_key, query=query,
                           cached_answer="" if entry is None else entry.answer)
        with self._lock:
            self._stats.misses += 1
            self._stats.shadow_lookups += 1
            self._stats.shadow_would_hit += rec.would_serve
            key = (partition, " ".join(query.split()))
            self._open.pop(key, None)
            self._open[key] = rec
            while len(self._open) > self.log.records.maxlen:  # type: ignore[operator]
                _, old = self._open.popitem(last=False)
                self.log.add(old)  # never compared: logged with agree=None

    def finish(self, partition: str, query: str, answer: str) -> None:
        """The model's ``answer`` for ``query`` was stored: compare and log its record."""
        with self._lock:
            rec = self._open.pop((partition, " ".join(query.split())), None)
        if rec is None:
            return
        if rec.entry_id:
            rec.agree = self._agree(answer, rec.cached_answer)
            if rec.would_serve:
                self._feedback(rec.entry_id, rec.agree)
        self.log.add(rec)


def read_shadow_log(path: str | os.PathLike[str]) -> list[ShadowRecord]:
    """Records from a JSON-lines shadow log; a line that does not parse is a clear error."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"no shadow log at {p} (run the cache with mode='shadow' and "
                                "shadow_log=PATH, or [semantic] mode = \"shadow\")")
    out = []
    names = set(ShadowRecord.__slots__)  # type: ignore[attr-defined]
    with open(p, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(ShadowRecord(**{k: v for k, v in d.items() if k in names}))
            except (ValueError, TypeError) as exc:
                raise InvalidInputError(f"{p}:{n}: not a shadow record ({exc})") from None
    return out


def answers_agree(a: str, b: str, match: Any, embed: Callable[[list[str]], np.ndarray]) -> bool:
    """Do two answers mean the same? The same text (case and spacing aside) always does;
    otherwise ``match`` decides: a callable ``f(a, b) -> bool``, a cosine threshold on the two
    answers' embeddings (answers of at least :data:`MIN_EMBED_WORDS` words), or None (text
    only)."""
    if " ".join(a.lower().split()) == " ".join(b.lower().split()):
        return True
    if match is None:
        return False
    if callable(match):
        return bool(match(a, b))
    if min(len(a.split()), len(b.split())) < MIN_EMBED_WORDS:
        return False  # labels, numbers, one-word answers: the same only when the same text
    v = embed([a, b])
    return float(v[0] @ v[1]) >= float(match)


@dataclass(frozen=True, slots=True)
class ShadowBand:
    lo: float
    hi: float
    lookups: int  # records whose similarity is in [lo, hi)
    would_hit: int  # of those, would-be hits
    compared: int  # would-be hits whose real answer is known
    agree: int  # of those, agreeing

    @property
    def precision(self) -> float | None:
        return self.agree / self.compared if self.compared else None


@dataclass(frozen=True, slots=True)
class ShadowReport:
    lookups: int
    would_hit: int
    compared: int  # would-be hits with a known real answer
    agree: int
    bands: list[ShadowBand]
    target_precision: float
    threshold: float | None  # lowest cosine cut whose estimated precision meets the target
    threshold_precision: float | None
    threshold_hit_rate: float | None  # share of lookups at or above that cut
    curve: list[tuple[float, float, float]]  # (cut, estimated precision, hit rate), descending

    @property
    def would_hit_rate(self) -> float:
        return self.would_hit / self.lookups if self.lookups else 0.0

    @property
    def estimated_precision(self) -> float | None:
        return self.agree / self.compared if self.compared else None

    def as_dict(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "would_hit": self.would_hit,
                "would_hit_rate": self.would_hit_rate, "compared": self.compared,
                "estimated_precision": self.estimated_precision,
                "bands": [{"lo": b.lo, "hi": b.hi, "lookups": b.lookups,
                           "would_hit": b.would_hit, "compared": b.compared, "agree": b.agree,
                           "precision": b.precision} for b in self.bands],
                "target_precision": self.target_precision, "threshold": self.threshold,
                "threshold_precision": self.threshold_precision,
                "threshold_hit_rate": self.threshold_hit_rate,
                "curve": [list(c) for c in self.curve]}


def shadow_report(records: Iterable[ShadowRecord], *, target_precision: float = 0.95,
                  bands: Sequence[float] = DEFAULT_BANDS, min_support: int = 20) -> ShadowReport:
    """Summarise shadow records. The threshold search reads every compared record (would-be
    hits and misses alike: a miss's best candidate says what a lower cut would have served)."""
    if not 0.0 < target_precision <= 1.0:
        raise ConfigError(f"target precision must be in (0, 1], got {target_precision!r}")
    if list(bands) != sorted(bands) or len(bands) < 2:
        raise ConfigError("bands must be at least two ascending similarity edges")
    rs = list(records)
    hit = [r for r in rs if r.would_serve]
    cmp_hit = [r for r in hit if r.agree is not None]
    out_bands = []
    top = bands[-1]
    for lo, hi in zip(bands[:-1], bands[1:], strict=True):
        # the last band is closed above: an identical query's float32 cosine can be 1 + 1e-7
        inb = [r for r in rs if r.similarity is not None and lo <= r.similarity
               and (r.similarity < hi or hi == top)]
        hb = [r for r in inb if r.would_serve]
        cb = [r for r in hb if r.agree is not None]
        out_bands.append(ShadowBand(float(lo), float(hi), len(inb), len(hb), len(cb),
                                    sum(bool(r.agree) for r in cb)))
    # the cosine cut: every record with a candidate and a known agreement
    known = sorted((r for r in rs if r.similarity is not None and r.agree is not None),
                   key=lambda r: -float(r.similarity))  # type: ignore[arg-type]
    curve: list[tuple[float, float, float]] = []
    best: tuple[float, float, float] | None = None
    agree = 0
    n_all = max(1, len(rs))
    for i, r in enumerate(known, 1):
        agree += bool(r.agree)
        if i < len(known) and known[i].similarity == r.similarity:
            continue
        prec = agree / i
        cut = float(r.similarity)  # type: ignore[arg-type]
        curve.append((cut, prec, i / n_all))
        if i >= min_support and prec >= target_precision:
            best = (cut, prec, i / n_all)
    return ShadowReport(len(rs), len(hit), len(cmp_hit), sum(bool(r.agree) for r in cmp_hit),
                        out_bands, target_precision, None if best is None else best[0],
                        None if best is None else best[1], None if best is None else best[2],
                        curve)


def plot_shadow_report(rep: ShadowReport, path: str | os.PathLike[str]) -> None:
    """Two panels: estimated precision and would-be hits by band; precision and hit rate
    against the cosine cut, with the target and the suggested threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    try:
        labels = [f"{x.lo:.2f}-{min(x.hi, 1.0):.2f}" for x in rep.bands]
        xs = np.arange(len(labels))
        a.bar(xs, [x.would_hit for x in rep.bands], color="#9ecae1", label="would-be hits")
        a.set_xticks(xs, labels, rotation=45, ha="right")
        a.set_ylabel("would-be hits")
        a.set_xlabel("similarity band")
        a2 = a.twinx()
        a2.plot(xs, [np.nan if x.precision is None else x.precision for x in rep.bands],
                "o-", color="#d62728", label="estimated precision")
        a2.set_ylim(0, 1.05)
        a2.set_ylabel("estimated precision")
        a.set_title(f"{rep.lookups} lookups, would-be hit rate {rep.would_hit_rate:.1%}")
        if rep.curve:
            b.plot([c[0] for c in rep.curve], [c[1] for c in rep.curve], label="precision")
            b.plot([c[0] for c in rep.curve], [c[2] for c in rep.curve], label="hit rate")
        b.axhline(rep.target_precision, color="gray", ls=":", label="target")
        if rep.threshold is not None:
            b.axvline(rep.threshold, color="black", ls="--",
                      label=f"cut {rep.threshold:.3f}")
        b.set_xlabel("cosine cut")
        b.set_ylim(0, 1.05)
        b.invert_xaxis()
        b.legend(loc="lower left")
        b.set_title("if every candidate at or above the cut were served")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
