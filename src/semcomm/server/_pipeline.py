"""Pipelines: a chain of model stages served under one virtual model name.

Prompt layout. Every stage sees the client's conversation first, then the earlier stages'
instructions and outputs, then its own instruction::

    stage 0: conversation + [system: s0]
    stage 1: conversation + [system: s0] + [assistant: out0] + [system: s1]
    stage 2: ... + [assistant: out1] + [system: s2]

so each stage's prompt extends the previous stage's prompt and output. Handoff per transition,
chosen automatically (``handoff = "auto"``) from what is available:

* ``kv``: same model, KV-reusing engine. The next stage restores the previous stage's prompt
  from the KV prefix cache (and its output too when the engine stores it) instead of
  recomputing it; only the new tail is prefilled.
* ``c2c``: different models with a trained fuser (``semcomm.fusion``): the receiver reads the
  sharer's KV of the shared context through the fuser; the sharer writes no text.
* ``text``: the fallback; the previous output is passed as text and prefilled again.

With ``layout = "shared"`` a stage's prompt starts with its own system prompt (a role), then
the request and the earlier answers it reads, each a document::

    stage i: [system: s_i] + [user: "Request:" <request> "Answer 1 (role):" <out_0> ...]

so the text the stages share follows a different prefix in each, and an exact prefix cache
never hits on it; an in-process model with KV reuse reuses each document's KV under every
stage's prompt instead (``shared`` handoff, engine/_documents.py: stored once, re-rotated,
a share recomputed in context). A model with an anchor pool (``[models.X] anchor_bytes``)
reuses the KV as an earlier stage computed it in context first: the request as a stage
prefilled in full read it, an answer as its stage generated it (``response["semcomm"]
["anchors"]``). ``pattern = "fanout"`` runs every stage but the last on the
request alone (specialists, concurrently) and the last on all their answers (a synthesizer or
a judge); a chain's stage reads every earlier answer.

The modes used are reported in ``response["semcomm"]["handoffs"]`` and the
``semcomm_pipeline_handoffs`` metric.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from ..runtime import Completion, Started, StreamItem
from ._backends import BackendStatus, GenRequest, ModelBackend, Piece, collect, messages_text
from ._c2c import C2CHandoff, FusionRegistry
from ._config import PipelineConfig

__all__ = ["PipelineBackend", "stage_messages"]

log = logging.getLogger(__name__)


def stage_messages(base: list[dict[str, str]], systems: list[str], outputs: list[str],
                   stage: int) -> list[dict[str, str]]:
    """The messages stage ``stage`` sees (see the module docstring)."""
    msgs = list(base)
    for j in range(stage + 1):
        if systems[j]:
            msgs.append({"role": "system", "content": systems[j]})
        if j < stage and outputs[j]:
            msgs.append({"role": "assistant", "content": outputs[j]})
    return msgs


def _reused(c: Completion) -> int:
    """Document tokens a stage's completion reused (0 without documents)."""
    doc = c.meta.get("documents")
    return int(doc["reused_tokens"]) if doc else 0


def _anchors(done: Sequence[Completion]) -> dict[str, int]:
    """What the stages' anchors did (engine/_anchors.py): documents placed from one, their
    tokens, and the segments kept as anchors (documents in context, answers)."""
    docs = [c.meta["documents"] for c in done if c.meta.get("documents")]
    return {"documents": sum(int(d.get("documents_anchored", 0)) for d in docs),
            "tokens": sum(int(d.get("anchored_tokens", 0)) for d in docs),
            "captured": sum(int(d.get("anchors_captured", 0)) for d in docs)}


class PipelineBackend:
    """A virtual model that runs its stages in order (see the module docstring)."""

    kind = "pipeline"
    kv_reuse = False  # its stages reuse KV, not the pipeline as one model
    max_positions = None

    def __init__(self, name: str, cfg: PipelineConfig, models: Mapping[str, ModelBackend],
                 fusions: FusionRegistry | None = None) -> None:
        """``models``: the backends the stages name; ``fusions``: C2C handoffs (None: none)."""
        self.name = name
        self.cfg = cfg
        self.models = models
        self.fusions = fusions

    def _backend(self, i: int) -> ModelBackend:
        return self.models[self.cfg.stages[i].model]

    def handoff_mode(self, i: int) -> str:
        """Mode of the handoff into stage ``i`` (i >= 1)."""
        prev, cur = self.cfg.stages[i - 1], self.cfg.stages[i]
        b = self._backend(i)
        if self.cfg.layout == "shared":  # documents reused under each stage's own prompt
            return "shared" if b.kv_reuse and self.cfg.handoff in ("auto", "kv") else "text"
        want = self.cfg.handoff
        same = prev.model == cur.model
        kv_ok = same and b.kv_reuse
        if want in ("auto", "kv") and kv_ok:
            return "kv"
        if want in ("auto", "c2c") and not same and self._fusion(i) is not None:
            return "c2c"
        return "text"

    def _fusion(self, i: int) -> C2CHandoff | None:
        if self.fusions is None:
            return None
        return self.fusions.get(self.cfg.stages[i - 1].model, self.cfg.stages[i].model,
                                self.cfg.fuser)

    def plan_note(self) -> str:
        try:
            modes = [self.handoff_mode(i) for i in range(1, len(self.cfg.stages))]
        except KeyError:
            return "stages reference missing models"
        sep = " | " if self.cfg.pattern == "fanout" else " -> "
        chain = sep.join(s.model for s in self.cfg.stages[:-1])
        chain = (f"({chain}) -> " if self.cfg.pattern == "fanout" else
                 (chain + " -> " if chain else "")) + self.cfg.stages[-1].model
        return f"{chain}; {self.cfg.pattern}, {self.cfg.layout} layout; handoffs {modes or ['none']}"

    def prepare(self, req: GenRequest) -> None:
        return None  # each stage prepares its own request

    def status(self) -> BackendStatus:
        ups = [self._backend(i).status() for i in range(len(self.cfg.stages))]
        down = [s.detail for s in ups if not s.up]
        return BackendStatus(up=not down, detail="; ".join(down) or self.plan_note(),
                             queue_depth=sum(s.queue_depth for s in ups),
                             in_flight=sum(s.in_flight for s in ups))

    def _stage_req(self, req: GenRequest, i: int, messages: list[dict[str, str]]) -> GenRequest:
        st = self.cfg.stages[i]
        return GenRequest(model=st.model, messages=messages, prompt=None,
                          max_tokens=st.max_tokens or req.max_tokens,
                          temperature=req.temperature, top_p=req.top_p,
                          stop=req.stop if i == len(self.cfg.stages) - 1 else [],
                          seed=req.seed, tenant=req.tenant,
                          request_id=f"{req.request_id}.{i}",
                          stream=req.stream and i == len(self.cfg.stages) - 1, ctx=req.ctx)

    def _shared_req(self, req: GenRequest, i: int, request: str,
                    answers: Sequence[tuple[int, str]]) -> GenRequest:
        """Stage ``i``'s request in the shared layout: its system prompt, then the request and
        the ``(stage, answer)`` pairs it reads, each a document (module docstring)."""
        st = self.cfg.stages[i]
        pieces = [Piece("system", st.system)] if st.system else []
        pieces.append(Piece("user", "Request:\n"))
        if request:
            pieces.append(Piece("user", request, document=True))
        for k, (j, text) in enumerate(answers, 1):
            who = self.cfg.stages[j].role or self.cfg.stages[j].model
            pieces.append(Piece("user", f"\n\nAnswer {k} ({who}):\n"))
            if text:
                pieces.append(Piece("user", text, document=True))
        pieces.append(Piece("user", "\n\n"))
        sreq = self._stage_req(req, i, [])
        sreq.messages = ([{"role": "system", "content": st.system}] if st.system else []) + [
            {"role": "user", "content": "".join(p.text for p in pieces if p.role == "user")}]
        # text handoff: the same prompt, read as plain text (nothing reused across stages)
        sreq.documents = pieces if self.cfg.handoff in ("auto", "kv") else None
        sreq.selector, sreq.recompute = self.cfg.selector, self.cfg.recompute
        sreq.margin, sreq.watch = self.cfg.margin, self.cfg.watch
        return sreq

    async def _stream_shared(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        request = (messages_text(req.messages).rstrip("\n") if req.messages is not None
                   else req.prompt or "")
        stages = self.cfg.stages
        last = len(stages) - 1
        outputs = [""] * len(stages)
        comps: list[Completion | None] = [None] * len(stages)
        handoffs: dict[str, int] = {}
        for i in range(1, last + 1):
            mode = self.handoff_mode(i)
            handoffs[mode] = handoffs.get(mode, 0) + 1

        async def run(i: int, reads: list[int]) -> None:
            sreq = self._shared_req(req, i, request, [(j, outputs[j]) for j in reads])
            comps[i] = c = await collect(self._backend(i).stream(sreq))
            outputs[i] = c.text

        if self.cfg.pattern == "fanout":  # specialists at once, each on the request alone
            await asyncio.gather(*(run(i, []) for i in range(last)))
        else:
            for i in range(last):
                await run(i, list(range(i)))
        earlier = [c for c in comps[:last] if c is not None]
        reused = [_reused(c) for c in earlier]
        before_prompt = sum(c.prompt_tokens for c in earlier)
        before_kv = sum(c.hit_tokens for c in earlier) - sum(reused)
        sreq = self._shared_req(req, last, request, [(j, outputs[j]) for j in range(last)])
        final: Completion | None = None
        async for item in self._backend(last).stream(sreq):
            if isinstance(item, Started):  # kv: exact prefixes; docs: documents reused
                docs = sum(reused) + sum(int(x[5:]) for x in item.layers
                                         if x.startswith("docs:"))
                yield Started(prompt_tokens=before_prompt + item.prompt_tokens,
                              hit_tokens=before_kv + item.hit_tokens,
                              layers=(f"docs:{docs}",) if docs else ())
            elif isinstance(item, Completion):
                final = comps[last] = item
            else:
                yield item
        if final is None:  # pragma: no cover - the backend broke the stream contract
            raise RuntimeError(f"pipeline {self.name!r}: stage {last} ended without a result")
        done = [c for c in comps if c is not None]
        saved: dict[str, int] = {}
        for c in done:
            saved["docs"] = saved.get("docs", 0) + _reused(c)
            saved["kv"] = saved.get("kv", 0) + c.hit_tokens - _reused(c)
        saved = {k: v for k, v in saved.items() if v}
        hits = [f"kv:{saved['kv']}"] if saved.get("kv") else []
        hits += [f"docs:{saved['docs']}"] if saved.get("docs") else []
        yield Completion(
            text=final.text, finish_reason=final.finish_reason,
            prompt_tokens=sum(c.prompt_tokens for c in done),
            completion_tokens=sum(c.completion_tokens for c in done), hits=hits,
            hit_tokens=sum(c.hit_tokens for c in done), ttft_s=final.ttft_s,
            meta={"model": self.name, "pipeline": self.name, "pattern": self.cfg.pattern,
                  "layout": "shared", "handoffs": handoffs, "saved_tokens_by_layer": saved,
                  "anchors": _anchors(done),
                  "stages": [{"stage": i, "model": stages[i].model, "role": stages[i].role,
                              "prompt_tokens": c.prompt_tokens, "hit_tokens": c.hit_tokens,
                              "completion_tokens": c.completion_tokens,
                              "ttft_s": round(c.ttft_s, 6),
                              **({"documents": c.meta["documents"]}
                                 if "documents" in c.meta else {})}
                             for i, c in enumerate(comps) if c is not None],
                  "intermediate": outputs[:-1]})

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamItem]:
        if self.cfg.layout == "shared":
            async for item in self._stream_shared(req):
                yield item
            return
        base = req.messages if req.messages is not None else [
            {"role": "user", "content": req.prompt or ""}]
        systems = [s.system for s in self.cfg.stages]
        outputs: list[str] = []
        stages_meta: list[dict[str, Any]] = []
        handoffs: dict[str, int] = {}
        saved: dict[str, int] = {}
        prompt_total = completion_total = hit_total = 0
        last = len(self.cfg.stages) - 1
        modes = ["start"] + [self.handoff_mode(i) for i in range(1, last + 1)]
        for i in range(last + 1):
            mode = modes[i]
            if i:
                handoffs[mode] = handoffs.get(mode, 0) + 1
            if i < last and modes[i + 1] == "c2c":
                # a sharer writes no text: the next stage reads its KV through the fuser
                outputs.append("")
                systems[i] = ""
                stages_meta.append({"stage": i, "model": self.cfg.stages[i].model,
                                    "role": self.cfg.stages[i].role, "handoff": mode,
                                    "prompt_tokens": 0, "hit_tokens": 0,
                                    "completion_tokens": 0, "ttft_s": 0.0, "sharer": True})
                continue
            sreq = self._stage_req(req, i, stage_messages(base, systems, outputs, i))
            backend = self._backend(i)
            if mode == "c2c":
                handoff = self._fusion(i)
                assert handoff is not None  # handoff_mode chose c2c because it exists
                items = None
                if i == last:  # the fused answer streams piece by piece as it is decoded
                    comp = None
                    async for item in handoff.stream(sreq):
                        if isinstance(item, Started):
                            yield Started(prompt_tokens=prompt_total + item.prompt_tokens,
                                          hit_tokens=hit_total + item.hit_tokens, layers=("c2c",))
                        elif isinstance(item, Completion):
                            comp = item
                        else:
                            yield item
                else:
                    comp = await handoff.generate(self, sreq, outputs)
            elif i < last:
                comp = await collect(backend.stream(sreq))
                items = None
            else:
                items = backend.stream(sreq)
                comp = None
            if items is not None:  # final stage: stream it through
                async for item in items:
                    if isinstance(item, Started):
                        yield Started(prompt_tokens=prompt_total + item.prompt_tokens,
                                      hit_tokens=hit_total + item.hit_tokens,
                                      layers=("c2c",) if handoffs.get("c2c") else ())
                    elif isinstance(item, Completion):
                        comp = item
                    else:
                        yield item
            assert comp is not None
            if mode == "c2c":
                fused = int((comp.meta.get("c2c") or {}).get("fused_tokens", 0))
                saved["c2c"] = saved.get("c2c", 0) + fused
            layer = "kv" if mode in ("kv", "start") else ("c2c" if mode == "c2c" else "")
            if comp.hit_tokens:
                key = "snapshot" if mode == "kv" else (layer or "kv")
                saved[key] = saved.get(key, 0) + comp.hit_tokens
            prompt_total += comp.prompt_tokens
            completion_total += comp.completion_tokens
            hit_total += comp.hit_tokens
            outputs.append(comp.text)
            stages_meta.append({"stage": i, "model": self.cfg.stages[i].model,
                                "role": self.cfg.stages[i].role, "handoff": mode,
                                "prompt_tokens": comp.prompt_tokens,
                                "hit_tokens": comp.hit_tokens,
                                "completion_tokens": comp.completion_tokens,
                                "ttft_s": round(comp.ttft_s, 6), **({"c2c": comp.meta["c2c"]}
                                                                   if "c2c" in comp.meta else {})})
            if i == last:
                hits = []
                if saved.get("kv") or saved.get("snapshot"):
                    hits.append(f"kv:{saved.get('kv', 0) + saved.get('snapshot', 0)}")
                if saved.get("c2c") or handoffs.get("c2c"):
                    hits.append("c2c")
                yield Completion(
                    text=comp.text, finish_reason=comp.finish_reason,
                    prompt_tokens=prompt_total, completion_tokens=completion_total,
                    hits=hits, hit_tokens=hit_total, ttft_s=comp.ttft_s,
                    meta={"model": self.name, "pipeline": self.name, "stages": stages_meta,
                          "handoffs": handoffs, "saved_tokens_by_layer": saved,
                          "intermediate": outputs[:-1]},
                )

    async def aclose(self) -> None:
        return None
