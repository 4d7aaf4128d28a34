"""semcomm.reference: the synthetic world and the two reference tiny models.

* :func:`build_world` / :class:`World` (module :mod:`semcomm.reference.world`): a seeded fictional
  world rendered into statements, QA, multiple choice, paraphrase groups, near misses,
  conversations and agent chains.
* The shipped models (``assets/sharer``: Llama-style with a reduced MiniLM WordPiece tokenizer,
  trained on every fact; ``assets/receiver``: Qwen2-style with a byte-level BPE tokenizer, trained
  on the "seen" facts only): :func:`sharer_path`, :func:`receiver_path`, :func:`load_sharer`,
  :func:`load_receiver`, and :func:`router_labels` (which model answers which question).
* :func:`build_all` retrains both models into :data:`ASSETS_DIR` (or another folder) and
  :func:`evaluate_model` scores one on the world (both imported on first use: they need
  transformers).

See ``docs/reference.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._assets import (
    ASSETS_DIR,
    assets_dir,
    load_model,
    load_receiver,
    load_sharer,
    model_card_eval,
    receiver_path,
    router_labels,
    sharer_path,
)
from ._tiny import TINY_MODEL_ID, build_byte_tokenizer, build_tiny_model
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

if TYPE_CHECKING:  # pragma: no cover
    from ._build import build_all
    from ._eval import evaluate_model

_LAZY = {"build_all": "._build", "evaluate_model": "._eval"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'semcomm.reference' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ASSETS_DIR",
    "LETTERS",
    "ROUTER_PROMPT",
    "SYSTEM_PROMPT",
    "TINY_MODEL_ID",
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
    "build_all",
    "build_byte_tokenizer",
    "build_tiny_model",
    "build_world",
    "evaluate_model",
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
