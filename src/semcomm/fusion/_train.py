"""Training a fuser: both models frozen, a loss on what the receiver says after the prompt.

Each step mirrors inference exactly: sharer prefill of its prompt, receiver prefill of its
prompt without the last token, alignment, fusion, then the receiver runs the last prompt
token and a continuation through the fused cache. Two objectives (``TrainConfig.objective``):

* ``"answer"`` (default): an example is a shared text and the receiver's answer
  (:class:`FusionExample`); the loss is cross-entropy on the answer tokens.
* ``"choice"``: an example is a multiple-choice question (:class:`~._mcqa.MCQuestion`); the
  fused prefix of ``shared_text(q)`` is computed once and every choice's summed
  log-probability after it (``" " + choice``, the ``loglik`` rule of ``fusion eval --data``)
  is computed in one batch over that prefix; the loss is cross-entropy over the choices
  toward the correct one (plus ``answer_weight`` times the correct choice's mean token loss).

Data file: JSON Lines, ``{"shared" (or "context"), "answer"}`` lines for ``answer``, the
``data/mcqa`` format ``{"question", "choices", "answer"}`` for ``choice``. Checkpoints
(``fuser.safetensors`` + ``fuser.json`` + ``optimizer.safetensors`` + ``train_state.json``)
are written every ``checkpoint_every`` steps and at the end; ``resume=True`` continues from
the last one. With validation, the best state so far is also written to ``best/`` whenever
it improves, so a run stopped early still has its best-by-validation fuser. With
``prefill_cache``, the two frozen prefills of each example are computed once and read back from
disk afterwards (:class:`~._prefill_cache.PrefillCache`), in training steps and validation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import ConfigError, InvalidInputError
from ._align import align_offsets
from ._fuser import Fuser, FuserConfig
from ._io import atomic_write_json, load_fuser, save_fuser, save_tensors
from ._kvio import KVLayers, align_layers, cache_kwargs, layers_to_cache, prefill_layers
from ._mcqa import MCQuestion, shared_text
from ._pipeline import ModelSide
from ._prefill_cache import PrefillCache, PrefillCacheStats

__all__ = [
    "OBJECTIVES",
    "FusionExample",
    "FusionTrainer",
    "TrainConfig",
    "TrainResult",
    "choice_scores",
    "read_examples",
]

OBJECTIVES = ("answer", "choice")
BEST_DIR = "best"  # subfolder of the output folder holding the best-by-validation fuser

log = logging.getLogger(__name__)

Prefill = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], KVLayers]
"""How a frozen model's prompt KV is obtained: :func:`prefill_layers` (computed) or
:meth:`PrefillCache.prefill` (computed once, then read from disk); (model, ids, mask) in."""


@dataclass(frozen=True, slots=True)
class FusionExample:
    shared: str  # text both models read (the context)
    answer: str  # what the receiver should say after its prompt


@dataclass(slots=True)
class TrainConfig:
    """Trainer settings (stored in ``train_state.json``)."""

    steps: int = 300
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 20
    clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    append_eos: bool = True  # train the receiver to stop after the answer
    reduce: str = "mean"  # alignment reduction (see _align)
    device: str = "cpu"
    max_prompt_tokens: int = 512
    threads: int = 0  # torch intra-op threads on CPU (0: leave torch's default)
    eval_every: int = 0  # with validation examples: validation loss every N steps, best kept
    bf16: bool = False  # bfloat16 autocast for both models and the fuser (weights stay fp32)
    fuser: dict[str, Any] = field(default_factory=dict)  # FuserConfig overrides
    objective: str = "answer"  # "answer" (answer-token CE) or "choice" (CE over choice scores)
    gate_lr: float = 0.0  # peak learning rate of the gate logits (0: lr); no weight decay
    answer_weight: float = 0.0  # choice objective: + this x the correct choice's token CE

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.gate_lr < 0 or self.answer_weight < 0:
            raise ConfigError("gate_lr and answer_weight must be >= 0")


@dataclass(slots=True)
class TrainResult:
    steps: int
    first_loss: float
    last_loss: float
    losses: list[float]
    seconds: float
    out: Path | None
    prefill_cache: PrefillCacheStats | None = None  # lookups since the trainer was built


def read_examples(path: str | Path) -> list[FusionExample]:
    """Load a JSONL training file; errors name the line that is wrong."""
    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"training data {p} does not exist")
    examples: list[FusionExample] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{p}:{n}: not valid JSON ({exc.msg})") from exc
        shared = obj.get("shared", obj.get("context")) if isinstance(obj, dict) else None
        answer = obj.get("answer") if isinstance(obj, dict) else None
        if not isinstance(shared, str) or not isinstance(answer, str) or not shared or not answer:
            raise InvalidInputError(
                f"{p}:{n}: each line needs non-empty string fields 'shared' and 'answer'"
            )
        examples.append(FusionExample(shared=shared, answer=answer))
    if not examples:
        raise InvalidInputError(f"training data {p} holds no examples")
    return examples


@dataclass(slots=True)
class _Encoded:
    r_ids: list[int]  # receiver prompt, full
    s_ids: list[int]
    weights: torch.Tensor  # [len(r_ids)-1, len(s_ids)]
    mask: torch.Tensor  # [len(r_ids)-1]
    answer_ids: list[int]


@dataclass(slots=True)
class _Batch:
    s_ids: torch.Tensor  # [B, M] left padded
    s_mask: torch.Tensor
    r_ids: torch.Tensor  # [B, N] receiver prompt minus last token, left padded
    r_mask: torch.Tensor
    weights: torch.Tensor  # [B, N, M]
    fuse_mask: torch.Tensor  # [B, N]
    c_ids: torch.Tensor  # [B, T] last prompt token + answer, right padded
    c_mask: torch.Tensor
    labels: torch.Tensor  # [B, T] next-token targets, -100 where ignored

    def to(self, device: torch.device) -> _Batch:
        return _Batch(*(getattr(self, f).to(device) for f in self.__slots__))  # type: ignore[attr-defined]


def encode_example(
    sharer: ModelSide, receiver: ModelSide, ex: FusionExample, *, reduce: str, append_eos: bool
) -> _Encoded:
    r = receiver.encode(ex.shared)
    s = sharer.encode(ex.shared)
    if len(r.input_ids) < 2:
        raise InvalidInputError(f"receiver prompt too short to fuse: {ex.shared[:40]!r}")
    al = align_offsets(r.spans[:-1], s.spans, reduce=reduce)  # type: ignore[arg-type]
    ans = list(receiver.tokenizer(ex.answer, add_special_tokens=False)["input_ids"])
    eos = getattr(receiver.tokenizer, "eos_token_id", None)
    if append_eos and isinstance(eos, int):
        ans.append(eos)
    if not ans:
        raise InvalidInputError(f"answer tokenizes to nothing: {ex.answer!r}")
    return _Encoded(r.input_ids, s.input_ids, al.weights, al.mask, ans)


@dataclass(slots=True)
class _ChoiceEncoded:
    r_ids: list[int]  # receiver prompt, full (its last token is fed after fusion)
    s_ids: list[int]
    weights: torch.Tensor  # [len(r_ids)-1, len(s_ids)]
    mask: torch.Tensor  # [len(r_ids)-1]
    options: list[list[int]]  # receiver tokens of " " + choice, one list per choice
    answer: int  # index of the correct choice


@dataclass(slots=True)
class _ChoiceBatch:
    """B questions, K = total choices; every choice row reads its question's fused prefix."""

    s_ids: torch.Tensor  # [B, M] left padded
    s_mask: torch.Tensor
    r_ids: torch.Tensor  # [B, N] receiver prompt minus last token, left padded
    r_mask: torch.Tensor
    weights: torch.Tensor  # [B, N, M]
    fuse_mask: torch.Tensor  # [B, N]
    owner: torch.Tensor  # [K] question of each choice row
    c_ids: torch.Tensor  # [K, T] last prompt token + choice tokens, right padded
    c_mask: torch.Tensor
    labels: torch.Tensor  # [K, T] next-token targets (the choice tokens), -100 where ignored
    slot: torch.Tensor  # [B, C] choice row of (question, choice j), -1 past its choices
    answer: torch.Tensor  # [B] index of the correct choice

    def to(self, device: torch.device) -> _ChoiceBatch:
        return _ChoiceBatch(*(getattr(self, f).to(device) for f in self.__slots__))  # type: ignore[attr-defined]


def encode_choice_example(
    sharer: ModelSide, receiver: ModelSide, q: MCQuestion, *, reduce: str
) -> _ChoiceEncoded:
    """A question as the evaluator reads it: ``shared_text(q)`` + each side's suffix."""
    shared = shared_text(q)
    r = receiver.encode(shared)
    s = sharer.encode(shared)
    if len(r.input_ids) < 2:
        raise InvalidInputError(f"receiver prompt too short to fuse: {shared[:40]!r}")
    al = align_offsets(r.spans[:-1], s.spans, reduce=reduce)  # type: ignore[arg-type]
    opts = [
        list(receiver.tokenizer(" " + c, add_special_tokens=False)["input_ids"]) for c in q.choices
    ]
    if any(not o for o in opts):
        raise InvalidInputError(f"a choice tokenizes to nothing: {q.choices!r}")
    return _ChoiceEncoded(r.input_ids, s.input_ids, al.weights, al.mask, opts, q.answer)


def _collate_prefix(
    items: list[Any], r_pad: int, s_pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded sharer and receiver prompts with their alignment (shared by both batches)."""
    b = len(items)
    n = max(len(it.r_ids) - 1 for it in items)
    m = max(len(it.s_ids) for it in items)
    s_ids = torch.full((b, m), s_pad, dtype=torch.long)
    s_mask = torch.zeros(b, m, dtype=torch.long)
    r_ids = torch.full((b, n), r_pad, dtype=torch.long)
    r_mask = torch.zeros(b, n, dtype=torch.long)
    weights = torch.zeros(b, n, m)
    fuse_mask = torch.zeros(b, n)
    for i, it in enumerate(items):
        ls, lr = len(it.s_ids), len(it.r_ids) - 1
        s_ids[i, m - ls :] = torch.tensor(it.s_ids)
        s_mask[i, m - ls :] = 1
        r_ids[i, n - lr :] = torch.tensor(it.r_ids[:-1])
        r_mask[i, n - lr :] = 1
        weights[i, n - lr :, m - ls :] = it.weights
        fuse_mask[i, n - lr :] = it.mask
    return s_ids, s_mask, r_ids, r_mask, weights, fuse_mask


def collate_choices(items: list[_ChoiceEncoded], r_pad: int, s_pad: int) -> _ChoiceBatch:
    s_ids, s_mask, r_ids, r_mask, weights, fuse_mask = _collate_prefix(items, r_pad, s_pad)
    rows = [(i, j, o) for i, it in enumerate(items) for j, o in enumerate(it.options)]
    k = len(rows)
    t = 1 + max(len(o) for _, _, o in rows)
    c = max(len(it.options) for it in items)
    owner = torch.tensor([i for i, _, _ in rows], dtype=torch.long)
    c_ids = torch.full((k, t), r_pad, dtype=torch.long)
    c_mask = torch.zeros(k, t, dtype=torch.long)
    labels = torch.full((k, t), -100, dtype=torch.long)
    slot = torch.full((len(items), c), -1, dtype=torch.long)
    for row, (i, j, o) in enumerate(rows):
        cont = [items[i].r_ids[-1], *o]
        c_ids[row, : len(cont)] = torch.tensor(cont)
        c_mask[row, : len(cont)] = 1
        labels[row, : len(o)] = torch.tensor(o)
        slot[i, j] = row
    answer = torch.tensor([it.answer for it in items], dtype=torch.long)
    return _ChoiceBatch(
        s_ids, s_mask, r_ids, r_mask, weights, fuse_mask, owner, c_ids, c_mask, labels, slot, answer
    )


def collate(items: list[_Encoded], r_pad: int, s_pad: int) -> _Batch:
    s_ids, s_mask, r_ids, r_mask, weights, fuse_mask = _collate_prefix(items, r_pad, s_pad)
    b = len(items)
    t = max(len(it.answer_ids) + 1 for it in items)
    c_ids = torch.full((b, t), r_pad, dtype=torch.long)
    c_mask = torch.zeros(b, t, dtype=torch.long)
    labels = torch.full((b, t), -100, dtype=torch.long)
    for i, it in enumerate(items):
        cont = [it.r_ids[-1], *it.answer_ids]
        c_ids[i, : len(cont)] = torch.tensor(cont)
        c_mask[i, : len(cont)] = 1
        labels[i, : len(cont) - 1] = torch.tensor(cont[1:])
    return _Batch(s_ids, s_mask, r_ids, r_mask, weights, fuse_mask, c_ids, c_mask, labels)


def _fused_prefix(
    fuser: Fuser | None,
    sharer: torch.nn.Module,
    receiver: torch.nn.Module,
    batch: Any,
    prefill: Prefill = prefill_layers,
) -> KVLayers:
    """Receiver KV of the prompts without their last token, fused with the sharer's
    (``fuser=None``: the receiver's own). Gradients reach the fuser only."""
    r_layers = prefill(receiver, batch.r_ids, batch.r_mask)
    if fuser is not None:
        s_layers = prefill(sharer, batch.s_ids, batch.s_mask)
        aligned = align_layers(s_layers, batch.weights)
        r_layers = fuser.fuse(aligned, r_layers, batch.fuse_mask)
    return r_layers


def choice_scores(
    fuser: Fuser | None,
    sharer: torch.nn.Module,
    receiver: torch.nn.Module,
    batch: _ChoiceBatch,
    *,
    prefill: Prefill = prefill_layers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of every choice after its question's fused prefix.

    Each question's prefix is fused once; its choice rows read it through an index on the
    batch dimension (no copy in the graph beyond the gather). Returns (scores [B, C] with
    ``-inf`` past a question's choices, token counts [B, C]); the same numbers as
    ``score_choices``'s ``loglik`` in ``fusion eval --data``.
    """
    layers = _fused_prefix(fuser, sharer, receiver, batch, prefill)
    owner = batch.owner
    cache = layers_to_cache(
        [(k.index_select(0, owner), v.index_select(0, owner)) for k, v in layers]
    )
    start = batch.r_mask.sum(-1).index_select(0, owner)  # [K] prompt tokens already cached
    t = batch.c_ids.shape[1]
    position_ids = start[:, None] + torch.arange(t, device=start.device)[None]
    out = receiver(
        input_ids=batch.c_ids,
        attention_mask=torch.cat([batch.r_mask.index_select(0, owner), batch.c_mask], dim=1),
        position_ids=position_ids,
        use_cache=True,
        **cache_kwargs(receiver, cache),
    )
    logits = out.logits.float()  # [K, T, V]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        batch.labels.reshape(-1),
        ignore_index=-100,
        reduction="none",
    ).view(batch.labels.shape)
    row_scores = -nll.sum(-1)  # [K]; ignored positions contribute 0
    row_tokens = (batch.labels != -100).sum(-1)
    valid = batch.slot >= 0
    idx = batch.slot.clamp_min(0)
    scores = torch.where(valid, row_scores[idx], torch.full_like(row_scores[idx], -math.inf))
    tokens = torch.where(valid, row_tokens[idx], torch.zeros_like(row_tokens[idx]))
    return scores, tokens


def choice_loss(
    fuser: Fuser | None,
    sharer: torch.nn.Module,
    receiver: torch.nn.Module,
    batch: _ChoiceBatch,
    *,
    answer_weight: float = 0.0,
    prefill: Prefill = prefill_layers,
) -> torch.Tensor:
    """Cross-entropy over the choices' summed log-probabilities toward the correct choice,
    plus ``answer_weight`` x the correct choice's mean token loss; mean over questions."""
    scores, tokens = choice_scores(fuser, sharer, receiver, batch, prefill=prefill)
    loss = torch.nn.functional.cross_entropy(scores, batch.answer)
    if answer_weight:
        right = scores.gather(1, batch.answer[:, None])[:, 0]
        n = tokens.gather(1, batch.answer[:, None])[:, 0].clamp_min(1)
        loss = loss + answer_weight * (-right / n).mean()
    return loss


def fused_loss(
    fuser: Fuser | None,
    sharer: torch.nn.Module,
    receiver: torch.nn.Module,
    batch: _Batch,
    *,
    prefill: Prefill = prefill_layers,
) -> torch.Tensor:
    """Receiver cross-entropy on answer tokens given the fused prompt cache.

    With ``fuser=None`` this is the receiver alone (the baseline the fuser must beat).
    """
    r_layers = _fused_prefix(fuser, sharer, receiver, batch, prefill)
    cache = layers_to_cache(r_layers)
    start = batch.r_mask.sum(-1)  # [B] real prompt tokens already cached
    t = batch.c_ids.shape[1]
    position_ids = start[:, None] + torch.arange(t, device=start.device)[None]
    out = receiver(
        input_ids=batch.c_ids,
        attention_mask=torch.cat([batch.r_mask, batch.c_mask], dim=1),
        position_ids=position_ids,
        use_cache=True,
        **cache_kwargs(receiver, cache),
    )
    logits = out.logits.float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), ignore_index=-100
    )


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            return v
    return 0


def _freeze(model: torch.nn.Module) -> None:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


class FusionTrainer:
    """Trains a :class:`Fuser` for one (sharer, receiver) pair.

    Lifecycle: build (new fuser, or ``resume=True`` from ``out``), :meth:`train`, done. The
    models are frozen in place (``requires_grad=False``, eval mode) for the trainer's life.
    """

    def __init__(
        self,
        sharer: ModelSide,
        receiver: ModelSide,
        examples: list[FusionExample] | list[MCQuestion],
        config: TrainConfig,
        *,
        out: str | Path | None = None,
        resume: bool = False,
        meta: dict[str, Any] | None = None,
        val_examples: list[FusionExample] | list[MCQuestion] | None = None,
        val_metric: Callable[[Fuser], float] | None = None,
        init: str | Path | None = None,
        prefill_cache: str | Path | None = None,
    ):
        """``examples``: :class:`FusionExample` for the ``answer`` objective,
        :class:`MCQuestion` for ``choice``. ``init``: a fuser folder whose weights start a
        fresh run (same shapes; the temperature schedule is this run's); ignored on resume.
        ``prefill_cache``: a folder for the frozen prefills of each example (see
        :class:`PrefillCache`); not part of the run's config, so it may be added, moved or
        dropped between resumes."""
        self.sharer, self.receiver = sharer, receiver
        self.prefill_cache = PrefillCache(prefill_cache) if prefill_cache is not None else None
        self._prefill: Prefill = (
            self.prefill_cache.prefill if self.prefill_cache is not None else prefill_layers
        )
        self.config = config
        self.out = Path(out) if out is not None else None
        self.meta = dict(meta or {})
        self.device = torch.device(config.device)
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
        for side in (sharer, receiver):
            _freeze(side.model)
            side.model.to(self.device)
        self.step = 0
        self.losses: list[float] = []
        self.train_seconds = 0.0  # wall time spent in train(), summed over resumes
        state_path = self.out / "train_state.json" if self.out is not None else None
        if resume and state_path is not None and state_path.exists():
            self.fuser = load_fuser(self.out, sharer=sharer.spec, receiver=receiver.spec)  # type: ignore[arg-type]
            state = json.loads(state_path.read_text(encoding="utf-8"))
            self.step = int(state["step"])
            self.losses = [float(x) for x in state.get("losses", [])]
            self.train_seconds = float(state.get("train_seconds", 0.0))
            log.info("resuming fuser training at step %d from %s", self.step, self.out)
        else:
            if resume:
                log.info("nothing to resume in %s; starting fresh", self.out)
            kwargs = dict(config.fuser)
            kwargs.setdefault("anneal_steps", config.steps)
            try:
                fcfg = FuserConfig(sharer=sharer.spec, receiver=receiver.spec, **kwargs)
            except TypeError as exc:
                raise ConfigError(f"bad fuser setting: {exc}") from exc
            self.fuser = Fuser(fcfg)
            if init is not None:
                start = load_fuser(init, sharer=sharer.spec, receiver=receiver.spec)
                try:
                    self.fuser.load_state_dict(start.state_dict())
                except RuntimeError as exc:
                    raise ConfigError(
                        f"--init fuser {init} has other shapes than this run's fuser settings "
                        f"(hidden/blocks/intermediate-mult/mapping): {exc}"
                    ) from exc
                self.meta["init"] = str(init)
                log.info("starting from the weights of %s", init)
        self.fuser.to(self.device)
        # the gate logits get their own learning rate (and no weight decay, which would pull
        # them to 0, the undecided state); gate_logit is the fuser's last parameter, so the
        # optimizer's parameter ids are those of a single-group optimizer (old checkpoints load)
        gate = [self.fuser.gate_logit]
        rest = [p for n, p in self.fuser.named_parameters() if n != "gate_logit"]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": rest, "weight_decay": config.weight_decay, "peak_lr": config.lr},
                {"params": gate, "weight_decay": 0.0, "peak_lr": config.gate_lr or config.lr},
            ],
            lr=config.lr,
        )
        if resume and self.step > 0 and self.out is not None:
            self._load_optimizer(self.out / "optimizer.safetensors")
        t0 = time.perf_counter()
        self._choice = config.objective == "choice"
        self.encoded: list[Any] = self._encode_all(examples, "training")
        self.encoded = [e for e in self.encoded if len(e.r_ids) <= config.max_prompt_tokens]
        if not self.encoded:
            raise InvalidInputError("no training example fits max_prompt_tokens")
        log.info("encoded %d examples in %.1fs", len(self.encoded), time.perf_counter() - t0)
        self._r_pad = _pad_id(receiver.tokenizer)
        self._s_pad = _pad_id(sharer.tokenizer)
        self.val_encoded: list[Any] = self._encode_all(val_examples or [], "validation")
        # validation: a score to maximise (val_metric, e.g. accuracy on validation questions),
        # else minus the training loss on val_examples; the best fuser state is kept (and
        # written to out/best/ when it improves)
        self.val_metric = val_metric
        self.val_losses: list[tuple[int, float]] = []  # (step, validation score)
        self.best: tuple[float, int, dict[str, torch.Tensor]] | None = None
        if resume and self.step > 0 and state_path is not None and state_path.exists():
            self._restore_best(json.loads(state_path.read_text(encoding="utf-8")))

    def _encode_all(self, examples: list[Any], what: str) -> list[Any]:
        c = self.config
        out: list[Any] = []
        for ex in examples:
            if self._choice:
                if not isinstance(ex, MCQuestion):
                    raise InvalidInputError(
                        f"the choice objective needs multiple-choice {what} data "
                        "({'question', 'choices', 'answer'} lines)"
                    )
                out.append(encode_choice_example(self.sharer, self.receiver, ex, reduce=c.reduce))
            else:
                if not isinstance(ex, FusionExample):
                    raise InvalidInputError(
                        f"the answer objective needs {what} data of {{'shared', 'answer'}} lines"
                    )
                out.append(
                    encode_example(
                        self.sharer, self.receiver, ex, reduce=c.reduce, append_eos=c.append_eos
                    )
                )
        return out

    def _restore_best(self, state: dict[str, Any]) -> None:
        """Validation history and the best state of a resumed run (from out/best/)."""
        self.val_losses = [(int(a), float(b)) for a, b in state.get("val_losses", [])]
        best = state.get("best")
        if best is None or self.out is None:
            return
        best_dir = self.out / BEST_DIR
        if not (best_dir / "fuser.safetensors").exists():
            log.warning("train_state names a best step but %s is missing", best_dir)
            return
        fz = load_fuser(best_dir, sharer=self.sharer.spec, receiver=self.receiver.spec)
        state_dict = {k: v.to(self.device) for k, v in fz.state_dict().items()}
        self.best = (float(best["score"]), int(best["step"]), state_dict)

    # -- optimizer state without pickle -------------------------------------------------
    def _save_optimizer(self, path: Path) -> None:
        sd = self.optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        for pid, st in sd["state"].items():
            for name, val in st.items():
                tensors[f"{pid}.{name}"] = (
                    val if isinstance(val, torch.Tensor) else torch.tensor(val)
                )
        save_tensors(path, tensors)

    def _load_optimizer(self, path: Path) -> None:
        if not path.exists():
            log.warning("no optimizer state at %s; continuing with a fresh optimizer", path)
            return
        flat = load_file(str(path))
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, val in flat.items():
            pid, name = key.split(".", 1)
            state.setdefault(int(pid), {})[name] = val
        sd = self.optimizer.state_dict()
        sd["state"] = state
        self.optimizer.load_state_dict(sd)

    def _lr(self, step: int, peak: float | None = None) -> float:
        """Warmup then cosine to 10% of ``peak`` (default ``config.lr``)."""
        c = self.config
        peak = c.lr if peak is None else peak
        if step < c.warmup:
            return peak * (step + 1) / max(c.warmup, 1)
        frac = (step - c.warmup) / max(c.steps - c.warmup, 1)
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def checkpoint(self) -> None:
        if self.out is None:
            return
        meta = dict(self.meta)
        meta.update(
            {
                "steps": self.step,
                "last_loss": self.losses[-1] if self.losses else None,
                "train_seconds": round(self.train_seconds, 1),
                "val_losses": self.val_losses,
                "train_config": asdict(self.config),
            }
        )
        save_fuser(self.fuser, self.out, extra=meta)
        self._save_optimizer(self.out / "optimizer.safetensors")
        atomic_write_json(
            self.out / "train_state.json",
            {
                "step": self.step,
                "losses": self.losses,
                "train_seconds": self.train_seconds,
                "config": asdict(self.config),
                "val_losses": self.val_losses,
                "best": (
                    {"step": self.best[1], "score": self.best[0]} if self.best is not None else None
                ),
            },
        )

    def _save_best(self) -> None:
        """Write the best-by-validation state to out/best/ (a loadable fuser folder)."""
        if self.out is None or self.best is None:
            return
        score, step, state = self.best
        current = {k: v.detach().clone() for k, v in self.fuser.state_dict().items()}
        self.fuser.load_state_dict(state)
        meta = dict(self.meta)
        meta.update(
            {
                "steps": step,
                "best_step": step,
                "best_val_score": score,
                "val_losses": self.val_losses,
                "train_config": asdict(self.config),
            }
        )
        save_fuser(self.fuser, self.out / BEST_DIR, extra=meta)
        self.fuser.load_state_dict(current)

    def batch(self, rng: random.Random) -> _Batch | _ChoiceBatch:
        items = [
            self.encoded[rng.randrange(len(self.encoded))] for _ in range(self.config.batch_size)
        ]
        return self._collate(items)

    def _collate(self, items: list[Any]) -> _Batch | _ChoiceBatch:
        if self._choice:
            return collate_choices(items, self._r_pad, self._s_pad).to(self.device)
        return collate(items, self._r_pad, self._s_pad).to(self.device)

    def _loss(self, fuser: Fuser | None, batch: _Batch | _ChoiceBatch) -> torch.Tensor:
        s, r = self.sharer.model, self.receiver.model
        if isinstance(batch, _ChoiceBatch):
            return choice_loss(
                fuser, s, r, batch, answer_weight=self.config.answer_weight, prefill=self._prefill
            )
        return fused_loss(fuser, s, r, batch, prefill=self._prefill)

    def evaluate_loss(self, items: list[Any] | None = None, *, fused: bool = True) -> float:
        """Mean training loss (answer or choice objective; gate hard, no dropout) over
        ``items`` (default: the first 64 training examples)."""
        items = items if items is not None else self.encoded[:64]
        self.fuser.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(items), self.config.batch_size):
                chunk = items[i : i + self.config.batch_size]
                with self._autocast():
                    loss = self._loss(self.fuser if fused else None, self._collate(chunk))
                total += float(loss) * len(chunk)
                n += len(chunk)
        return total / max(n, 1)

    def _autocast(self) -> Any:
        if not self.config.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    @property
    def _validating(self) -> bool:
        return bool(self.config.eval_every) and (
            bool(self.val_encoded) or self.val_metric is not None
        )

    def _validate(self) -> float:
        """Validation score (higher is better); remembers the best fuser state seen so far."""
        self.fuser.eval()
        with torch.no_grad():
            if self.val_metric is not None:
                score = float(self.val_metric(self.fuser))
            else:
                score = -self.evaluate_loss(self.val_encoded)
        self.val_losses.append((self.step, score))
        if self.best is None or score > self.best[0]:
            state = {k: v.detach().clone() for k, v in self.fuser.state_dict().items()}
            self.best = (score, self.step, state)
            self._save_best()
        log.info(
            "step %d validation score %.4f (best %.4f at step %d)",
            self.step,
            score,
            self.best[0],
            self.best[1],
        )
        return score

    def train(self, progress: Callable[[int, int, float], None] | None = None) -> TrainResult:
        """Run until ``config.steps``; ``progress(step, total, loss)`` is called each step."""
        c = self.config
        rng = random.Random(c.seed * 1_000_003 + self.step)
        t0 = time.perf_counter()
        self.fuser.train()
        first = None
        if self._validating and self.step == 0 and not self.val_losses:
            self._validate()  # the starting point (zero-init: the receiver alone) is a candidate
            self.fuser.train()
        while self.step < c.steps:
            self.fuser.set_step(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr(self.step, group.get("peak_lr"))
            with self._autocast():
                loss = self._loss(self.fuser, self.batch(rng))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.fuser.parameters(), c.clip)
            self.optimizer.step()
            self.step += 1
            value = float(loss.detach())
            if first is None:
                first = value
            self.losses.append(value)
            if progress is not None:
                progress(self.step, c.steps, value)
            if self._validating and self.step % c.eval_every == 0:
                self._validate()
                self.fuser.train()
            if c.checkpoint_every and self.step % c.checkpoint_every == 0:
                self.train_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                self.checkpoint()
        self.fuser.set_step(self.step)
        if self._validating:
            if not self.val_losses or self.val_losses[-1][0] != self.step:
                self._validate()
            assert self.best is not None
            best_loss, best_step, state = self.best
            log.info("keeping the fuser of step %d (validation score %.4f)", best_step, best_loss)
            self.fuser.load_state_dict(state)
            self.meta["best_step"] = best_step
            self.meta["best_val_score"] = best_loss
        self.fuser.eval()
        self.train_seconds += time.perf_counter() - t0
        self.checkpoint()
        seconds = self.train_seconds
        losses = self.losses
        return TrainResult(
            steps=self.step,
            first_loss=first if first is not None else (losses[0] if losses else float("nan")),
            last_loss=sum(losses[-10:]) / max(len(losses[-10:]), 1) if losses else float("nan"),
            losses=losses,
            seconds=seconds,
            out=self.out,
            prefill_cache=(
                replace(self.prefill_cache.stats) if self.prefill_cache is not None else None
            ),
        )
