"""Cache-to-cache handoff between two different in-process models (``semcomm.fusion``).

The sharer stage writes no text: its KV of the shared context (the client's conversation,
restored from the KV store when the sharer's engine has it) is projected by the trained fuser
into the receiver's prompt cache, and the receiver answers from that fused cache.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from ..runtime import Completion, Delta, Started, StreamItem
from ..security import TenantContext
from ._backends import GenRequest, LocalBackend, messages_text

__all__ = ["C2CHandoff", "FusionRegistry", "cut_at_stop", "find_fuser"]

log = logging.getLogger(__name__)


def _shipped_fusers() -> list[Path]:
    """Fusers shipped with semcomm: the catalog pairs' (the default pair's first; the larger
    sharer's pairs once shipped), then the reference pair's."""
    from ..fusion import shipped_fuser_path, shipped_pair_fusers

    return [*shipped_pair_fusers(), shipped_fuser_path()]


def _fits(path: Path, sharer: LocalBackend, receiver: LocalBackend) -> bool:
    """Whether the fuser at ``path`` was trained for models of these shapes (from its JSON)."""
    import json

    try:
        doc = json.loads((path / "fuser.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    for side, backend in (("sharer", sharer), ("receiver", receiver)):
        want = doc.get(side) or {}
        cfg = backend.runner.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        have = {"model_type": getattr(cfg, "model_type", None),
                "num_layers": getattr(cfg, "num_hidden_layers", None),
                "vocab_size": getattr(cfg, "vocab_size", None)}
        if any(want.get(k) is not None and want.get(k) != v for k, v in have.items()):
            return False
    return True


def find_fuser(sharer: LocalBackend, receiver: LocalBackend, fuser: str | None
               ) -> tuple[Any, str]:
    """``(C2CHandoff | None, why)`` for a (sharer, receiver) pair of in-process models.

    With no ``fuser`` configured, the shipped fuser whose pair has these models' shapes is used
    (a catalog pair: Qwen2.5-Coder-0.5B-Instruct -> SmolLM2-135M-Instruct, or
    Qwen2.5-Coder-1.5B-Instruct -> either of them once its fuser is shipped; or the reference
    pair).
    """
    try:
        from ..fusion import FusionPipeline, ModelSide, load_fuser  # noqa: F401
    except ImportError as exc:
        return None, f"semcomm.fusion unavailable ({exc})"
    path: Path | None = Path(fuser) if fuser else None
    if path is None:
        shipped = [p for p in _shipped_fusers() if p.exists()]
        fitting = [p for p in shipped if _fits(p, sharer, receiver)]
        if not fitting:
            return None, (f"no fuser configured, and none of the shipped ones ({', '.join(p.name for p in shipped)}) "
                          f"is for {sharer.name} -> {receiver.name}")
        path = fitting[0]
    if not path.exists():
        return None, f"no fuser at {path}"
    try:
        return C2CHandoff(sharer, receiver, path), f"fuser {path}"
    except Exception as exc:  # a fuser for another pair, a damaged file: say so, use text
        log.warning("fuser %s cannot join %s -> %s: %s", path, sharer.name, receiver.name, exc)
        return None, f"fuser {path} does not fit {sharer.name} -> {receiver.name}: {exc}"


class FusionRegistry:
    """The C2C handoffs of a server's in-process model pairs, each loaded once on first use.

    ``get`` answers None (text handoff then) for pairs that are not both in-process models or
    have no fitting fuser, and records why in ``notes`` (shown by ``/health``).
    """

    def __init__(self, models: Mapping[str, Any], notes: dict[str, str]) -> None:
        self.models = models  # the server's model backends by name (not pipelines)
        self.notes = notes
        self._handoffs: dict[tuple[str, str, str | None], C2CHandoff | None] = {}

    def get(self, sharer: str, receiver: str, fuser: str | None) -> C2CHandoff | None:
        key = (sharer, receiver, fuser)
        if key not in self._handoffs:
            s, r = self.models.get(sharer), self.models.get(receiver)
            if not (isinstance(s, LocalBackend) and isinstance(r, LocalBackend)):
                self._handoffs[key] = None
            else:
                handoff, why = find_fuser(s, r, fuser)
                self._handoffs[key] = handoff
                self.notes[f"c2c:{sharer}->{receiver}"] = why
        return self._handoffs[key]


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to (not including) its earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i != -1), default=-1)
    return (text[:cut], True) if cut != -1 else (text, False)


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that begins some stop string (held back)."""
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


_STARTED = object()  # the worker's "prompt prepared" marker (with the stats so far)
_END = object()


class C2CHandoff:
    """A loaded fuser for one (sharer, receiver) pair; ``generate`` runs one fused answer."""

    def __init__(self, sharer: LocalBackend, receiver: LocalBackend, path: Path) -> None:
        from ..fusion import ModelSide, load_fuser

        self.sharer = sharer
        self.receiver = receiver
        s_run: Any = sharer.runner
        r_run: Any = receiver.runner
        self._s_model, self._s_tok = s_run.model, s_run.tokenizer
        self._r_model, self._r_tok = r_run.model, r_run.tokenizer
        s_side = ModelSide(self._s_model, self._s_tok)
        r_side = ModelSide(self._r_model, self._r_tok)
        self._s_spec, self._r_spec = s_side.spec, r_side.spec
        self.fuser = load_fuser(path, sharer=self._s_spec, receiver=self._r_spec)
        self.fuser.eval()
        self.path = path

    def _pipeline(self, system: str, ctx: TenantContext) -> Any:
        from ..fusion import FusionPipeline, ModelSide

        # the sharer's prompt KV from the KV store, in the admitted tenant's namespace
        engine = None if ctx.isolate else self.sharer.runner.engine(ctx.tenant,
                                                                     ctx.digest or None)
        s_side = ModelSide(self._s_model, self._s_tok, _spec=self._s_spec)
        r_side = ModelSide(self._r_model, self._r_tok,
                           prefix=f"system: {system}\n" if system else "",
                           suffix="\nassistant:", _spec=self._r_spec)
        return FusionPipeline(s_side, r_side, self.fuser, sharer_engine=engine, check=False)

    def _split(self, sreq: GenRequest) -> tuple[str, str]:
        """``(system, shared)``: the receiver stage's own instruction and the shared context."""
        msgs = list(sreq.messages or [])
        system = ""
        if msgs and msgs[-1]["role"] == "system":  # the receiver stage's own instruction
            system = msgs.pop()["content"]
        return system, messages_text(msgs).rstrip("\n") or (sreq.prompt or "")

    async def stream(self, sreq: GenRequest) -> AsyncIterator[StreamItem]:
        """The fused answer as the one stream contract: ``Started``, ``Delta`` per piece as the
        receiver decodes it, then the ``Completion``. Stop strings are held back until they
        are ruled out, so no part of one reaches the client; closing the stream stops decoding."""
        system, shared = self._split(sreq)
        pipe = self._pipeline(system, sreq.tenant_ctx)
        stops = [s for s in sreq.stop if s]
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        halt = threading.Event()
        stats: dict[str, Any] = {}
        t0 = time.perf_counter()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            gen = pipe.stream(shared, max_new_tokens=sreq.max_tokens, stats=stats)
            started = False
            try:
                for piece in gen:
                    if not started:
                        put((_STARTED, dict(stats)))
                        started = True
                    put(piece)
                    if halt.is_set():
                        break
                if not started:
                    put((_STARTED, dict(stats)))
                put(_END)
            except BaseException as exc:  # reaches the request as the error it is
                put(exc)
            finally:
                gen.close()

        worker = asyncio.ensure_future(asyncio.to_thread(work))
        text, released, stopped, ttft = "", 0, False, 0.0
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, tuple) and item and item[0] is _STARTED:
                    ttft = time.perf_counter() - t0
                    yield Started(prompt_tokens=int(item[1].get("receiver_prompt_tokens", 0)),
                                  hit_tokens=0, layers=("c2c",))
                    continue
                text += item
                cut, found = cut_at_stop(text, stops)
                if found:
                    text, stopped = cut, True
                    halt.set()
                    break
                safe = len(text) - _held_back(text, stops)
                if safe > released:
                    yield Delta(text[released:safe])
                    released = safe
            if len(text) > released:
                yield Delta(text[released:])
        finally:
            halt.set()
            await worker
        generated = int(stats.get("generated_tokens", 0))
        yield Completion(
            text=text, finish_reason="length" if not stopped and generated >= sreq.max_tokens
            else "stop", prompt_tokens=int(stats.get("receiver_prompt_tokens", 0)),
            completion_tokens=generated, hits=["c2c"], hit_tokens=0, ttft_s=ttft,
            meta={"c2c": {"fused_tokens": int(stats.get("fused_tokens", 0)), "fuser": str(self.path),
                          "sharer_prompt_tokens": int(stats.get("sharer_prompt_tokens", 0)),
                          "sharer_source": stats.get("sharer_source", "")}},
        )

    async def generate(self, pipeline: Any, sreq: GenRequest, outputs: list[str]) -> Completion:
        """Answer stage ``sreq`` with the sharer's understanding of the conversation fused in."""
        system, shared = self._split(sreq)
        pipe = self._pipeline(system, sreq.tenant_ctx)
        stops = [s for s in sreq.stop if s]
        t0 = time.perf_counter()
        gen = await asyncio.to_thread(
            pipe.generate, shared, max_new_tokens=sreq.max_tokens,
            stop=(lambda text: any(s in text for s in stops)) if stops else None)
        elapsed = time.perf_counter() - t0
        text, stopped = cut_at_stop(gen.text, stops)
        stats = dict(getattr(gen, "stats", {}) or {})
        fused = int(stats.get("fused_tokens", 0))
        prompt_tokens = int(stats.get("receiver_prompt_tokens", 0))
        return Completion(
            text=text, finish_reason="length" if not stopped and len(gen.token_ids)
            >= sreq.max_tokens else "stop", prompt_tokens=prompt_tokens, completion_tokens=len(gen.token_ids),
            hits=["c2c"], hit_tokens=0, ttft_s=elapsed,
            meta={"c2c": {"fused_tokens": fused, "fuser": str(self.path),
                          "sharer_prompt_tokens": int(stats.get("sharer_prompt_tokens", 0)),
                          "sharer_source": stats.get("sharer_source", "")}},
        )
