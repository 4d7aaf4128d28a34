"""The reference world: a seeded, fictional knowledge world rendered into text.

``build_world(seed)`` makes people, cities, companies and products with attributes and
relations (:class:`Fact`), then renders them into statements (train and held-out templates),
question-answer pairs, four-option multiple-choice questions, paraphrase groups, near-miss
negatives, support conversations under one shared system prompt, and agent chains (router step,
then specialist step).

Determinism: every random choice comes from a ``random.Random`` seeded with a string derived
from the seed and a purpose name (string seeds are hashed with SHA-512 by ``random``, never with
Python's salted ``hash()``), and everything iterates over lists or sorted keys. The same seed gives
the same :meth:`World.to_json` bytes in any process; :meth:`World.digest` is their SHA-256.

Surface form: all text is lowercase ASCII with the punctuation ``. , ? :`` only, because the
sharer's WordPiece tokenizer lowercases. Multi-line renderings (conversations, agent chains) use
``\\n`` between turns; the WordPiece tokenizer turns newlines into spaces.

The fact split: each relation's facts are shuffled and the first ``seen_fraction`` of them are
``"seen"`` (the receiver model is trained on them), the rest ``"unseen"``. The sharer model is
trained on every fact.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import InvalidInputError
from . import _names as names
from ._templates import DESKS, TEMPLATES

__all__ = [
    "LETTERS",
    "ROUTER_PROMPT",
    "SYSTEM_PROMPT",
    "AgentChain",
    "Conversation",
    "Entity",
    "Fact",
    "MCQuestion",
    "NearMiss",
    "ParaphraseGroup",
    "QAPair",
    "Sentence",
    "Turn",
    "World",
    "build_world",
    "format_mc",
    "format_qa",
]

FactSplit = Literal["seen", "unseen"]
SplitArg = Literal["seen", "unseen", "all"]

WORLD_FORMAT = 1

SYSTEM_PROMPT = (
    "you are the help desk of the atlas, a guide to the people, cities, companies and products "
    "of our world. answer each question in one short sentence."
)
ROUTER_PROMPT = (
    "you are the router of the atlas. send each request to the people desk, the company desk, "
    "the product desk or the city desk."
)
LETTERS: tuple[str, ...] = ("a", "b", "c", "d")


def format_qa(question: str, answer: str | None = None) -> str:
    """The QA surface form: ``"question: Q answer: A."`` (prompt only when ``answer`` is None).

    Option log-likelihood scoring feeds ``format_qa(q)`` and scores ``" " + option + "."``.
    """
    prompt = f"question: {question} answer:"
    return prompt if answer is None else f"{prompt} {answer}."


def format_mc(question: str, options: tuple[str, ...] | list[str], letter: str | None = None) -> str:
    """The multiple-choice surface form, ending in ``"answer:"`` (plus ``" b."`` with a letter)."""
    opts = " ".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
    prompt = f"question: {question} options: {opts} answer:"
    return prompt if letter is None else f"{prompt} {letter}."


@dataclass(frozen=True, slots=True)
class Entity:
    """One thing in the world. ``id`` is stable for a seed (``"person-007"``)."""

    id: str
    kind: str  # "person" | "city" | "company" | "product"
    name: str  # display name used in text ("alice smith", "the glide phone")
    attrs: tuple[tuple[str, str], ...]  # sorted (attribute, value) pairs, values are display text


@dataclass(frozen=True, slots=True)
class Fact:
    """A (subject, relation, object) triple with its split and canonical statement."""

    id: str  # "fact-0001"
    subject_id: str
    subject: str  # subject display name
    relation: str  # a key of the relation templates (lives_in, works_at, ...)
    object: str  # display form of the object: "oxford", "engineer", "120 dollars", "1987"
    split: FactSplit  # "seen": in the receiver's training data; "unseen": sharer only
    statement: str  # canonical statement (first train template)


@dataclass(frozen=True, slots=True)
class Sentence:
    """A statement of one fact rendered with one template."""

    fact_id: str
    template: int  # index into the relation's train (or heldout) templates
    heldout: bool  # True: rendered with a held-out template (never trained on)
    split: FactSplit
    text: str


@dataclass(frozen=True, slots=True)
class QAPair:
    """A question about one fact, in one paraphrase, with its short answer."""

    id: str
    fact_id: str
    paraphrase: int  # index of the question template; 0 is canonical
    question: str
    answer: str
    split: FactSplit

    @property
    def text(self) -> str:
        """The QA rendered as training text."""
        return format_qa(self.question, self.answer)


@dataclass(frozen=True, slots=True)
class MCQuestion:
    """A four-option multiple-choice question about one fact (distractors of the same type)."""

    id: str
    fact_id: str
    relation: str
    question: str
    options: tuple[str, str, str, str]
    answer_index: int
    split: FactSplit

    @property
    def answer(self) -> str:
        """The correct option's text."""
        return self.options[self.answer_index]

    @property
    def letter(self) -> str:
        """The correct option's letter (``"a"``..``"d"``)."""
        return LETTERS[self.answer_index]

    @property
    def prompt(self) -> str:
        """Prompt for answer-letter evaluation (ends in ``"answer:"``)."""
        return format_mc(self.question, self.options)

    @property
    def qa_prompt(self) -> str:
        """Prompt for option log-likelihood scoring: each option follows as ``" option."``."""
        return format_qa(self.question)


@dataclass(frozen=True, slots=True)
class ParaphraseGroup:
    """Questions that mean the same (one fact) and their shared answer."""

    id: str
    fact_id: str
    questions: tuple[str, ...]
    answer: str
    split: FactSplit


@dataclass(frozen=True, slots=True)
class NearMiss:
    """A question and a near-identical question that means something else.

    ``kind`` is what changed: ``"entity"`` (another subject), ``"number"`` (a price),
    ``"date"`` (a year) or ``"negation"``. A semantic cache holding ``anchor`` must not serve its
    answer for ``negative``.
    """

    id: str
    kind: str
    fact_id: str
    anchor: str
    anchor_answer: str
    negative: str
    negative_answer: str


@dataclass(frozen=True, slots=True)
class Turn:
    """One message of a conversation."""

    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True, slots=True)
class Conversation:
    """A multi-turn support conversation; all share :data:`SYSTEM_PROMPT` as first turn."""

    id: str
    turns: tuple[Turn, ...]
    fact_ids: tuple[str, ...]  # the facts the assistant turns state, in order
    split: FactSplit  # "seen" when every fact is seen, else "unseen"

    def render(self, upto: int | None = None, sep: str = "\n") -> str:
        """``"system: ...\\nuser: ...\\nassistant: ..."``; ``upto`` keeps the first turns only."""
        turns = self.turns if upto is None else self.turns[:upto]
        return sep.join(f"{t.role}: {t.content}" for t in turns)

    def messages(self) -> list[dict[str, str]]:
        """OpenAI-style ``[{"role": ..., "content": ...}]``."""
        return [{"role": t.role, "content": t.content} for t in self.turns]


@dataclass(frozen=True, slots=True)
class AgentChain:
    """A two-step agent chain: a router picks a desk, then the specialist desk answers."""

    id: str
    fact_id: str
    request: str  # the user's question
    route: str  # the correct desk ("people desk", ...)
    router_prompt: str  # router step prompt, ends in "route:"; answer is " " + route
    specialist_system: str  # the specialist desk's system prompt
    specialist_prompt: str  # specialist step prompt, ends in "assistant:"
    answer: str  # the specialist's answer sentence
    split: FactSplit


@dataclass(slots=True)
class World:
    """A rendered world. Build with :func:`build_world`; all methods are pure and deterministic."""

    seed: int
    seen_fraction: float
    entities: list[Entity]
    facts: list[Fact]
    _mc: list[MCQuestion] = field(default_factory=list, repr=False)

    # -- lookups ---------------------------------------------------------------------------
    def entity(self, entity_id: str) -> Entity:
        """The entity with this id (``InvalidInputError`` if none)."""
        for e in self.entities:
            if e.id == entity_id:
                return e
        raise InvalidInputError(f"no entity with id {entity_id!r} in this world")

    def fact(self, fact_id: str) -> Fact:
        """The fact with this id (``InvalidInputError`` if none)."""
        idx = _fact_index(fact_id)
        if 0 <= idx < len(self.facts) and self.facts[idx].id == fact_id:
            return self.facts[idx]
        raise InvalidInputError(f"no fact with id {fact_id!r} in this world")

    def facts_in(self, split: SplitArg = "all") -> list[Fact]:
        """Facts of one split: ``"seen"``, ``"unseen"`` or ``"all"``."""
        _check_split(split)
        return [f for f in self.facts if split == "all" or f.split == split]

    @property
    def relations(self) -> list[str]:
        """Relation names in a fixed order."""
        return list(TEMPLATES)

    # -- renderings ------------------------------------------------------------------------
    def sentences(self, heldout: bool = False, split: SplitArg = "all") -> list[Sentence]:
        """Every fact in every train template (or every held-out template if ``heldout``)."""
        out: list[Sentence] = []
        for f in self.facts_in(split):
            tpl = TEMPLATES[f.relation]
            for i, t in enumerate(tpl.heldout if heldout else tpl.train):
                out.append(Sentence(f.id, i, heldout, f.split, _render(t, f)))
        return out

    def qa_pairs(self, split: SplitArg = "all") -> list[QAPair]:
        """One QA pair per fact and question paraphrase."""
        out: list[QAPair] = []
        for f in self.facts_in(split):
            for i, q in enumerate(TEMPLATES[f.relation].questions):
                out.append(QAPair(f"{f.id}-q{i}", f.id, i, _render(q, f), f.object, f.split))
        return out

    def mc_questions(self, split: SplitArg = "all") -> list[MCQuestion]:
        """One four-option multiple-choice question per fact (canonical question)."""
        _check_split(split)
        return [m for m in self._mc if split == "all" or m.split == split]

    def paraphrase_groups(self, split: SplitArg = "all") -> list[ParaphraseGroup]:
        """Per fact, its question paraphrases (same meaning, different words) and answer."""
        return [
            ParaphraseGroup(
                f"para-{f.id}",
                f.id,
                tuple(_render(q, f) for q in TEMPLATES[f.relation].questions),
                f.object,
                f.split,
            )
            for f in self.facts_in(split)
        ]

    def near_misses(self, kind: str | None = None) -> list[NearMiss]:
        """Near-miss negatives; ``kind`` filters (entity, number, date, negation)."""
        kinds = ("entity", "number", "date", "negation")
        if kind is not None and kind not in kinds:
            raise InvalidInputError(f"near-miss kind must be one of {kinds}, got {kind!r}")
        rng = _rng(self.seed, "near-miss")
        by_rel: dict[str, list[Fact]] = {}
        for f in self.facts:
            by_rel.setdefault(f.relation, []).append(f)
        out: list[NearMiss] = []
        for f in self.facts:
            tpl = TEMPLATES[f.relation]
            others = [g for g in by_rel[f.relation] if g.object != f.object]
            g = others[rng.randrange(len(others))]
            out.append(
                NearMiss(
                    f"nm-{f.id}-entity", "entity", f.id,
                    _render(tpl.questions[0], f), f.object,
                    _render(tpl.questions[0], g), g.object,
                )
            )
            if f.relation in ("price", "founded"):
                value = int(f.object.split()[0])
                step = 10 if f.relation == "price" else 1
                delta = step * (1 + rng.randrange(3)) * (1 if rng.random() < 0.5 else -1)
                changed = _replace_number(f, value + delta)
                out.append(
                    NearMiss(
                        f"nm-{f.id}-{'number' if f.relation == 'price' else 'date'}",
                        "number" if f.relation == "price" else "date",
                        f.id,
                        _render(tpl.yes_no, f), "yes",
                        _render(tpl.yes_no, changed), "no",
                    )
                )
            out.append(
                NearMiss(
                    f"nm-{f.id}-negation", "negation", f.id,
                    _render(tpl.yes_no, f), "yes",
                    _render(tpl.negated, f), "no",
                )
            )
        return [n for n in out if kind is None or n.kind == kind]

    def conversations(self, n: int | None = None, split: SplitArg = "all",
                      turns: int = 3) -> list[Conversation]:
        """Support conversations: ``turns`` user questions about one entity, each answered.

        One conversation per entity that has facts (in ``split``), capped at ``n``. The
        questions are about the entity and the entities its facts point to (a person's city
        and employer), drawn without repetition; ``turns`` caps their number.
        """
        if turns < 1:
            raise InvalidInputError(f"turns must be >= 1, got {turns}")
        _check_split(split)
        rng = _rng(self.seed, f"conversations:{turns}")
        by_subject: dict[str, list[Fact]] = {}
        for f in self.facts:
            by_subject.setdefault(f.subject, []).append(f)
        out: list[Conversation] = []
        for e in self.entities:
            own = by_subject.get(e.name, [])
            linked = [g for f in own for g in by_subject.get(f.object, [])]
            own = [f for f in own if split == "all" or f.split == split]
            linked = [f for f in linked if split == "all" or f.split == split]
            if not own:
                continue
            first = own[rng.randrange(len(own))]
            rest = [f for f in own + linked if f.id != first.id]
            picks = [first] + rng.sample(rest, min(turns - 1, len(rest)))
            msgs = [Turn("system", SYSTEM_PROMPT)]
            for f in picks:
                tpl = TEMPLATES[f.relation]
                q = tpl.questions[rng.randrange(len(tpl.questions))]
                a = tpl.train[rng.randrange(len(tpl.train))]
                msgs += [Turn("user", _render(q, f)), Turn("assistant", _render(a, f))]
            seen = all(f.split == "seen" for f in picks)
            out.append(
                Conversation(f"conv-{e.id}", tuple(msgs), tuple(f.id for f in picks),
                             "seen" if seen else "unseen")
            )
        return out if n is None else out[:n]

    def agent_chains(self, split: SplitArg = "all") -> list[AgentChain]:
        """One router-then-specialist chain per fact."""
        rng = _rng(self.seed, "agent-chains")
        out: list[AgentChain] = []
        for f in self.facts_in(split):
            tpl = TEMPLATES[f.relation]
            desk = DESKS[tpl.subject_kind]
            q = _render(tpl.questions[rng.randrange(len(tpl.questions))], f)
            spec_sys = (
                f"you are the {desk} of the atlas. answer questions about "
                f"{_KIND_PLURAL[tpl.subject_kind]} in one short sentence."
            )
            out.append(
                AgentChain(
                    id=f"chain-{f.id}",
                    fact_id=f.id,
                    request=q,
                    route=desk,
                    router_prompt=f"system: {ROUTER_PROMPT}\nrequest: {q}\nroute:",
                    specialist_system=spec_sys,
                    specialist_prompt=f"system: {spec_sys}\nuser: {q}\nassistant:",
                    answer=f.statement,
                    split=f.split,
                )
            )
        return out

    def texts(self) -> list[str]:
        """Every distinct string the world renders (for tokenizer building and round-trip tests)."""
        out: list[str] = [s.text for s in self.sentences()]
        out += [s.text for s in self.sentences(heldout=True)]
        out += [q.text for q in self.qa_pairs()]
        out += [format_mc(m.question, m.options, m.letter) for m in self._mc]
        for n in self.near_misses():
            out += [format_qa(n.anchor, n.anchor_answer), format_qa(n.negative, n.negative_answer)]
        out += [c.render() for c in self.conversations()]
        for a in self.agent_chains():
            out += [f"{a.router_prompt} {a.route}.", f"{a.specialist_prompt} {a.answer}"]
        return list(dict.fromkeys(out))

    # -- export ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Everything the world renders, as plain JSON-able data."""
        return {
            "format": WORLD_FORMAT,
            "seed": self.seed,
            "seen_fraction": self.seen_fraction,
            "system_prompt": SYSTEM_PROMPT,
            "entities": [asdict(e) for e in self.entities],
            "facts": [asdict(f) for f in self.facts],
            "sentences": [asdict(s) for s in self.sentences()],
            "heldout_sentences": [asdict(s) for s in self.sentences(heldout=True)],
            "qa_pairs": [asdict(q) for q in self.qa_pairs()],
            "mc_questions": [asdict(m) for m in self._mc],
            "paraphrase_groups": [asdict(p) for p in self.paraphrase_groups()],
            "near_misses": [asdict(n) for n in self.near_misses()],
            "conversations": [asdict(c) for c in self.conversations()],
            "agent_chains": [asdict(a) for a in self.agent_chains()],
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): identical bytes for identical seeds."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True)

    def digest(self) -> str:
        """SHA-256 hex of :meth:`to_json`."""
        return hashlib.sha256(self.to_json().encode("ascii")).hexdigest()

    def export_jsonl(self, directory: str | Path) -> list[Path]:
        """Write one ``<section>.jsonl`` per section (sorted keys, one record a line)."""
        out_dir = Path(directory)
        out_dir.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        for section, rows in self.to_dict().items():
            if not isinstance(rows, list):
                continue
            path = out_dir / f"{section}.jsonl"
            tmp = path.with_suffix(".jsonl.tmp")
            with tmp.open("w", encoding="ascii", newline="\n") as fh:
                for row in rows:
                    fh.write(json.dumps(row, sort_keys=True, separators=(",", ":")) + "\n")
            tmp.replace(path)
            written.append(path)
        return written


_KIND_PLURAL = {"person": "people", "company": "companies", "product": "products",
                "city": "cities"}


def _check_split(split: str) -> None:
    if split not in ("seen", "unseen", "all"):
        raise InvalidInputError(f"split must be 'seen', 'unseen' or 'all', got {split!r}")


def _fact_index(fact_id: str) -> int:
    try:
        return int(fact_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _rng(seed: int, purpose: str) -> random.Random:
    # random.Random(str) seeds from SHA-512 of the string: stable across processes.
    return random.Random(f"semcomm-world:{seed}:{purpose}")


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _render(template: str, fact: Fact) -> str:
    return template.format(s=fact.subject, o=fact.object, ao=_article(fact.object))


def _replace_number(fact: Fact, value: int) -> Fact:
    unit = " dollars" if fact.relation == "price" else ""
    return Fact(fact.id, fact.subject_id, fact.subject, fact.relation, f"{value}{unit}",
                fact.split, fact.statement)


def build_world(
    seed: int = 0,
    *,
    people: int = 100,
    cities: int = 20,
    companies: int = 24,
    products: int = 40,
    seen_fraction: float = 0.5,
) -> World:
    """Build the world for ``seed``. Counts are capped by the name lists (see ``_names``).

    Raises :class:`~semcomm.errors.InvalidInputError` for counts out of range.
    """
    limits = {
        "people": (people, len(names.FIRST_NAMES)),
        "cities": (cities, len(names.CITY_NAMES)),
        "companies": (companies, len(names.COMPANY_NAMES)),
        "products": (products, len(names.PRODUCT_WORDS)),
    }
    for key, (value, cap) in limits.items():
        if not 4 <= value <= cap:
            raise InvalidInputError(f"{key} must be between 4 and {cap}, got {value}")
    if not 0.0 < seen_fraction < 1.0:
        raise InvalidInputError(f"seen_fraction must be in (0, 1), got {seen_fraction}")

    rng = _rng(seed, "entities")

    def pick(pool: tuple[str, ...], k: int) -> list[str]:
        items = list(pool)
        rng.shuffle(items)
        return items[:k]

    city_names = pick(names.CITY_NAMES, cities)
    company_names = pick(names.COMPANY_NAMES, companies)
    product_words = pick(names.PRODUCT_WORDS, products)
    first = pick(names.FIRST_NAMES, people)

    entities: list[Entity] = []
    triples: list[tuple[str, str, str, str]] = []  # (subject_id, subject, relation, object)

    for i, c in enumerate(city_names):
        eid = f"city-{i:03d}"
        region = names.REGIONS[rng.randrange(len(names.REGIONS))]
        entities.append(Entity(eid, "city", c, (("region", region),)))
        triples.append((eid, c, "region", region))
    for i, c in enumerate(company_names):
        eid = f"company-{i:03d}"
        city = city_names[rng.randrange(len(city_names))]
        industry = names.INDUSTRIES[rng.randrange(len(names.INDUSTRIES))]
        year = str(1950 + rng.randrange(70))
        entities.append(Entity(eid, "company", c, tuple(sorted(
            (("based_in", city), ("industry", industry), ("founded", year))))))
        triples += [(eid, c, "based_in", city), (eid, c, "industry", industry),
                    (eid, c, "founded", year)]
    for i, w in enumerate(product_words):
        eid = f"product-{i:03d}"
        category = names.PRODUCT_CATEGORIES[rng.randrange(len(names.PRODUCT_CATEGORIES))]
        name = f"the {w} {category}"
        maker = company_names[rng.randrange(len(company_names))]
        price = f"{10 * (1 + rng.randrange(30))} dollars"
        entities.append(Entity(eid, "product", name, tuple(sorted(
            (("category", category), ("made_by", maker), ("price", price))))))
        triples += [(eid, name, "made_by", maker), (eid, name, "price", price)]
    for i, fn in enumerate(first):
        eid = f"person-{i:03d}"
        name = f"{fn} {names.LAST_NAMES[rng.randrange(len(names.LAST_NAMES))]}"
        city = city_names[rng.randrange(len(city_names))]
        employer = company_names[rng.randrange(len(company_names))]
        job = names.PROFESSIONS[rng.randrange(len(names.PROFESSIONS))]
        entities.append(Entity(eid, "person", name, tuple(sorted(
            (("lives_in", city), ("works_at", employer), ("profession", job))))))
        triples += [(eid, name, "lives_in", city), (eid, name, "works_at", employer),
                    (eid, name, "profession", job)]

    # Split: per relation, a seeded shuffle; the first seen_fraction are "seen".
    split_rng = _rng(seed, "split")
    split_of: dict[int, FactSplit] = {}
    for rel in TEMPLATES:
        idxs = [i for i, t in enumerate(triples) if t[2] == rel]
        split_rng.shuffle(idxs)
        n_seen = round(len(idxs) * seen_fraction)
        for rank, i in enumerate(idxs):
            split_of[i] = "seen" if rank < n_seen else "unseen"

    facts: list[Fact] = []
    for i, (sid, subj, rel, obj) in enumerate(triples):
        stub = Fact(f"fact-{i:04d}", sid, subj, rel, obj, split_of[i], "")
        facts.append(Fact(stub.id, sid, subj, rel, obj, split_of[i],
                          _render(TEMPLATES[rel].train[0], stub)))

    world = World(seed=seed, seen_fraction=seen_fraction, entities=entities, facts=facts)
    world._mc = _make_mc(world)
    return world


def _make_mc(world: World) -> list[MCQuestion]:
    rng = _rng(world.seed, "mc")
    domain: dict[str, list[str]] = {}
    for f in world.facts:
        values = domain.setdefault(f.relation, [])
        if f.object not in values:
            values.append(f.object)
    # Relations with few distinct values (region: 5) still have >= 4 options.
    out: list[MCQuestion] = []
    for f in world.facts:
        wrong = [v for v in domain[f.relation] if v != f.object]
        assert len(wrong) >= 3, f"relation {f.relation} has fewer than 4 distinct values"
        distractors = rng.sample(wrong, 3)
        pos = rng.randrange(4)
        options = distractors[:pos] + [f.object] + distractors[pos:]
        q = _render(TEMPLATES[f.relation].questions[0], f)
        out.append(MCQuestion(f"mc-{f.id}", f.id, f.relation, q,
                              (options[0], options[1], options[2], options[3]), pos, f.split))
    return out
