"""Model and tokenizer fingerprints for KV namespaces (cheap, deterministic, computed once).

A model fingerprint is BLAKE2b over the canonical architecture config JSON (minus fields that
do not change the computation: names, paths, version stamps, dtype which the namespace carries
separately) and a digest of the weights: the name, shape and dtype of every parameter and
buffer plus 64 strided float32 samples of each. Two checkpoints of one architecture differ in
their samples; a copy of the same weights on another machine or device gives the same digest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["model_fingerprint", "tokenizer_fingerprint"]

_IGNORED_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_commit_hash",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "use_cache",
}
_SAMPLES = 64


def _config_json(config: Any) -> str:
    d = config.to_dict()
    d = {k: v for k, v in d.items() if k not in _IGNORED_CONFIG_KEYS}
    return json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)


def model_fingerprint(model: Any) -> str:
    """Hex digest naming a model's architecture and weights."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(model).__name__.encode())
    h.update(_config_json(model.config).encode())
    with torch.no_grad():
        tensors = sorted(
            list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False))
        )
        for name, t in tensors:
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype!s}".encode())
            flat = t.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            step = max(1, flat.numel() // _SAMPLES)
            sample = flat[::step][:_SAMPLES].float().cpu().contiguous()
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hex digest of a tokenizer's vocabulary, rules, special tokens and chat template."""
    if tokenizer is None:
        return ""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        vocab = tokenizer.get_vocab()
        h.update(json.dumps(sorted(vocab.items()), separators=(",", ":")).encode())
    specials = getattr(tokenizer, "special_tokens_map", {})
    h.update(json.dumps(specials, sort_keys=True, default=str).encode())
    tmpl = getattr(tokenizer, "chat_template", None)
    if tmpl:
        h.update(str(tmpl).encode())
    return h.hexdigest()
