"""Agents that read what another agent already read: shared segments reused across agents.

Several agents of one model, each with its own role prompt, put the same text (the user's
request, an upstream agent's answer, a retrieved passage) into their prompts after different
prefixes, so an exact prefix cache never hits on it. Here each agent's prompt is a segmented
prompt (engine/_documents.py) whose shared text is :class:`Document` segments, and a
:class:`DocumentReuse` with an :class:`AnchorPool` places each shared segment's KV under the
agent's own prefix, keys re-rotated, then recomputes a share ``r`` of its tokens in context with
the documents issue's selectors (the text outside the shared segments always in full).

Where a shared segment's KV comes from, best first:

1. an **anchor**: the segment's KV as some agent computed it *in context*: the answer an agent
   generated (its own decode KV, free) and every shared segment of a prompt that was prefilled
   in full (the first agent, a fallback). KVCOMM (NeurIPS'25) keeps such in-context copies as
   its anchors; here the most recent anchor of a segment is used, and with ``offsets`` the
   anchor gets the offset (exact minus anchored KV) its slot learned on earlier questions,
   as KVCOMM's placeholder offsets do (docs/agents.md "Offsets"). Anchors live in an
   :class:`AnchorPool` (engine/_anchors.py: bounded in bytes, keyed under the engine's
   namespace, tenant included); capturing and placing them is :class:`DocumentReuse`'s, the
   same code the engine runs for any prompt with documents (``HFEngine(anchors=...)``);
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

The test sees the first token only, and a long answer decoded after reused KV can drift later.
``watch`` guards the rest: while an agent decodes after a kept reused prefill, the first step
whose top-1 minus top-2 probability is below ``watch`` has the KV rebuilt in full (the prompt
and the tokens so far, one prefill), and decoding goes on from exact KV; the agent's first
token (its TTFT) is still the reused prefill's. ``judge_margin``: the judge's own threshold
(its decision is one token among the candidate numbers).

What each agent reused, recomputed, whether it fell back and why is in its :class:`AgentTurn`.
With ``recompute=1.0`` every token is recomputed: the tokens are full prefill's.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidInputError
from ._anchors import AnchorPool
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
    _margin,
)

__all__ = [
    "DEFAULT_JUDGE_GATE",
    "DEFAULT_WATCH",
    "GATES",
    "MATH_ROLES",
    "Agent",
    "AgentPipeline",
    "AgentTurn",
    "PipelineRun",
    "default_agents",
    "extract_choice",
    "extract_number",
]

GATES = ("off", "margin", "dual", "dual+margin", "always")
# the defaults, measured (docs/agents.md "Measured"): a solver's answer is watched past its first
# token; the judge prefills in full (its pick moved under reuse with margins up to 0.23, and no
# test cheap enough to pay for itself kept it: with a 0.3 margin 14 of 16 judges fell back)
DEFAULT_WATCH = 0.1
DEFAULT_JUDGE_GATE = "always"


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
    offsets_applied: int = 0  # of those, segments that got their slot's learned offset
    offsets_learned: int = 0  # exact segments of this turn learned as offset samples
    stored_segments: int = 0  # shared segments placed from the document store
    computed_segments: int = 0  # shared segments computed alone on a miss
    mode: str = "full"  # full, reuse, fallback
    gate: str = ""
    gate_detail: dict[str, Any] = field(default_factory=dict)
    selector: str = ""
    recompute: float = 0.0
    pick: int | None = None  # a judge's pick (0-based) by its candidate numbers' logits
    repaired_at: int | None = None  # ``watch``: the answer token after which KV was rebuilt
    ttft_s: float = 0.0
    total_s: float = 0.0

    @property
    def saved_tokens(self) -> int:
        """Prompt tokens not recomputed: none once ``watch`` rebuilt the KV in full."""
        return 0 if self.repaired_at is not None else self.reused_tokens + self.prefix_hit_tokens

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
            and ``judge_margin`` (default ``margin``) the judge's (default ``always``: the
            judge prefills in full; ``dual+margin`` tests its decision, its first token).
        watch: rebuild the KV in full at the first decode step after a kept reused prefill
            whose top-1 minus top-2 probability is below this (0: off; module docstring).
            Default 0.1.
        pool: the anchors (default: the engine's ``anchors``, else a new :class:`AnchorPool`).
        anchors: False never uses anchors (documents computed alone only; ``pool`` is None).
        offsets: KVCOMM's offsets (engine/_anchors.py): each agent's shared segment placed
            from an anchor gets the mean difference between exact and anchored KV learned for
            that agent, segment and anchor source from earlier questions' exact prompts; an
            agent prefills in full (``mode`` ``warmup``) until its slot has ``offsets``
            samples. 0: off.
    """

    def __init__(self, engine: Any, solvers: Sequence[Agent], judge: Agent | None = None, *,
                 reuse: bool = True, selector: str = "epic", recompute: float = 0.15,
                 gate: str = "margin", judge_gate: str = DEFAULT_JUDGE_GATE,
                 margin: float = 0.02,
                 dual_selector: str = "concat", pool: AnchorPool | None = None,
                 anchors: bool = True, kind: str = "math", watch: float = DEFAULT_WATCH,
                 judge_margin: float | None = None, offsets: int = 0):
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
        self.judge_margin = self.margin if judge_margin is None else float(judge_margin)
        self.watch = float(watch)
        if not 0.0 <= self.watch <= 1.0:
            raise InvalidInputError(f"watch must be within [0, 1], got {watch}")
        self.dual_selector = dual_selector
        self.use_anchors = bool(anchors)
        self.kind = kind
        self.pool: AnchorPool | None = None
        if self.reuse and self.use_anchors:
            self.pool = pool if pool is not None else engine.anchors or AnchorPool()
        # blended prompts are not stored whole: an agent's prompt is seldom asked again
        self.offsets = int(offsets) if self.pool is not None else 0
        self.shared = (DocumentReuse(engine, keep_blended=False, pool=self.pool,
                                     offsets=self.offsets) if self.reuse else None)

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
              restrict: list[int] | None = None, margin: float | None = None
              ) -> tuple[bool, dict[str, Any]]:
        """(keep the reused prefill?, what was measured); ``restrict``: the token ids the
        decision is among (a judge's candidate numbers)."""
        if restrict:
            logits = logits[restrict]
        if gate == "always":
            return False, {"forced": True}
        m = _margin(logits)
        detail: dict[str, Any] = {"margin": round(m, 4)}  # reported under any test
        if gate == "off":
            return True, detail
        keep = True
        if "margin" in gate:
            keep = keep and m >= (self.margin if margin is None else margin)
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
            reusable = any(shared.available(ids[s:e]) for s, e in prompt.spans)
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
        g = gate or (self.judge_gate if agent.judge else self.gate)
        if reusable and shared is not None and g == "always":  # no blend to test: in full
            turn.gate, turn.gate_detail = g, {"forced": True}
            turn.mode = "fallback"
        elif reusable and shared is not None:
            pre = shared.prefill(prompt, selector=self.selector, recompute=self.recompute,
                                 capacity=cap, store=False)
            st = pre.stats
            if st.full_prefill:  # a slot's offset is still learning: prefilled in full
                full = False
                cache, logits = pre.cache, pre.last_logits
                turn.mode = "warmup"
                turn.prefix_hit_tokens = st.prefix_hit_tokens
                turn.recomputed_tokens = st.recomputed_tokens
                for job in pre.store_jobs:
                    job()
            else:
                keep, detail = self._gate(g, pre.last_logits, prompt, restrict,
                                          self.judge_margin if agent.judge else self.margin)
                turn.gate, turn.gate_detail = g, detail
                turn.selector, turn.recompute = st.selector, self.recompute
                if keep:
                    full = False
                    cache, logits = pre.cache, pre.last_logits
                    turn.mode = "reuse"
                    turn.reused_tokens = st.reused_tokens
                    turn.prefix_hit_tokens = st.prefix_hit_tokens
                    turn.recomputed_tokens = st.recomputed_tokens
                    turn.anchor_segments = st.documents_anchored
                    turn.stored_segments = st.documents_hit
                    turn.computed_segments = st.documents_computed
                    turn.offsets_applied = st.offsets_applied
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
            if shared is not None and turn.mode != "reuse":  # exact: its documents as anchors
                self._capture_exact(turn, prompt, cache, agent.name)
            return turn, cache, n
        seq = DecodeState(eng.tokenizer, SamplingParams(), eng.device,
                          max_new_tokens=agent.max_new_tokens, eos_ids=eng.eos_token_ids)
        step = torch.zeros((1, 1), dtype=torch.long, device=eng.device)
        watch = self.watch if turn.mode == "reuse" else 0.0

        def forward(nxt: list[int]) -> torch.Tensor:
            nonlocal cache, watch
            step.fill_(nxt[0])
            with torch.inference_mode():
                out = eng._runner.forward(step, cache)[None]
            if watch and _margin(out[0]) < watch:  # unsure: go on from exact KV
                watch = 0.0
                turn.repaired_at = len(seq.token_ids)
                pre = eng.prefill(ids + list(seq.token_ids), store=False)
                cache, out = pre.cache, pre.last_logits[None]
            return out

        for i, _ in enumerate(decode_steps([seq], logits[None], forward)):
            if i == 0:
                turn.ttft_s = time.perf_counter() - t0
        seq.finish()
        toks = [t for t in seq.token_ids if t not in eng.eos_token_ids]
        turn.tokens = toks
        turn.text = (seq.text or "").strip() if eng.tokenizer is not None else ""
        turn.total_s = time.perf_counter() - t0
        # anchors: the shared segments of a fully prefilled prompt, and the answer itself
        if shared is not None and shared.pool is not None:
            if turn.mode != "reuse" or turn.repaired_at is not None:  # the prompt's KV is exact
                self._capture_exact(turn, prompt, cache, agent.name)
            shared.capture_answer(toks, cache, n, agent.name, prompt=prompt)
        elif shared is not None and eng.store is not None:
            # documents only: each shared segment and the answer computed alone and stored
            # (after the agent's answer, so later agents find them)
            for seg in [ids[s:e] for s, e in prompt.spans] + ([toks] if toks else []):
                shared.precompute(Document(tokens=tuple(seg)))
        return turn, cache, n

    def _capture_exact(self, turn: AgentTurn, prompt: Any, cache: Any, source: str) -> None:
        """An exactly computed prompt's documents as anchors (and offset samples)."""
        assert self.shared is not None
        if self.shared.pool is not None:
            learned = BlendStats()
            self.shared.capture_prompt(prompt, cache, source, stats=learned)
            turn.offsets_learned = learned.offsets_learned

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
