"""Generated near-miss traffic for the semantic cache: each query differs from every entry
stored in its scope in one thing that changes the answer (a number, a date, a unit, a negation,
two entities swapped), as an attacker or an unlucky user would send it.

A *group* is one template in one scope: a few stored phrasings (with answers that repeat their
own value, as a generated answer does: "The number 96033 is ..."), then queries that change
that value. Every query is a pair (the stored entry it is nearest to, the query); none may be
served. Each group also carries one control query, a stored phrasing sent again, which must be
served (so a cache that serves nothing does not pass).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["KINDS", "Group", "groups"]


@dataclass(slots=True)
class Group:
    kind: str
    template: str
    stored: list[tuple[str, str]]  # (question, answer)
    queries: list[str]  # each changes what is asked: must not be served
    control: str = ""  # a stored question asked again: must be served
    stored_values: list[str] = field(default_factory=list)


# --- numbers ----------------------------------------------------------------------------------

_NUMBER_TEMPLATES = [
    ("Write one sentence about the number {v}.", "The number {v} is an interesting number."),
    ("What is the square root of {v}?", "The square root of {v} is about {r}."),
    ("Is {v} a prime number?", "{v} is not a prime number; it is divisible by small factors."),
    ("How do I get a refund within {v} days?", "Within {v} days you can ask for a refund."),
    ("What is {v} divided by 7?", "{v} divided by 7 is {r}."),
    ("How many calories are in {v} eggs?", "{v} eggs have about {r} calories."),
    ("What happened to flight {v} yesterday?", "Flight {v} was delayed by two hours."),
    ("Where is my order number {v}?", "Order {v} has shipped and arrives tomorrow."),
    ("What is the best laptop under {v} dollars?", "Under {v} dollars, pick a mid-range laptop."),
    ("What does error code {v} mean?", "Error code {v} means the request timed out."),
    ("How much is {v} times 12?", "{v} times 12 is {r}."),
    ("Can I return an item after {v} days?", "After {v} days, returns need a receipt."),
    ("How long does it take to walk {v} miles?", "Walking {v} miles takes about {r} hours."),
    ("What was the score of game {v} of the series?", "Game {v} ended 3 to 2."),
    ("Tell me a fun fact about the year {v}.", "In {v}, something memorable happened."),
    ("How many people live in a town of {v} houses?", "A town of {v} houses has about {r} "
     "people."),
    ("What is {v} percent of 250?", "{v} percent of 250 is {r}."),
    ("Is a credit score of {v} good?", "A credit score of {v} is fair."),
    ("What is the speed limit on highway {v}?", "Highway {v} has a limit of 65 mph."),
    ("How do I solve x + {v} = 100?", "Subtract {v} from both sides: x = {r}."),
]


def _number(rng: random.Random, near: int | None = None) -> str:
    style = rng.random()
    if near is not None and style < 0.4:  # an adjacent value: 96033 / 96034
        return str(near + rng.choice([-1, 1, 10, -10, 100]))
    if style < 0.6:
        return str(rng.randint(2, 99))
    if style < 0.8:
        return str(rng.randint(100, 999_999))
    if style < 0.9:
        return f"{rng.randint(1, 99)}.{rng.randint(1, 9)}"
    return rng.choice(["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                       "twelve", "fifteen", "twenty", "fifty", "a hundred", "a thousand"])


_WORD_VALUES = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
                "nine": 9, "ten": 10, "twelve": 12, "fifteen": 15, "twenty": 20, "fifty": 50,
                "a hundred": 100, "a thousand": 1000}


def _value(v: str) -> float:
    """The number a value spells ("four" and "4" are one value, not a near miss)."""
    return float(_WORD_VALUES.get(v, v))


def _numbers(rng: random.Random) -> Iterator[Group]:
    for template, answer in _NUMBER_TEMPLATES:
        values: list[str] = []
        seen: set[float] = set()
        while len(values) < 3:
            v = _number(rng)
            if _value(v) not in seen:
                seen.add(_value(v))
                values.append(v)
        queries: list[str] = []
        while len(queries) < 50:
            base = values[len(queries) % 3]
            near = int(base) if base.isdigit() else None
            v = _number(rng, near)
            if _value(v) in seen:
                continue
            seen.add(_value(v))
            queries.append(template.format(v=v))
        yield Group("numbers", template,
                    [(template.format(v=v), answer.format(v=v, r=rng.randint(2, 900)))
                     for v in values], queries, control=template.format(v=values[0]),
                    stored_values=values)


# --- dates ------------------------------------------------------------------------------------

_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _date(rng: random.Random, style: int) -> str:
    y = rng.randint(1950, 2030)
    m = rng.randint(1, 12)
    d = rng.randint(1, 28)
    return [
        f"{_MONTHS[m - 1]} {d}",
        f"{d} {_MONTHS[m - 1]} {y}",
        f"{y}-{m:02d}-{d:02d}",
        f"{m:02d}/{d:02d}/{y}",
        rng.choice(_DAYS),
        f"{rng.choice(['next', 'last', 'this'])} {rng.choice(['week', 'month', 'year', 'weekend'])}",
        rng.choice(["today", "tomorrow", "yesterday", "tonight"]),
        f"{_MONTHS[m - 1]} {y}",
        f"the {rng.randint(195, 202)}0s",
        f"{rng.randint(1, 12)} {rng.choice(['am', 'pm'])}",
        f"{_MONTHS[m - 1]}",
    ][style]


_DATE_TEMPLATES = [
    ("What events are happening in Paris on {d}?", "On {d}, Paris hosts a music festival."),
    ("Is the store open on {d}?", "Yes, on {d} the store opens at 9."),
    ("What was the weather like in London on {d}?", "On {d}, London was rainy and cool."),
    ("Which trains leave for Lyon on {d}?", "On {d}, trains to Lyon leave every hour."),
    ("Book me a table for two on {d}.", "Your table for two on {d} is booked."),
    ("What happened in the news on {d}?", "On {d}, the main story was the election."),
    ("Is there a holiday on {d}?", "There is no public holiday on {d}."),
    ("Can I schedule the meeting for {d}?", "The meeting is scheduled for {d}."),
    ("What is the exchange rate for {d}?", "For {d}, one euro buys 1.08 dollars."),
    ("Remind me to call the bank on {d}.", "I will remind you on {d}."),
    ("Was the museum busy on {d}?", "On {d} the museum had long queues."),
    ("What is on the menu for {d}?", "For {d}, the menu is soup and pasta."),
    ("How much did the stock rise on {d}?", "On {d} the stock rose 2 percent."),
    ("Are flights to Rome cheaper on {d}?", "On {d} flights to Rome cost less."),
    ("Who won the match played on {d}?", "The home team won on {d}."),
    ("Is my appointment on {d} confirmed?", "Your appointment on {d} is confirmed."),
    ("What time does the sun set on {d}?", "On {d} the sun sets at 6 pm."),
    ("Which concerts are in Berlin on {d}?", "On {d}, Berlin has two jazz concerts."),
    ("Is the office closed on {d}?", "The office is open on {d}."),
    ("Do I need to pay rent on {d}?", "Rent is due on {d}."),
]


def _dates(rng: random.Random) -> Iterator[Group]:
    for i, (template, answer) in enumerate(_DATE_TEMPLATES):
        for style in (i % 11, (i + 5) % 11):
            values: list[str] = []
            seen: set[str] = set()
            tries = 0
            while len(values) < 3 and tries < 500:
                tries += 1
                d = _date(rng, style)
                if d not in seen:
                    seen.add(d)
                    values.append(d)
            queries: list[str] = []
            while len(queries) < 25 and tries < 2000:
                tries += 1
                d = _date(rng, style if rng.random() < 0.8 else rng.randint(0, 10))
                if d in seen:
                    continue
                seen.add(d)
                queries.append(template.format(d=d))
            yield Group("dates", template, [(template.format(d=d), answer.format(d=d))
                                            for d in values], queries,
                        control=template.format(d=values[0]), stored_values=values)


# --- units ------------------------------------------------------------------------------------

_UNIT_SETS = [
    ["kilograms", "pounds", "grams", "ounces", "tons", "stones"],
    ["miles", "kilometers", "meters", "feet", "inches", "yards", "centimeters"],
    ["liters", "gallons", "cups", "milliliters", "pints", "quarts", "tablespoons"],
    ["hours", "minutes", "seconds", "days", "weeks", "months", "years"],
    ["dollars", "euros", "pounds sterling", "yen", "francs", "rupees", "pesos"],
    ["megabytes", "gigabytes", "kilobytes", "terabytes", "bits", "bytes"],
    ["degrees Celsius", "degrees Fahrenheit", "kelvin"],
    ["calories", "kilojoules", "joules", "kilowatt hours"],
    ["mph", "km/h", "knots", "meters per second"],
    ["percent", "basis points"],
]

_UNIT_TEMPLATES = [
    ("How much is 5 {u} in total?", "5 {u} is the amount you asked about."),
    ("Is 30 {u} a lot?", "30 {u} is a moderate amount."),
    ("How do I convert 12 {u}?", "12 {u} converts as shown in the table."),
    ("What can I buy with 40 {u}?", "40 {u} buys a week of groceries."),
    ("Write one sentence about 7 {u}.", "7 {u} is a small but useful quantity."),
    ("Is 100 {u} too much for a child?", "100 {u} is too much for a child."),
    ("How long does it take to use up 3 {u}?", "3 {u} lasts about a week."),
    ("Round 2.5 {u} to the nearest whole number.", "2.5 {u} rounds to 3 {u}."),
    ("Explain what 1 {u} means.", "1 {u} is the basic unit you asked about."),
    ("Is 0.5 {u} enough?", "0.5 {u} is usually enough."),
]


def _units(rng: random.Random) -> Iterator[Group]:
    for template, answer in _UNIT_TEMPLATES:
        for units in _UNIT_SETS:
            for u in units[:3]:  # each stored alone; every other unit of its set asked
                yield Group("units", template, [(template.format(u=u), answer.format(u=u))],
                            [template.format(u=w) for w in units if w != u],
                            control=template.format(u=u), stored_values=[u])


# --- negations --------------------------------------------------------------------------------

_ACTIONS = ["get my money back", "use my account after cancelling", "travel with a pet",
            "drink tap water here", "change my flight online", "pay by credit card",
            "park on this street", "return opened items", "share my subscription",
            "cancel the order", "bring food into the cinema", "smoke on the balcony",
            "reset my password by email", "open a second account", "transfer money abroad",
            "book a room for one night", "upgrade my seat", "delete my data",
            "take photos in the museum", "work from home on Fridays", "check in early",
            "leave my bags at reception", "use the gym after 10", "invite a friend",
            "pay in cash", "skip the deposit", "rent a car at 18", "swim in the lake",
            "camp in the park", "fly with a power bank"]

_NEGATION_FORMS: list[tuple[str, str]] = [
    ("Can I {a}?", "Can I not {a}?"),
    ("Can I {a}?", "Why can't I {a}?"),
    ("Is it possible to {a}?", "Is it impossible to {a}?"),
    ("Is it allowed to {a}?", "Is it not allowed to {a}?"),
    ("Should I {a}?", "Should I never {a}?"),
    ("Why do people {a}?", "Why don't people {a}?"),
    ("What happens if I {a}?", "What happens if I do not {a}?"),
    ("Am I able to {a}?", "Am I unable to {a}?"),
    ("Do I have to {a}?", "Do I no longer have to {a}?"),
    ("Is it legal to {a}?", "Is it illegal to {a}?"),
    ("Does the hotel let guests {a}?", "Does the hotel never let guests {a}?"),
    ("Are customers allowed to {a}?", "Are customers not allowed to {a}?"),
    ("Is it safe to {a}?", "Is it unsafe to {a}?"),
    ("I want to {a}.", "I don't want to {a}."),
    ("Can guests {a} without asking?", "Can guests {a} with asking?"),
    ("Is it a good idea to {a}?", "Is it not a good idea to {a}?"),
    ("Will I be able to {a}?", "Will I not be able to {a}?"),
    ("Must I {a}?", "Mustn't I {a}?"),
    ("Is there a way to {a}?", "Is there no way to {a}?"),
    ("Did they let you {a}?", "Didn't they let you {a}?"),
]


def _negations(rng: random.Random) -> Iterator[Group]:
    for pos, neg in _NEGATION_FORMS:
        for flip in (False, True):  # the positive stored and the negative asked, and back
            stored_t, asked_t = (neg, pos) if flip else (pos, neg)
            acts = rng.sample(_ACTIONS, len(_ACTIONS))
            stored = acts[:3]
            pairs = [(stored_t.format(a=a), ("No" if flip else "Yes") + f", you can {a}.")
                     for a in stored]
            queries = [asked_t.format(a=a) for a in acts]  # every action, negation flipped
            yield Group("negations", stored_t, pairs, queries,
                        control=stored_t.format(a=stored[0]), stored_values=stored)


# --- swapped entities -------------------------------------------------------------------------

_ENTITY_SETS = {
    "city": ["Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon",
             "Dublin", "Oslo"],
    "person": ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Ivy",
               "Jack"],
    "language": ["English", "French", "German", "Spanish", "Italian", "Japanese", "Chinese",
                 "Russian", "Arabic", "Dutch"],
    "company": ["Google", "Apple", "Microsoft", "Amazon", "Netflix", "Spotify", "Tesla",
                "Intel", "Oracle", "Adobe"],
    "currency": ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK", "NOK", "INR"],
    "team": ["Arsenal", "Chelsea", "Liverpool", "Barcelona", "Juventus", "Bayern", "Ajax",
             "Porto", "Celtic", "Benfica"],
}

_SWAP_TEMPLATES = [
    ("city", "Is {a} bigger than {b}?", "{a} is bigger than {b}."),
    ("city", "How do I get from {a} to {b} by train?", "Take the fast train from {a} to {b}."),
    ("city", "Is {a} more expensive than {b} for tourists?", "{a} costs more than {b}."),
    ("city", "How long is the flight from {a} to {b}?", "From {a} to {b} takes two hours."),
    ("person", "Did {a} send the money to {b}?", "Yes, {a} sent it to {b}."),
    ("person", "Is {a} older than {b}?", "{a} is older than {b}."),
    ("person", "Why did {a} call {b} last night?", "{a} called {b} about the trip."),
    ("person", "Does {a} owe {b} any money?", "{a} owes {b} ten dollars."),
    ("language", "Translate this sentence from {a} to {b}.", "Here it is from {a} in {b}."),
    ("language", "Is {a} better than {b} for beginners?", "{a} is better than {b}."),
    ("language", "How do I switch my phone from {a} to {b}?", "Settings: {a} to {b}."),
    ("company", "Did {a} acquire {b}?", "Yes, {a} bought {b} last year."),
    ("company", "Is {a} worth more than {b}?", "{a} is worth more than {b}."),
    ("company", "Why did {a} sue {b}?", "{a} sued {b} over a patent."),
    ("company", "Can I move my data from {a} to {b}?", "Export from {a}, import into {b}."),
    ("currency", "Convert 100 {a} to {b}.", "100 {a} is about 92 {b}."),
    ("currency", "Is the {a} stronger than the {b}?", "The {a} is stronger than the {b}."),
    ("currency", "What is the {a} to {b} exchange rate?", "One {a} buys 0.9 {b}."),
    ("team", "Did {a} beat {b} last season?", "{a} beat {b} 2 to 1."),
    ("team", "Will {a} play away at {b} this weekend?", "{a} play at {b} on Sunday."),
]


def _swaps(rng: random.Random) -> Iterator[Group]:
    for kind, template, answer in _SWAP_TEMPLATES:
        names = _ENTITY_SETS[kind]
        pairs_all = [(a, b) for a in names for b in names if a != b]
        rng.shuffle(pairs_all)
        stored = pairs_all[:3]
        chosen = [p for p in pairs_all[3:] if (p[1], p[0]) not in stored][:47]
        queries = [template.format(a=b, b=a) for a, b in stored]  # the stored ones, swapped
        queries += [template.format(a=b, b=a) for a, b in chosen[:47]]
        yield Group("swaps", template, [(template.format(a=a, b=b), answer.format(a=a, b=b))
                                        for a, b in stored], queries,
                    control=template.format(a=stored[0][0], b=stored[0][1]),
                    stored_values=[f"{a}|{b}" for a, b in stored])
        del chosen


KINDS: dict[str, Callable[[random.Random], Iterator[Group]]] = {
    "numbers": _numbers, "dates": _dates, "units": _units, "negations": _negations,
    "swaps": _swaps,
}


_TAIL = " Let me know if you have any other questions about this."


def groups(kind: str, seed: int = 0) -> list[Group]:
    """The groups of one kind (deterministic for a seed). Every answer ends with the same
    sentence, as generated answers often do: answers of one template then look alike, so the
    stored phrasings form answer clusters and the cluster rules are tested too."""
    out = list(KINDS[kind](random.Random(f"{kind}:{seed}")))
    for g in out:
        g.stored = [(q, a + _TAIL) for q, a in g.stored]
    return out
