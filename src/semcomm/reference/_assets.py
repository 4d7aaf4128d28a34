"""Where the shipped reference models live, and how to load them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = [
    "ASSETS_DIR",
    "assets_dir",
    "load_model",
    "load_receiver",
    "load_sharer",
    "model_card_eval",
    "receiver_path",
    "router_labels",
    "sharer_path",
]

ASSETS_DIR = Path(__file__).resolve().parent / "assets"


def assets_dir() -> Path:
    """The assets folder: ``$SEMCOMM_REFERENCE_DIR`` if set, else the one shipped in the package."""
    env = os.environ.get("SEMCOMM_REFERENCE_DIR")
    return Path(env) if env else ASSETS_DIR


def _model_dir(name: str) -> Path:
    path = assets_dir() / name
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"reference model {name!r} not found at {path} (config.json missing); "
            "run `semcomm reference build` to create it"
        )
    return path


def sharer_path() -> Path:
    """Folder of the sharer (Llama-style, reduced MiniLM WordPiece, trained on all facts)."""
    return _model_dir("sharer")


def receiver_path() -> Path:
    """Folder of the receiver (Qwen2-style, byte-level BPE, trained on "seen" facts only)."""
    return _model_dir("receiver")


def load_model(path: str | Path, dtype: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a folder via ``AutoModelForCausalLM`` / ``AutoTokenizer``.

    Weights ship in fp16; ``dtype`` defaults to float32 (CPU kernels and exact evaluation).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


def load_sharer(dtype: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the shipped sharer."""
    return load_model(sharer_path(), dtype)


def load_receiver(dtype: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the shipped receiver."""
    return load_model(receiver_path(), dtype)


def router_labels() -> list[dict[str, Any]]:
    """Per multiple-choice question, which model answers it (option log-likelihood).

    Rows: ``{"question_id", "fact_id", "question", "relation", "split", "sharer_correct",
    "receiver_correct"}``, computed at build time for the world of seed 0.
    """
    path = assets_dir() / "router_labels.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} not found; run `semcomm reference build`")
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def model_card_eval(name: str) -> dict[str, Any]:
    """The evaluation recorded at build time for ``"sharer"`` or ``"receiver"``."""
    path = _model_dir(name) / "eval.json"
    return json.loads(path.read_text(encoding="utf-8"))
