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
    assert warm.stats.hit_tokens == len(ids) - 1 and warm.token_ids == cold.token_ids
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
    assert warm.stats.hit_tokens == len(ids) - 1
