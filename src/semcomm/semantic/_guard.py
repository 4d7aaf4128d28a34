"""The lexical near-miss guard.

Embeddings put "Can I get my money back?" and "Can I NOT get my money back?" at cosine 0.95.
No threshold separates such pairs, so a cheap lexical check vetoes a hit when the query and
the candidate differ in any of:

- **negation**: one side negates (not, n't, never, no longer, without, ...) and the other not,
  or one side has a word the other has with a negating prefix (possible / impossible,
  safe / unsafe, legal / illegal, ...);
- **numbers**: the numbers (digits with their sign, number words, ordinals), in the order they
  come, differ;
- **dates**: month names, weekdays, relative days (today, tomorrow, ...), relative periods
  ("next week", "last year"), times of day (morning, noon, "5 pm" / "5 am") differ;
- **units**: both sides name units of measure or currencies (kilograms, miles, hours, GB,
  percent, $, ...), and not the same ones;
- **question type**: why / who / when / where asked on one side only ("Why is X humble?"
  against "Is X humble?");
- **named entities**: a capitalised word (not sentence-initial) or an acronym on one side does
  not occur on the other side at all (case-insensitively);
- **antonyms**: one side uses one word of a known opposite pair (positive/negative, before/after,
  similar/different, winter/summer, ...) and the other side uses the opposite word;
- **codes**: model numbers and other letter-digit codes differ (M605n / M605x);
- **roles**: both sides use exactly the same words in a different order ("employees at A about
  the acquisition by B" / "... at B about the acquisition by A"; "mental illness and not
  insane" / "not mental illness and insane"; "Is A better than B" / "Is B better than A"),
  unless the words that moved are joined by "or", "and", "vs" or the text asks for a
  comparison ("between", "difference", "compare");
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
_WORD = re.compile(r"[A-Za-z][A-Za-z'’\-]*(?:\+\+|#)?|(?<![\w-])-\d+(?:[.,]\d+)*"
                   r"|\d+(?:[.,]\d+)*")
# a letter-digit code: M605n, A4, 3G, ps4, i7-8700k
_CODE = re.compile(r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9][\w-]*\b")
# "X and Y Z": two coordinated words and the word they share ("speaking and listening skills")
_COORD = re.compile(r"([A-Za-z][\w'-]*) and ([A-Za-z][\w'-]*) ([A-Za-z][\w'-]*)")
# words that make a reordering symmetric ("X or Y", "between X and Y", "X vs Y")
# a reordering is harmless when the moved words are joined by one of these ...
_JOINERS = frozenset({"or", "and", "vs", "versus", "nor"})
# ... or when the text asks for a comparison of the two
_COMPARISON = frozenset({"between", "difference", "differences", "compare", "compared",
                         "comparison", "similarities", "similar", "both"})

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

# relative periods: "next week", "last year", "this weekend" (modifier, period) -> a date token
_REL_MODIFIERS = frozenset(["next", "last", "this", "previous", "coming", "past", "following"])
_REL_PERIODS = frozenset(["week", "weekend", "month", "year", "quarter", "decade", "century",
                          "season", "semester", "term", "morning", "afternoon", "evening",
                          "night", "spring", "summer", "autumn", "fall", "winter"])
# times of day, and "am" / "pm" after a number
_TIMES_OF_DAY = frozenset(["morning", "afternoon", "evening", "night", "noon", "midnight",
                           "midday", "dawn", "dusk"])
_MERIDIEM = {"am": "am", "pm": "pm"}

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
        ("allowed permitted allow permit", "forbidden prohibited banned forbid prohibit"),
    ]
)


def _units_table() -> dict[str, str]:
    """Unit word -> its canonical name (plurals and abbreviations folded together)."""
    groups = {
        "mg": "mg milligram milligrams", "g": "gram grams gramme grammes",
        "kg": "kg kgs kilogram kilograms kilo kilos", "lb": "lb lbs pound pounds",
        "oz": "oz ounce ounces", "t": "ton tons tonne tonnes",
        "mm": "mm millimeter millimeters millimetre millimetres",
        "cm": "cm centimeter centimeters centimetre centimetres",
        "m": "meter meters metre metres",
        "km": "km kms kilometer kilometers kilometre kilometres", "in": "inch inches",
        "ft": "ft foot feet", "yd": "yard yards", "mi": "mile miles",
        "ml": "ml milliliter milliliters millilitre millilitres",
        "l": "liter liters litre litres", "gal": "gallon gallons",
        "pt": "pint pints", "qt": "quart quarts", "tbsp": "tbsp tablespoon tablespoons",
        "tsp": "tsp teaspoon teaspoons", "ms": "millisecond milliseconds",
        "s": "sec secs seconds", "min": "mins minute minutes", "h": "hr hrs hour hours",
        "day": "days", "week": "weeks", "month": "months", "year": "years yr yrs",
        "decade": "decades", "century": "centuries",
        "usd": "usd dollar dollars buck bucks", "eur": "eur euro euros",
        "gbp": "gbp sterling quid", "jpy": "jpy yen", "chf": "chf franc francs",
        "inr": "inr rupee rupees", "peso": "peso pesos", "cent": "cent cents",
        "btc": "btc bitcoin bitcoins", "bit": "bit bits", "byte": "byte bytes",
        "kb": "kb kilobyte kilobytes kib", "mb": "mb megabyte megabytes mib",
        "gb": "gb gigabyte gigabytes gib", "tb": "tb terabyte terabytes tib",
        "celsius": "celsius centigrade", "fahrenheit": "fahrenheit", "kelvin": "kelvin",
        "kcal": "calorie calories kcal kilocalorie kilocalories", "j": "joule joules",
        "kj": "kj kilojoule kilojoules", "kwh": "kwh", "w": "watt watts",
        "kw": "kw kilowatt kilowatts", "v": "volt volts", "amp": "amp amps ampere amperes",
        "mph": "mph", "kph": "kph kmh", "knot": "knot knots", "%": "percent percentage",
        "bp": "bps", "acre": "acre acres", "ha": "hectare hectares", "hz": "hz hertz",
        "ghz": "ghz gigahertz", "mhz": "mhz megahertz", "mah": "mah",
    }
    return {w: unit for unit, words in groups.items() for w in words.split()}


_UNITS = _units_table()
# units that are also ordinary words or letters: counted only right after a number ("5 m",
# "3 cups", "1 second", "10 stone", "2 days")
_UNITS_AFTER_NUMBER = {"m": "m", "s": "s", "h": "h", "g": "g", "l": "l", "t": "t", "j": "j",
                       "w": "w", "v": "v", "a": "amp", "in": "in", "st": "st", "c": "celsius",
                       "f": "fahrenheit", "k": "kelvin", "second": "s", "stone": "st",
                       "stones": "st", "cup": "cup", "cups": "cup", "day": "day",
                       "week": "week", "month": "month", "year": "year", "cal": "kcal",
                       "pt": "pt", "qt": "qt", "yd": "yd", "min": "min"}
_SYMBOL = re.compile(r"°\s?[CcFf]\b|[$€£¥%₹₿]")
_UNIT_SYMBOLS = {"$": "usd", "€": "eur", "£": "gbp", "¥": "jpy", "%": "%", "°c": "celsius",
                 "°f": "fahrenheit", "₹": "inr", "₿": "btc"}

# negating prefixes: "impossible" is "possible" negated
_NEG_PREFIXES = ("un", "im", "in", "il", "ir", "dis", "non-", "non")

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
    number_seq: tuple[str, ...] = ()  # the numbers in the order they come
    units: frozenset[str] = frozenset()  # canonical units of measure and currencies


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
    numbers: list[str] = []
    dates: set[str] = set()
    entities: set[str] = set()
    units: set[str] = {_UNIT_SYMBOLS[m.group(0).lower().replace(" ", "")]
                       for m in _SYMBOL.finditer(text)}
    neg = 0
    sentence_start = True
    prev = ""  # the previous token, lower-cased
    after_number = False  # the previous token was a number
    for tok in raw:
        low = tok.lower().replace("’", "'")
        words.add(low)
        if low.endswith("'s"):
            words.add(low[:-2])
        if low in _NEGATIONS or low.endswith("n't"):
            neg += 1
        number = True
        if tok[0].isdigit() or tok[0] == "-":
            numbers.append(_canonical_number(tok))
        elif low in _NUMBER_WORDS:
            numbers.append(str(_NUMBER_WORDS[low]))
        else:
            number = False
            if low in _ORDINALS:
                numbers.append(f"ord:{_ORDINALS[low]}")
        if low in _DAYS or (low in _MONTHS and (low not in _AMBIGUOUS_MONTHS
                                                or (tok[0].isupper() and not sentence_start))):
            dates.add(low[:3])
        if low in _TIMES_OF_DAY:
            dates.add(low)
        if prev in _REL_MODIFIERS and (low in _REL_PERIODS or low in _DAYS or low in _MONTHS):
            dates.add(f"{prev}:{low}")
        if after_number and low in _MERIDIEM:
            dates.add(_MERIDIEM[low])
        if after_number and low in _UNITS_AFTER_NUMBER:
            units.add(_UNITS_AFTER_NUMBER[low])
        elif low in _UNITS:
            units.add(_UNITS[low])
        if low == "sterling" and prev in ("pound", "pounds"):
            units.discard("lb")
        prev = low
        after_number = number
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
        number_seq=tuple(numbers),
        units=frozenset(units),
        dates=frozenset(dates),
        entities=frozenset(entities),
        qwords=frozenset(words & _QWORDS),
        codes=codes,
        sequence=tuple(t.lower().replace("’", "'") for t in raw),
        coordinated=coord,
    )


def _canonical_number(tok: str) -> str:
    """"1,000" -> "1000", "05" -> "5", "2.50" -> "2.5", "-3" stays "-3", "3rd" -> "ord:3"."""
    m = re.fullmatch(r"(\d+)(st|nd|rd|th)", tok.lower())
    if m:
        return f"ord:{int(m.group(1))}"
    t = tok.replace(",", "")
    sign = "-" if t.startswith("-") else ""
    t = t.lstrip("-")
    whole, dot, frac = t.partition(".")
    if whole.isdigit():
        whole = str(int(whole))
    frac = frac.rstrip("0") if frac.isdigit() else frac
    return sign + whole + (f".{frac}" if dot and frac else "")


def _negated_prefix(a: TextFeatures, b: TextFeatures) -> bool:
    """``b`` has a word that ``a`` has, with a negating prefix ("possible" / "impossible")."""
    for w in b.words - a.words:
        for p in _NEG_PREFIXES:
            stem = w[len(p):]
            if w.startswith(p) and len(stem) >= 4 and stem in a.words and stem not in b.words:
                return True
    return False


@dataclass(frozen=True, slots=True)
class GuardResult:
    """Outcome of :meth:`LexicalGuard.check`: ``ok`` or the first ``reason`` that vetoed."""

    ok: bool
    reason: str = ""  # "negation" | "number" | "date" | "unit" | "question" | "entity" |
    # "antonym" | "code" | "roles" | "scope" | ""


_OK = GuardResult(True)


class LexicalGuard:
    """Veto near-miss hits (see the module docstring). Each check can be switched off."""

    def __init__(self, *, negation: bool = True, numbers: bool = True, dates: bool = True,
                 entities: bool = True, antonyms: bool = True, question: bool = True,
                 codes: bool = True, roles: bool = True, scope: bool = True,
                 units: bool = True) -> None:
        self.units = units
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
        if self.negation and (a.negated != b.negated or _negated_prefix(a, b)
                              or _negated_prefix(b, a)):
            return GuardResult(False, "negation")
        if self.numbers and a.number_seq != b.number_seq:
            return GuardResult(False, "number")
        if self.dates and a.dates != b.dates:
            return GuardResult(False, "date")
        if self.units and a.units and b.units and a.units != b.units:
            return GuardResult(False, "unit")
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
    diff = [i for i, (w, v) in enumerate(zip(a.sequence, b.sequence, strict=True)) if w != v]
    moved = {a.sequence[i] for i in diff}
    if "not" in moved or any(w in _NEGATIONS for w in moved):
        return True  # a negation moved to another clause
    if a.words & _COMPARISON:
        return False  # "the difference between X and Y", "compare X with Y"
    # "X or Y" is "Y or X"; "X better than Y" is not "Y better than X"
    return not (set(a.sequence[diff[0]:diff[-1] + 1]) & _JOINERS)
