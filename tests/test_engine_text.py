"""Text prompts, chat messages, streaming text pieces and stop strings (byte-level tokenizer)."""

from __future__ import annotations

from typing import Any

import pytest

from semcomm.cli._quickstart import _config_built_model
from semcomm.engine import HFEngine
from semcomm.kv import MemoryStore


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    model, tokenizer, _ = _config_built_model()
    return HFEngine(model, tokenizer, store=MemoryStore(), chunk_size=32, device="cpu")


def test_text_and_chat_prompts_hit_the_cache(engine: HFEngine) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief. " * 10},
                                  {"role": "user", "content": "Where is my bike?"}]
    ids = engine.tokenize(msgs)
    assert ids == engine.tokenize(engine.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False))
    cold = engine.generate(msgs, max_new_tokens=6)
    warm = engine.generate(msgs, max_new_tokens=6)
    assert warm.stats.hit_tokens == len(ids) and warm.token_ids == cold.token_ids
    assert cold.text == engine.decode(cold.token_ids)
    follow = msgs + [{"role": "assistant", "content": "At home."},
                     {"role": "user", "content": "Thanks"}]
    assert engine.generate(follow, max_new_tokens=2).stats.hit_tokens >= 96  # shared prefix


def test_stream_pieces_join_to_the_text(engine: HFEngine) -> None:
    full = engine.generate("The quick brown fox", max_new_tokens=12)
    stream = engine.generate("The quick brown fox", max_new_tokens=12, stream=True)
    pieces = list(stream)
    assert all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == full.text
    assert stream.result is not None and stream.result.token_ids == full.token_ids


def test_stop_string_ends_generation_and_is_cut(engine: HFEngine) -> None:
    full = engine.generate("Stop here please", max_new_tokens=16)
    assert full.text is not None and len(full.text) >= 6
    stop = full.text[3:5]
    cut = full.text.find(stop)
    res = engine.generate("Stop here please", max_new_tokens=16, stop=[stop])
    assert res.stats.finish_reason == "stop"
    assert res.text == full.text[:cut]
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert len(res.token_ids) < len(full.token_ids)
    first = full.token_ids.index(full.token_ids[2])
    by_id = engine.generate("Stop here please", max_new_tokens=16, stop=[full.token_ids[2]])
    assert by_id.token_ids == full.token_ids[: first + 1] and by_id.stats.finish_reason == "stop"


def test_reference_model_by_path_is_exact() -> None:
    """The id/path code path (from_pretrained for model and tokenizer) on the trained receiver."""
    import torch

    from semcomm.reference._assets import receiver_path

    from ._engine_models import reference_greedy

    eng = HFEngine(str(receiver_path()), store=MemoryStore(), chunk_size=16, device="cpu",
                   dtype="float32")
    assert eng.tokenizer is not None and eng.dtype == torch.float32
    prompt = "alice smith lives in oxford. the glide phone costs 120 dollars. alice smith works at"
    ids = eng.tokenize(prompt)
    ref = reference_greedy(eng.model, ids, 8)
    cold = eng.generate(prompt, max_new_tokens=8)
    warm = eng.generate(prompt, max_new_tokens=8)
    assert cold.token_ids == ref and warm.token_ids == ref
    assert warm.stats.hit_tokens == len(ids) and warm.stats.logits_restored


def test_stop_string_never_leaks_into_the_stream(engine: HFEngine) -> None:
    """Issue-15 regression: a stream held no part of a stop string back, so the start of a stop
    string reached the client before the rest of it was generated."""
    full = engine.generate("Stop here please", max_new_tokens=16)
    assert full.text is not None and len(full.text) >= 8
    for stop in (full.text[4:7], full.text[5:7] + "\x00"):  # completes / never completes
        plain = engine.generate("Stop here please", max_new_tokens=16, stop=[stop])
        stream = engine.generate("Stop here please", max_new_tokens=16, stop=[stop], stream=True)
        pieces = list(stream)
        assert stream.result is not None and "".join(pieces) == stream.result.text == plain.text
        cut = full.text.find(stop)
        assert plain.text == (full.text[:cut] if cut >= 0 else full.text)


class _CharTokenizer:
    """Token id = one character (for pinning down exactly what a stream releases)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize(
    ("text", "stops", "pieces", "final"),
    [
        ("a\n\nb", ["\n\n\n"], ["a", "", "", "\n\nb"], "a\n\nb"),  # held, then released
        ("a\n\n\nb", ["\n\n\n"], ["a", "", "", ""], "a"),  # held, then cut: nothing leaks
        ("xabcy", ["bcd", "ab"], ["x", "", ""], "x"),  # the earliest stop wins
        ("hello", [], ["h", "e", "l", "l", "o"], "hello"),
    ],
)
def test_stop_text_releases_only_what_cannot_start_a_stop(
    text: str, stops: list[str], pieces: list[str], final: str
) -> None:
    from semcomm.engine._decode import StopText

    st = StopText(_CharTokenizer(), stops)
    got = []
    for ch in text:
        piece, stopped = st.push(ord(ch))
        got.append(piece)
        if stopped:
            break
    assert got == pieces
    tail = st.finish()
    assert "".join(got) + tail == st.text == final


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct",
                                  "gemma-3-270m"])
def test_incremental_detokenization_matches_decode(name: str) -> None:
    """Real tokenizers (byte-level BPE, SentencePiece): the pieces join to decode(ids),
    multi-byte characters and leading spaces included."""
    from transformers import AutoTokenizer

    from semcomm.engine._decode import StopText
    from semcomm.models import is_pulled, model_path

    if not is_pulled(name):
        pytest.skip(f"{name} is not pulled")
    tok = AutoTokenizer.from_pretrained(model_path(name))
    text = (" Paris is the capital of France.\n\n  Ünïcödé — naïve café, 東京は日本の首都です。"
            " Emoji: 🙂🚀 def f(x):\n    return x ** 2  # done")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    st = StopText(tok, [])
    pieces = [st.push(t)[0] for t in ids]
    pieces.append(st.finish())
    assert "".join(pieces) == st.text == tok.decode(ids, skip_special_tokens=True)
    assert sum(1 for p in pieces if p) > len(ids) // 2  # released as it goes, not at the end
