"""An on-disk cache of the frozen prefills of fuser training.

Both models are frozen while a fuser trains, so the prompt KV that :func:`prefill_layers`
computes for one example depends only on the model, how it is run (device type, autocast
dtype) and the example's token ids; the same questions come back every epoch.
:class:`PrefillCache` computes each example's prefill once per model, writes it to disk and
reads it back in later steps and validation passes. It is lossless: the file holds the bytes
the model produced (bfloat16 or float32, as computed), so a step that reads it uses the same
KV as a step that computes it.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ._io import save_tensors
from ._kvio import KVLayers, prefill_layers

__all__ = ["PrefillCache", "PrefillCacheStats"]

log = logging.getLogger(__name__)

VariantDigest = NewType("VariantDigest", str)
"""Hex digest of one model run one way (config, parameter dtypes and a sample of the weights,
device type, autocast dtype): files of two variants never share a folder, so KV computed by
one model (or in another precision) is never read as another's."""

_SAMPLE = 256  # weights sampled per parameter tensor for the model digest (cheap, per model)

# per layer (key dtype, key heads, key dim, value dtype, value heads, value dim)
_Layout = tuple[tuple[torch.dtype, int, int, torch.dtype, int, int], ...]
_Rows = list[tuple[torch.Tensor, torch.Tensor]]  # one example's layers: ([H, L, D], [H, L, D])


@dataclass(slots=True)
class PrefillCacheStats:
    """Lookups since the cache was built; one lookup is one (model, example) pair, so a fused
    step of B examples makes 2 x B (sharer and receiver). Only :class:`PrefillCache` changes
    these counts."""

    hits: int = 0  # read back from disk
    misses: int = 0  # computed and written (absent files and the ``rewritten`` ones)
    rewritten: int = 0  # of the misses: files present but unreadable or not this example's


def _model_digest(model: torch.nn.Module) -> str:
    """Config, parameter names, shapes and dtypes, and an evenly spaced sample of every
    parameter's values: two checkpoints of one architecture differ here."""
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    to_json = getattr(cfg, "to_json_string", None)
    h.update((to_json() if callable(to_json) else type(model).__qualname__).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE]
            h.update(f"{name}|{p.dtype}|{tuple(p.shape)}".encode())
            h.update(sample.float().cpu().numpy().tobytes())
    return h.hexdigest()


class PrefillCache:
    """The prompt KV of frozen models, one safetensors file per (model variant, example).

    Layout: ``<directory>/<variant>/<ids digest>.safetensors`` with ``k.<i>``/``v.<i>``
    ``[H, L, D]`` for every layer ``i`` (no batch dimension, no padding, the dtype the model
    produced) and the example's token ids ``ids`` ``[L]``. Invariants:

    * a file holds the KV of exactly the token ids stored in it, computed by its folder's
      variant: a read checks the ids and every tensor's shape and dtype against the
      variant's layout, and anything else (absent, truncated, unreadable, another example's
      or another layout's file) is recomputed and rewritten, never an error;
    * files are written to a temporary name and renamed into place, so a reader sees a whole
      file or none (a failed write is logged and the computed KV is still used);
    * :meth:`prefill` returns what :func:`prefill_layers` returns for the same batch, up to
      the float noise of batching, with zeros at padded positions (which every consumer masks).
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.stats = PrefillCacheStats()
        # per model, computed on first use (the models are frozen for the cache's life)
        self._models: weakref.WeakKeyDictionary[torch.nn.Module, str] = (
            weakref.WeakKeyDictionary()
        )
        # per variant: the layout of the last row computed (else of the first file read)
        self._layouts: dict[VariantDigest, _Layout] = {}

    def _variant(self, model: torch.nn.Module, device: torch.device) -> VariantDigest:
        digest = self._models.get(model)
        if digest is None:
            digest = self._models[model] = _model_digest(model)
        dt = device.type
        amp = str(torch.get_autocast_dtype(dt)) if torch.is_autocast_enabled(dt) else "off"
        text = f"{digest}|{dt}|{amp}"
        return VariantDigest(hashlib.sha256(text.encode()).hexdigest()[:32])

    def prefill(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> KVLayers:
        """:func:`prefill_layers` through the cache: ids, mask ``[B, M]`` (padded on either
        side); returns per layer ``([B, H, M, D], [B, H, M, D])``."""
        variant = self._variant(model, ids.device)
        folder = self.directory / variant
        real = mask.bool()
        rows: list[_Rows | None] = []
        paths: list[Path] = []
        row_ids = [ids[i][real[i]].to("cpu", torch.long) for i in range(ids.shape[0])]
        for rid in row_ids:
            name = hashlib.sha256(rid.numpy().tobytes()).hexdigest()[:32]
            paths.append(folder / f"{name}.safetensors")
            rows.append(self._read(paths[-1], rid, variant))
        todo = [i for i, r in enumerate(rows) if r is None]
        self.stats.hits += len(rows) - len(todo)
        self.stats.misses += len(todo)
        if todo:
            self._compute(model, ids, mask, todo, rows, paths, row_ids, variant)
        full = [r for r in rows if r is not None]
        assert len(full) == len(rows)
        return self._pad(full, real)

    def _read(self, path: Path, row_ids: torch.Tensor, variant: VariantDigest) -> _Rows | None:
        if not path.exists():
            return None
        try:
            flat = load_file(str(path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            log.warning("prefill cache file %s is unreadable (%s); recomputing it", path, exc)
            self.stats.rewritten += 1
            return None
        n = sum(1 for k in flat if k.startswith("k."))
        layers = [(flat.get(f"k.{i}"), flat.get(f"v.{i}")) for i in range(n)]
        stored = flat.get("ids")
        ok = (
            n > 0
            and stored is not None
            and stored.dtype == row_ids.dtype
            and torch.equal(stored, row_ids)
            and len(flat) == 2 * n + 1
            and all(
                k is not None and v is not None and k.dim() == 3 and v.dim() == 3
                and k.shape[1] == v.shape[1] == len(row_ids)
                for k, v in layers
            )
        )
        if ok:
            rows: _Rows = layers  # type: ignore[assignment]  # checked above: no None left
            layout = self._layouts.setdefault(variant, _layout_of(rows))
            if _layout_of(rows) == layout:
                return rows
        log.warning("prefill cache file %s is not this example's KV; recomputing it", path)
        self.stats.rewritten += 1
        return None

    def _compute(
        self,
        model: torch.nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        todo: list[int],
        rows: list[_Rows | None],
        paths: list[Path],
        row_ids: list[torch.Tensor],
        variant: VariantDigest,
    ) -> None:
        """Prefill the missing rows as one batch (less the columns none of them uses; the
        position ids come from the mask, so dropping pad columns changes no position)."""
        sub_mask = mask[todo]
        keep = sub_mask.bool().any(0)
        sub_mask = sub_mask[:, keep]
        layers = prefill_layers(model, ids[todo][:, keep], sub_mask)
        for j, i in enumerate(todo):
            real = sub_mask[j].bool()
            row: _Rows = [(k[j][:, real], v[j][:, real]) for k, v in layers]  # [H, L, D]
            rows[i] = row
            self._layouts[variant] = _layout_of(row)  # the model's own layout is the truth
            tensors = {"ids": row_ids[i]}
            for n, (k, v) in enumerate(row):
                tensors[f"k.{n}"], tensors[f"v.{n}"] = k, v
            try:
                paths[i].parent.mkdir(parents=True, exist_ok=True)
                save_tensors(paths[i], tensors, {"format": "semcomm-prefill"})
            except OSError as exc:
                log.warning("cannot write prefill cache file %s: %s", paths[i], exc)

    @staticmethod
    def _pad(rows: list[_Rows], real: torch.Tensor) -> KVLayers:
        """Rows of ``[H, L_b, D]`` into the batch layout ``[B, H, M, D]``, zeros where
        ``real`` (``[B, M]``) is False."""
        b, m = real.shape
        out: KVLayers = []
        for n, (k0, v0) in enumerate(rows[0]):
            k = k0.new_zeros(b, k0.shape[0], m, k0.shape[2], device=real.device)
            v = v0.new_zeros(b, v0.shape[0], m, v0.shape[2], device=real.device)
            for i, row in enumerate(rows):
                k[i][:, real[i]] = row[n][0].to(real.device)  # [H, L_i, D] into [H, M, D]
                v[i][:, real[i]] = row[n][1].to(real.device)
            out.append((k, v))
        return out


def _layout_of(rows: _Rows) -> _Layout:
    return tuple(
        (k.dtype, k.shape[0], k.shape[2], v.dtype, v.shape[0], v.shape[2]) for k, v in rows
    )
