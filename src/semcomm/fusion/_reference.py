"""Model sides from a path spec, and the fuser shipped for the reference pair.

:func:`load_side` loads a model (catalog name, model folder or offline hub id) with its prompt
template as a :class:`~semcomm.fusion.ModelSide`; :func:`shipped_fuser_path` is the folder
of the fuser trained for the reference pair (the server's ``c2c`` hand-off default).
Evaluation on the reference world lives with the CLI (``semcomm.cli._tools.fusion_reference``).
"""

from __future__ import annotations

from pathlib import Path

from ._pipeline import ModelSide

__all__ = ["ASSETS_DIR", "load_side", "shipped_fuser_path", "split_template"]

ASSETS_DIR = Path(__file__).resolve().parent / "assets"


def shipped_fuser_path() -> Path:
    """Folder of the fuser shipped for the reference pair."""
    return ASSETS_DIR / "reference"

def split_template(template: str) -> tuple[str, str]:
    """``"PREFIX{shared}SUFFIX"`` -> ``(PREFIX, SUFFIX)``; the placeholder must appear once."""
    from ..errors import ConfigError

    if template.count("{shared}") != 1:
        raise ConfigError(f"prompt template {template!r} must contain '{{shared}}' exactly once")
    prefix, suffix = template.split("{shared}")
    return prefix.replace("\\n", "\n"), suffix.replace("\\n", "\n")

def load_side(
    path: str | Path, *, add_special_tokens: bool = True, template: str = "{shared}"
) -> ModelSide:
    """A model (catalog name, folder with config.json + weights + tokenizer, or a hub id
    available offline) as a :class:`ModelSide` in fp32 (in bfloat16 when it is a catalog
    model converted in bfloat16, e.g. ``qwen2.5-coder-1.5b-instruct``: its weights are exact
    in bfloat16 and half the memory).

    ``template`` wraps the shared text in this model's own prompt, e.g. a chat template
    ``"<|im_start|>user\\n{shared}<|im_end|>\\n<|im_start|>assistant\\n"`` (a literal
    ``\\n`` becomes a newline).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..errors import ConfigError

    where = _resolve_model(path)
    p = Path(where)
    if p.exists() and not (p / "config.json").is_file():
        raise ConfigError(f"no model at {p} (config.json missing)")
    try:
        dtype = _stored_dtype(p) or torch.float32
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype).eval()
        tok = AutoTokenizer.from_pretrained(where)
    except OSError as exc:
        raise ConfigError(
            f"cannot load model {path!r}: not a catalog name, a model folder or a hub id "
            f"available offline ({exc})"
        ) from exc
    prefix, suffix = split_template(template)
    return ModelSide(
        model, tok, prefix=prefix, suffix=suffix, add_special_tokens=add_special_tokens
    )

def _stored_dtype(folder: Path) -> object | None:
    """``torch.bfloat16`` for a catalog folder whose manifest says it was converted in
    bfloat16; None otherwise (then float32 is used, as for every other model)."""
    import json

    import torch

    try:
        man = json.loads((folder / "semcomm-model.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return torch.bfloat16 if isinstance(man, dict) and man.get("dtype") == "bfloat16" else None


def catalog_name_of(spec: str | Path) -> str | None:
    """The catalog name a model spec stands for (a name or alias, or a pulled model's
    converted folder); None for hub ids and other folders."""
    import json

    text = str(spec)
    p = Path(text)
    if p.exists():
        try:
            man = json.loads((p / "semcomm-model.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        name = man.get("name") if isinstance(man, dict) else None
        return name if isinstance(name, str) else None
    from ..models import catalog_entry, is_catalog_name

    return catalog_entry(text).name if is_catalog_name(text) else None


def _resolve_model(spec: str | Path) -> str:
    """A catalog name becomes its converted folder; a path or hub id is kept as it is."""
    text = str(spec)
    if Path(text).exists():
        return text
    from ..models import resolve_model

    return resolve_model(text, quiet=True)
