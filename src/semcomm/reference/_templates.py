"""Sentence and question templates, one :class:`RelationTemplates` per relation.

Placeholders: ``{s}`` the subject's display name, ``{o}`` the object's display form
(``"120 dollars"``, ``"an engineer"`` is written ``{ao}``: the object with its article).
All text is lowercase because the sharer's WordPiece tokenizer lowercases; the only
punctuation is ``. , ? :`` so that both tokenizers round-trip every rendered string.

``train`` statement templates are used in training; ``heldout`` ones never are (perplexity on
them measures language, not memorised strings). Held-out templates use only words that training
text uses, in new combinations, so that their perplexity is not dominated by never-trained
tokens. ``questions[0]`` is the canonical question used
for QA and multiple choice; all four form a paraphrase group.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DESKS", "TEMPLATES", "RelationTemplates"]


@dataclass(frozen=True, slots=True)
class RelationTemplates:
    """Templates of one relation (see module docstring for placeholders)."""

    relation: str
    subject_kind: str  # kind of the subject entity
    train: tuple[str, ...]  # statement templates seen in training
    heldout: tuple[str, ...]  # statement templates only used for evaluation
    questions: tuple[str, ...]  # paraphrases of one question; [0] is canonical
    yes_no: str  # a yes/no question whose answer is "yes" for the true object
    negated: str  # the same yes/no question with a negation: its answer is "no"


TEMPLATES: dict[str, RelationTemplates] = {
    t.relation: t
    for t in (
        RelationTemplates(
            "lives_in",
            "person",
            (
                "{s} lives in {o}.",
                "{s} makes a home in {o}.",
                "the home of {s} is in {o}.",
                "{s} is a resident of {o}.",
                "{s} has a house in {o}.",
                "these days {s} lives in {o}.",
            ),
            ("the home city of {s} is {o}.", "{o} is the city where {s} lives."),
            (
                "where does {s} live?",
                "which city does {s} live in?",
                "in what city does {s} reside?",
                "what is the home city of {s}?",
            ),
            "does {s} live in {o}?",
            "does {s} not live in {o}?",
        ),
        RelationTemplates(
            "works_at",
            "person",
            (
                "{s} works at {o}.",
                "{s} is employed by {o}.",
                "{s} has a job at {o}.",
                "the employer of {s} is {o}.",
                "{s} works for the company {o}.",
                "every day {s} goes to work at {o}.",
            ),
            ("{o} employs {s}.", "{s} earns a living at {o}."),
            (
                "where does {s} work?",
                "which company does {s} work for?",
                "who employs {s}?",
                "what company is {s} employed by?",
            ),
            "does {s} work at {o}?",
            "does {s} not work at {o}?",
        ),
        RelationTemplates(
            "profession",
            "person",
            (
                "{s} works as {ao}.",
                "{s} is {ao}.",
                "by trade {s} is {ao}.",
                "the job of {s} is {o}.",
                "{s} earns money as {ao}.",
                "{s} has been {ao} for years.",
            ),
            ("the profession of {s} is {o}.", "for a living {s} works as {ao}."),
            (
                "what does {s} do for a living?",
                "what is the job of {s}?",
                "what is the profession of {s}?",
                "what work does {s} do?",
            ),
            "is {s} {ao}?",
            "is {s} not {ao}?",
        ),
        RelationTemplates(
            "based_in",
            "company",
            (
                "{s} is based in {o}.",
                "{s} has its headquarters in {o}.",
                "the head office of {s} is in {o}.",
                "{s} is run from {o}.",
                "{s} keeps its main office in {o}.",
                "the company {s} is located in {o}.",
            ),
            ("{o} is home to the company {s}.", "the company {s} is run from {o}."),
            (
                "where is {s} based?",
                "in which city is {s} located?",
                "where is the head office of {s}?",
                "which city is {s} run from?",
            ),
            "is {s} based in {o}?",
            "is {s} not based in {o}?",
        ),
        RelationTemplates(
            "industry",
            "company",
            (
                "{s} works in {o}.",
                "{s} is a {o} company.",
                "the business of {s} is {o}.",
                "{s} makes its money in {o}.",
                "{s} belongs to the {o} industry.",
                "{s} is known for {o}.",
            ),
            ("the industry of {s} is {o}.", "{s} is known as a {o} company."),
            (
                "what industry is {s} in?",
                "what business is {s} in?",
                "what does the company {s} do?",
                "which industry does {s} belong to?",
            ),
            "is {s} a {o} company?",
            "is {s} not a {o} company?",
        ),
        RelationTemplates(
            "founded",
            "company",
            (
                "{s} was founded in {o}.",
                "{s} was started in {o}.",
                "the company {s} dates from {o}.",
                "{s} opened its doors in {o}.",
                "{s} has existed since {o}.",
                "in {o} the company {s} was founded.",
            ),
            ("{s} opened in the year {o}.", "the year {s} was founded is {o}."),
            (
                "when was {s} founded?",
                "in what year was {s} started?",
                "what year did {s} open?",
                "since when has {s} existed?",
            ),
            "was {s} founded in {o}?",
            "was {s} not founded in {o}?",
        ),
        RelationTemplates(
            "made_by",
            "product",
            (
                "{s} is made by {o}.",
                "{o} makes {s}.",
                "{s} comes from {o}.",
                "the maker of {s} is {o}.",
                "{s} is built by {o}.",
                "{s} is a product of {o}.",
            ),
            ("{s} is made by the company {o}.", "{o} builds and makes {s}."),
            (
                "who makes {s}?",
                "which company makes {s}?",
                "who is the maker of {s}?",
                "what company builds {s}?",
            ),
            "is {s} made by {o}?",
            "is {s} not made by {o}?",
        ),
        RelationTemplates(
            "price",
            "product",
            (
                "{s} costs {o}.",
                "{s} sells for {o}.",
                "the price of {s} is {o}.",
                "you can buy {s} for {o}.",
                "{s} is priced at {o}.",
                "{s} has a price of {o}.",
            ),
            ("{s} will cost you {o}.", "for {o} you can buy {s}."),
            (
                "how much does {s} cost?",
                "what is the price of {s}?",
                "how many dollars is {s}?",
                "what does {s} sell for?",
            ),
            "does {s} cost {o}?",
            "does {s} not cost {o}?",
        ),
        RelationTemplates(
            "region",
            "city",
            (
                "{s} is in the {o}.",
                "{s} lies in the {o}.",
                "the city of {s} is in the {o}.",
                "{s} is a city in the {o}.",
                "you will find {s} in the {o}.",
                "{s} sits in the {o} of the country.",
            ),
            ("{s} is located in the {o} region.", "in the {o} lies the city of {s}."),
            (
                "where is {s}?",
                "which region is {s} in?",
                "in what part of the country is {s}?",
                "where does {s} lie?",
            ),
            "is {s} in the {o}?",
            "is {s} not in the {o}?",
        ),
    )
}

# The specialist desk that answers each kind of subject (agent chains: router -> specialist).
DESKS: dict[str, str] = {
    "person": "people desk",
    "company": "company desk",
    "product": "product desk",
    "city": "city desk",
}
