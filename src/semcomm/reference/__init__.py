"""semcomm.reference: the synthetic world and the two reference tiny models.

* :func:`build_world` / :class:`World` (module :mod:`semcomm.reference.world`): a seeded fictional
  world rendered into statements, QA, multiple choice, paraphrase groups, near misses,
  conversations and agent chains.
* The shipped models (``assets/sharer``: Llama-style with a reduced MiniLM WordPiece tokenizer,
  trained on every fact; ``assets/receiver``: Qwen2-style with a byte-level BPE tokenizer, trained
  on the "seen" facts only): :func:`sharer_path`, :func:`receiver_path`, :func:`load_sharer`,
  :func:`load_receiver`, and :func:`router_labels` (which model answers which question).

See ``docs/reference.md``.
"""

from __future__ import annotations

from ._assets import (
    assets_dir,
    load_model,
    load_receiver,
    load_sharer,
    model_card_eval,
    receiver_path,
    router_labels,
    sharer_path,
)
from .world import (
    LETTERS,
    ROUTER_PROMPT,
    SYSTEM_PROMPT,
    AgentChain,
    Conversation,
    Entity,
    Fact,
    MCQuestion,
    NearMiss,
    ParaphraseGroup,
    QAPair,
    Sentence,
    Turn,
    World,
    build_world,
    format_mc,
    format_qa,
)

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
    "assets_dir",
    "build_world",
    "format_mc",
    "format_qa",
    "load_model",
    "load_receiver",
    "load_sharer",
    "model_card_eval",
    "receiver_path",
    "router_labels",
    "sharer_path",
]
