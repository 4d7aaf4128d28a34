"""Training a fuser: both models frozen, the receiver's next-token loss on answer tokens.

A training example is a shared text (what both models read) and the receiver's answer.
Each step mirrors inference exactly: sharer prefill of its prompt, receiver prefill of its
prompt without the last token, alignment, fusion, then the receiver runs the last prompt
token and the answer through the fused cache; the loss is cross-entropy on the answer.

Data file: JSON Lines, one object per line with ``"shared"`` (or ``"context"``) and
``"answer"``. Checkpoints (``fuser.safetensors`` + ``fuser.json`` + ``optimizer.safetensors``
+ ``train_state.json``) are written every ``checkpoint_every`` steps and at the end;
``resume=True`` continues from the last one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import ConfigError, InvalidInputError
from ._align import align_offsets
from ._fuser import Fuser, FuserConfig
from ._io import atomic_write_json, load_fuser, save_fuser, save_tensors
from ._kvio import align_layers, cache_kwargs, layers_to_cache, prefill_layers
from ._pipeline import ModelSide

__all__ = ["FusionExample", "FusionTrainer", "TrainConfig", "TrainResult", "read_examples"]

log = logging.getLogger(__name__)


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


@dataclass(slots=True)
class TrainResult:
    steps: int
    first_loss: float
    last_loss: float
    losses: list[float]
    seconds: float
    out: Path | None


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


def collate(items: list[_Encoded], r_pad: int, s_pad: int) -> _Batch:
    b = len(items)
    n = max(len(it.r_ids) - 1 for it in items)
    m = max(len(it.s_ids) for it in items)
    t = max(len(it.answer_ids) + 1 for it in items)
    s_ids = torch.full((b, m), s_pad, dtype=torch.long)
    s_mask = torch.zeros(b, m, dtype=torch.long)
    r_ids = torch.full((b, n), r_pad, dtype=torch.long)
    r_mask = torch.zeros(b, n, dtype=torch.long)
    weights = torch.zeros(b, n, m)
    fuse_mask = torch.zeros(b, n)
    c_ids = torch.full((b, t), r_pad, dtype=torch.long)
    c_mask = torch.zeros(b, t, dtype=torch.long)
    labels = torch.full((b, t), -100, dtype=torch.long)
    for i, it in enumerate(items):
        ls, lr = len(it.s_ids), len(it.r_ids) - 1
        s_ids[i, m - ls :] = torch.tensor(it.s_ids)
        s_mask[i, m - ls :] = 1
        r_ids[i, n - lr :] = torch.tensor(it.r_ids[:-1])
        r_mask[i, n - lr :] = 1
        weights[i, n - lr :, m - ls :] = it.weights
        fuse_mask[i, n - lr :] = it.mask
        cont = [it.r_ids[-1], *it.answer_ids]
        c_ids[i, : len(cont)] = torch.tensor(cont)
        c_mask[i, : len(cont)] = 1
        labels[i, : len(cont) - 1] = torch.tensor(cont[1:])
    return _Batch(s_ids, s_mask, r_ids, r_mask, weights, fuse_mask, c_ids, c_mask, labels)


def fused_loss(
    fuser: Fuser | None, sharer: torch.nn.Module, receiver: torch.nn.Module, batch: _Batch
) -> torch.Tensor:
    """Receiver cross-entropy on answer tokens given the fused prompt cache.

    With ``fuser=None`` this is the receiver alone (the baseline the fuser must beat).
    """
    r_layers = prefill_layers(receiver, batch.r_ids, batch.r_mask)
    if fuser is not None:
        s_layers = prefill_layers(sharer, batch.s_ids, batch.s_mask)
        aligned = align_layers(s_layers, batch.weights)
        r_layers = fuser.fuse(aligned, r_layers, batch.fuse_mask)
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
        examples: list[FusionExample],
        config: TrainConfig,
        *,
        out: str | Path | None = None,
        resume: bool = False,
        meta: dict[str, Any] | None = None,
        val_examples: list[FusionExample] | None = None,
        val_metric: Callable[[Fuser], float] | None = None,
    ):
        self.sharer, self.receiver = sharer, receiver
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
        self.fuser.to(self.device)
        self.optimizer = torch.optim.AdamW(
            self.fuser.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        if resume and self.step > 0 and self.out is not None:
            self._load_optimizer(self.out / "optimizer.safetensors")
        t0 = time.perf_counter()
        self.encoded = [
            encode_example(sharer, receiver, ex, reduce=config.reduce, append_eos=config.append_eos)
            for ex in examples
        ]
        self.encoded = [e for e in self.encoded if len(e.r_ids) <= config.max_prompt_tokens]
        if not self.encoded:
            raise InvalidInputError("no training example fits max_prompt_tokens")
        log.info("encoded %d examples in %.1fs", len(self.encoded), time.perf_counter() - t0)
        self._r_pad = _pad_id(receiver.tokenizer)
        self._s_pad = _pad_id(sharer.tokenizer)
        self.val_encoded = [
            encode_example(sharer, receiver, ex, reduce=config.reduce, append_eos=config.append_eos)
            for ex in (val_examples or [])
        ]
        # validation: a score to maximise (val_metric, e.g. accuracy on validation questions),
        # else minus the answer loss on val_examples; the best fuser state is kept
        self.val_metric = val_metric
        self.val_losses: list[tuple[int, float]] = []  # (step, validation score)
        self.best: tuple[float, int, dict[str, torch.Tensor]] | None = None

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

    def _lr(self, step: int) -> float:
        c = self.config
        if step < c.warmup:
            return c.lr * (step + 1) / max(c.warmup, 1)
        frac = (step - c.warmup) / max(c.steps - c.warmup, 1)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

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
            },
        )

    def batch(self, rng: random.Random) -> _Batch:
        items = [
            self.encoded[rng.randrange(len(self.encoded))] for _ in range(self.config.batch_size)
        ]
        return collate(items, self._r_pad, self._s_pad).to(self.device)

    def evaluate_loss(self, items: list[_Encoded] | None = None, *, fused: bool = True) -> float:
        """Mean answer loss (gate hard, no dropout) over ``items`` (default: 64 examples)."""
        items = items if items is not None else self.encoded[:64]
        self.fuser.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(items), self.config.batch_size):
                chunk = items[i : i + self.config.batch_size]
                b = collate(chunk, self._r_pad, self._s_pad).to(self.device)
                with self._autocast():
                    loss = fused_loss(
                        self.fuser if fused else None, self.sharer.model, self.receiver.model, b
                    )
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
        log.info("step %d validation score %.4f", self.step, score)
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
                group["lr"] = self._lr(self.step)
            with self._autocast():
                loss = fused_loss(
                    self.fuser, self.sharer.model, self.receiver.model, self.batch(rng)
                )
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
        )
