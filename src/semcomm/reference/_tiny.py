"""A config-built tiny Qwen2 model with a byte-level tokenizer: the offline fallback model.

Used by the embedded default when the reference models are not available (and by tests, which
need a model that builds in milliseconds). Weights are random but seeded, so every process builds
the same model; the tokenizer maps each UTF-8 byte to one token, so any text round-trips.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_MODEL_ID", "build_byte_tokenizer", "build_tiny_model"]

TINY_MODEL_ID = "semcomm-tiny"

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A ChatML template (the Qwen2 family's), so that chat messages render the way real models do.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges: 256 byte tokens plus three ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def build_tiny_model(
    *, seed: int = 0, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2
) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``: a seeded random Qwen2 (float32, eval mode) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        use_sliding_window=False,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    config.name_or_path = TINY_MODEL_ID
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer
