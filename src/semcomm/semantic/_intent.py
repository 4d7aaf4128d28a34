"""The intent check of answer-cluster hits: a learned metric on the embedder's vectors.

The centroid rule (:class:`~semcomm.semantic.ClusterVotePolicy`) serves a cluster when the
query sits as close to its centroid as the cluster's own phrasings do. Cosine alone does not
tell an action from its topic: "make a vacation request" is as close to a stored cluster of
"is my vacation request approved" phrasings as a real rewording of it is. On CLINC150's
development intents the cosine signals separate right cluster hits from such near-miss twins
at AUC 0.79-0.82 (docs/BENCHMARKS.md, "semantic cache").

:class:`IntentMetric` is a logistic model over the query ``q`` and the cluster's unit centroid
``c``: per dimension ``q_i c_i`` and ``(q_i - c_i)^2`` (a learned diagonal metric: which
directions of the embedding space carry the intent and which only the topic), plus the cosine to
the centroid and to the cluster's most similar phrasing. A centroid hit is served only when
its score reaches ``cut``. It costs one dot product of ``2 * dim + 2`` numbers per candidate
cluster (microseconds; no model call).

The shipped weights (``assets/intent_metric``) belong to the default embedder,
all-MiniLM-L6-v2, and were fitted by ``tools.train.semantic_intent --fit`` on
pairs made from the CLINC150 ``train`` phrasings of the 74 development intents only (a cluster
of 5 phrasings of one intent against another phrasing of it, or against the phrasings of other
intents nearest its centroid). Its cut is the strictest at which no development set loses more
than 4 % of its right centroid hits, scored out of sample (cross-validated by intent): a pooled
2 %, which removed 30 % of the near-miss twins there. Another embedder gets no intent check
unless it brings weights of its own.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, InvalidInputError

__all__ = ["INTENT_METRIC_DIR", "IntentMetric", "default_intent_metric", "intent_features"]

INTENT_METRIC_DIR = Path(__file__).resolve().parent / "assets" / "intent_metric"
FORMAT_VERSION = 1


def intent_features(query: np.ndarray, centroid: np.ndarray, best: float) -> np.ndarray:
    """The model's input for one (query, cluster): ``q * c``, ``(q - c)^2``, ``q . c`` and the
    cosine to the cluster's most similar phrasing (``best``). ``query`` and ``centroid`` are
    unit vectors of one embedder."""
    q = np.asarray(query, dtype=np.float32).reshape(-1)
    c = np.asarray(centroid, dtype=np.float32).reshape(-1)
    if q.shape != c.shape:
        raise InvalidInputError(f"query and centroid differ in dimension: {q.shape[0]} and "
                                f"{c.shape[0]}")
    return np.concatenate([q * c, (q - c) ** 2,
                           np.asarray([float(q @ c), float(best)], np.float32)])


class IntentMetric:
    """A linear score of a query against an answer cluster (see the module docstring); a cluster
    hit needs ``score(...) >= cut``.

    ``weights`` has ``2 * dim + 2`` entries (see :func:`intent_features`); ``embedder`` names
    the embedder whose vectors it was fitted on (the cache uses it only with that embedder).
    """

    def __init__(self, weights: Any, bias: float, cut: float, *, embedder: str,
                 meta: dict[str, Any] | None = None) -> None:
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if w.size < 4 or (w.size - 2) % 2:
            raise ConfigError(f"intent metric weights must have 2 * dim + 2 entries, got {w.size}")
        if not np.isfinite(w).all() or not np.isfinite([bias, cut]).all():
            raise ConfigError("intent metric weights, bias and cut must be finite numbers")
        self.weights = w
        self.dim = (w.size - 2) // 2
        # the same score without building the feature row (the lookup path)
        self._w_prod = w[: self.dim].astype(np.float64)
        self._w_sq = w[self.dim: 2 * self.dim].astype(np.float64)
        self._w_cos, self._w_best = float(w[-2]), float(w[-1])
        self.bias = float(bias)
        self.cut = float(cut)
        self.embedder = str(embedder)
        self.meta = dict(meta or {})

    def score(self, query: np.ndarray, centroid: np.ndarray, best: float) -> float:
        """The score of ``query`` against the cluster with this unit ``centroid`` whose most
        similar phrasing is at cosine ``best``; higher means the same intent."""
        q = np.asarray(query, dtype=np.float64).reshape(-1)
        c = np.asarray(centroid, dtype=np.float64).reshape(-1)
        if q.size != self.dim or c.size != self.dim:
            raise InvalidInputError(f"intent metric is for {self.dim}-dimensional vectors, got "
                                    f"{q.size} and {c.size}")
        d = q - c
        return (float((q * c) @ self._w_prod) + float((d * d) @ self._w_sq)
                + self._w_cos * float(q @ c) + self._w_best * float(best) + self.bias)

    def accepts(self, query: np.ndarray, centroid: np.ndarray, best: float) -> bool:
        return self.score(query, centroid, best) >= self.cut

    def with_cut(self, cut: float) -> IntentMetric:
        """The same weights with another cut: lower serves more cluster hits (and more near-miss
        twins), higher fewer."""
        return IntentMetric(self.weights, self.bias, float(cut), embedder=self.embedder,
                            meta=self.meta)

    def save(self, path: str | Path) -> Path:
        """Write ``weights.npy`` and ``config.json`` into the folder ``path``."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "weights.npy", self.weights)
        cfg = {"format_version": FORMAT_VERSION, "embedder": self.embedder, "dim": self.dim,
               "bias": self.bias, "cut": self.cut, **self.meta}
        (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        return d

    @classmethod
    def load(cls, path: str | Path = INTENT_METRIC_DIR) -> IntentMetric:
        d = Path(path)
        try:
            cfg = json.loads((d / "config.json").read_text())
            w = np.load(d / "weights.npy", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read an intent metric from {d}: {e}") from e
        if cfg.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"intent metric in {d} has format {cfg.get('format_version')!r}, "
                              f"this semcomm reads {FORMAT_VERSION}")
        meta = {k: v for k, v in cfg.items()
                if k not in ("format_version", "embedder", "dim", "bias", "cut")}
        m = cls(w, cfg["bias"], cfg["cut"], embedder=cfg["embedder"], meta=meta)
        if m.dim != cfg.get("dim"):
            raise ConfigError(f"intent metric in {d}: {w.size} weights do not match dim "
                              f"{cfg.get('dim')!r}")
        return m

    def __repr__(self) -> str:
        return f"IntentMetric(embedder={self.embedder!r}, dim={self.dim}, cut={self.cut:.4f})"


@lru_cache(maxsize=1)
def default_intent_metric() -> IntentMetric:
    """The shipped intent check of the default embedder, one per process."""
    return IntentMetric.load(INTENT_METRIC_DIR)
