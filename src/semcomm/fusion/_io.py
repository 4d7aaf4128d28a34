"""Saving and loading fusers: ``fuser.safetensors`` (weights) + ``fuser.json`` (config, pair).

Loading is strict: a missing or extra tensor, a wrong shape, or a config for another pair
raises a :mod:`semcomm.errors` error naming the problem (the reference C2C code loads with
``strict=False`` and silently ignores mismatches). Writes go to a temporary file first and
are renamed into place, so a crash leaves the old checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import ConfigError, CorruptEntryError
from ._fuser import Fuser, FuserConfig
from ._spec import ModelSpec

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "load_fuser", "read_fuser_config", "save_fuser"]

WEIGHTS_NAME = "fuser.safetensors"
CONFIG_NAME = "fuser.json"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (tmp file + rename)."""
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None
) -> None:
    """safetensors file written atomically."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=meta
    )
    os.replace(tmp, path)


def save_fuser(fuser: Fuser, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
    """Write ``fuser.safetensors`` and ``fuser.json`` into ``directory``; returns it.

    ``extra`` (training facts: steps, loss, data, command) is stored under ``"meta"``.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.float32) for k, v in fuser.state_dict().items()}
    save_tensors(out / WEIGHTS_NAME, state, {"format": "semcomm-fuser"})
    doc = fuser.config.to_dict()
    doc["meta"] = dict(extra or {})
    doc["meta"]["num_parameters"] = fuser.num_parameters()
    atomic_write_json(out / CONFIG_NAME, doc)
    return out


def _resolve(path: str | Path) -> tuple[Path, Path]:
    p = Path(path)
    if not p.exists() and not p.suffix:
        raise ConfigError(f"no fuser config at {p}: the folder does not exist")
    if p.is_dir():
        return p / CONFIG_NAME, p / WEIGHTS_NAME
    if p.suffix == ".json":
        return p, p.with_name(WEIGHTS_NAME)
    if p.suffix == ".safetensors":
        return p.with_name(CONFIG_NAME), p
    raise ConfigError(f"fuser path {p}: expected a directory, a .json or a .safetensors file")


def read_fuser_config(path: str | Path) -> tuple[FuserConfig, dict[str, Any]]:
    """The config and meta stored with a fuser (no weights loaded)."""
    cfg_path, _ = _resolve(path)
    if not cfg_path.exists():
        raise ConfigError(
            f"no fuser config at {cfg_path} (expected {CONFIG_NAME} next to the weights)"
        )
    try:
        doc = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"fuser config {cfg_path} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"fuser config {cfg_path} must hold a JSON object")
    meta = doc.pop("meta", {}) or {}
    return FuserConfig.from_dict(doc), meta


def load_fuser(
    path: str | Path,
    *,
    sharer: ModelSpec | None = None,
    receiver: ModelSpec | None = None,
    device: str | torch.device = "cpu",
) -> Fuser:
    """Load a fuser strictly; with ``sharer``/``receiver`` given, check it fits that pair."""
    config, _ = read_fuser_config(path)
    _, weights_path = _resolve(path)
    fuser = Fuser(config)
    if sharer is not None and receiver is not None:
        fuser.check_models(sharer, receiver)
    if not weights_path.exists():
        raise ConfigError(f"no fuser weights at {weights_path}")
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptEntryError(f"fuser weights {weights_path} are unreadable: {exc}") from exc
    own = fuser.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ConfigError(
            f"fuser weights {weights_path} do not match its config: "
            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}"
        )
    bad = [k for k in own if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        k = bad[0]
        raise ConfigError(
            f"fuser weights {weights_path}: tensor {k} has shape {tuple(state[k].shape)}, "
            f"the config needs {tuple(own[k].shape)} ({len(bad)} tensors differ)"
        )
    fuser.load_state_dict(state, strict=True)
    fuser.to(device)
    fuser.eval()
    return fuser
