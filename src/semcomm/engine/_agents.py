"""Agents that read what another agent already read: shared segments reused across agents.

Several agents of one model, each with its own role prompt, put the same text (the user's
request, an upstream agent's answer, a retrieved passage) into their prompts after different
prefixes, so an exact prefix cache never hits on it. Here each agent's prompt is a segmented
prompt (engine/_documents.py) whose shared text is :class:`Document` segments, and
:class:`SharedSegments` (a :class:`DocumentReuse`) places each shared segment's KV under the
agent's own prefix, keys re-rotated, then recomputes a share ``r`` of its tokens in context with
the documents issue's selectors (the text outside the shared segments always in full).

Where a shared segment's KV comes from, best first:

1. an **anchor**: the segment's KV as some agent computed it *in context*: the answer an agent
   generated (its own decode KV, free) and every shared segment of a prompt that was prefilled
   in full (the first agent, a fallback). KVCOMM (NeurIPS'25) keeps such in-context copies as
   its anchors; here the most recent anchor of a segment is used (KVCOMM's interpolation of
   offsets between anchors of *different* segment contents is not done). Anchors live in an
   :class:`AnchorPool` bounded in bytes (least recently used evicted first, at most
   ``per_segment`` per segment), keyed by the document key chain, which roots at the engine's
   namespace digest (model, dtype, codec, tenant): another tenant never sees them;
2. the segment's KV computed alone after the chat header (a stored document, the documents
   issue's path), computed and stored on a miss.

Then a **confidence test** on the first next-token distribution decides whether the reused
prefill is kept or the agent falls back to full prefill (KVCOMM falls back when its anchors
disagree; the 2026 judge-consistency work when two reuse methods disagree):

* ``margin``: the top-1 probability minus the top-2 probability below ``margin`` (the reused
  prefill is not sure of its first token) -> full prefill;
* ``dual``: a second reuse method (``dual_selector`` at the same budget) picks another first
  token -> full prefill;
* ``dual+margin`` either; ``off`` never; ``always`` always (tests, and a measured bound).

What each agent reused, recomputed, whether it fell back and why is in its :class:`AgentTurn`.
With ``recompute=1.0`` every token is recomputed: the tokens are full prefill's.
"""

from __future__ import annotations

import re
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidInputError
from ..kv import ChunkKey
from . import _cache_adapter as ca
from ._decode import DecodeState, SamplingParams, decode_steps
from ._documents import (
    SELECTORS,
    BlendStats,
    Document,
    DocumentReuse,
    Segment,
    System,
    Text,
    User,
    rotate_keys,
)

__all__ = [
    "DEFAULT_ANCHOR_BUDGET",
    "GATES",
    "MATH_ROLES",
    "Agent",
    "AgentPipeline",
    "AgentTurn",
    "Anchor",
    "AnchorPool",
    "PipelineRun",
    "SharedSegments",
    "default_agents",
    "extract_choice",
    "extract_number",
]

GATES = ("off", "margin", "dual", "dual+margin", "always")
DEFAULT_ANCHOR_BUDGET = 256 << 20


# ------------------------------------------------------------------------------ anchors
@dataclass
class Anchor:
    """A shared segment's KV as computed in some agent's context: ``k``/``v`` ``[L, H, n, D]``
    (keys as computed, at positions ``start..start+n``)."""

    key: bytes
    k: torch.Tensor
    v: torch.Tensor
    start: int
    source: str

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class AnchorPool:
    """Anchors of shared segments, bounded: at most ``budget_bytes`` in all (least recently used
    evicted first) and ``per_segment`` per segment (the oldest evicted first)."""

    def __init__(self, budget_bytes: int = DEFAULT_ANCHOR_BUDGET, per_segment: int = 4):
        if budget_bytes < 0 or per_segment < 1:
            raise InvalidInputError("an anchor pool takes budget_bytes >= 0 and per_segment >= 1")
        self.budget_bytes = int(budget_bytes)
        self.per_segment = int(per_segment)
        self._items: OrderedDict[tuple[bytes, int], Anchor] = OrderedDict()  # LRU order
        self._serial = 0
        self.nbytes = 0
        self.evictions = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def segments(self) -> int:
        return len({k for k, _ in self._items})

    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, start: int, source: str) -> bool:
        """Keep a copy; False when it alone exceeds the budget (nothing kept)."""
        a = Anchor(bytes(key), k.detach().clone(), v.detach().clone(), int(start), source)
        if a.nbytes > self.budget_bytes:
            return False
        same = [ik for ik in self._items if ik[0] == a.key]
        while len(same) >= self.per_segment:
            self._drop(same.pop(0))
        self._serial += 1
        self._items[(a.key, self._serial)] = a
        self.nbytes += a.nbytes
        while self.nbytes > self.budget_bytes:
            self._drop(next(iter(self._items)))
        return True

    def _drop(self, ik: tuple[bytes, int]) -> None:
        a = self._items.pop(ik)
        self.nbytes -= a.nbytes
        self.evictions += 1

    def has(self, key: bytes) -> bool:
        return any(ik[0] == key for ik in self._items)

    def get(self, key: bytes) -> Anchor | None:
        """The segment's most recent anchor (marked used), or None."""
        found = [ik for ik in self._items if ik[0] == key]
        if not found:
            self.misses += 1
            return None
        ik = max(found, key=lambda t: t[1])
        self._items.move_to_end(ik)
        self.hits += 1
        return self._items[ik]

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, Any]:
        return {"anchors": len(self), "segments": self.segments(), "bytes": self.nbytes,
                "budget_bytes": self.budget_bytes, "evictions": self.evictions,
                "hits": self.hits, "misses": self.misses}


class SharedSegments(DocumentReuse):
    """:class:`DocumentReuse` whose shared segments come from an :class:`AnchorPool` first (the
    in-context KV another agent computed), then from the document store (KV computed alone).
    Blended prompts are not stored whole (their KV depends on the anchors)."""

    def __init__(self, engine: Any, pool: AnchorPool | None = None):
        super().__init__(engine, key_mode="rotated", keep_blended=False)
        self.pool = pool if pool is not None else AnchorPool()
        self.anchor_hits = 0
        self.anchor_tokens = 0

    def segment_key(self, tokens: Sequence[int]) -> bytes:
        """A segment's key: its document key chain's last link (namespace, tenant, tokens)."""
        return self.document_keys(list(tokens))[-1]

    def capture(self, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, start: int,
                source: str) -> bool:
        """Keep ``[L, H, n, D]`` KV of a segment computed at positions ``start..`` as an anchor."""
        if k.shape[2] != len(tokens):
            raise InvalidInputError("an anchor's KV must cover its segment's tokens")
        return self.pool.put(self.segment_key(tokens), k, v, start, source)

    def _fetch_document(self, keys: list[ChunkKey], n: int, out_k: torch.Tensor,
                        out_v: torch.Tensor, at: int, stats: BlendStats) -> bool:
        a = self.pool.get(keys[-1]) if keys else None
        if a is not None and a.k.shape[2] == n:
            # the caller moves keys stored "after the anchor" by (at - len(anchor)): put the
            # anchor's keys there first (one rotation is exact: R(x - y) R(y) = R(x))
            out_k[:, :, at:at + n] = rotate_keys(a.k, len(self.anchor) - a.start, self.spec)
            out_v[:, :, at:at + n] = a.v
            self.anchor_hits += 1
            self.anchor_tokens += n
            return True
        return super()._fetch_document(keys, n, out_k, out_v, at, stats)


# ------------------------------------------------------------------------------- agents
@dataclass(frozen=True)
class Agent:
    """One agent: a role prompt (system message) and what it is asked after the shared text."""

    name: str
    role: str
    instruction: str
    max_new_tokens: int = 128
    judge: bool = False


MATH_ROLES = (
    ("solver", "You are a careful mathematician. You solve problems step by step."),
    ("checker", "You are a meticulous checker. You verify every step of a solution."),
    ("teacher", "You are a patient teacher. You explain solutions simply and correctly."),
    ("skeptic", "You are a skeptical reviewer. You look for mistakes in earlier answers."),
    ("engineer", "You are a practical engineer. You compute quantities exactly."),
    ("analyst", "You are a precise analyst. You restate the facts before solving."),
)
_MATH_ASK = ("Solve the problem briefly (a few short steps; use earlier answers if they help, "
             "fix them if they are wrong). End with: The answer is <number>.")
_CHOICE_ASK = ("Pick the correct option (use earlier answers if they help). Give one short "
               "reason, then end with: The answer is <letter>.")


def default_agents(k: int = 4, kind: str = "math", max_new_tokens: int | None = None
                   ) -> tuple[list[Agent], Agent]:
    """``k`` solvers with different role prompts and a judge, for ``kind`` math or choice."""
    if k < 1:
        raise InvalidInputError("a pipeline needs at least one solver agent")
    ask = _MATH_ASK if kind == "math" else _CHOICE_ASK
    mx = max_new_tokens or (160 if kind == "math" else 48)
    solvers = [Agent(f"{MATH_ROLES[i % len(MATH_ROLES)][0]}{'' if i < len(MATH_ROLES) else i}",
                     MATH_ROLES[i % len(MATH_ROLES)][1], ask, mx) for i in range(k)]
    judge = Agent("judge", "You are a fair judge. You pick the correct answer among candidates.",
                  f"Which answer above is correct? Reply with its number (1 to {k}) only.", 4,
                  judge=True)
    return solvers, judge


def extract_number(text: str) -> str | None:
    """The final number of a math answer ("The answer is N", else the last number)."""
    t = text.replace(",", "")
    m = re.findall(r"answer is[^0-9\-]*(-?\d+(?:\.\d+)?)", t, flags=re.I)
    nums = m or re.findall(r"-?\d+(?:\.\d+)?", t)
    if not nums:
        return None
    x = nums[-1]
    if "." in x:
        x = x.rstrip("0").rstrip(".")
    return x


def extract_choice(text: str, k: int) -> int | None:
    """The option index of a multiple-choice answer ("The answer is B", else the first lone
    letter among the first ``k``)."""
    letters = "ABCDEFGHIJ"[:k]
    m = re.findall(rf"answer is\W*\(?([{letters}])\b", text)
    if not m:
        m = re.findall(rf"\b([{letters}])\b", text)
    return letters.index(m[-1] if m and "answer is" in text else m[0]) if m else None


# ------------------------------------------------------------------------------ results
@dataclass
class AgentTurn:
    """What one agent did: its answer, prompt, what it reused, TTFT, the gate's verdict."""

    name: str
    text: str
    tokens: list[int]
    prompt_tokens: int
    reused_tokens: int = 0  # shared-segment tokens whose reused KV was kept
    prefix_hit_tokens: int = 0  # exact prefix restored from the prefix cache
    recomputed_tokens: int = 0
    anchor_segments: int = 0  # shared segments placed from an anchor
    stored_segments: int = 0  # shared segments placed from the document store
    computed_segments: int = 0  # shared segments computed alone on a miss
    mode: str = "full"  # full, reuse, fallback
    gate: str = ""
    gate_detail: dict[str, Any] = field(default_factory=dict)
    selector: str = ""
    recompute: float = 0.0
    pick: int | None = None  # a judge's pick (0-based) by its candidate numbers' logits
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def saved_tokens(self) -> int:
        return self.reused_tokens + self.prefix_hit_tokens

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tokens"}
        out["saved_tokens"] = self.saved_tokens
        return out


@dataclass
class PipelineRun:
    question: str
    turns: list[AgentTurn]
    pick: int | None  # the judge's pick (0-based), None without a parsable pick
    final_text: str
    latency_s: float

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)

    @property
    def reused_share(self) -> float:
        n = self.prompt_tokens
        return sum(t.saved_tokens for t in self.turns) / n if n else 0.0


# ----------------------------------------------------------------------------- pipeline
class AgentPipeline:
    """K solver agents of one engine, each reading the question and every earlier solver's
    answer, then a judge that picks one answer by its number.

    Args:
        engine: an :class:`HFEngine` (a store makes documents and role prompts reusable).
        solvers, judge: the agents (:func:`default_agents`); judge None: the last solver's
            answer is final.
        reuse: False runs every agent by full prefill (the baseline; with the engine's store,
            exact prefixes, e.g. role prompts, are still reused).
        selector, recompute: how shared segments are blended (engine/_documents.py).
        gate, margin, dual_selector: the confidence test (module docstring); ``judge_gate``
            the judge's (default ``dual+margin``: the judge's first token is its decision).
        pool: the anchors (a new :class:`AnchorPool` by default).
        anchors: False never uses anchors (documents computed alone only).
    """

    def __init__(self, engine: Any, solvers: Sequence[Agent], judge: Agent | None = None, *,
                 reuse: bool = True, selector: str = "epic", recompute: float = 0.15,
                 gate: str = "margin", judge_gate: str = "dual+margin", margin: float = 0.02,
                 dual_selector: str = "concat", pool: AnchorPool | None = None,
                 anchors: bool = True, kind: str = "math"):
        for g in (gate, judge_gate):
            if g not in GATES:
                raise InvalidInputError(f"unknown gate {g!r}; one of {', '.join(GATES)}")
        for s in (selector, dual_selector):
            if s not in SELECTORS:
                raise InvalidInputError(f"unknown selector {s!r}; one of {', '.join(SELECTORS)}")
        if not solvers:
            raise InvalidInputError("a pipeline needs at least one solver agent")
        self.engine = engine
        self.solvers = list(solvers)
        self.judge = judge
        self.reuse = bool(reuse)
        self.selector = selector
        self.recompute = float(recompute)
        self.gate = gate
        self.judge_gate = judge_gate
        self.margin = float(margin)
        self.dual_selector = dual_selector
        self.use_anchors = bool(anchors)
        self.kind = kind
        self.shared = SharedSegments(engine, pool) if self.reuse else None
        self.pool = self.shared.pool if self.shared is not None else None

    # ----------------------------------------------------------- prompts
    @staticmethod
    def segments(agent: Agent, question: Document, answers: Sequence[Document]) -> list[Segment]:
        """An agent's prompt: role, the question and earlier answers (shared), its ask."""
        segs: list[Segment] = [System(agent.role), User("Problem:\n"), question, Text("\n\n")]
        for j, a in enumerate(answers):
            segs += [Text(f"Answer {j + 1}:\n"), a, Text("\n\n")]
        segs.append(Text(agent.instruction))
        return segs

    # ----------------------------------------------------------- one agent
    def _full_prefill(self, ids: list[int], capacity: int) -> tuple[Any, torch.Tensor, int]:
        eng = self.engine
        pre = eng.prefill(ids, store=eng.store is not None)
        return pre.cache, pre.last_logits, int(pre.stats.hit_tokens)

    def _gate(self, gate: str, logits: torch.Tensor, prompt: Any,
              restrict: list[int] | None = None) -> tuple[bool, dict[str, Any]]:
        """(keep the reused prefill?, what was measured); ``restrict``: the token ids the
        decision is among (a judge's candidate numbers)."""
        if restrict:
            logits = logits[restrict]
        if gate == "off":
            return True, {}
        if gate == "always":
            return False, {"forced": True}
        detail: dict[str, Any] = {}
        keep = True
        if "margin" in gate:
            p = torch.softmax(logits.float(), -1)
            top = torch.topk(p, 2).values
            m = float(top[0] - top[1])
            detail["margin"] = round(m, 4)
            keep = keep and m >= self.margin
        if "dual" in gate and keep:
            assert self.shared is not None
            other = self.shared.prefill(prompt, selector=self.dual_selector,
                                        recompute=self.recompute, store=False).last_logits
            if restrict:
                other = other[restrict]
            a, b = int(logits.argmax()), int(other.argmax())
            detail["dual_agree"] = a == b
            keep = keep and a == b
        return keep, detail

    def choice_tokens(self, k: int) -> list[int] | None:
        """Token ids of the candidate numbers "1".."k" (None unless each is one token)."""
        tok = self.engine.tokenizer
        if tok is None:
            return None
        ids = [tok(str(i), add_special_tokens=False)["input_ids"] for i in range(1, k + 1)]
        return [x[0] for x in ids] if all(len(x) == 1 for x in ids) else None

    def run_agent(self, agent: Agent, question: Document, answers: Sequence[Document],
                  gate: str | None = None) -> tuple[AgentTurn, Any, int]:
        """Run one agent; returns its turn, its cache (prompt + answer) and its prompt length.

        A judge with single-token candidate numbers picks by its first next-token logits over
        those numbers only (``turn.pick``; no decoding), so the gate tests the decision itself.
        """
        eng = self.engine
        segs = self.segments(agent, question, answers)
        t0 = time.perf_counter()
        shared = self.shared
        turn = AgentTurn(agent.name, "", [], 0)
        if shared is not None:
            prompt = shared.prepare(segs)
            ids = list(prompt.ids)
            reusable = any(self._available(ids[s:e]) for s, e in prompt.spans)
        else:
            from ._documents import build_prompt

            prompt = build_prompt(eng.tokenizer, segs)
            ids = list(prompt.ids)
            reusable = False
        n = len(ids)
        turn.prompt_tokens = n
        restrict = self.choice_tokens(len(answers)) if agent.judge and answers else None
        cap = n + agent.max_new_tokens + 1
        full = True
        if reusable and shared is not None:
            shared.anchor_hits = shared.anchor_tokens = 0
            pre = shared.prefill(prompt, selector=self.selector, recompute=self.recompute,
                                 capacity=cap, store=False)
            st = pre.stats
            anchor_hits = shared.anchor_hits
            g = gate or (self.judge_gate if agent.judge else self.gate)
            keep, detail = self._gate(g, pre.last_logits, prompt, restrict)
            turn.gate, turn.gate_detail = g, detail
            turn.selector, turn.recompute = st.selector, self.recompute
            if keep:
                full = False
                cache, logits = pre.cache, pre.last_logits
                turn.mode = "reuse"
                turn.reused_tokens = st.reused_tokens
                turn.prefix_hit_tokens = st.prefix_hit_tokens
                turn.recomputed_tokens = st.recomputed_tokens
                turn.anchor_segments = anchor_hits
                turn.stored_segments = st.documents_hit - anchor_hits
                turn.computed_segments = st.documents_computed
                for job in pre.store_jobs:  # documents computed alone, the exact head
                    job()
            else:
                turn.mode = "fallback"
        if full:
            cache, logits, hit = self._full_prefill(ids, cap)
            turn.prefix_hit_tokens = hit
            turn.recomputed_tokens = n - hit
        if restrict:  # the judge's decision: the most likely candidate number
            turn.pick = int(logits[restrict].argmax())
            turn.ttft_s = turn.total_s = time.perf_counter() - t0
            turn.tokens = [restrict[turn.pick]]
            turn.text = str(turn.pick + 1)
            return turn, cache, n
        seq = DecodeState(eng.tokenizer, SamplingParams(), eng.device,
                          max_new_tokens=agent.max_new_tokens, eos_ids=eng.eos_token_ids)
        step = torch.zeros((1, 1), dtype=torch.long, device=eng.device)

        def forward(nxt: list[int]) -> torch.Tensor:
            step.fill_(nxt[0])
            with torch.inference_mode():
                return eng._runner.forward(step, cache)[None]

        for i, _ in enumerate(decode_steps([seq], logits[None], forward)):
            if i == 0:
                turn.ttft_s = time.perf_counter() - t0
        seq.finish()
        toks = [t for t in seq.token_ids if t not in eng.eos_token_ids]
        turn.tokens = toks
        turn.text = (seq.text or "").strip() if eng.tokenizer is not None else ""
        turn.total_s = time.perf_counter() - t0
        # anchors: the shared segments of a fully prefilled prompt, and the answer itself
        if shared is not None and self.use_anchors:
            if full:
                for s, e in prompt.spans:
                    k, v = ca.stack_range(cache, s, e)
                    shared.capture(ids[s:e], k, v, s, agent.name)
            if toks:
                have = ca.cache_length(cache)
                missing = n + len(toks) - have
                if missing > 0:  # the last chosen tokens were never fed: feed them
                    with torch.inference_mode():
                        eng._runner.forward(torch.tensor([toks[len(toks) - missing:]],
                                                         device=eng.device), cache)
                k, v = ca.stack_range(cache, n, n + len(toks))
                shared.capture(toks, k, v, n, agent.name)
        elif shared is not None and eng.store is not None:
            # documents only: each shared segment and the answer computed alone and stored
            # (after the agent's answer, so later agents find them)
            for seg in [ids[s:e] for s, e in prompt.spans] + ([toks] if toks else []):
                shared.precompute(Document(tokens=tuple(seg)))
        return turn, cache, n

    def _available(self, tokens: list[int]) -> bool:
        shared = self.shared
        assert shared is not None
        key = shared.segment_key(tokens)
        if self.use_anchors and shared.pool.has(key):
            return True
        return shared.is_stored(Document(tokens=tuple(tokens)))

    # ----------------------------------------------------------- the pipeline
    def run(self, question: str, choices: Sequence[str] | None = None) -> PipelineRun:
        """Every solver in order, then the judge; the final answer is the picked one's text
        (without a judge or a parsable pick: the most common extracted answer, latest wins)."""
        t0 = time.perf_counter()
        text = question
        if choices:
            text += "\n" + "\n".join(f"{'ABCDEFGHIJ'[i]}. {c}" for i, c in enumerate(choices))
        qdoc = Document(text)
        answers: list[Document] = []
        turns: list[AgentTurn] = []
        for agent in self.solvers:
            turn, _, _ = self.run_agent(agent, qdoc, answers)
            turns.append(turn)
            answers.append(Document(tokens=tuple(turn.tokens)) if turn.tokens
                           else Document("(no answer)"))
        pick: int | None = None
        if self.judge is not None:
            turn, _, _ = self.run_agent(self.judge, qdoc, answers)
            turns.append(turn)
            m = re.search(r"\d+", turn.text)
            if turn.pick is not None:
                pick = turn.pick
            elif m and 1 <= int(m.group()) <= len(self.solvers):
                pick = int(m.group()) - 1
        solver_texts = [t.text for t in turns[: len(self.solvers)]]
        if pick is not None:
            final = solver_texts[pick]
        else:
            keyed = [self._final(t, len(choices or ())) for t in solver_texts]
            counts = Counter(k for k in keyed if k is not None)
            best = max(counts.values(), default=0)
            final = next((t for t, k in zip(reversed(solver_texts), reversed(keyed))
                          if k is not None and counts[k] == best), solver_texts[-1])
        return PipelineRun(question, turns, pick, final, time.perf_counter() - t0)

    @staticmethod
    def _final(text: str, k: int) -> Any:
        return extract_choice(text, k) if k else extract_number(text)
