"""The model router: which of N models should answer, by predicted quality against cost.

Features come from the local embedder (all-MiniLM-L6-v2 by default, offline; any
``semcomm.semantic`` embedder or callable). For a conversation the features are the embedding of
the last user message next to the embedding of the whole rendered conversation, so earlier turns
count (RouteLLM looks at the last message only). A :class:`QualityPredictor` (one logistic
regression per model, trained jointly in numpy) predicts ``P(model m answers well | prompt)``.

Decision rule (N-way; RouteLLM's strong/weak threshold for N = 2)::

    choose argmax_m  p_m(x) - lambda * c_m        c_m = (cost_m - min cost) / (max cost - min cost)

``lambda`` is calibrated on a sample so that the mean ``c_m`` of the chosen models (the *cost
share*: for two models, the share of requests sent to the strong one) meets a budget. Evaluation
sweeps the budget and reports quality against cost share, PGR per point and APGR (the area under
the PGR curve), as in RouteLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, InvalidInputError

__all__ = [
    "SHIPPED_ROUTERS",
    "ModelChoice",
    "ModelRouter",
    "ModelSpec",
    "QualityPredictor",
    "RouterEval",
    "render_conversation",
    "shipped_router_path",
]

logger = logging.getLogger(__name__)

_FORMAT = "semcomm.model-router/1"

_ASSETS = Path(__file__).resolve().parent / "assets"

#: Routers shipped with semcomm, by name: ``[routing] model_router = NAME`` or
#: ``ModelRouter.load(NAME)``. ``smollm2-qwen2.5-coder`` routes between the embedded default's
#: two real models (SmolLM2-135M-Instruct, cost 1; Qwen2.5-Coder-0.5B-Instruct, cost 4), trained
#: on their own multiple-choice answers (tools.train.router_real; docs/BENCHMARKS.md).
SHIPPED_ROUTERS: dict[str, str] = {"smollm2-qwen2.5-coder": "smollm2-qwen2.5-coder.json"}


def shipped_router_path(name: str) -> Path:
    """The file of a shipped router (``ConfigError`` naming the known ones otherwise)."""
    if name not in SHIPPED_ROUTERS:
        raise ConfigError(f"no shipped model router named {name!r}; shipped: {sorted(SHIPPED_ROUTERS)}")
    return _ASSETS / SHIPPED_ROUTERS[name]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A candidate model: its name and its relative cost per request."""

    name: str
    cost: float


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """The model router's answer for one prompt."""

    model: str  # chosen model's name
    index: int  # its position in ``ModelRouter.models``
    quality: dict[str, float]  # predicted P(answers well) per model
    cost_weight: float  # the lambda in use


def render_conversation(prompt: str | Sequence[Any]) -> tuple[str, str]:
    """``(last user message, whole conversation)`` from a string or OpenAI-style messages.

    Messages are dicts or objects with ``role`` and ``content`` (a string or text parts).
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidInputError("cannot route an empty prompt")
        return prompt, prompt
    msgs = list(prompt)
    if not msgs:
        raise InvalidInputError("cannot route an empty conversation")
    parts: list[str] = []
    last_user = ""
    for m in msgs:
        if isinstance(m, Mapping):
            role, content = str(m.get("role", "user")), m.get("content", "")
        else:  # message objects (e.g. pydantic models) with role/content attributes
            role, content = str(getattr(m, "role", "user")), getattr(m, "content", "")
        if content is None:
            content = ""
        if isinstance(content, list):  # content parts
            content = " ".join(
                str(p.get("text", "") if isinstance(p, Mapping) else getattr(p, "text", "")) for p in content
            )
        text = str(content)
        parts.append(f"{role}: {text}")
        if role == "user":
            last_user = text
    whole = "\n".join(parts)
    return (last_user or parts[-1]), whole


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[None]:
    """Run small dense algebra on one BLAS thread when ``threadpoolctl`` is available.

    The matrices here are a few hundred rows; multi-threaded BLAS only adds spin-waiting, which
    on a loaded host made a fit ~10x slower.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


class QualityPredictor:
    """Per-model logistic regressions on a shared feature vector (numpy, L2-regularised).

    Features are centred on the training mean, optionally projected on their top ``rank``
    principal directions (``proj``, (D, k)), and divided by one global scale (the RMS distance to
    the mean), then fitted by full-batch Adam on the mean binary cross-entropy plus ``l2``.
    ``rank="auto"`` picks the rank among ``ranks`` (None = no projection) by ``folds``-fold
    cross-validated log-loss on the training data: with a few hundred labelled prompts and 768
    embedding dimensions, a low rank keeps what the prompts share (task, template) and drops what
    identifies single prompts.
    """

    def __init__(
        self,
        l2: float = 1e-3,
        steps: int = 400,
        lr: float = 0.05,
        seed: int = 0,
        rank: int | str | None = "auto",
        ranks: Sequence[int | None] = (8, 16, 32, 64, None),
        folds: int = 4,
    ) -> None:
        if isinstance(rank, str) and rank != "auto":
            raise ConfigError(f"rank must be an int, None or 'auto', got {rank!r}")
        self.l2 = l2
        self.steps = steps
        self.lr = lr
        self.seed = seed
        self.rank = rank
        self.ranks = tuple(ranks)
        self.folds = folds
        self.rank_: int | None = None  # the rank in use after fit (None: no projection)
        self.cv_logloss: dict[str, float] = {}  # rank -> mean validation log-loss (rank="auto")
        self.weights: np.ndarray | None = None  # (k, M)
        self.bias: np.ndarray | None = None  # (M,)
        self.mean: np.ndarray | None = None  # (D,)
        self.proj: np.ndarray | None = None  # (D, k) or None
        self.scale: float = 1.0

    def fit(self, x: np.ndarray, y: np.ndarray) -> QualityPredictor:
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if x.ndim != 2 or y.ndim != 2 or len(x) != len(y):
            raise InvalidInputError(f"features (N, D) and labels (N, M) must align, got {x.shape} and {y.shape}")
        if len(x) < 2:
            raise InvalidInputError("need at least two labelled prompts to train a model router")
        with _one_blas_thread():
            rank = self.rank
            if rank == "auto":
                rank = self._select_rank(x, y)
            self._fit_fixed(x, y, rank if isinstance(rank, int) else None)
        return self

    def _select_rank(self, x: np.ndarray, y: np.ndarray) -> int | None:
        n = len(x)
        candidates = [r for r in self.ranks if r is None or r < min(n, x.shape[1])]
        if n < 8 * self.folds or len(candidates) <= 1:
            return None
        fold = np.arange(n) % self.folds
        best: tuple[float, int | None] | None = None
        for r in candidates:
            losses = []
            for k in range(self.folds):
                # fewer steps in the search: it ranks candidates, the final fit converges
                part = QualityPredictor(self.l2, min(self.steps, 150), self.lr, self.seed, rank=r)
                part._fit_fixed(x[fold != k], y[fold != k], r)
                q = np.clip(part.predict(x[fold == k]), 1e-6, 1 - 1e-6)
                yy = y[fold == k]
                losses.append(float(-np.mean(yy * np.log(q) + (1 - yy) * np.log(1 - q))))
            loss = float(np.mean(losses))
            self.cv_logloss[str(r)] = loss
            if best is None or loss < best[0] - 1e-9:
                best = (loss, r)
        assert best is not None
        return best[1]

    def _fit_fixed(self, x: np.ndarray, y: np.ndarray, rank: int | None) -> None:
        self.mean = x.mean(axis=0)
        c = x - self.mean
        if rank is not None:
            _, _, vt = np.linalg.svd(c, full_matrices=False)
            self.proj = vt[:rank].T.copy()  # (D, k)
            c = c @ self.proj
        else:
            self.proj = None
        self.rank_ = rank
        # one global scale, not per feature: a feature constant in training (std 0) must not
        # blow up when it moves at prediction time
        self.scale = float(np.sqrt((c**2).sum(axis=1).mean())) + 1e-9
        z = c / self.scale
        n, d = z.shape
        m = y.shape[1]
        rng = np.random.default_rng(self.seed)
        w = rng.normal(0.0, 0.01, size=(d, m))
        p0 = np.clip(y.mean(axis=0), 1e-3, 1 - 1e-3)
        b = np.log(p0 / (1 - p0))
        mw, vw = np.zeros_like(w), np.zeros_like(w)
        mb, vb = np.zeros_like(b), np.zeros_like(b)
        b1, b2, eps = 0.9, 0.999, 1e-8
        for t in range(1, self.steps + 1):
            logits = z @ w + b  # (N, M)
            p = 1.0 / (1.0 + np.exp(-logits))
            g = (p - y) / n  # dBCE/dlogits, (N, M)
            gw = z.T @ g + self.l2 * w
            gb = g.sum(axis=0)
            mw = b1 * mw + (1 - b1) * gw
            vw = b2 * vw + (1 - b2) * gw * gw
            mb = b1 * mb + (1 - b1) * gb
            vb = b2 * vb + (1 - b2) * gb * gb
            c1, c2 = 1 - b1**t, 1 - b2**t
            w -= self.lr * (mw / c1) / (np.sqrt(vw / c2) + eps)
            b -= self.lr * (mb / c1) / (np.sqrt(vb / c2) + eps)
        self.weights, self.bias = w, b

    def predict(self, x: np.ndarray) -> np.ndarray:
        """(N, M) probabilities."""
        if self.weights is None or self.bias is None or self.mean is None:
            raise RuntimeError("QualityPredictor used before fit()")
        c = np.asarray(x, dtype=np.float64) - self.mean
        if self.proj is not None:
            c = c @ self.proj
        return np.asarray(1.0 / (1.0 + np.exp(-((c / self.scale) @ self.weights + self.bias))))

    def to_dict(self) -> dict[str, Any]:
        if self.weights is None or self.bias is None or self.mean is None:
            raise RuntimeError("cannot save an untrained predictor")
        return {"l2": self.l2, "steps": self.steps, "lr": self.lr, "seed": self.seed,
                "rank": self.rank_, "weights": self.weights.tolist(), "bias": self.bias.tolist(),
                "mean": self.mean.tolist(), "scale": self.scale,
                "proj": None if self.proj is None else self.proj.tolist(),
                "cv_logloss": self.cv_logloss}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QualityPredictor:
        p = cls(l2=float(d["l2"]), steps=int(d["steps"]), lr=float(d["lr"]), seed=int(d["seed"]),
                rank=d.get("rank"))
        p.rank_ = d.get("rank")
        p.weights = np.asarray(d["weights"], dtype=np.float64)
        p.bias = np.asarray(d["bias"], dtype=np.float64)
        p.mean = np.asarray(d["mean"], dtype=np.float64)
        p.scale = float(d["scale"])
        p.proj = None if d.get("proj") is None else np.asarray(d["proj"], dtype=np.float64)
        p.cv_logloss = dict(d.get("cv_logloss", {}))
        return p


@dataclass(slots=True)
class RouterEval:
    """Quality against cost share over a budget sweep (RouteLLM's evaluation, N-way)."""

    models: list[str]
    budgets: list[float]  # requested cost shares
    cost_share: list[float]  # achieved mean normalised cost per point
    quality: list[float]  # mean correctness of the chosen models per point
    pgr: list[float]  # (quality - q_cheapest) / (q_strongest - q_cheapest) per point
    apgr: float  # area under PGR over cost share in [0, 1]
    random_apgr: float  # the same for a random router (the diagonal, by construction ~0.5)
    model_quality: dict[str, float]  # each model alone
    oracle_quality: float  # best achievable (any model correct)
    cpt: dict[str, float]  # cost share needed for 50% / 80% PGR ("cpt50", "cpt80")
    n: int  # prompts evaluated
    cheapest: str = ""  # the PGR anchors: the cheapest and the costliest model
    costliest: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _norm_costs(models: Sequence[ModelSpec]) -> np.ndarray:
    c = np.asarray([m.cost for m in models], dtype=np.float64)
    span = float(c.max() - c.min())
    return (c - c.min()) / span if span > 0 else np.zeros_like(c)


class ModelRouter:
    """Route prompts among ``models`` by predicted quality against cost.

    Args:
        models: candidate models with relative costs (at least two).
        embedder: a ``semcomm.semantic`` embedder, a model path, a callable or None (MiniLM).
        predictor: the quality predictor (default :class:`QualityPredictor`).
    """

    def __init__(self, models: Sequence[ModelSpec], *, embedder: Any = None,
                 predictor: QualityPredictor | None = None) -> None:
        if len(models) < 2:
            raise ConfigError("a model router needs at least two models")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ConfigError(f"model names must be unique, got {names}")
        if any(m.cost < 0 for m in models):
            raise ConfigError("model costs must be non-negative")
        self.models = list(models)
        self._embedder_arg = embedder
        self._embedder: Any = None
        self.predictor = predictor or QualityPredictor()
        self.cost_weight = 0.0  # lambda; set by calibrate()
        self.trained = False

    # -- features ---------------------------------------------------------------------------
    @property
    def embedder(self) -> Any:
        if self._embedder is None:
            from ..semantic import as_embedder

            self._embedder = as_embedder(self._embedder_arg)
        return self._embedder

    def features(self, prompts: Sequence[str | Sequence[Mapping[str, Any]]]) -> np.ndarray:
        """(N, 2 x dim): [embed(last user message), embed(whole conversation)]."""
        if not prompts:
            return np.zeros((0, 0))
        pairs = [render_conversation(p) for p in prompts]
        last = self.embedder.embed([a for a, _ in pairs])
        whole = self.embedder.embed([b for _, b in pairs])
        return np.concatenate([np.asarray(last), np.asarray(whole)], axis=1)

    # -- training and decisions ---------------------------------------------------------------
    def fit(self, prompts: Sequence[str | Sequence[Mapping[str, Any]]], correct: np.ndarray,
            *, budget: float | None = 0.5) -> ModelRouter:
        """Train on labelled prompts: ``correct[i, m]`` = model m answered prompt i well."""
        y = np.asarray(correct, dtype=np.float64)
        if y.ndim != 2 or y.shape != (len(prompts), len(self.models)):
            raise InvalidInputError(
                f"labels must be (prompts, models) = ({len(prompts)}, {len(self.models)}), got {y.shape}"
            )
        if budget is not None and not 0.0 <= budget <= 1.0:
            raise ConfigError(f"budget (cost share) must be within 0..1, got {budget}")
        x = self.features(prompts)
        self.predictor.fit(x, y)
        self.trained = True
        if budget is not None:
            self.calibrate_features(x, budget)
        return self

    def quality(self, prompts: Sequence[str | Sequence[Mapping[str, Any]]]) -> np.ndarray:
        """(N, M) predicted probability that each model answers well."""
        self._check_trained()
        return self.predictor.predict(self.features(prompts))

    def _choose(self, q: np.ndarray, lam: float) -> np.ndarray:
        util = q - lam * _norm_costs(self.models)[None, :]
        return np.asarray(np.argmax(util, axis=1))

    def calibrate(self, prompts: Sequence[str | Sequence[Mapping[str, Any]]], budget: float) -> float:
        """Set lambda so the mean cost share on ``prompts`` is at most ``budget`` (0..1)."""
        self._check_trained()
        return self.calibrate_features(self.features(prompts), budget)

    def calibrate_features(self, x: np.ndarray, budget: float) -> float:
        if not 0.0 <= budget <= 1.0:
            raise ConfigError(f"budget (cost share) must be within 0..1, got {budget}")
        self.cost_weight = self._lambda_for(self.predictor.predict(x), budget)
        return self.cost_weight

    def _lambda_for(self, q: np.ndarray, budget: float) -> float:
        c = _norm_costs(self.models)

        def share(lam: float) -> float:
            return float(c[self._choose(q, lam)].mean())

        if share(0.0) <= budget:
            return 0.0
        lo, hi = 0.0, 1.0
        while share(hi) > budget and hi < 1e6:
            hi *= 2
        for _ in range(60):  # bisection: the share is non-increasing in lambda
            mid = (lo + hi) / 2
            if share(mid) > budget:
                lo = mid
            else:
                hi = mid
        return hi

    def route(self, prompt: str | Sequence[Mapping[str, Any]]) -> ModelChoice:
        """Choose a model for one prompt or conversation."""
        self._check_trained()
        q = self.predictor.predict(self.features([prompt]))
        i = int(self._choose(q, self.cost_weight)[0])
        return ModelChoice(self.models[i].name, i, dict(zip([m.name for m in self.models], q[0].tolist(),
                                                             strict=True)), self.cost_weight)

    def _check_trained(self) -> None:
        if not self.trained:
            raise RuntimeError("ModelRouter used before fit() or load()")

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, prompts: Sequence[str | Sequence[Mapping[str, Any]]], correct: np.ndarray,
                 *, points: int = 21) -> RouterEval:
        """Sweep the budget from 0 to 1 and measure quality, PGR and APGR on labelled prompts."""
        self._check_trained()
        y = np.asarray(correct, dtype=np.float64)
        if y.shape != (len(prompts), len(self.models)):
            raise InvalidInputError(f"labels must be (prompts, models), got {y.shape}")
        q = self.predictor.predict(self.features(prompts))
        return evaluate_choices(self.models, q, y, points=points, lambda_for=self._lambda_for,
                                choose=self._choose)

    # -- persistence (JSON, no pickle) --------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        self._check_trained()
        emb = self.embedder
        doc = {
            "format": _FORMAT,
            "models": [asdict(m) for m in self.models],
            "embedder": {"name": emb.name, "dim": emb.dim},
            "cost_weight": self.cost_weight,
            "predictor": self.predictor.to_dict(),
        }
        p = Path(path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        tmp.replace(p)
        return p

    @classmethod
    def load(cls, path: str | Path, *, embedder: Any = None) -> ModelRouter:
        """Load a router saved by :meth:`save`, or a shipped one by name (:data:`SHIPPED_ROUTERS`)."""
        p = shipped_router_path(str(path)) if str(path) in SHIPPED_ROUTERS else Path(path)
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"model router file {p} does not exist") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model router file {p} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ConfigError(f"{p} is not a semcomm model router file (format {_FORMAT})")
        r = cls([ModelSpec(**m) for m in doc["models"]], embedder=embedder,
                predictor=QualityPredictor.from_dict(doc["predictor"]))
        r.cost_weight = float(doc["cost_weight"])
        r.trained = True
        want = doc["embedder"]
        if r.embedder.dim * 2 != np.asarray(doc["predictor"]["mean"]).shape[0]:
            raise ConfigError(
                f"{p} was trained with embedder {want['name']} (dim {want['dim']}); "
                f"this one has dim {r.embedder.dim}"
            )
        if r.embedder.name != want["name"]:
            logger.warning("model router %s trained with embedder %s, used with %s", p, want["name"],
                           r.embedder.name)
        return r


def evaluate_choices(models: Sequence[ModelSpec], q: np.ndarray, y: np.ndarray, *, points: int,
                     lambda_for: Any, choose: Any) -> RouterEval:
    """Budget sweep given predicted qualities ``q`` and true correctness ``y`` (both (N, M))."""
    c = _norm_costs(models)
    cheap, strong = int(np.argmin(c)), int(np.argmax(c))
    model_q = y.mean(axis=0)
    q_lo, q_hi = float(model_q[cheap]), float(model_q[strong])
    gap = q_hi - q_lo
    budgets = np.linspace(0.0, 1.0, points)
    shares, quals = [], []
    rows = np.arange(len(y))
    for b in budgets:
        pick = choose(q, lambda_for(q, float(b)))
        shares.append(float(c[pick].mean()))
        quals.append(float(y[rows, pick].mean()))
    pgr = [(qq - q_lo) / gap if abs(gap) > 1e-12 else 0.0 for qq in quals]
    # area under PGR over achieved cost share, with the curve anchored at (0, 0) and (1, 1)
    xs = np.concatenate([[0.0], np.asarray(shares), [1.0]])
    ys = np.concatenate([[0.0], np.asarray(pgr), [1.0]])
    order = np.argsort(xs, kind="stable")
    xs, ys = xs[order], ys[order]
    apgr = float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2))
    cpt: dict[str, float] = {}
    for target in (0.5, 0.8):
        ok = [s for s, g in zip(shares, pgr, strict=True) if g >= target]
        cpt[f"cpt{int(target * 100)}"] = float(min(ok)) if ok else float("nan")
    return RouterEval(
        models=[m.name for m in models], budgets=budgets.tolist(), cost_share=shares, quality=quals,
        pgr=pgr, apgr=apgr, random_apgr=0.5, model_quality={m.name: float(v) for m, v in zip(models, model_q, strict=True)},
        oracle_quality=float(y.max(axis=1).mean()), cpt=cpt, n=len(y),
        cheapest=models[cheap].name, costliest=models[strong].name,
    )


def split_of(text: str, test_fraction: float = 0.25) -> str:
    """Deterministic train/test assignment of a prompt (BLAKE2b of its text)."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return "test" if (h % 10_000) < test_fraction * 10_000 else "train"


@dataclass(slots=True)
class LabelledSet:
    """Prompts with per-model correctness labels (for training and evaluation)."""

    prompts: list[str]
    correct: np.ndarray  # (N, M) 0/1
    models: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


def load_labelled(path: str | Path | None, models: Sequence[str] | None = None, *,
                  text_field: str = "question", part: str = "all",
                  test_fraction: float = 0.25) -> LabelledSet:
    """Read JSONL rows ``{text_field: ..., "<model>_correct": bool, ...}``.

    ``path=None`` uses the reference world's labels (``semcomm.reference.router_labels()``).
    Models default to every ``*_correct`` field of the first row. ``part`` picks the
    deterministic ``train``/``test`` split or ``all``.
    """
    if path is None:
        from ..reference import router_labels

        rows = router_labels()
        source = "semcomm.reference.router_labels()"
    else:
        p = Path(path)
        if not p.is_file():
            raise InvalidInputError(f"labelled data file {p} does not exist")
        rows = []
        with p.open(encoding="utf-8") as fh:
            for i, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidInputError(f"{p} line {i}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise InvalidInputError(f"{p} line {i}: expected a JSON object")
                rows.append(row)
        source = str(p)
    if not rows:
        raise InvalidInputError(f"{source}: no labelled rows")
    if part not in ("train", "test", "all"):
        raise ConfigError(f"part must be train, test or all, got {part!r}")
    names = list(models) if models else sorted(k[: -len("_correct")] for k in rows[0] if k.endswith("_correct"))
    if len(names) < 2:
        raise InvalidInputError(f"{source}: need '<model>_correct' fields for at least two models")
    prompts: list[str] = []
    labels: list[list[float]] = []
    for i, row in enumerate(rows, start=1):
        text = row.get(text_field)
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError(f"{source} row {i}: missing text field {text_field!r}")
        if part != "all" and split_of(text, test_fraction) != part:
            continue
        lab = []
        for n in names:
            v = row.get(f"{n}_correct")
            if not isinstance(v, (bool, int)):
                raise InvalidInputError(f"{source} row {i}: field '{n}_correct' must be true/false")
            lab.append(float(bool(v)))
        prompts.append(text)
        labels.append(lab)
    if not prompts:
        raise InvalidInputError(f"{source}: no rows in part {part!r}")
    return LabelledSet(prompts, np.asarray(labels), names, {"source": source, "part": part})
