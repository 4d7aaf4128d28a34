"""A small learned verifier that sees the best and the runner-up candidate.

Choosing among many stored entries is a ranking problem: a candidate that barely beats the
runner-up, or that differs from the query in content words the embedding glossed over, is a
likely false hit. :class:`LexicalVerifier` scores ``P(right | features)`` with a logistic
model over eight cheap features (cosine, margin over the runner-up, content-word overlap in
both directions, character-trigram overlap, length ratio, size of the content-word
difference). Its weights are plain numbers (``_verifier_weights.py``), trained on
``meancache_val.csv`` by ``tools.train.semantic_verifier``; no pickle.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from ._policy import Candidate

__all__ = ["FEATURE_NAMES", "LexicalVerifier", "verifier_features"]

FEATURE_NAMES = ("cos", "margin", "jaccard", "q_missing", "c_missing", "trigram",
                 "len_ratio", "diff_words")

_STOP = frozenset(
    ["a", "an", "the", "is", "are", "was", "were", "be", "been", "being", "am", "do", "does", "did", "doing", "have", "has", "had", "having", "i", "me", "my", "we", "our", "you", "your", "he", "she", "it", "its", "they", "them", "their", "what", "which", "who", "whom", "whose", "when", "where", "why", "how", "this", "that", "these", "those", "to", "of", "in", "on", "at", "by", "for", "with", "about", "as", "into", "from", "up", "down", "out", "over", "under", "again", "then", "once", "here", "there", "all", "any", "both", "each", "few", "more", "most", "other", "some", "such", "only", "own", "same", "so", "than", "too", "very", "can", "will", "just", "should", "would", "could", "may", "might", "must", "shall", "and", "or", "but", "if", "because", "until", "while", "get", "got", "one", "ones", "someone", "something", "thing", "things", "way", "ways", "best", "good", "really", "much", "many", "also", "know", "like", "want", "need", "make", "makes", "using", "use", "used", "s", "t"]
)
_TOK = re.compile(r"[a-z0-9]+")


@lru_cache(maxsize=65536)
def _content(text: str) -> frozenset[str]:
    return frozenset(w[:-1] if len(w) > 4 and w.endswith("s") else w
                     for w in _TOK.findall(text.lower()) if w not in _STOP)


@lru_cache(maxsize=65536)
def _trigrams(text: str) -> frozenset[str]:
    t = " ".join(_TOK.findall(text.lower()))
    return frozenset(t[i : i + 3] for i in range(max(0, len(t) - 2)))


def verifier_features(query: str, cached: str, cos: float, runner_up: float | None) -> np.ndarray:
    """The eight features (see :data:`FEATURE_NAMES`) for one (query, candidate) pair."""
    a, b = _content(query), _content(cached)
    union = len(a | b) or 1
    ta, tb = _trigrams(query), _trigrams(cached)
    la, lb = len(_TOK.findall(query)), len(_TOK.findall(cached))
    margin = 0.3 if runner_up is None else min(0.3, cos - runner_up)
    return np.array([
        cos,
        margin,
        len(a & b) / union,
        len(a - b) / (len(a) or 1),
        len(b - a) / (len(b) or 1),
        len(ta & tb) / (len(ta | tb) or 1),
        min(la, lb) / (max(la, lb) or 1),
        min(len(a ^ b), 6) / 6.0,
    ], dtype=np.float64)


class LexicalVerifier:
    """``score(query, best, runner_up) -> P(right)``; ``None`` weights = the shipped ones."""

    def __init__(self, weights: Sequence[float] | None = None, bias: float | None = None,
                 mean: Sequence[float] | None = None, scale: Sequence[float] | None = None):
        if weights is None:
            from ._verifier_weights import BIAS, MEAN, SCALE, WEIGHTS

            weights, bias, mean, scale = WEIGHTS, BIAS, MEAN, SCALE
        self.w = np.asarray(weights, dtype=np.float64)
        self.b = float(bias or 0.0)
        self.mean = np.zeros(len(self.w)) if mean is None else np.asarray(mean, np.float64)
        self.scale = np.ones(len(self.w)) if scale is None else np.asarray(scale, np.float64)

    def score(self, query: str, best: Candidate, runner_up: Candidate | None) -> float:
        x = verifier_features(query, best.query, best.similarity,
                              None if runner_up is None else runner_up.similarity)
        z = float(((x - self.mean) / self.scale) @ self.w + self.b)
        return 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, z))))

    def __call__(self, query: str, best: Candidate, runner_up: Candidate | None) -> float:
        return self.score(query, best, runner_up)
