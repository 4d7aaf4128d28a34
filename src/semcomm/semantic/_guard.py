"""The lexical near-miss guard.

Embeddings put "Can I get my money back?" and "Can I NOT get my money back?" at cosine 0.95.
No threshold separates such pairs, so a cheap lexical check vetoes a hit when the query and
the candidate differ in any of:

- **negation**: one side negates (not, n't, never, no longer, without, ...) and the other not;
- **numbers**: the sets of numbers (digits or number words, ordinals) differ;
- **dates**: month names, weekdays or relative days (today, tomorrow, ...) differ;
- **question type**: why / who / when / where asked on one side only ("Why is X humble?"
  against "Is X humble?");
- **named entities**: a capitalised word (not sentence-initial) or an acronym on one side does
  not occur on the other side at all (case-insensitively);
- **antonyms**: one side uses one word of a known opposite pair (positive/negative, before/after,
  similar/different, winter/summer, ...) and the other side uses the opposite word;
- **codes**: model numbers and other letter-digit codes differ (M605n / M605x);
- **roles**: both sides use exactly the same words in a different order ("employees at A about
  the acquisition by B" / "... at B about the acquisition by A"; "mental illness and not
  insane" / "not mental illness and insane");
- **scope**: one side coordinates two words ("speaking and listening skills") where the other
  has only one of them ("speaking skills").

The guard is deterministic, has no model, and costs a few microseconds. It is the difference
between a cache that is usually right and one that is right on the cases users test first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["GuardResult", "LexicalGuard", "TextFeatures", "text_features"]

# a word keeps a "++" or "#" suffix, so C, C++ and C# stay three different names
_WORD = re.compile(r"[A-Za-z][A-Za-z'’\-]*(?:\+\+|#)?|\d+(?:[.,]\d+)*")
# a letter-digit code: M605n, A4, 3G, ps4, i7-8700k
_CODE = re.compile(r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9][\w-]*\b")
# "X and Y Z": two coordinated words and the word they share ("speaking and listening skills")
_COORD = re.compile(r"([A-Za-z][\w'-]*) and ([A-Za-z][\w'-]*) ([A-Za-z][\w'-]*)")
# words that make a reordering symmetric ("X or Y", "between X and Y", "X vs Y")
_SYMMETRIC = frozenset({"or", "vs", "versus", "between", "difference", "compare", "compared",
                        "better", "and"})

_NEGATIONS = frozenset(
    ["not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without", "cannot", "cant", "can't", "won't", "wont", "dont", "don't", "doesn't", "doesnt", "didn't", "didnt", "isn't", "isnt", "aren't", "arent", "wasn't", "wasnt", "weren't", "werent", "shouldn't", "shouldnt", "wouldn't", "wouldnt", "couldn't", "couldnt", "hasn't", "hasnt", "haven't", "havent", "hadn't", "mustn't", "neednt", "needn't", "nowhere", "unable"]
)

_NUMBER_WORDS: dict[str, float] = {
    w: i for i, w in enumerate(
        ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
    )
}
_NUMBER_WORDS.update({"teens": 10, "twenties": 20, "thirties": 30, "forties": 40, "fifties": 50,
                      "sixties": 60, "seventies": 70, "eighties": 80, "nineties": 90})
_NUMBER_WORDS.update({"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
                      "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000,
                      "million": 10**6, "billion": 10**9, "half": 0.5, "double": 2,
                      "twice": 2, "single": 1, "dozen": 12})
_ORDINALS = {w: i + 1 for i, w in enumerate(
    ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"])}

_MONTHS = frozenset(["january", "february", "march", "april", "may", "june", "july", "august", "september", "october", "november", "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec"])
_DAYS = frozenset(["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday", "today", "tomorrow", "yesterday", "tonight", "weekend"])
# "may", "march" are often verbs: counted as dates only when capitalised mid-sentence.
_AMBIGUOUS_MONTHS = frozenset({"may", "march", "jan", "mar", "dec", "sep"})

_ANTONYMS: tuple[tuple[frozenset[str], frozenset[str]], ...] = tuple(
    (frozenset(a.split()), frozenset(b.split()))
    for a, b in [
        ("positive", "negative"),
        ("advantage advantages pros benefit benefits", "disadvantage disadvantages cons drawbacks"),
        ("best", "worst"),
        ("increase increases increasing", "decrease decreases decreasing reduce reduces"),
        ("before", "after"),
        ("similar same similarities similarity", "different differ differs difference differences"),
        ("buy buying", "sell selling"),
        ("male men man boy boys", "female women woman girl girls"),
        ("good", "bad"),
        ("cheap cheapest cheaper", "expensive costly"),
        ("first", "last"),
        ("love", "hate"),
        ("start starting begin", "stop stopping end quit"),
        ("win winning", "lose losing"),
        ("more most", "less least fewer"),
        ("gain", "lose"),
        ("high higher highest", "low lower lowest"),
        ("import", "export"),
        ("rich", "poor"),
        ("easy easiest", "hard hardest difficult"),
        ("legal", "illegal"),
        ("true", "false"),
        ("north northern", "south southern"),
        ("east eastern", "west western"),
        ("fast faster fastest", "slow slower slowest"),
        ("open", "close closed"),
        ("add", "remove delete"),
        ("upload", "download"),
        ("input", "output"),
        ("min minimum", "max maximum"),
        ("past", "future"),
        ("young", "old"),
        ("long longer", "short shorter"),
        ("online", "offline"),
        ("accept", "reject"),
        ("married", "single divorced"),
        ("winter", "summer"),
    ]
)

_STOP_CAPS = frozenset(
    ["i", "i'm", "i've", "i'd", "i'll", "what", "how", "why", "when", "where", "which", "who", "whom", "whose", "is", "are", "was", "were", "do", "does", "did", "can", "could", "should", "would", "will", "shall", "may", "might", "must", "the", "a", "an", "if", "in", "on", "at", "to", "for", "of", "and", "or", "my", "your", "our", "their", "his", "her", "its", "it", "this", "that", "these", "those", "there", "here", "hi", "hello", "please", "tell", "explain", "give", "quora"]
)


# Question words whose presence changes what is asked ("Why is X humble?" is not "Is X
# humble?"); how/what/which are left out because paraphrases swap them freely.
_QWORDS = frozenset(["why", "who", "when", "where", "whom"])


@dataclass(frozen=True, slots=True)
class TextFeatures:
    """Lexical facts about one text that the guard compares."""

    words: frozenset[str]  # lower-cased tokens
    negated: bool  # odd number of negation cues
    numbers: frozenset[str]  # normalised numbers ("2", "2.5", "ord:1")
    dates: frozenset[str]  # month/day names
    entities: frozenset[str]  # lower-cased capitalised words / acronyms, not sentence-initial
    qwords: frozenset[str]  # why / who / when / where present
    codes: frozenset[tuple[str, str]] = frozenset()  # letter-digit codes: (digits, letters)
    sequence: tuple[str, ...] = ()  # the lower-cased tokens in order
    coordinated: frozenset[tuple[str, str, str]] = frozenset()  # (x, y, z) of "x and y z"


@lru_cache(maxsize=65536)
def text_features(text: str) -> TextFeatures:
    """Extract :class:`TextFeatures` (cached: the same text is analysed once)."""
    raw = _WORD.findall(text)
    # a code's digits and its letters (in order): "rs500" and "500rs" are one code, M605n and
    # M605x are two
    codes = frozenset((re.sub(r"\D", "", m), re.sub(r"[^a-z]", "", m.lower()))
                      for m in _CODE.findall(text))
    coord = frozenset((a.lower(), b.lower(), c.lower()) for a, b, c in _COORD.findall(text))
    words: set[str] = set()
    numbers: set[str] = set()
    dates: set[str] = set()
    entities: set[str] = set()
    neg = 0
    sentence_start = True
    for tok in raw:
        low = tok.lower().replace("’", "'")
        words.add(low)
        if low.endswith("'s"):
            words.add(low[:-2])
        if low in _NEGATIONS or low.endswith("n't"):
            neg += 1
        if tok[0].isdigit():
            numbers.add(tok.replace(",", ""))
        elif low in _NUMBER_WORDS:
            numbers.add(str(_NUMBER_WORDS[low]))
        elif low in _ORDINALS:
            numbers.add(f"ord:{_ORDINALS[low]}")
        elif re.fullmatch(r"\d+(st|nd|rd|th)", low):
            numbers.add(f"ord:{low[:-2]}")
        if low in _DAYS or (low in _MONTHS and (low not in _AMBIGUOUS_MONTHS
                                                or (tok[0].isupper() and not sentence_start))):
            dates.add(low[:3])
        is_cap = tok[0].isupper() and (not sentence_start or (len(tok) > 1 and tok.isupper()))
        if is_cap and low not in _STOP_CAPS and low not in _MONTHS and low not in _DAYS:
            entities.add(low.removesuffix("'s"))
        sentence_start = False
    # sentence boundaries inside the text reset "sentence-initial"
    for m in re.finditer(r"[.?!]\s+([A-Z][A-Za-z'\-]*)", text):
        w = m.group(1).lower()
        if not m.group(1).isupper():
            entities.discard(w)
    return TextFeatures(
        words=frozenset(words),
        negated=bool(neg % 2),
        numbers=frozenset(numbers),
        dates=frozenset(dates),
        entities=frozenset(entities),
        qwords=frozenset(words & _QWORDS),
        codes=codes,
        sequence=tuple(t.lower().replace("’", "'") for t in raw),
        coordinated=coord,
    )


@dataclass(frozen=True, slots=True)
class GuardResult:
    """Outcome of :meth:`LexicalGuard.check`: ``ok`` or the first ``reason`` that vetoed."""

    ok: bool
    reason: str = ""  # "negation" | "number" | "date" | "question" | "entity" | "antonym" |
    # "code" | "roles" | "scope" | ""


_OK = GuardResult(True)


class LexicalGuard:
    """Veto near-miss hits (see the module docstring). Each check can be switched off."""

    def __init__(self, *, negation: bool = True, numbers: bool = True, dates: bool = True,
                 entities: bool = True, antonyms: bool = True, question: bool = True,
                 codes: bool = True, roles: bool = True, scope: bool = True) -> None:
        self.codes = codes
        self.roles = roles
        self.scope = scope
        self.question = question
        self.negation = negation
        self.numbers = numbers
        self.dates = dates
        self.entities = entities
        self.antonyms = antonyms

    def check(self, query: str, candidate: str) -> GuardResult:
        a = text_features(query)
        b = text_features(candidate)
        if self.negation and a.negated != b.negated:
            return GuardResult(False, "negation")
        if self.numbers and a.numbers != b.numbers:
            return GuardResult(False, "number")
        if self.dates and a.dates != b.dates:
            return GuardResult(False, "date")
        if self.question and a.qwords != b.qwords:
            return GuardResult(False, "question")
        if self.entities and ((a.entities - b.words) or (b.entities - a.words)):
            return GuardResult(False, "entity")
        if self.antonyms:
            for left, right in _ANTONYMS:
                al, ar = bool(a.words & left), bool(a.words & right)
                bl, br = bool(b.words & left), bool(b.words & right)
                if (al and not ar and br and not bl) or (ar and not al and bl and not br):
                    return GuardResult(False, "antonym")
        if self.codes and a.codes and b.codes and a.codes != b.codes:
            return GuardResult(False, "code")
        if self.roles and _roles_swapped(a, b):
            return GuardResult(False, "roles")
        if self.scope and (_added_scope(a, b) or _added_scope(b, a)):
            return GuardResult(False, "scope")
        return _OK

    def __call__(self, query: str, candidate: str) -> bool:
        return self.check(query, candidate).ok


def _added_scope(a: TextFeatures, b: TextFeatures) -> bool:
    """``a`` is ``b`` with "and y" added after a word ("speaking and listening skills" /
    "speaking skills"): the same text otherwise, so the only change is the wider scope."""
    if not a.coordinated or len(a.sequence) != len(b.sequence) + 2:
        return False
    seq = a.sequence
    for i in range(1, len(seq) - 1):
        if seq[i] == "and" and seq[:i] + seq[i + 2:] == b.sequence and \
                seq[i + 1] not in _STOP_CAPS:
            return True
    return False


def _roles_swapped(a: TextFeatures, b: TextFeatures) -> bool:
    """The same words in another order, where order is not symmetric ("X or Y" is)."""
    if a.sequence == b.sequence or len(a.sequence) < 3 or sorted(a.sequence) != sorted(b.sequence):
        return False
    moved = {w for w, v in zip(a.sequence, b.sequence, strict=True) if w != v}
    if "not" in moved or any(w in _NEGATIONS for w in moved):
        return True  # a negation moved to another clause
    return not (a.words & _SYMMETRIC)
