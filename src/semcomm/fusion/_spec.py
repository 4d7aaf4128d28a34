"""What the fuser needs to know about a model: its KV layout and an identity fingerprint.

A :class:`ModelSpec` is read from a transformers config (and, for the fingerprint, the
model's input embedding and the tokenizer vocabulary). A fuser stores the specs of the pair
it was trained for; loading it against other models raises a clear error instead of
silently producing garbage (the reference C2C code loads with ``strict=False``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import UnsupportedModelError

__all__ = ["LAYER_MAPPINGS", "ModelSpec", "layer_mapping", "model_spec"]

# config keys that do not change what a model computes (paths, versions, bookkeeping)
_VOLATILE_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "architectures",
        "_commit_hash",
        "use_cache",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "_attn_implementation_autoset",
        "_attn_implementation",
        "attn_implementation",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
    }
)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """KV layout and identity of one model (sharer or receiver).

    ``fingerprint`` hashes the compute-relevant config, a strided sample of the input
    embedding and the tokenizer vocabulary: two different models with the same shapes get
    different fingerprints, so a fuser trained for one pair is refused for another.
    """

    model_type: str  # e.g. "llama", "qwen2", "qwen3"
    num_layers: int  # decoder layers that hold KV
    num_kv_heads: int  # KV heads per layer (GQA aware)
    head_dim: int  # channels per KV head
    vocab_size: int
    fingerprint: str  # hex digest; "" when unknown (then only shapes are checked)

    @property
    def kv_dim(self) -> int:
        """Flattened width of one token's keys (or values) in one layer."""
        return self.num_kv_heads * self.head_dim

    def describe(self) -> str:
        """One line for error messages."""
        return (
            f"{self.model_type} (layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, vocab={self.vocab_size})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(
            model_type=str(data["model_type"]),
            num_layers=int(data["num_layers"]),
            num_kv_heads=int(data["num_kv_heads"]),
            head_dim=int(data["head_dim"]),
            vocab_size=int(data["vocab_size"]),
            fingerprint=str(data.get("fingerprint", "")),
        )

    def same_layout(self, other: ModelSpec) -> bool:
        return (self.num_layers, self.num_kv_heads, self.head_dim) == (
            other.num_layers,
            other.num_kv_heads,
            other.head_dim,
        )


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _check_full_attention(cfg: Any) -> None:
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        odd = sorted({t for t in layer_types if t != "full_attention"})
        if odd:
            raise UnsupportedModelError(
                f"{cfg.model_type}: layers of type {odd} (sliding-window or linear attention) "
                "keep no full per-token KV; cache-to-cache fusion needs full-attention layers"
            )
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise UnsupportedModelError(
            f"{cfg.model_type}: use_sliding_window=True; cache-to-cache fusion needs "
            "full-attention layers"
        )


def _config_digest(cfg: Any) -> str:
    data = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    clean = {k: v for k, v in data.items() if k not in _VOLATILE_KEYS}
    return hashlib.sha256(
        json.dumps(clean, sort_keys=True, default=str).encode("utf-8")
    ).hexdigest()


def _embedding_digest(model: torch.nn.Module) -> str:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None or not hasattr(emb, "weight"):
        return ""
    w = emb.weight.detach()
    # strided sample of rows: cheap for 150k-row tables, still changes when weights change
    step = max(1, w.shape[0] // 64)
    sample = w[::step].to(torch.float32).contiguous().cpu().numpy()
    return hashlib.sha256(sample.tobytes()).hexdigest()


def _tokenizer_digest(tokenizer: Any) -> str:
    if tokenizer is None:
        return ""
    vocab = tokenizer.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def model_spec(model: torch.nn.Module, tokenizer: Any = None) -> ModelSpec:
    """Read the :class:`ModelSpec` of a transformers causal LM (and its tokenizer).

    Raises :class:`UnsupportedModelError` for sliding-window or linear-attention layers.
    """
    cfg = _text_config(model.config)
    _check_full_attention(cfg)
    n_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    parts = [_config_digest(cfg), _embedding_digest(model), _tokenizer_digest(tokenizer)]
    fingerprint = hashlib.sha256("|".join(parts).encode("ascii")).hexdigest()[:32]
    return ModelSpec(
        model_type=str(cfg.model_type),
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(cfg.vocab_size),
        fingerprint=fingerprint,
    )


def _last_aligned(n_receiver: int, n_sharer: int) -> list[int]:
    # terminal alignment: last receiver layer reads the last sharer layer; extra receiver
    # layers at the bottom are clamped to sharer layer 0 (the gate may switch them off)
    offset = n_sharer - n_receiver
    return [min(max(offset + t, 0), n_sharer - 1) for t in range(n_receiver)]


def _uniform(n_receiver: int, n_sharer: int) -> list[int]:
    # place both stacks on [0, 1] and take the nearest sharer layer
    if n_receiver == 1:
        return [n_sharer - 1]
    return [round(t * (n_sharer - 1) / (n_receiver - 1)) for t in range(n_receiver)]


def _first_aligned(n_receiver: int, n_sharer: int) -> list[int]:
    return [min(t, n_sharer - 1) for t in range(n_receiver)]


LAYER_MAPPINGS = {
    "last_aligned": _last_aligned,
    "uniform": _uniform,
    "first_aligned": _first_aligned,
}


def layer_mapping(name_or_list: str | list[int], n_receiver: int, n_sharer: int) -> list[int]:
    """Sharer layer read by each receiver layer.

    ``name_or_list`` is a strategy name from :data:`LAYER_MAPPINGS` or an explicit list with
    one sharer layer index per receiver layer.
    """
    from ..errors import ConfigError

    if n_receiver < 1 or n_sharer < 1:
        raise ConfigError(f"layer counts must be >= 1 (receiver={n_receiver}, sharer={n_sharer})")
    if isinstance(name_or_list, str):
        fn = LAYER_MAPPINGS.get(name_or_list)
        if fn is None:
            raise ConfigError(
                f"layer_mapping: unknown strategy {name_or_list!r}; "
                f"choose one of {sorted(LAYER_MAPPINGS)} or give a list of sharer layers"
            )
        return fn(n_receiver, n_sharer)
    mapping = [int(x) for x in name_or_list]
    if len(mapping) != n_receiver:
        raise ConfigError(
            f"layer_mapping: {len(mapping)} entries given, the receiver has {n_receiver} layers"
        )
    bad = [x for x in mapping if not 0 <= x < n_sharer]
    if bad:
        raise ConfigError(
            f"layer_mapping: sharer layers {bad} out of range (the sharer has {n_sharer} layers)"
        )
    return mapping
