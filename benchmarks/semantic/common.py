"""Shared helpers for the semantic-cache benchmarks (not a benchmark itself): the QQP cache protocol.

Protocol (issue: semantic answer cache): from a labelled pair file, keep pairs so that no
question text appears twice; store every first question; look up every second question
against all stored entries; a hit is right when the returned entry's question is in the same
connected component of the file's duplicate labels as the query. Recall counts the queries
that have a duplicate stored.
"""

from __future__ import annotations

import csv
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "semantic"


def norm(t: str) -> str:
    return re.sub(r"\s+", " ", t).strip().lower()


@dataclass
class Protocol:
    stored: list[str]  # first questions (stored)
    queries: list[str]  # second questions (looked up)
    labels: list[int]  # the pair label
    comp: dict[str, int]  # normalised question -> duplicate component id

    def same(self, a: str, b: str) -> bool:
        ca, cb = self.comp.get(norm(a)), self.comp.get(norm(b))
        return ca is not None and ca == cb

    def has_dup_stored(self) -> np.ndarray:
        comps = {self.comp.get(norm(s)) for s in self.stored}
        comps.discard(None)
        return np.array([self.comp.get(norm(q)) in comps for q in self.queries])


def read_pairs(path: Path) -> list[tuple[str, str, int]]:
    rows = []
    with open(path, newline="", encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            q1, q2 = (r.get("question1") or "").strip(), (r.get("question2") or "").strip()
            if q1 and q2:
                rows.append((q1, q2, int(r["is_duplicate"])))
    return rows


def build_protocol(path: Path, *, seed: int = 0, limit: int | None = None) -> Protocol:
    return protocol_from_rows(read_pairs(path), seed=seed, limit=limit)


def protocol_vectors(path: Path, seed: int, vec: dict[str, np.ndarray],
                     embed: Callable[[list[str]], np.ndarray]
                     ) -> tuple[Protocol, np.ndarray, np.ndarray]:
    """:func:`build_protocol` of ``path`` with the queries' and stored questions' vectors;
    ``vec`` caches vectors across calls (texts embedded once over several seeds)."""
    pv = build_protocol(path, seed=seed)
    new = [t for t in dict.fromkeys(pv.queries + pv.stored) if t not in vec]
    if new:
        vec.update(zip(new, embed(new), strict=True))
    return (pv, np.stack([vec[t] for t in pv.queries]),
            np.stack([vec[t] for t in pv.stored]))


def read_tsv_pairs(path: Path, ia: int = 3, ib: int = 4) -> list[tuple[str, str, int]]:
    """MRPC-style TSV (label in column 0; a header line whose label is not a number is
    skipped)."""
    rows = []
    with open(path, newline="", encoding="utf-8-sig") as fh:
        for r in csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE):
            try:
                y = int(float(r[0]))
            except (IndexError, ValueError):
                continue
            if len(r) > max(ia, ib) and r[ia].strip() and r[ib].strip():
                rows.append((r[ia].strip(), r[ib].strip(), y))
    return rows


def protocol_from_rows(rows: list[tuple[str, str, int]], *, seed: int = 0,
                       limit: int | None = None) -> Protocol:
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for q1, q2, y in rows:
        a, b = find(norm(q1)), find(norm(q2))
        if y == 1 and a != b:
            parent[a] = b
    roots: dict[str, int] = {}
    comp = {q: roots.setdefault(find(q), len(roots)) for q in list(parent)}
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    seen: set[str] = set()
    stored, queries, labels = [], [], []
    for i in order:
        q1, q2, y = rows[i]
        n1, n2 = norm(q1), norm(q2)
        if n1 in seen or n2 in seen or n1 == n2:
            continue
        seen.update((n1, n2))
        stored.append(q1)
        queries.append(q2)
        labels.append(y)
        if limit and len(stored) >= limit:
            break
    return Protocol(stored, queries, labels, comp)


@dataclass
class Outcome:
    """Per query: the similarity of the first guard-passing candidate and whether it is right."""

    sim: np.ndarray  # (n,) best admissible similarity (-inf: none)
    right: np.ndarray  # (n,) bool
    cand: np.ndarray  # (n,) index of the stored question (-1: none)
    runner: np.ndarray  # (n,) similarity of the next admissible candidate (-inf: none)


def outcomes(p: Protocol, qv: np.ndarray, sv: np.ndarray, guard=None, k: int = 8) -> Outcome:
    sims = qv @ sv.T
    top = np.argsort(-sims, axis=1)[:, :k]
    n = len(p.queries)
    best = np.full(n, -np.inf)
    runner = np.full(n, -np.inf)
    right = np.zeros(n, bool)
    cand = np.full(n, -1)
    for i in range(n):
        found = 0
        for j in top[i]:
            if guard is not None and not guard(p.queries[i], p.stored[j]):
                continue
            if found == 0:
                best[i] = sims[i, j]
                cand[i] = j
                right[i] = p.same(p.queries[i], p.stored[j])
                found = 1
            else:
                runner[i] = sims[i, j]
                break
    return Outcome(best, right, cand, runner)


def pr_at(o: Outcome, has_dup: np.ndarray, t: float) -> tuple[float, float, int]:
    hit = o.sim >= t
    nh = int(hit.sum())
    prec = float(o.right[hit].mean()) if nh else 1.0
    rec = float((hit & o.right).sum() / max(1, has_dup.sum()))
    return prec, rec, nh


def curve(o: Outcome, has_dup: np.ndarray, ts: np.ndarray) -> list[tuple[float, float, float]]:
    return [(float(t), *pr_at(o, has_dup, float(t))[:2]) for t in ts]


class VectorModel:
    """Synthetic 384-d cache contents for index benchmarks at sizes no text set here reaches.

    ``kind="minilm"``: a Gaussian with the mean and covariance of all-MiniLM-L6-v2 embeddings of
    the questions in ``meancache_val.csv`` (participation ratio ~140 of 384 dimensions), and
    paraphrase queries drawn as stored vector + a difference of two labelled duplicates
    (covariance of those differences: median cosine to the stored vector ~0.88, like real
    duplicate pairs). Real embeddings also cluster by topic, which this model does not, so it is
    harder for a graph index than real caches are. ``kind="iso"``: isotropic random unit
    vectors with isotropic noise of the same cosine, the hardest case.
    """

    def __init__(self, kind: str = "minilm", *, dim: int = 384, n_questions: int = 6000,
                 data: Path = DEFAULT_DATA / "meancache_val.csv") -> None:
        if kind not in ("minilm", "iso"):
            raise ValueError(f"unknown vector model {kind!r} (minilm or iso)")
        self.kind, self.dim = kind, dim
        if kind == "iso":
            return
        from semcomm.semantic import default_embedder

        rows = read_pairs(data)
        texts: dict[str, int] = {}
        dups: list[tuple[int, int]] = []
        for q1, q2, y in rows:
            if len(texts) >= n_questions:
                break
            a, b = texts.setdefault(q1, len(texts)), texts.setdefault(q2, len(texts))
            if y == 1:
                dups.append((a, b))
        emb = default_embedder()
        if emb.dim != dim:
            raise ValueError(f"default embedder has dim {emb.dim}, expected {dim}")
        v = np.asarray(emb.embed(list(texts)), dtype=np.float64)
        self.mean = v.mean(0)
        x = v - self.mean
        eye = 1e-6 * np.eye(dim)
        self.chol = np.linalg.cholesky(x.T @ x / len(x) + eye)
        d = np.asarray([v[a] - v[b] for a, b in dups])
        self.chol_para = np.linalg.cholesky(d.T @ d / len(d) + eye)
        self.n_questions, self.n_duplicates = len(texts), len(dups)

    def sample(self, rng: np.random.Generator, n: int, chunk: int = 100_000) -> np.ndarray:
        out = np.empty((n, self.dim), np.float32)
        for s in range(0, n, chunk):
            z = rng.standard_normal((min(chunk, n - s), self.dim))
            x = z if self.kind == "iso" else self.mean + z @ self.chol.T
            out[s : s + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
        return out

    def paraphrase(self, rng: np.random.Generator, v: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """``v`` moved by a paraphrase-sized difference (``scale`` < 1: a closer paraphrase)."""
        v = np.asarray(v, np.float64).reshape(-1, self.dim)
        z = rng.standard_normal(v.shape)
        # iso: noise of norm ~0.54, the median cosine (0.88) of the minilm paraphrase draw
        d = 0.54 / np.sqrt(self.dim) * z if self.kind == "iso" else z @ self.chol_para.T
        x = v + scale * d
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def exact_best(base: np.ndarray, queries: np.ndarray, chunk: int = 200_000) -> np.ndarray:
    """Index of each query's most similar base vector (brute force, chunked)."""
    best = np.full(len(queries), -np.inf)
    arg = np.zeros(len(queries), np.int64)
    for s in range(0, len(base), chunk):
        sims = queries @ base[s : s + chunk].T
        j = sims.argmax(1)
        m = sims[np.arange(len(queries)), j]
        upd = m > best
        best[upd], arg[upd] = m[upd], j[upd] + s
    return arg


# -- FAQ traffic (issue: semantic cache on real traffic) ------------------------------------
# CLINC150 intents where one intent is one answer (no slot that changes the answer), split by
# domain: the banking and credit-card domains are the held-out "banking-support" set (the
# issue's workload; banking77 is not in the data), the rest are for development.
BANKING_INTENTS = (
    "transfer", "transactions", "balance", "freeze_account", "pay_bill", "bill_balance",
    "bill_due", "interest_rate", "routing", "min_payment", "order_checks", "pin_change",
    "report_fraud", "account_blocked", "spending_history", "credit_score", "report_lost_card",
    "credit_limit", "rewards_balance", "new_card", "application_status", "card_declined",
    "international_fees", "apr", "redeem_rewards", "credit_limit_change", "damaged_card",
    "replacement_card_duration", "improve_credit_score", "expiration_date",
)
DEV_FAQ_INTENTS = (
    "are_you_a_bot", "do_you_have_pets", "how_old_are_you", "meaning_of_life",
    "what_are_your_hobbies", "what_can_i_ask_you", "what_is_your_name", "where_are_you_from",
    "who_do_you_work_for", "who_made_you", "thank_you", "goodbye", "greeting", "user_name",
    "direct_deposit", "pto_balance", "pto_used", "payday", "income", "insurance",
    "insurance_change", "rollover_401k", "taxes", "w2", "carry_on", "lost_luggage",
    "travel_notification", "jump_start", "oil_change_how", "oil_change_when", "tire_change",
    "tire_pressure", "last_maintenance", "schedule_maintenance", "mpg", "gas_type", "find_phone",
    "reset_settings", "sync_device", "whisper_mode", "change_accent", "change_speed",
    "change_volume", "order_status",
)


@dataclass
class FAQWorkload:
    """Stored phrasings with their answers, and lookups with the answer that is right for them
    (None: out of scope, any hit is wrong)."""

    name: str
    stored: list[str]
    answers: list[str]
    queries: list[str]
    expected: list[str | None]

    def in_scope(self) -> np.ndarray:
        return np.array([e is not None for e in self.expected])


def clinc_faq(split: str, intents: tuple[str, ...], *, per_intent: int = 5,
              queries_per_intent: int | None = None, seed: int = 0,
              data: Path = DEFAULT_DATA) -> FAQWorkload:
    """``per_intent`` stored phrasings per intent from CLINC150 ``train``; queries from ``split``
    ("train": other train utterances, dev; "val": the held-out val utterances) plus the
    out-of-scope queries of the same split (oos_train / oos_val)."""
    import json

    d = json.loads((data / "clinc150" / "clinc150_dev.json").read_text())
    rng = random.Random(seed)
    by: dict[str, list[str]] = {i: [] for i in intents}
    for t, i in d["train"]:
        if i in by:
            by[i].append(t)
    stored: list[str] = []
    answers: list[str] = []
    queries: list[str] = []
    expected: list[str | None] = []
    held: dict[str, list[str]] = {}
    for i in intents:
        texts = list(by[i])
        rng.shuffle(texts)
        for t in texts[:per_intent]:
            stored.append(t)
            answers.append(f"answer:{i}")
        held[i] = texts[per_intent:]
    if split == "val":
        held = {i: [] for i in intents}
        for t, i in d["val"]:
            if i in held:
                held[i].append(t)
    for i in intents:
        qs = held[i][:queries_per_intent] if queries_per_intent else held[i]
        queries.extend(qs)
        expected.extend([f"answer:{i}"] * len(qs))
    oos = d["oos_train" if split == "train" else "oos_val"]
    queries.extend(t for t, _ in oos)
    expected.extend([None] * len(oos))
    return FAQWorkload(f"clinc150-{split}", stored, answers, queries, expected)


def quora_faq(path: Path, *, per_component: int = 5, distractors: int = 3000,
              seed: int = 0) -> FAQWorkload:
    """An FAQ built from a Quora pair file: every duplicate component of 3+ questions is one
    answer; up to ``per_component`` of its questions are stored and one other is looked up.
    ``distractors`` questions without any duplicate are stored as their own answers, and as
    many others are looked up as out-of-scope queries (QQP leaves some duplicates unlabelled,
    so a few of those "wrong" hits are right by meaning)."""
    p = build_protocol(path, seed=seed, limit=1)  # only its duplicate components are used
    rng = random.Random(seed)
    members: dict[int, list[str]] = {}
    text: dict[str, str] = {}
    for q1, q2, _ in read_pairs(path):
        text.setdefault(norm(q1), q1.strip())
        text.setdefault(norm(q2), q2.strip())
    for q, c in p.comp.items():
        members.setdefault(c, []).append(text[q])
    stored: list[str] = []
    answers: list[str] = []
    queries: list[str] = []
    expected: list[str | None] = []
    singles = []
    for c in sorted(members):
        m = sorted(members[c])
        if len(m) >= 3:
            rng.shuffle(m)
            q, keep = m[0], m[1:1 + per_component]
            stored.extend(keep)
            answers.extend([f"answer:q{c}"] * len(keep))
            queries.append(q)
            expected.append(f"answer:q{c}")
        elif len(m) == 1:
            singles.append(m[0])
    rng.shuffle(singles)
    for s in singles[:distractors]:
        stored.append(s)
        answers.append(f"answer:{norm(s)}")
    for s in singles[distractors:2 * distractors]:
        queries.append(s)
        expected.append(None)
    return FAQWorkload(f"quora-faq-{path.stem}", stored, answers, queries, expected)


# -- fresh held-out FAQ traffic (benchmarks.semantic.fresh) -----------------------------------
# CLINC150 intents that no earlier semantic benchmark, training run or cut choice touched
# (neither BANKING_INTENTS nor DEV_FAQ_INTENTS), picked by reading their train phrasings
# only (no cache was run on them first): the ones where one intent is one answer (no slot such
# as a date, a place, a name or an amount that changes the answer). The other unused intents
# (slots: "set a timer for N", "translate X", and the *_update twins of these lists) are never
# stored: their queries are out of scope for this cache, and some are near misses of the
# stored ones (shopping_list_update against shopping_list, reminder_update against reminder).
FRESH_FAQ_INTENTS = (
    "cancel", "current_location", "flip_coin", "gas", "maybe", "next_holiday", "next_song",
    "no", "yes", "pto_request_status", "repeat", "roll_dice", "shopping_list", "todo_list",
    "reminder", "what_song", "tell_joke",
)


def clinc_fresh(*, per_intent: int = 5, seed: int = 0,
                data: Path = DEFAULT_DATA) -> tuple[FAQWorkload, list[str]]:
    """``per_intent`` stored ``train`` phrasings per :data:`FRESH_FAQ_INTENTS` intent; queries:
    every other ``train`` and every ``val`` phrasing of those intents (in scope), the ``val``
    phrasings of the other unused intents (out of scope, "unstored-intent") and CLINC's own
    ``oos_train`` + ``oos_val`` (out of scope, "clinc-oos"; earlier benchmarks read these).
    Returns the workload and each query's kind ("in-scope", "unstored-intent", "clinc-oos")."""
    import json

    d = json.loads((data / "clinc150" / "clinc150_dev.json").read_text())
    rng = random.Random(seed)
    used = set(BANKING_INTENTS) | set(DEV_FAQ_INTENTS) | set(FRESH_FAQ_INTENTS)
    by: dict[str, list[str]] = {i: [] for i in FRESH_FAQ_INTENTS}
    for t, i in d["train"]:
        if i in by:
            by[i].append(t)
    w = FAQWorkload("clinc-fresh", [], [], [], [])
    kinds: list[str] = []
    for i in FRESH_FAQ_INTENTS:
        texts = list(by[i])
        rng.shuffle(texts)
        w.stored.extend(texts[:per_intent])
        w.answers.extend([f"answer:{i}"] * per_intent)
        rest = texts[per_intent:] + [t for t, j in d["val"] if j == i]
        w.queries.extend(rest)
        w.expected.extend([f"answer:{i}"] * len(rest))
        kinds.extend(["in-scope"] * len(rest))
    for t, j in d["val"]:
        if j not in used:
            w.queries.append(t)
            w.expected.append(None)
            kinds.append("unstored-intent")
    for t, _ in d["oos_train"] + d["oos_val"]:
        w.queries.append(t)
        w.expected.append(None)
        kinds.append("clinc-oos")
    return w, kinds


def unstored_intent_queries(split: str, *, per_intent: int | None = None, seed: int = 0,
                            data: Path = DEFAULT_DATA) -> list[str]:
    """Phrasings (``train`` or ``val``) of the CLINC150 intents that no FAQ workload stores
    (neither banking, development nor fresh): out-of-scope queries for any of them.
    ``per_intent``: a seeded sample per intent (``train`` has 100 each)."""
    import json

    d = json.loads((data / "clinc150" / "clinc150_dev.json").read_text())
    used = set(BANKING_INTENTS) | set(DEV_FAQ_INTENTS) | set(FRESH_FAQ_INTENTS)
    by: dict[str, list[str]] = {}
    for t, i in d[split]:
        if i not in used:
            by.setdefault(i, []).append(t)
    rng = random.Random(seed)
    out: list[str] = []
    for i in sorted(by):
        texts = list(by[i])
        if per_intent is not None:
            rng.shuffle(texts)
            texts = texts[:per_intent]
        out.extend(texts)
    return out


def dev_train_phrasings(data: Path = DEFAULT_DATA) -> tuple[list[str], dict[str, list[str]]]:
    """The 74 development and banking intents and each one's CLINC ``train`` phrasings."""
    import json

    d = json.loads((data / "clinc150" / "clinc150_dev.json").read_text())
    intents = list(DEV_FAQ_INTENTS) + list(BANKING_INTENTS)
    by: dict[str, list[str]] = {i: [] for i in intents}
    for t, i in d["train"]:
        if i in by:
            by[i].append(t)
    return intents, by


def holdout_quarter(intents: list[str], rng: random.Random) -> set[str]:
    """The seeded quarter of ``intents`` a clinc-holdout split leaves unstored (draws from
    ``rng``: :func:`clinc_holdout` goes on drawing from the same one)."""
    order = intents[:]
    rng.shuffle(order)
    return set(order[: len(order) // 4])


def clinc_holdout(split_seed: int, *, per_intent: int = 5, queries_per_intent: int = 20,
                  unstored_per_intent: int = 10,
                  data: Path = DEFAULT_DATA) -> tuple[FAQWorkload, list[str]]:
    """Development FAQ traffic with near-miss out-of-scope queries (``train`` phrasings only,
    so no fresh lookup is read): of the 74 development and banking intents a seeded quarter is
    left unstored, and 20 phrasings of each are looked up ("twin": many are near misses of a
    stored intent, such as ``pto_used`` against ``pto_balance``); the other intents store
    ``per_intent`` phrasings and look up ``queries_per_intent`` others; plus
    ``unstored_per_intent`` phrasings of each intent no FAQ set stores ("unstored").
    ``split_seed`` picks the quarter (100 + split_seed). Returns the workload and each query's
    kind ("in-scope", "twin", "unstored")."""
    intents, by = dev_train_phrasings(data)
    rng = random.Random(100 + split_seed)
    held = holdout_quarter(intents, rng)
    w = FAQWorkload(f"clinc-holdout-{split_seed}", [], [], [], [])
    kinds: list[str] = []
    for i in intents:
        texts = by[i][:]
        rng.shuffle(texts)
        if i in held:
            qs = texts[:queries_per_intent]
            w.queries.extend(qs)
            w.expected.extend([None] * len(qs))
            kinds.extend(["twin"] * len(qs))
        else:
            w.stored.extend(texts[:per_intent])
            w.answers.extend([f"answer:{i}"] * per_intent)
            qs = texts[per_intent:per_intent + queries_per_intent]
            w.queries.extend(qs)
            w.expected.extend([f"answer:{i}"] * len(qs))
            kinds.extend(["in-scope"] * len(qs))
    oos = unstored_intent_queries("train", per_intent=unstored_per_intent, seed=split_seed,
                                  data=data)
    w.queries.extend(oos)
    w.expected.extend([None] * len(oos))
    kinds.extend(["unstored"] * len(oos))
    return w, kinds
